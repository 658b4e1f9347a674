"""The wait-for edges, kept per instance and spelled out rank to rank only where a question reads them.

An edge says: live rank `waiter`, blocked in an op, waits on rank `target`:

- a collective (g, k) on rank a waits on every member b of g that never began
  (g, k) (b's highest seq on g < k), and on a member that began it but died
  inside it;
- a recv from q waits on q unless q posted the matching send (src, dst, tag,
  p2p_seq_id); a send to q likewise needs q's recv; a dead q that posted
  but never finished is waited on too.

A collective's edges are its waiters x its absent members: a world barrier at
16,384 ranks with 16,128 waiters and 255 absent ranks is 4.1 M of them, while
the graph (waitgraph.py) needs one arc per waiter and one per absent member,
and the wording reads the edges of a handful of ranks. So `WaitEdges` keeps
the two small tables (the waiters' blocking rows, the absent members per
instance) plus the p2p edges, and `select` expands only the rows a question
filters on; `frame` is the whole table (the Parquet export, tests), built on
first use. A selection is exactly the whole table's rows that pass the same
filter, in the same order: oldest wait first (`start_ns`, waiter, target),
"not begun" before "died in it" on ties.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Collection

import numpy as np
import pandas as pd

from ncclscope import schema as S
from ncclscope.index.p2p_pairs import KEY, direction

if TYPE_CHECKING:
    from ncclscope.index.views import TraceIndex

EDGE_COLUMNS = ["waiter", "target", "via", "op_name", "process_group", "seq", "peer", "tag", "op_id", "start_ns",
                "status", "reason", "n_began", "n_members"]
STR_EDGE_COLUMNS = ("via", "op_name", "process_group", "status", "reason")
NOT_BEGUN = "not begun"


def _empty() -> pd.DataFrame:
    return pd.DataFrame(columns=EDGE_COLUMNS)


def absent_members(blocking: pd.DataFrame, coll: pd.DataFrame, members: pd.DataFrame, dead: pd.Series,
                   max_seq: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(waiters, absent): the collective blocking rows (renamed: waiter, seq) and, per instance they block
    in, the members that did not begin it or died in it (process_group, seq, member, reason, n_began,
    n_members), "not begun" rows first.

    `members` is the index's member table (process_group, member, n_members), `max_seq` its max-seq table."""
    b = blocking[blocking["kind"] == S.KIND_COLLECTIVE]
    none = pd.DataFrame(columns=["process_group", "seq", "member", "reason", "n_began", "n_members"])
    if not len(b):
        return b.rename(columns={"rank": "waiter", "collective_seq_id": "seq"}), none
    b = b.rename(columns={"rank": "waiter", "collective_seq_id": "seq"})
    # Targets per instance (instances x members), never waiters x members rows.
    inst = b[["process_group", "seq"]].drop_duplicates()
    m = inst.merge(members, on="process_group").merge(max_seq.rename(columns={"rank": "member"}),
                                                      on=["process_group", "member"], how="left")
    m["max_seq"] = m["max_seq"].fillna(0).astype("int64")
    m["began"] = m["max_seq"] >= m["seq"]
    m["n_began"] = m.groupby(["process_group", "seq"])["began"].transform("sum").astype("int64")
    m["reason"] = np.where(m["began"], "", NOT_BEGUN)
    died = m[m["began"] & m["member"].map(dead).fillna(True).astype(bool).to_numpy()]
    if len(died):
        stat = coll.loc[coll["rank"].isin(died["member"].unique()).to_numpy(),
                        ["process_group", "collective_seq_id", "rank", "status"]].rename(
            columns={"collective_seq_id": "seq", "rank": "member", "status": "member_status"})
        died = died.merge(stat, on=["process_group", "seq", "member"], how="left")
        died = died[died["member_status"].astype(object).fillna("") != S.STATUS_OK].assign(reason="died in it")
        m = pd.concat([m[~m["began"]], died.drop(columns="member_status")], ignore_index=True)
    else:
        m = m[~m["began"]]
    return b, m[list(none.columns)].reset_index(drop=True) if len(m) else none


def _codes(values: pd.Series) -> tuple[np.ndarray, list[str]]:
    """A small string column as (int codes, categories in sorted order)."""
    codes, cats = pd.factorize(values.astype(str).to_numpy(dtype=object), sort=True)
    return codes, [str(c) for c in cats]


def _expand(b: pd.DataFrame, m: pd.DataFrame) -> pd.DataFrame:
    """Waiters x absent members of each instance, as the rows of `b.merge(m, on=(group, seq))` (left order,
    then right order) minus self-edges, "not begun" first, without the merge's intermediate frames: the
    string columns are categoricals (one byte a row instead of a string), the ints int64."""
    inst = m[["process_group", "seq"]].drop_duplicates().reset_index(drop=True)
    if not len(inst) or not len(b):
        return _empty()
    inst["iid"] = np.arange(len(inst), dtype=np.int64)
    b_iid = b[["process_group", "seq"]].merge(inst, on=["process_group", "seq"], how="left")["iid"].to_numpy()
    m_iid = m[["process_group", "seq"]].merge(inst, on=["process_group", "seq"], how="left")["iid"].to_numpy()
    has = ~pd.isna(b_iid)
    b_rows = np.flatnonzero(has)
    b_iid = b_iid[has].astype(np.int64)
    m_order = np.argsort(m_iid.astype(np.int64), kind="stable")
    counts = np.bincount(m_iid.astype(np.int64), minlength=len(inst))
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    per = counts[b_iid]
    left = np.repeat(b_rows, per)                                   # row of b, once per target
    # position of each edge inside its instance's target list: 0..count-1
    first = np.cumsum(per) - per
    within = np.arange(len(left), dtype=np.int64) - np.repeat(first, per)
    right = m_order[np.repeat(starts[b_iid], per) + within]         # row of m
    del first, within
    waiter = b["waiter"].to_numpy(np.int64)[left]
    target = m["member"].to_numpy(np.int64)[right]
    keep = np.flatnonzero(target != waiter)
    reason_codes, reason_cats = _codes(m["reason"])
    rc = reason_codes[right[keep]]
    nb = reason_cats.index(NOT_BEGUN) if NOT_BEGUN in reason_cats else -1
    # the kept edges, "not begun" first (stable): one position array, each column taken once through it
    order = keep[np.concatenate([np.flatnonzero(rc == nb), np.flatnonzero(rc != nb)])]
    del keep
    left, right, waiter, target = left[order], right[order], waiter[order], target[order]
    rc = reason_codes[right]
    del order
    cols: dict[str, object] = {"waiter": waiter, "target": target,
                               "via": pd.Categorical.from_codes(np.zeros(len(left), dtype=np.int8),
                                                                categories=[S.KIND_COLLECTIVE])}
    for c in ("op_name", "process_group", "seq", "peer", "tag", "op_id", "start_ns", "status"):
        if c in ("op_name", "process_group", "status"):
            codes, cats = _codes(b[c])
            cols[c] = pd.Categorical.from_codes(codes[left], categories=cats)
        else:
            cols[c] = b[c].to_numpy(np.int64)[left]
    cols["reason"] = pd.Categorical.from_codes(rc, categories=reason_cats)
    cols["n_began"] = m["n_began"].to_numpy(np.int64)[right]
    cols["n_members"] = m["n_members"].to_numpy(np.int64)[right]
    return pd.DataFrame({c: cols[c] for c in EDGE_COLUMNS}, copy=False)     # fresh arrays: no second copy


def p2p_edges(blocking: pd.DataFrame, p2p: pd.DataFrame, dead: pd.Series) -> pd.DataFrame:
    """Edges from ranks blocked in send/recv to the peer that did not post the counterpart (or died in it)."""
    b = blocking[blocking["kind"] == S.KIND_P2P].copy()
    if not len(b):
        return _empty()
    b["direction"] = direction(b["op_name"])
    b = b[b["direction"] != ""]
    is_send = b["direction"] == "send"
    b = b.assign(src=np.where(is_send, b["rank"], b["peer"]), dst=np.where(is_send, b["peer"], b["rank"]),
                 seq=b["p2p_seq_id"].astype("int64"), tag=b["tag"].astype("int64"),
                 want=np.where(is_send, "recv", "send"))
    # Only the few counterparts the blocked ops need (the p2p table may hold millions of rows).
    near = p2p["src"].isin(b["src"].unique()).to_numpy() & p2p["dst"].isin(b["dst"].unique()).to_numpy()
    other = p2p.loc[near, KEY + ["direction", "status"]]
    other = pd.DataFrame({**{k: other[k].to_numpy(np.int64) for k in KEY},
                          "want": other["direction"].astype(str).to_numpy(),
                          "other_status": other["status"].astype(object).to_numpy()})
    other = other.drop_duplicates(KEY + ["want"])
    e = b.merge(other, on=KEY + ["want"], how="left")
    posted = e["other_status"].notna()
    peer_dead = e["peer"].map(dead).fillna(True).astype(bool)
    e["reason"] = np.where(~posted, "not posted", "died in it")
    e = e[~posted | (peer_dead & (e["other_status"].fillna("").astype(str) != S.STATUS_OK))]
    e = e.rename(columns={"rank": "waiter"}).assign(target=e["peer"].astype("int64"), via=S.KIND_P2P,
                                                     n_began=-1, n_members=2)
    return e[EDGE_COLUMNS].reset_index(drop=True)


def _concat(parts: list[pd.DataFrame]) -> pd.DataFrame:
    """Edge frames one under the other, string columns as categoricals over the union of their values
    (pandas would turn categoricals with different categories into object columns)."""
    parts = [p for p in parts if len(p)]
    if not parts:
        return _empty()
    for c in STR_EDGE_COLUMNS:
        values = [p[c].cat.categories if isinstance(p[c].dtype, pd.CategoricalDtype) else p[c].astype(str).unique()
                  for p in parts]
        cats = sorted({str(v) for vs in values for v in vs})
        parts = [p.assign(**{c: pd.Categorical(p[c] if isinstance(p[c].dtype, pd.CategoricalDtype)
                                               else p[c].astype(str), categories=cats)}) for p in parts]
    return pd.concat(parts, ignore_index=True) if len(parts) > 1 else parts[0].reset_index(drop=True)


def _sorted(edges: pd.DataFrame) -> pd.DataFrame:
    """`edges.sort_values(["start_ns", "waiter", "target"], kind="stable").reset_index(drop=True)` in one
    take (a stable lexsort is that order), skipped when the rows are in order already."""
    keys = ["start_ns", "waiter", "target"]
    if len(edges) < 2:
        return edges.reset_index(drop=True)
    if not all(edges[c].dtype.kind in "iu" for c in keys):
        return edges.sort_values(keys, kind="stable").reset_index(drop=True)
    st, w, t = (edges[c].to_numpy() for c in keys)
    if bool(((st[1:] > st[:-1]) | ((st[1:] == st[:-1]) & (
            (w[1:] > w[:-1]) | ((w[1:] == w[:-1]) & (t[1:] >= t[:-1]))))).all()):
        return edges.reset_index(drop=True)
    return edges.take(np.lexsort((t, w, st))).reset_index(drop=True)


def _isin(values: pd.Series, allowed: Collection[int] | None) -> np.ndarray:
    if allowed is None:
        return np.ones(len(values), dtype=bool)
    return values.isin(list(allowed)).to_numpy()


def _is(values: pd.Series, group: str | None) -> np.ndarray:
    if group is None:
        return np.ones(len(values), dtype=bool)
    return (values.astype(str) == group).to_numpy()


@dataclass
class WaitEdges:
    """Every wait-for edge of the live blocked ranks, held per instance (see the module docstring)."""

    waiters: pd.DataFrame = field(default_factory=pd.DataFrame)   # collective blocking rows of live ranks
    absent: pd.DataFrame = field(default_factory=pd.DataFrame)    # per instance: members waited on, in range
    p2p: pd.DataFrame = field(default_factory=_empty)             # p2p edges (EDGE_COLUMNS), live waiters

    def select(self, waiters: Collection[int] | None = None, targets: Collection[int] | None = None,
               group: str | None = None) -> pd.DataFrame:
        """The edges whose waiter is in `waiters`, target in `targets` and group is `group` (None: any),
        as the rows of `frame` that pass the filter, in its order (EDGE_COLUMNS, index 0..n-1)."""
        b, m, p = self.waiters, self.absent, self.p2p
        if len(b):
            b = b[_isin(b["waiter"], waiters) & _is(b["process_group"], group)]
        if len(m):
            m = m[_isin(m["member"], targets) & _is(m["process_group"], group)]
        if len(p):
            p = p[_isin(p["waiter"], waiters) & _isin(p["target"], targets) & _is(p["process_group"], group)]
        return _sorted(_concat(([_expand(b, m)] if len(b) and len(m) else []) + [p]))

    @cached_property
    def frame(self) -> pd.DataFrame:
        """All edges (a 16,384-rank world barrier: 4.1 M rows, ~0.3 GB): for the export and for tests."""
        return self.select()

    def __len__(self) -> int:
        return len(self.frame)


def wait_edges(ix: "TraceIndex") -> WaitEdges:
    """The wait-for edges of `ix`'s live blocked ranks (targets inside the world)."""
    st, blocking, world = ix.rank_states, ix.blocking, ix.trace.world_size
    dead = st["dead"]
    b, m = absent_members(blocking, ix.coll, ix.member_table, dead, ix.max_seq)
    p = p2p_edges(blocking, ix.p2p, dead)

    def live(w: pd.Series) -> np.ndarray:
        return ~w.map(dead).fillna(False).astype(bool).to_numpy()

    if len(b):
        b = b[live(b["waiter"])]
    if len(m):
        m = m[m["member"].between(0, world - 1).to_numpy()].reset_index(drop=True)
    if len(p):
        p = p[live(p["waiter"]) & p["target"].between(0, world - 1).to_numpy()].reset_index(drop=True)
    return WaitEdges(waiters=b, absent=m, p2p=p)
