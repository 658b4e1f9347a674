"""The wait-for graph: who waits on whom at the end of the trace, across groups and p2p.

The edges (wait_edges.py: a blocked rank waits on the members that did not
begin its collective, or on the peer that did not post its p2p counterpart)
become a graph with one node per rank and one per blocked collective instance
(a world barrier with 16,128 waiters and 255 absent ranks is 16,383 arcs, not
4.1 M edges). Then the graph is cut into strongly connected components
(Tarjan, iterative) and every waiting chain is followed to where it ends: a
cycle (a component of more than one rank) or a single rank that waits on
nobody. `WaitGraph` holds the edges, the components and, per terminal
component, the ranks whose chains end there; waitfor.py turns each terminal
into a finding. Only the graph walk is Python, over ranks, not events.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

import numpy as np
import pandas as pd

from ncclscope.index.wait_edges import NOT_BEGUN, WaitEdges, wait_edges

if TYPE_CHECKING:
    from ncclscope.index.views import TraceIndex


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

    edges: WaitEdges                                      # waiter -> target, with the op (expanded on demand)
    comps: list[list[int]] = field(default_factory=list)  # strongly connected components (ranks), sinks first
    comp_of: dict[int, int] = field(default_factory=dict)
    waiters_of: dict[int, set[int]] = field(default_factory=dict)   # terminal component -> who waits on it

    def cycle(self, c: int) -> list[int]:
        """One concrete cycle through component `c`, from its lowest rank."""
        comp = self.comps[c]
        inside = self.edges.select(waiters=comp, targets=comp)
        adj: dict[int, list[int]] = {}
        for w, t in inside[["waiter", "target"]].drop_duplicates().to_numpy():
            adj.setdefault(int(w), []).append(int(t))
        return find_cycle(comp, adj)


def _arcs(we: WaitEdges) -> dict[int, list[int]]:
    """Adjacency of the graph the components are computed on, successors in the order of their first edge
    in `we.frame` (so the walk, and the components' order, are those of the rank-to-rank graph).

    A collective instance (g, k) is one node of its own (id -1 - its position among the absent table's
    instances) between its waiters and its targets; reachability and the components over ranks are the
    same as with rank-to-rank edges. Built from the per-instance tables, never from the expanded edges:
    a waiter's first edge into an instance goes to the instance's lowest absent member other than itself;
    an instance's first edge to target t comes from its oldest waiter (start, rank) other than t."""
    b, m, p = we.waiters, we.absent, we.p2p
    rows: list[pd.DataFrame] = []      # waiter arcs with the sort key of their first edge
    inst_adj: dict[int, list[int]] = {}
    if len(b) and len(m):
        inst = m[["process_group", "seq"]].drop_duplicates().reset_index(drop=True)
        inst["iid"] = np.arange(len(inst), dtype=np.int64)
        mi = m.merge(inst, on=["process_group", "seq"], how="left")
        nb = mi.assign(nb=(mi["reason"].astype(str) == NOT_BEGUN).to_numpy()).groupby(
            ["iid", "member"], sort=True)["nb"].any()
        targets = {int(i): g.index.get_level_values("member").to_numpy(np.int64) for i, g in nb.groupby(level=0)}
        bi = b[["process_group", "seq"]].merge(inst, on=["process_group", "seq"], how="left")["iid"].to_numpy()
        waiter, start = b["waiter"].to_numpy(np.int64), b["start_ns"].to_numpy(np.int64)
        has = np.flatnonzero(~pd.isna(bi))
        iid = bi[has].astype(np.int64)
        # each waiter's first target: its instance's lowest absent member, the second lowest if that is itself
        t1, t2 = (np.array([targets[i][j] if len(targets[i]) > j else -1 for i in range(len(inst))], dtype=np.int64)
                  for j in (0, 1))
        rep = np.where(t1[iid] != waiter[has], t1[iid], t2[iid])
        ok = rep >= 0
        first_nb = pd.DataFrame({"iid": iid[ok], "member": rep[ok]}).merge(
            nb.reset_index(), on=["iid", "member"], how="left")["nb"].fillna(False).to_numpy(bool)
        cls = np.where(first_nb, 0, 1).astype(np.int64)     # a "not begun" edge sorts before "died in it"
        rows.append(pd.DataFrame({"start": start[has][ok], "src": waiter[has][ok], "t": rep[ok], "part": 0,
                                  "cls": cls, "row": has[ok], "dst": -1 - iid[ok]}))
        # instance -> targets: ordered by their first edge, (oldest waiter other than t, t)
        w_of = pd.DataFrame({"iid": iid, "start": start[has], "w": waiter[has]}).drop_duplicates(["iid", "w"])
        w_of = w_of.sort_values(["iid", "start", "w"], kind="stable")
        for i, g in w_of.groupby("iid", sort=False):
            ws = list(zip(g["start"].tolist(), g["w"].tolist()))
            keyed = []
            for t in targets[int(i)].tolist():
                first = ws[0] if ws[0][1] != t else (ws[1] if len(ws) > 1 else None)
                if first is not None:
                    keyed.append((first, t))
            if keyed:
                inst_adj[-1 - int(i)] = [t for _, t in sorted(keyed)]
    if len(p):
        rows.append(pd.DataFrame({"start": p["start_ns"].to_numpy(np.int64), "src": p["waiter"].to_numpy(np.int64),
                                  "t": p["target"].to_numpy(np.int64), "part": 1, "cls": 0,
                                  "row": np.arange(len(p)), "dst": p["target"].to_numpy(np.int64)}))
    adj: dict[int, list[int]] = {}
    if rows:
        a = pd.concat(rows, ignore_index=True).sort_values(["src", "start", "t", "part", "cls", "row"], kind="stable")
        a = a.drop_duplicates(["src", "dst"])
        src, dst = a["src"].to_numpy(), a["dst"].to_numpy()
        cut = np.flatnonzero(np.r_[True, src[1:] != src[:-1]])
        if len(cut) == len(src):        # one successor each (a rank blocks in one op): no slicing
            adj = {s: [d] for s, d in zip(src.tolist(), dst.tolist())}
        else:
            adj = {int(src[i]): dst[i:j].tolist() for i, j in zip(cut, np.r_[cut[1:], len(src)])}
    adj.update(inst_adj)
    return adj


def wait_graph(ix: TraceIndex) -> WaitGraph:
    """Build the graph and, for each terminal component (a cycle or a rank waiting on nobody), its waiters."""
    edges = wait_edges(ix)
    adj = _arcs(edges)
    blocked = [int(r) for r in ix.blocking["rank"].unique()]
    nodes = sorted(set(blocked) | {int(t) for ts in adj.values() for t in ts if t >= 0})
    full = strongly_connected(nodes, adj)          # instance nodes (< 0) included
    comp_of = {v: i for i, c in enumerate(full) for v in c}
    comps = [c if c[0] >= 0 else [v for v in c if v >= 0] for c in full]     # sorted: instance ids lead
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
