"""Ranks' views of their process groups, kept as distinct views with their holders.

Split out of trace.py (the loader). A view is parsed once per distinct
`groups.json` (format 2: the rank's own groups plus its plan's fingerprint,
the whole plan once per fingerprint; older traces: the whole table per rank)
and never expanded to ranks x groups: `table()` writes members' rows, plus
every holder's row only for a group the views disagree on.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ncclscope.load import safe_io
from ncclscope import schema as S


def _short(exc: BaseException) -> str:
    return safe_io.short(exc)


_int = safe_io.trace_int


# Rows of `Trace.groups` a contested group may cost before its majority view falls back to its members' votes.
GROUP_ROW_BUDGET = 2_000_000
_MAX_RANGE = 1 << 24      # a hostile {"range": [0, 10**18, 1]} must not allocate the universe


class GroupViews:
    """Each rank's view of the process groups, kept as distinct views, never ranks x groups.

    Two on-disk shapes feed it (docs/trace-format.md):
    - a full view per rank (groups.json as a JSON list, or `groups` inside
      rank.json in older traces): parsed once per distinct byte string;
    - groups.json as an object (format 2): the rank's own groups plus the
      fingerprint of its whole plan; the whole plan travels in the files of
      rank 0 and of the lowest rank of every other fingerprint. A rank whose
      fingerprint has a plan holds that plan's view (after checking that its
      own groups agree with it); a rank whose plan was not found holds a
      partial view of just its own groups, and a warning says so.

    `majority()` answers "who is in group g" by weighting each distinct view
    by its holders. `table()` is the `groups` table the analyses vote over:
    each rank's rows for the groups it belongs to (one representative row
    for a group none of a view's holders is in), plus, for a group some
    views disagree on, every holder's row, so the vote there counts every
    rank as it did when every rank wrote everything (within
    GROUP_ROW_BUDGET rows; past it the majority view votes through its
    members). A healthy 16,384-rank run is 5 rows per rank, not 20,545.
    """

    def __init__(self) -> None:
        self._index: dict[Any, int] = {}
        self._views: list[dict[str, list[Any]]] = []
        self._holders: list[list[int]] = []
        self._plans: dict[str, int] = {}                 # fingerprint -> index of its full view
        self._pending: list[tuple[int, str, list[Any], Path]] = []   # (rank, fingerprint, own groups, where)
        self._warnings: list[str] | None = None
        self.fingerprints: dict[int, str] = {}           # rank -> fingerprint of its plan (format 2 only)

    # ---- input ---------------------------------------------------------------
    def add(self, rank: int, raw: Any, warnings: list[str], where: Path) -> None:
        """`raw`: the bytes of groups.json, or an already-parsed list (rank.json of older traces) or object."""
        if self._warnings is None:
            self._warnings = warnings
        if isinstance(raw, (bytes, str)):
            head = raw.lstrip()[:1]
            if head in (b"{", "{"):
                try:
                    obj = safe_io.loads(raw, where)
                except ValueError as exc:
                    warnings.append(f"{where}: unreadable JSON ({_short(exc)}); this rank's group view is unknown")
                    return
                self._add_own(rank, obj, warnings, where)
                return
        elif isinstance(raw, dict):
            self._add_own(rank, raw, warnings, where)
            return
        key = raw if isinstance(raw, (bytes, str)) else json.dumps(raw, sort_keys=True, default=str)
        idx = self._index.get(key)
        if idx is None:
            if isinstance(raw, (bytes, str)):
                try:
                    raw = safe_io.loads(raw, where)
                except ValueError as exc:
                    warnings.append(f"{where}: unreadable JSON ({_short(exc)}); this rank's group view is unknown")
                    return
            idx = self._index[key] = len(self._views)
            self._views.append(_parse_view(raw, warnings, where))
            self._holders.append([])
        self._holders[idx].append(rank)

    def _add_own(self, rank: int, obj: Any, warnings: list[str], where: Path) -> None:
        """groups.json format 2: {fingerprint, groups (own), plan (whole, on some ranks)}."""
        if not isinstance(obj, dict):
            warnings.append(f"{where}: group table is not a list or an object; ignored")
            return
        fp = str(obj.get("fingerprint", ""))[:64]
        own = obj.get("groups")
        if not isinstance(own, list):
            warnings.append(f"{where}: no list of own groups; this rank's group view is unknown")
            own = []
        plan = obj.get("plan")
        if isinstance(plan, list):
            view = _parse_view(plan, warnings, where)
            known = self._plans.get(fp)
            if known is None:
                self._plans[fp] = len(self._views)
                self._views.append(view)
                self._holders.append([])
            elif not _same_view(self._views[known], view):
                warnings.append(f"{where}: a plan with fingerprint {fp} that differs from another rank's plan "
                                f"with the same fingerprint; this rank keeps its own")
                self._views.append(view)
                self._holders.append([rank])
                self.fingerprints[rank] = fp
                return
        self.fingerprints[rank] = fp
        self._pending.append((rank, fp, own, where))

    def add_rows(self, rows: list[dict[str, Any]]) -> None:
        """Group rows in the GROUP schema (from the foreign-format readers)."""
        by_rank: dict[int, list[dict[str, Any]]] = {}
        for row in rows:
            by_rank.setdefault(int(row["rank"]), []).append(
                {"name": row["process_group"], "kind": row["group_kind"], "ranks": list(row["ranks"]),
                 "creation_order": row["creation_order"], "backend": row["backend"]})
        for r, lst in by_rank.items():
            self.add(r, lst, [], Path("."))

    def resolve(self, warnings: list[str] | None = None) -> None:
        """Attach every format-2 rank to its plan's view (or to a view of its own groups)."""
        if not self._pending:
            return
        warnings = warnings if warnings is not None else (self._warnings if self._warnings is not None else [])
        pending, self._pending = self._pending, []
        lookups: dict[int, dict[str, tuple[str, Any, int]]] = {}
        orphans: dict[str, list[int]] = {}
        disagree: list[int] = []
        for rank, fp, own, where in sorted(pending, key=lambda p: p[0]):
            idx = self._plans.get(fp)
            if idx is not None:
                look = lookups.get(idx)
                if look is None:
                    v = self._views[idx]
                    look = lookups[idx] = {n: (k, _members_key(m), o) for n, k, m, o in zip(
                        v["process_group"], v["group_kind"], v["ranks"], v["creation_order"])}
                if _own_agrees(own, look):
                    self._holders[idx].append(rank)
                    continue
                disagree.append(rank)
            else:
                orphans.setdefault(fp, []).append(rank)
            self._views.append(_parse_view(own, warnings, where))
            self._holders.append([rank])
        for fp, rs in orphans.items():
            warnings.append(f"group plan {fp or '(no fingerprint)'} of {_ranks_text(rs)} is in no loaded "
                            f"groups.json (rank 0 or the plan's lowest rank is missing); only their own groups "
                            f"are known")
        if disagree:
            warnings.append(f"{_ranks_text(disagree)}: own groups disagree with the plan of the same fingerprint; "
                            f"kept as their own views")

    # ---- views -----------------------------------------------------------------
    @property
    def views(self) -> list[dict[str, list[Any]]]:
        self.resolve()
        return self._views

    @property
    def holders(self) -> list[list[int]]:
        self.resolve()
        return self._holders

    def table(self) -> pd.DataFrame:
        """The `groups` table (one row per (rank, group) vote; see the class docstring)."""
        views, holders = self.views, self.holders
        live = [i for i, (v, h) in enumerate(zip(views, holders)) if h and len(v["process_group"])]
        if not live:
            return pd.DataFrame(columns=S.GROUP_COLUMNS)
        main = max(live, key=lambda i: (len(holders[i]), -i))
        contested = _contested(views, live, main)
        cost = {i: len(holders[i]) * sum(n in contested for n in views[i]["process_group"]) for i in live} \
            if contested else {i: 0 for i in live}
        others = sum(c for i, c in cost.items() if i != main)
        full_main = cost[main] + others <= GROUP_ROW_BUDGET
        full_others = others <= GROUP_ROW_BUDGET
        parts = []
        main_names = frozenset(views[main]["process_group"])
        for i in live:
            full = full_main if i == main else full_others
            # a group no holder of this view is in gets one representative row, from the majority view
            # (old traces' views differ in backend strings only: one per rank, and must not cost ranks x groups)
            parts.append(_view_rows(views[i], np.asarray(sorted(holders[i]), dtype=np.int64),
                                    contested if full else frozenset(), None if i == main else main_names))
        rank = np.concatenate([p[0] for p in parts])
        order = np.lexsort((np.concatenate([p[1] for p in parts]), rank))
        cols: dict[str, Any] = {"rank": rank[order].astype(np.int32)}
        for name in S.GROUP_COLUMNS[1:]:
            col = np.concatenate([p[2][name] for p in parts])
            cols[name] = col[order]
        out = pd.DataFrame(cols)
        out["creation_order"] = out["creation_order"].astype("int32")
        return out

    def majority(self) -> dict[str, list[int]]:
        votes: dict[str, dict[tuple[int, ...], int]] = {}
        for view, holders in zip(self.views, self.holders):
            if not holders:
                continue
            for name, members in zip(view["process_group"], view["ranks"]):
                tally = votes.setdefault(name, {})
                key = tuple(members)
                tally[key] = tally.get(key, 0) + len(holders)
        return {name: list(max(tally.items(), key=lambda kv: kv[1])[0]) for name, tally in votes.items()}


def _ranks_text(rs: list[int]) -> str:
    shown = ",".join(map(str, rs[:8])) + (f",... ({len(rs)} ranks)" if len(rs) > 8 else "")
    return f"rank{'s' if len(rs) > 1 else ''} {shown}"


def _members_key(m: Any) -> Any:
    """A comparable key of a member list: ("r", start, stop, step) for a progression, else a tuple."""
    if isinstance(m, dict):
        rng = m.get("range")
        if isinstance(rng, list) and len(rng) == 3 and all(isinstance(x, int) for x in rng) and rng[2] > 0:
            r = range(*rng)
            if len(r) >= 3:
                return ("r", r.start, r.start + len(r) * r.step, r.step)
            return tuple(r)
        return ("bad",)
    if not isinstance(m, (list, tuple, range)):
        return ("bad",)
    if len(m) >= 3:
        step = m[1] - m[0] if isinstance(m[0], int) and isinstance(m[1], int) else 0
        if step > 0 and list(m) == list(range(m[0], m[-1] + 1, step)):
            return ("r", m[0], m[-1] + step, step)
    return tuple(m)


def _own_agrees(own: list[Any], look: dict[str, tuple[str, Any, int]]) -> bool:
    """Each of a rank's own groups has the same kind, members and creation order in the plan."""
    for g in own:
        if not isinstance(g, dict):
            return False
        ref = look.get(str(g.get("name")))
        if ref is None or ref[0] != str(g.get("kind", "custom")) or ref[2] != _int(g.get("creation_order")):
            return False
        if ref[1] != _members_key(g.get("ranks", [])):
            return False
    return True


def _same_view(a: dict[str, list[Any]], b: dict[str, list[Any]]) -> bool:
    return all(a[k] == b[k] for k in S.GROUP_COLUMNS[1:])


def _contested(views: list[dict[str, list[Any]]], live: list[int], main: int) -> frozenset[str]:
    """Names of groups on which some view disagrees with the majority view (kind, members or order)."""
    if len(live) == 1:
        return frozenset()
    mv = views[main]
    ref = {n: (k, m, o) for n, k, m, o in zip(mv["process_group"], mv["group_kind"], mv["ranks"],
                                               mv["creation_order"])}
    out = set()
    for i in live:
        if i == main:
            continue
        v = views[i]
        for n, k, m, o in zip(v["process_group"], v["group_kind"], v["ranks"], v["creation_order"]):
            r = ref.get(n)
            if r is not None and (r[0] != k or r[2] != o or (r[1] is not m and r[1] != m)):
                out.add(n)
    return frozenset(out)


def _view_rows(view: dict[str, list[Any]], holders: np.ndarray, full: frozenset[str],
               covered: frozenset[str] | None = None) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """(rank, group index, columns) of one view's rows: members' votes, one representative for a
    group none of the holders is in (unless it is in `covered`), every holder's vote on the groups in `full`."""
    names = view["process_group"]
    n = len(names)
    lens = np.fromiter((len(m) for m in view["ranks"]), dtype=np.int64, count=n)
    flat = np.fromiter((x for m in view["ranks"] for x in m), dtype=np.int64, count=int(lens.sum()))
    gi = np.repeat(np.arange(n, dtype=np.int64), lens)
    is_full = np.fromiter((nm in full for nm in names), dtype=bool, count=n) if full else np.zeros(n, dtype=bool)
    sel = ~is_full[gi] & np.isin(flat, holders)
    r_mem, g_mem = flat[sel], gi[sel]
    voted = np.zeros(n, dtype=bool)
    voted[g_mem] = True
    need = ~voted & ~is_full
    if covered:
        need &= ~np.fromiter((nm in covered for nm in names), dtype=bool, count=n)
    rep = np.flatnonzero(need)
    full_idx = np.flatnonzero(is_full)
    rank = np.concatenate([r_mem, np.full(len(rep), holders[0], dtype=np.int64),
                           np.repeat(holders, len(full_idx))])
    g = np.concatenate([g_mem, rep, np.tile(full_idx, len(holders))])
    cols = {}
    for name in S.GROUP_COLUMNS[1:]:
        arr = np.empty(n, dtype=object)
        arr[:] = view[name]          # one shared object per group: view_keys dedups member lists by identity
        cols[name] = arr[g]
    return rank, g, cols


def _decode_members(members: Any) -> list[int]:
    if isinstance(members, dict):
        rng = members.get("range")
        if isinstance(rng, list) and len(rng) == 3 and all(isinstance(x, int) for x in rng) and rng[2] > 0:
            r = range(*rng)
            if len(r) <= _MAX_RANGE:
                return list(r)
        return []
    if isinstance(members, list):
        return [_int(x) for x in members if isinstance(x, (int, str))]
    return []


def _parse_view(raw: Any, warnings: list[str], where: Path) -> dict[str, list[Any]]:
    view: dict[str, list[Any]] = {name: [] for name in S.GROUP_COLUMNS[1:]}
    if not isinstance(raw, list):
        warnings.append(f"{where}: group table is not a list; ignored")
        return view
    for g in raw:
        if isinstance(g, dict) and "name" in g:
            view["process_group"].append(str(g["name"]))
            view["group_kind"].append(str(g.get("kind", "custom")))
            view["ranks"].append(_decode_members(g.get("ranks", [])))
            view["creation_order"].append(_int(g.get("creation_order")))
            view["backend"].append(str(g.get("backend", "")))
    return view
