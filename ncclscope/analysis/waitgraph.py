"""The wait-for graph: who waits on whom at the end of the trace, across groups and p2p.

From each live rank's blocking op (rank_states.py):

- a collective (g, k) on rank a waits on every member b of g that never began
  (g, k) (b's highest seq on g < k), and on a member that began it but died
  inside it;
- a recv from q waits on q unless q posted the matching send (src, dst, tag,
  p2p_seq_id); a send to q likewise needs q's recv; a dead q that posted
  but never finished is waited on too.

Then the graph is cut into strongly connected components (Tarjan, iterative)
and every waiting chain is followed to where it ends: a cycle (a component of
more than one rank) or a single rank that waits on nobody. `WaitGraph` holds
the edges, the components and, per terminal component, the ranks whose chains
end there; waitfor.py turns each terminal into a finding. Vectorised: a
collective's edges (its waiters x its absent members) are built from index
arrays, strings as categoricals (a world barrier at 16,384 ranks is 4.1 M
edges); only the graph walk is Python, over ranks, not events.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

import numpy as np
import pandas as pd

from .. import schema as S
from .p2p_pairs import KEY, direction

if TYPE_CHECKING:
    from .index import TraceIndex

EDGE_COLUMNS = ["waiter", "target", "via", "op_name", "process_group", "seq", "peer", "tag", "op_id", "start_ns",
                "status", "reason", "n_began", "n_members"]



def collective_edges(blocking: pd.DataFrame, coll: pd.DataFrame, members: pd.DataFrame, dead: pd.Series,
                     max_seq: pd.DataFrame) -> pd.DataFrame:
    """Edges from ranks blocked in a collective to members that did not begin it (or died in it).

    `members` is the index's member table (process_group, member, n_members), `max_seq` its max-seq table."""
    b = blocking[blocking["kind"] == S.KIND_COLLECTIVE]
    if not len(b):
        return pd.DataFrame(columns=EDGE_COLUMNS)
    b = b.rename(columns={"rank": "waiter", "collective_seq_id": "seq"})
    # Targets per instance first (instances x members), then the waiters of each instance: a world
    # barrier with thousands of waiters must not become waiters x members rows.
    inst = b[["process_group", "seq"]].drop_duplicates()
    m = inst.merge(members, on="process_group").merge(max_seq.rename(columns={"rank": "member"}),
                                                      on=["process_group", "member"], how="left")
    m["max_seq"] = m["max_seq"].fillna(0).astype("int64")
    m["began"] = m["max_seq"] >= m["seq"]
    m["n_began"] = m.groupby(["process_group", "seq"])["began"].transform("sum").astype("int64")
    m["reason"] = np.where(m["began"], "", "not begun")
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
    if not len(m):
        return pd.DataFrame(columns=EDGE_COLUMNS)
    return _expand(b, m)


STR_EDGE_COLUMNS = ("via", "op_name", "process_group", "status", "reason")


def _codes(values: pd.Series) -> tuple[np.ndarray, list[str]]:
    """A small string column as (int codes, categories in sorted order)."""
    codes, cats = pd.factorize(values.astype(str).to_numpy(dtype=object), sort=True)
    return codes, [str(c) for c in cats]


def _expand(b: pd.DataFrame, m: pd.DataFrame) -> pd.DataFrame:
    """Waiters x absent members of each instance, as the rows of `b.merge(m, on=(group, seq))` (left order,
    then right order), without the merge's intermediate frames: a world barrier with 16,128 waiters and 255
    absent ranks is 4.1 M edges, built here from index arrays; the string columns are categoricals
    (one byte a row instead of a string), the ints int64 as before."""
    inst = m[["process_group", "seq"]].drop_duplicates().reset_index(drop=True)
    if not len(inst):
        return pd.DataFrame(columns=EDGE_COLUMNS)
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
    nb = reason_cats.index("not begun") if "not begun" in reason_cats else -1
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
        return pd.DataFrame(columns=EDGE_COLUMNS)
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


def strongly_connected(nodes: Iterable[int], adj: dict[int, list[int]]) -> list[list[int]]:
    """Tarjan's SCCs, iterative; emitted sinks first (reverse topological order)."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    on_stack: set[int] = set()
    stack: list[int] = []
    out: list[list[int]] = []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on_stack.add(v)
            succ = adj.get(v, [])
            recurse = False
            while i < len(succ):
                w = succ[i]
                i += 1
                if w not in index:
                    work.append((v, i))
                    work.append((w, 0))
                    recurse = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if recurse:
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return out


def find_cycle(comp: list[int], adj: dict[int, list[int]]) -> list[int]:
    """One concrete cycle inside a strongly connected component, starting at its lowest rank."""
    members = set(comp)
    path, seen = [comp[0]], {comp[0]: 0}
    v = comp[0]
    while True:
        nxt = next(w for w in adj.get(v, []) if w in members)
        if nxt in seen:
            return path[seen[nxt]:]
        seen[nxt] = len(path)
        path.append(nxt)
        v = nxt


@dataclass
class WaitGraph:
    """The wait-for graph and where its chains end."""

    edges: pd.DataFrame                                   # EDGE_COLUMNS: waiter -> target, with the op
    comps: list[list[int]] = field(default_factory=list)  # strongly connected components (ranks), sinks first
    comp_of: dict[int, int] = field(default_factory=dict)
    waiters_of: dict[int, set[int]] = field(default_factory=dict)   # terminal component -> who waits on it

    def cycle(self, c: int) -> list[int]:
        """One concrete cycle through component `c`, from its lowest rank."""
        comp = self.comps[c]
        e = self.edges
        inside = e[e["waiter"].isin(comp).to_numpy() & e["target"].isin(comp).to_numpy()]
        adj: dict[int, list[int]] = {}
        for w, t in inside[["waiter", "target"]].drop_duplicates().to_numpy():
            adj.setdefault(int(w), []).append(int(t))
        return find_cycle(comp, adj)


def _arcs(edges: pd.DataFrame) -> dict[int, list[int]]:
    """Adjacency of the graph the components are computed on, successors in edge order.

    A collective instance (g, k) is one node of its own (a negative id) between
    its waiters and its targets: a world barrier with 3,584 waiters and 511
    absent ranks is 4,095 arcs, not 1.8 million. Reachability and the
    components over ranks are the same as with rank-to-rank edges."""
    if not len(edges):
        return {}
    row = np.arange(len(edges))
    is_coll = (edges["via"] == S.KIND_COLLECTIVE).to_numpy()
    c = edges[is_coll]
    inst = -1 - c.groupby(["process_group", "seq"], sort=False).ngroup().to_numpy(np.int64)
    waiter, target = edges["waiter"].to_numpy(np.int64), edges["target"].to_numpy(np.int64)
    arcs = pd.DataFrame({
        "src": np.concatenate([waiter[~is_coll], waiter[is_coll], inst]),
        "dst": np.concatenate([target[~is_coll], inst, target[is_coll]]),
        "pos": np.concatenate([row[~is_coll], row[is_coll], row[is_coll]]),
    }, copy=False).sort_values("pos", kind="stable").drop_duplicates(["src", "dst"]).sort_values(["src", "pos"], kind="stable")
    src, dst = arcs["src"].to_numpy(), arcs["dst"].to_numpy()
    cut = np.flatnonzero(np.r_[True, src[1:] != src[:-1]])
    return {int(src[i]): dst[i:j].tolist() for i, j in zip(cut, np.r_[cut[1:], len(src)])}


def _concat(parts: list[pd.DataFrame]) -> pd.DataFrame:
    """Edge frames one under the other, string columns as categoricals over the union of their values
    (pandas would turn categoricals with different categories into object columns)."""
    parts = [p for p in parts if len(p)]
    if not parts:
        return pd.DataFrame(columns=EDGE_COLUMNS)
    for c in STR_EDGE_COLUMNS:
        values = [p[c].cat.categories if isinstance(p[c].dtype, pd.CategoricalDtype) else p[c].astype(str).unique()
                  for p in parts]
        cats = sorted({str(v) for vs in values for v in vs})
        parts = [p.assign(**{c: pd.Categorical(p[c] if isinstance(p[c].dtype, pd.CategoricalDtype)
                                               else p[c].astype(str), categories=cats)}) for p in parts]
    return pd.concat(parts, ignore_index=True) if len(parts) > 1 else parts[0].reset_index(drop=True)


def wait_edges(ix: TraceIndex) -> pd.DataFrame:
    """Every wait-for edge of the live blocked ranks, oldest wait first."""
    trace, st, blocking = ix.trace, ix.rank_states, ix.blocking
    dead = st["dead"]
    edges = _concat([collective_edges(blocking, ix.coll, ix.member_table, dead, ix.max_seq),
                     p2p_edges(blocking, ix.p2p, dead)])
    keep = ~edges["waiter"].map(dead).fillna(False).astype(bool) & edges["target"].between(0, trace.world_size - 1)
    return _sorted_rows(edges, keep.to_numpy())


def _sorted_rows(edges: pd.DataFrame, keep: np.ndarray) -> pd.DataFrame:
    """`edges[keep].sort_values(["start_ns", "waiter", "target"], kind="stable").reset_index(drop=True)` in
    one take (4.1 M edges at 16,384 ranks: the filter and the sort each copied all ~0.3 GB of them); the
    pandas expression for columns that are not plain integers (a stable lexsort is its order on those)."""
    keys = ["start_ns", "waiter", "target"]
    if not all(edges[c].dtype.kind in "iu" for c in keys):
        return edges[keep].sort_values(keys, kind="stable").reset_index(drop=True)
    rows = np.flatnonzero(keep)
    st, w, t = (edges[c].to_numpy()[rows] for c in keys)
    in_order = len(rows) < 2 or bool(((st[1:] > st[:-1]) | ((st[1:] == st[:-1]) & (
        (w[1:] > w[:-1]) | ((w[1:] == w[:-1]) & (t[1:] >= t[:-1]))))).all())
    if not in_order:
        rows = rows[np.lexsort((t, w, st))]
    del st, w, t
    return edges.take(rows).reset_index(drop=True)


def wait_graph(ix: TraceIndex) -> WaitGraph:
    """Build the graph and, for each terminal component (a cycle or a rank waiting on nobody), its waiters."""
    edges = wait_edges(ix)
    adj = _arcs(edges)
    blocked = [int(r) for r in ix.blocking["rank"].unique()]
    nodes = sorted(set(blocked) | {int(t) for t in edges["target"].unique()})
    full = strongly_connected(nodes, adj)          # instance nodes (< 0) included
    comp_of = {v: i for i, c in enumerate(full) for v in c}
    comps = [[v for v in c if v >= 0] for c in full]
    succ: list[set[int]] = [set() for _ in full]
    for v, ws in adj.items():
        a = comp_of[v]
        for w in ws:
            b = comp_of[w]
            if a != b:
                succ[a].add(b)
    # An instance node always has successors (its targets), so a terminal component holds ranks.
    terminal = [len(c) > 1 or not succ[i] for i, c in enumerate(comps)]
    reach: list[frozenset[int]] = []
    for i in range(len(full)):   # sinks first, so successors are done
        acc = {i} if terminal[i] else set()
        for s in succ[i]:
            acc |= reach[s]
        reach.append(frozenset(acc))
    waiters_of: dict[int, set[int]] = {i: set() for i in range(len(full)) if terminal[i]}
    for v in adj:
        if v < 0:
            continue
        for c in reach[comp_of[v]]:
            if c != comp_of[v]:
                waiters_of[c].add(v)
    return WaitGraph(edges=edges, comps=comps, comp_of={v: i for v, i in comp_of.items() if v >= 0},
                     waiters_of=waiters_of)
