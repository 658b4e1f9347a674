"""Group membership: who is in each process group, from the ranks' recorded views.

Every rank records every group it knows (name, kind, members, creation
order). On a healthy job the views are byte-identical, and the loader keeps
each distinct view once with the ranks that hold it (`trace.GroupViews`), so
membership is a vote over the distinct views weighted by their holders:
a 16,384-rank job with one view costs one pass over one view, never a
ranks x groups table. A group some rank used but nobody recorded gets the
ranks seen using it.

`group_view_table` is the per-rank table with each member list as one
comparable string, for the view checks that must name the odd ranks
(groups.check_group_views).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from ncclscope.load.trace import GroupViews

if TYPE_CHECKING:
    from ncclscope.load.trace import Trace


@dataclass(frozen=True)
class GroupInfo:
    """One process group as the analyses see it."""

    name: str
    kind: str                       # tp, dp, pp, cp, ep, world, custom (the kind most holders recorded)
    members: tuple[int, ...]        # sorted; the member list most holders recorded
    holders: int = 0                # ranks that recorded the group (0: nobody did)
    n_views: int = 1                # distinct member lists recorded for it (> 1: the ranks disagree)
    recorded: bool = True           # False: no rank recorded it; members are the ranks seen using it

    @property
    def size(self) -> int:
        return len(self.members)


def _vote(tally: dict[Any, list[int]]) -> Any:
    """The value most holders recorded; a tie goes to the value its lowest holder recorded."""
    return min(tally.items(), key=lambda kv: (-kv[1][0], kv[1][1]))[0]


def groups_from_views(views: GroupViews) -> dict[str, GroupInfo]:
    """Group name -> GroupInfo, voting over the distinct views weighted by how many ranks hold each."""
    held = [(view, holders) for view, holders in zip(views.views, views.holders) if holders]
    if len(held) == 1 and len(set(map(str, held[0][0]["process_group"]))) == len(held[0][0]["process_group"]):
        # one view, held by every rank that recorded one (a healthy run): nothing to vote on
        view, holders = held[0]
        n = len(holders)
        return {str(name): GroupInfo(name=str(name), kind=str(kind), members=tuple(sorted(map(int, ranks))),
                                     holders=n, n_views=1)
                for name, kind, ranks in zip(view["process_group"], view["group_kind"], view["ranks"])}
    members: dict[str, dict[tuple[int, ...], list[int]]] = {}
    kinds: dict[str, dict[str, list[int]]] = {}
    for view, holders in zip(views.views, views.holders):
        if not holders:
            continue
        n, low = len(holders), min(holders)
        for name, kind, ranks in zip(view["process_group"], view["group_kind"], view["ranks"]):
            name = str(name)
            key = tuple(map(int, ranks))
            t = members.setdefault(name, {}).setdefault(key, [0, low])
            t[0], t[1] = t[0] + n, min(t[1], low)
            k = kinds.setdefault(name, {}).setdefault(str(kind), [0, low])
            k[0], k[1] = k[0] + n, min(k[1], low)
    out = {}
    for name, tally in members.items():
        out[name] = GroupInfo(name=name, kind=_vote(kinds[name]), members=tuple(sorted(_vote(tally))),
                              holders=sum(c for c, _ in tally.values()), n_views=len(tally))
    return out


def recorded_groups(trace: "Trace") -> dict[str, GroupInfo]:
    """GroupInfo per recorded group: from the loader's distinct views, else from the groups table."""
    views = trace.group_views
    if views is None:
        views = GroupViews()
        views.add_rows(trace.groups.to_dict("records") if len(trace.groups) else [])
    return infer_kinds(groups_from_views(views))


INFERRED_PREFIX = "custom:"     # an inferred kind; groups.py checks no orthogonality on a guess


def infer_kinds(groups: dict[str, GroupInfo]) -> dict[str, GroupInfo]:
    """Kinds for groups nobody named (Flight Recorder calls them "1", "2", ... with desc "undefined").

    Structure says which belong together: the groups of one mesh dimension have
    the same size and the same spacing between members (tp {0,1},{2,3}: stride 1;
    dp {0,2},{1,3}: stride 2) and are disjoint. Each such family of two or more
    "custom" groups gets one kind, "custom:<size>x<spacing>"; the rest stay "custom".
    """
    fam: dict[tuple, list[str]] = {}
    for name, g in groups.items():
        if g.kind != "custom" or g.size < 2:
            continue
        m = g.members
        fam.setdefault((g.size, tuple(int(b - a) for a, b in zip(m, m[1:]))), []).append(name)
    out = dict(groups)
    for (size, gaps), names in fam.items():
        if len(names) < 2:
            continue
        seen: set[int] = set()
        if any(seen & set(groups[n].members) or seen.update(groups[n].members) for n in names):
            continue                                   # overlapping: not one dimension of a mesh
        spacing = gaps[0] if len(set(gaps)) == 1 else "-".join(map(str, gaps))
        kind = f"{INFERRED_PREFIX}{size}x{spacing}"
        for n in names:
            out[n] = GroupInfo(name=n, kind=kind, members=groups[n].members, holders=groups[n].holders,
                               n_views=groups[n].n_views, recorded=groups[n].recorded)
    return out


def used_groups(coll: pd.DataFrame, known: set[str], kinds_of: dict[str, str] | None = None) -> dict[str, GroupInfo]:
    """Groups that collectives used but no rank recorded: members are the ranks seen using them."""
    if not len(coll):
        return {}
    unknown = coll.loc[~coll["process_group"].isin(list(known)).to_numpy(), ["process_group", "rank"]]
    out = {}
    for name, ranks in unknown.drop_duplicates().groupby("process_group", sort=False)["rank"]:
        name = str(name)
        if name:
            kind = (kinds_of or {}).get(name) or name.rstrip("0123456789") or name
            out[name] = GroupInfo(name=name, kind=kind, members=tuple(sorted(int(r) for r in ranks)),
                                  holders=0, recorded=False)
    return out


# --------------------------------------------------------------------------
# The per-rank view table (for the checks that name the odd ranks)
# --------------------------------------------------------------------------
def view_keys(ranks: pd.Series) -> np.ndarray:
    """Each recorded member list as one "0,1,2" string (see `view_key_codes`)."""
    codes, texts = view_key_codes(ranks)
    return np.asarray(texts, dtype=object)[codes]


def view_key_codes(ranks: pd.Series) -> tuple[np.ndarray, list[str]]:
    """Each recorded member list as a code into its distinct "0,1,2" strings, numbered in order of first
    appearance (what factorizing the strings gives).

    1,024 ranks each recording every group of the world are 1.4 million lists
    (10 million ints). The loader shares one list object per distinct view
    (trace.py parses each distinct groups.json view once), so the lists are
    deduplicated by identity first and only the distinct ones are joined,
    through Arrow, and only those strings are compared (factorizing the per-row strings, long member
    lists of big groups, was 1.9 s at 16,384 ranks); readers that do not share objects still get the
    Arrow join over all rows.
    """
    if not len(ranks):
        return np.zeros(0, dtype=np.int64), []
    vals = ranks.to_numpy(dtype=object) if hasattr(ranks, "to_numpy") else np.asarray(ranks, dtype=object)
    ids = np.fromiter(map(id, vals), dtype=np.int64, count=len(vals))
    _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    by_first = np.argsort(first, kind="stable")          # distinct lists in order of first appearance
    rank_of = np.empty(len(first), dtype=np.int64)
    rank_of[by_first] = np.arange(len(first))
    uniq = vals[first[by_first]]
    try:
        arr = pa.array([list(r) if r is not None else [] for r in uniq], type=pa.list_(pa.int64()))
        texts = pc.binary_join(arr.cast(pa.list_(pa.string())), ",").to_numpy(zero_copy_only=False)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError, ValueError):
        texts = [",".join(str(int(x)) for x in r) for r in uniq]
    text_codes, distinct = pd.factorize(pd.Series(texts, dtype=object))   # equal lists held as two objects
    return text_codes[rank_of[inverse.reshape(-1)]], [str(t) for t in distinct]


def _parse_key(key: str) -> list[int]:
    return [int(x) for x in key.split(",")] if key else []


def majority_members(views: pd.DataFrame) -> dict[str, list[int]]:
    """Group name -> the member list most ranks recorded (same answer as Trace.group_members, vectorised)."""
    if not len(views):
        return {}
    cnt = views.groupby(["process_group", "members"], sort=False).size().rename("n").reset_index()
    cnt = cnt.sort_values(["process_group", "n"], ascending=[True, False], kind="stable")
    top = cnt.drop_duplicates("process_group")
    return {str(g): sorted(_parse_key(str(k))) for g, k in zip(top["process_group"], top["members"])}


def group_view_table(trace: "Trace") -> pd.DataFrame:
    """trace.groups with each member list as one comparable string (`members`)."""
    g = trace.groups
    if not len(g):
        return pd.DataFrame(columns=["rank", "process_group", "group_kind", "members", "creation_order"])
    # Categoricals: 1.4 million rows of a few thousand distinct names and member lists.
    return pd.DataFrame({
        "rank": g["rank"].astype("int64").to_numpy(),
        "process_group": _as_categorical(g["process_group"]),
        "group_kind": _as_categorical(g["group_kind"]),
        "members": _key_categorical(g["ranks"]),
        "creation_order": g["creation_order"].astype("int64").to_numpy(),
    })


def _key_categorical(ranks: pd.Series) -> pd.Categorical:
    """The member lists as `_as_categorical(view_keys(ranks))` gives them, without a string per row."""
    codes, texts = view_key_codes(ranks)
    return pd.Categorical.from_codes(codes, categories=pd.Index(texts, dtype=object))


def _as_categorical(s: pd.Series) -> pd.Categorical:
    codes, uniq = pd.factorize(s)
    names = pd.Index([str(u) for u in uniq], dtype=object)
    if (codes < 0).any():
        names = names.append(pd.Index([""], dtype=object)) if "" not in names else names
        codes = np.where(codes < 0, names.get_loc(""), codes)
    return pd.Categorical.from_codes(codes, categories=names)

