"""Ties and lone records decided by each rank's own history (`resolve_by_history`, asked by stopped.fr_roots).

A type/size/dtype vote the instance cannot decide: a 2-member group splits 1 vs 1, and when gloo aborts the
innocent partner on a size mismatch its record of the op dies with it, leaving the deviant alone. Training
repeats itself: each rank's own earlier calls on that group (from the same call site where it has some
there, the same call of it: site_visits.py) say what the op should have been. The rank whose op differs from
everything it issued there before is the deviant; the one that did what it always did is not. This works
without training steps, which Flight Recorder dumps do not carry.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

import pandas as pd

from ncclscope import schema as S
from ncclscope.findings import Cause, CauseBasis, Evidence, Finding, FindingKind, InstanceRef
from ncclscope.index.views import IndexLike, as_index
from ncclscope.index.labels import rank_label
from ncclscope.hang.loop_order import sequence_deviant
from ncclscope.hang.site_visits import same_call_history
from ncclscope.hang.skipped_statement import skipped_statement

HISTORY_MIN = 2                 # earlier calls that must agree before a rank's history counts
# ... where the only other member of the instance left no record at all (no dump: its process died): one
# earlier call from the very call site is enough, for nothing else can speak for the op (module docstring)
HISTORY_MIN_ALONE = 1
_CATEGORIES = ("type", "size", "dtype")
# The JSON order of a history-decided mismatch's `data` (its cause's claims among them), as earlier
# releases wrote it; one that replaces a tied vote keeps that finding's order.
HISTORY_LAYOUT = ("later_instances", "process_group", "seq", "categories", "ambiguous", "deviant_ranks", "unfinished",
                  "basis", "absent_ranks")


# --------------------------------------------------------------------------
# Ties and lone records decided by each rank's own history
# --------------------------------------------------------------------------
def _values(df: pd.DataFrame, cat: str) -> pd.Series:
    if cat == "type":
        red = df["reduce_op"].astype(str)
        return df["op_name"].astype(str) + red.where(red == "", "(" + red + ")")
    if cat == "size":
        return df["input_sizes"].astype(str).str.replace(" ", "", regex=False)
    return df["input_dtypes"].astype(str)


def _history(coll: pd.DataFrame, row, least: int = HISTORY_MIN) -> tuple[pd.DataFrame, str] | None:
    """(every earlier completed call of this rank on this group that is its history, the call site it is
    from): the same call of the same site where the rank has at least `least` calls there (site_visits.py),
    else all its calls on the group ("" for the site); None with fewer than `least`."""
    h = coll[(coll["rank"] == row.rank) & (coll["process_group"] == row.process_group)
             & (coll["collective_seq_id"] < row.collective_seq_id) & (coll["status"].astype(str) == S.STATUS_OK)]
    same = h[h["call_site"] == row.call_site] if str(row.call_site) else h.iloc[0:0]
    same = same_call_history(coll, row, same)      # a line that issues several calls: the same one before
    site = str(row.call_site) if len(same) >= least else ""
    h = same if site else h
    return (h, site) if len(h) >= least else None


def _history_value(history: tuple[pd.DataFrame, str], cat: str) -> tuple[str, int, str] | None:
    """(the value every call of `history` had in category `cat`, how many, their call site), or None."""
    h, site = history
    vals = _values(h, cat)
    if vals.nunique() != 1 or (cat != "type" and (vals == "").any()):
        return None
    return str(vals.iloc[0]), len(h), site


def _deviants(coll: pd.DataFrame, rows: pd.DataFrame, same_site: bool = False,
              least: int = HISTORY_MIN) -> dict[int, list[tuple[str, str, str, int, str]]]:
    """rank -> [(category, its value, its history's value, n, site)] for the rows that break their own history
    (site: the call site the history is from, "" when it is every call of the rank on the group; `least`
    earlier calls make a history)."""
    out: dict[int, list[tuple[str, str, str, int, str]]] = {}
    for row in rows.itertuples(index=False):
        history = _history(coll, row, least)       # once per row: every category reads the same calls
        if history is None or (same_site and not history[1]):
            continue
        for cat in _CATEGORIES:
            if cat == "size" and str(row.input_sizes) == "":
                continue
            hv = _history_value(history, cat)
            if hv is None:
                continue
            val = str(_values(pd.DataFrame([row._asdict()]), cat).iloc[0])
            if val != hv[0]:
                out.setdefault(int(row.rank), []).append((cat, val, *hv))
    return out


def resolve_by_history(source: IndexLike, findings: list[Finding]) -> list[Finding]:
    """The collective findings with ambiguous ties decided by history, plus lone unfinished records that
    break their rank's own history (the partner's record died with it)."""
    ix = as_index(source)
    coll, inst = ix.coll, ix.instances
    if not len(coll):
        return findings
    out: list[Finding] = []
    decided: set[tuple[str, int]] = set()
    for f in findings:
        if f.kind == FindingKind.COLLECTIVE_MISMATCH and f.cause.ambiguous and f.instance is not None:
            g, k = f.instance.group, f.instance.seq
            rows = coll[(coll["process_group"] == g) & (coll["collective_seq_id"] == k)]
            dev = _deviants(coll, rows)
            if len(dev) == 1 and len(rows) > 1:
                out.append(_history_finding(ix, g, k, rows, dev, base=f))
                decided.add((g, k))
                continue
            seq_dev = sequence_deviant(coll, rows, g)
            skip = None if seq_dev is not None else skipped_statement(coll, rows, g)
            if seq_dev is not None or skip is not None:
                out.append(_sequence_finding(ix, g, k, rows, seq_dev or skip, base=f, skipped=skip is not None))
                decided.add((g, k))
                continue
        out.append(f)
    if len(inst):
        out += _lone_records(ix, decided)
    return out


def _lone_records(ix: Any, decided: set[tuple[str, int]]) -> list[Finding]:
    """Instances one member alone recorded that break that member's own history (`resolve_by_history`).

    - unfinished, the others' records absent: the call site's history (HISTORY_MIN earlier calls) speaks;
    - where the group's other members left no dump at all (their processes died): gloo completes the
      survivor's side of a mismatched collective and aborts the partner, or leaves it waiting, so the
      instance the partner died in is the survivor's last on the group, or the one before when that last
      one is unfinished (a group whose member is dead completes nothing after). Nothing else can speak for
      those calls: one earlier call from the very call site is history enough (HISTORY_MIN_ALONE), and
      the survivor's own sequence on the group (loop_order.predicted_next: a skip or an extra call) where
      HISTORY_MIN earlier iterations say what was due.
    The earlier candidate is asked first: the first deviation is the root."""
    coll, inst = ix.coll, ix.instances
    out: list[Finding] = []
    missing = {r for r, info in ix.trace.ranks.items() if not info.present}
    with_dead = {g for g, m in ix.members.items() if missing & set(m) and len(m) >= 2} if missing else set()
    lone = inst[(inst["n_began"] == 1) & (inst["n_notok"] > 0)]
    cands = [(str(r.process_group), int(r.seq), False) for r in lone.itertuples(index=False)
             if str(r.process_group) not in with_dead]
    if with_dead:
        mine = coll[coll["process_group"].astype(str).isin(with_dead).to_numpy()]
        for _, sub in mine.groupby(["rank", "process_group"], sort=True, observed=True):
            sub = sub.sort_values("collective_seq_id")
            ks = [int(sub["collective_seq_id"].iloc[-1])]
            if str(sub["status"].iloc[-1]) != S.STATUS_OK and len(sub) > 1:
                ks.insert(0, int(sub["collective_seq_id"].iloc[-2]))
            cands += [(str(sub["process_group"].iloc[0]), k, True) for k in ks]
    for g, k, dead in cands:
        if (g, k) in decided or len(ix.members.get(g, [])) < 2:
            continue
        rows = coll[(coll["process_group"] == g) & (coll["collective_seq_id"] == k)]
        if len(rows) != 1:
            continue
        absent = set(ix.members.get(g, [])) - set(int(x) for x in rows["rank"])
        finished = str(rows["status"].iloc[0]) == S.STATUS_OK
        dead = dead and bool(absent) and absent <= missing
        if finished and not dead:
            continue
        dev = _deviants(coll, rows, same_site=True, least=HISTORY_MIN_ALONE if dead else HISTORY_MIN)
        if len(dev) == 1:
            # finished, the dead partner's death came after it: filed as the deviation before a death
            out.append(_history_finding(ix, g, k, rows, dev, before_death=finished))
            decided.add((g, k))
            continue
        seq_dev = sequence_deviant(coll, rows, g, alone=True) if dead else None
        # ... its loop order only where two earlier iterations agree: a loop's first iterations may differ
        # (DDP's bucket rebuild, a warm-up) and nothing else checks one against them (seed 20261210 #236)
        if seq_dev is not None and seq_dev[3] >= HISTORY_MIN:
            out.append(_sequence_finding(ix, g, k, rows, seq_dev, before_death=finished, absent=sorted(absent)))
            decided.add((g, k))
    return out


_WORD = {"type": "called", "size": "passed sizes", "dtype": "passed dtype"}


def _history_finding(ix, g: str, k: int, rows: pd.DataFrame, dev: dict, base: Finding | None = None,
                     before_death: bool = False) -> Finding:
    trace, members = ix.trace, ix.members
    (rank, diffs), = dev.items()
    mine = rows[rows["rank"] == rank].iloc[0]
    others = rows[rows["rank"] != rank].sort_values("rank")
    parts = [f"{_WORD[c]} {v} where its own {n} earlier call{'s' if n != 1 else ''} on {g}"
             f"{' from ' + site if site else ''} {'all ' if n > 1 else ''}"
             f"{'called' if c == 'type' else 'passed'} {hv}" for c, v, hv, n, site in diffs]
    title = f"{rank_label(trace, [rank])} deviates in {mine['op_name']} #{k} on {ix.label(g)}: " + "; ".join(parts)
    if len(others):
        title += f" ({rank_label(trace, others['rank'])} did what {'it' if len(others) == 1 else 'they'} always did there)"
    absent = sorted(set(members.get(g, [])) - set(int(r) for r in rows["rank"]))
    if absent:
        title += f"; {rank_label(trace, absent)} left no record of #{k} (its record may have died with it)"
    notok = rows[rows["status"].astype(str) != S.STATUS_OK]
    ev = [Evidence(rank=int(rank), note="deviant: " + "; ".join(f"{c} {v} (its history: {hv} x{n})"
                                                               for c, v, hv, n, _ in diffs) + f"; {mine['status']}",
                   op_name=str(mine["op_name"]), process_group=g, seq=k, op_id=int(mine["op_id"]),
                   time_ns=int(mine["start_ns"]))]
    ev += [Evidence(rank=int(r.rank), note=f"consistent with its own history; {r.status}", op_name=str(r.op_name),
                    process_group=g, seq=k, op_id=int(r.op_id), time_ns=int(r.start_ns))
           for r in others.itertuples(index=False)]
    data = {**(base.data if base is not None else {}), "process_group": g, "seq": k,
            "categories": [c for c, *_ in diffs]}
    cause = replace(base.cause if base is not None else Cause(later_instances=0), ambiguous=False,
                    deviant_ranks=(int(rank),), unfinished=bool(len(notok)), basis=CauseBasis.HISTORY,
                    absent_ranks=tuple(absent), before_death=before_death)
    if base is not None:
        return replace(base, title=title, ranks=[int(rank)], evidence=ev, data=data, cause=cause)
    return Finding(kind="collective_mismatch", severity="error", title=title, ranks=[int(rank)], evidence=ev,
                   instance=InstanceRef(g, k), data=data, cause=cause, layout=HISTORY_LAYOUT)


def _sequence_finding(ix, g: str, k: int, rows: pd.DataFrame, dev: tuple[int, str, str, int],
                      base: Finding | None = None, before_death: bool = False, absent: list[int] | None = None,
                      skipped: bool = False) -> Finding:
    """A tie decided by the members' own sequences on the group (loop_order.sequence_deviant): the rank
    whose call is not the one its earlier calls issue at that point, where every other member's is; or a
    lone record whose other members left no dump (`absent`, no `base`: `_lone_records`); or, `skipped`, the
    rank that skipped a statement of its loop to make its call (skipped_statement.py)."""
    rank, op, site, n = dev
    mine = rows[rows["rank"] == rank].iloc[0]
    others = rows[rows["rank"] != rank].sort_values("rank")
    at = f" at {mine['call_site']}" if str(mine["call_site"]) else ""
    src = f" from {site}" if site else ""
    iters = f"{n} earlier iteration{'' if n == 1 else 's'}"
    title = (f"{rank_label(ix.trace, [rank])} deviates in {mine['op_name']} #{k} on {ix.label(g)}: called "
             f"{mine['op_name']}{at}")
    if skipped:
        title += (f" without the {op}{src} on {g} that came before it in "
                  f"{'its own earlier iteration' if n == 1 else f'each of its own {iters}'} (it skipped that call)")
    else:
        title += (f" where its own earlier calls on {g} issue {op}{src} at this point of its loop "
                  f"({iters} {'says' if n == 1 else 'say'} so)")
    if len(others):
        title += (f"; {rank_label(ix.trace, others['rank'])} called what "
                  f"{'its own loop issues' if len(others) == 1 else 'their own loops issue'} there")
    if absent:
        title += f"; {rank_label(ix.trace, absent)} left no record of #{k} (no dump: its record died with it)"
    ev = [Evidence(rank=int(rank), note=f"deviant: {mine['op_name']} where its loop issues {op}; {mine['status']}",
                   op_name=str(mine["op_name"]), process_group=g, seq=k, op_id=int(mine["op_id"]),
                   time_ns=int(mine["start_ns"]))]
    ev += [Evidence(rank=int(r.rank), note=f"what its own loop issues here; {r.status}", op_name=str(r.op_name),
                    process_group=g, seq=k, op_id=int(r.op_id), time_ns=int(r.start_ns))
           for r in others.itertuples(index=False)]
    notok = rows[rows["status"].astype(str) != S.STATUS_OK]
    data = {**(base.data if base is not None else {}), "process_group": g, "seq": k,
            "expected": {"op_name": op, "call_site": site}}
    cause = replace(base.cause if base is not None else Cause(later_instances=0), ambiguous=False,
                    deviant_ranks=(int(rank),), unfinished=bool(len(notok)), basis=CauseBasis.HISTORY,
                    absent_ranks=tuple(absent) if absent else None, before_death=before_death)
    if base is None:
        return Finding(kind="collective_mismatch", severity="error", title=title, ranks=[int(rank)], evidence=ev,
                       instance=InstanceRef(g, k), data=data, cause=cause, layout=HISTORY_LAYOUT)
    return replace(base, title=title, ranks=[int(rank)], evidence=ev, data=data, cause=cause)
