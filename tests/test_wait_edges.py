"""The wait-for edges kept per instance (analysis/wait_edges.py): a selection is the whole table's rows
that pass the same filter, in the same order, and the graph's arcs are the ones the rank-to-rank edges
give (same successors, same order), on hand-built tables."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from ncclscope import schema as S
from ncclscope.index.wait_edges import EDGE_COLUMNS, WaitEdges
from ncclscope.index.waitgraph import _arcs

GROUPS = ["dp0", "tp1", "world"]


def _tables(seed: int) -> WaitEdges:
    """Random waiters (one blocking row per rank and instance), absent members (one row per member and
    instance), p2p edges; ties on start_ns on purpose."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 50))
    ranks = rng.choice(60, size=n, replace=False)
    b = pd.DataFrame({"waiter": ranks.astype(np.int64), "process_group": rng.choice(GROUPS, n),
                      "seq": rng.integers(1, 4, n).astype(np.int64),
                      "op_name": rng.choice(["all_reduce", "barrier"], n), "op_id": np.arange(n, dtype=np.int64),
                      "start_ns": rng.integers(0, 4, n).astype(np.int64) * 10**9, "status": "inflight",
                      "peer": np.int64(-1), "tag": np.int64(-1), "kind": S.KIND_COLLECTIVE})
    rows = []
    for g in GROUPS:
        for k in range(1, 4):
            if rng.random() < 0.2:
                continue
            for mbr in rng.choice(60, size=int(rng.integers(1, 8)), replace=False):
                rows.append({"process_group": g, "seq": k, "member": int(mbr),
                             "reason": "not begun" if rng.random() < 0.7 else "died in it",
                             "n_began": int(rng.integers(0, 8)), "n_members": 8})
    m = pd.DataFrame(rows, columns=["process_group", "seq", "member", "reason", "n_began", "n_members"])
    m = pd.concat([m[m["reason"] == "not begun"], m[m["reason"] != "not begun"]], ignore_index=True)
    npp = int(rng.integers(0, 12))
    p = pd.DataFrame({"waiter": rng.integers(0, 60, npp).astype(np.int64),
                      "target": rng.integers(0, 60, npp).astype(np.int64), "via": S.KIND_P2P,
                      "op_name": rng.choice(["send", "recv"], npp), "process_group": rng.choice(["pp0", "dp0"], npp),
                      "seq": rng.integers(1, 5, npp).astype(np.int64), "peer": np.int64(0), "tag": np.int64(0),
                      "op_id": np.arange(npp, dtype=np.int64) + 100,
                      "start_ns": rng.integers(0, 4, npp).astype(np.int64) * 10**9, "status": "inflight",
                      "reason": "not posted", "n_began": np.int64(-1), "n_members": np.int64(2)})[EDGE_COLUMNS]
    return WaitEdges(waiters=b, absent=m, p2p=p)


def _rank_to_rank_arcs(edges: pd.DataFrame) -> dict[int, list[int]]:
    """The reference: arcs built from the expanded edges (an instance node between its waiters and
    targets), successors ordered by their first edge."""
    if not len(edges):
        return {}
    row = np.arange(len(edges))
    is_coll = (edges["via"].astype(str) == S.KIND_COLLECTIVE).to_numpy()
    c = edges[is_coll]
    inst = c.groupby(["process_group", "seq"], sort=False, observed=True).ngroup().to_numpy(np.int64)
    key = list(zip(c["process_group"].astype(str), c["seq"]))
    waiter, target = edges["waiter"].to_numpy(np.int64), edges["target"].to_numpy(np.int64)
    src = list(waiter[~is_coll]) + list(waiter[is_coll]) + [("i", k) for k in key]
    dst = list(target[~is_coll]) + [("i", k) for k in key] + list(target[is_coll])
    pos = list(row[~is_coll]) + list(row[is_coll]) + list(row[is_coll])
    del inst
    first: dict = {}
    for s, d, p in sorted(zip(src, dst, pos), key=lambda x: x[2]):
        first.setdefault(s, {}).setdefault(d, p)
    return {s: [d for d, _ in sorted(ds.items(), key=lambda x: x[1])] for s, ds in first.items()}


def _named(we: WaitEdges, adj: dict[int, list[int]]) -> dict:
    """`_arcs`' instance ids (-1 - position in the absent table) as ("i", (group, seq))."""
    inst = we.absent[["process_group", "seq"]].drop_duplicates().reset_index(drop=True)
    name = {-1 - i: ("i", (str(g), int(k))) for i, (g, k) in enumerate(inst.itertuples(index=False))}
    return {name.get(s, s): [name.get(d, d) for d in ds] for s, ds in adj.items()}


@pytest.mark.parametrize("seed", range(40))
def test_selection_is_the_filtered_table_and_arcs_are_the_rank_to_rank_ones(seed: int) -> None:
    we = _tables(seed)
    full = we.frame
    assert list(full.columns) == EDGE_COLUMNS
    coll = full[(full["via"].astype(str) == S.KIND_COLLECTIVE).to_numpy()]
    assert not (coll["waiter"] == coll["target"]).any()          # a rank never waits on itself in a collective
    st = full[["start_ns", "waiter", "target"]].to_numpy()
    assert (np.lexsort(st.T[::-1]) == np.arange(len(full))).all()        # oldest wait first
    rng = np.random.default_rng(seed + 1000)
    for _ in range(6):
        waiters = set(rng.choice(60, size=int(rng.integers(1, 30)), replace=False).tolist()) \
            if rng.random() < 0.7 else None
        targets = set(rng.choice(60, size=int(rng.integers(1, 30)), replace=False).tolist()) \
            if rng.random() < 0.7 else None
        group = str(rng.choice(GROUPS + ["pp0"])) if rng.random() < 0.4 else None
        got = we.select(waiters=waiters, targets=targets, group=group)
        keep = np.ones(len(full), dtype=bool)
        if waiters is not None:
            keep &= full["waiter"].isin(list(waiters)).to_numpy()
        if targets is not None:
            keep &= full["target"].isin(list(targets)).to_numpy()
        if group is not None:
            keep &= (full["process_group"].astype(str) == group).to_numpy()
        want = full[keep].reset_index(drop=True)
        assert len(got) == len(want)
        for c in EDGE_COLUMNS:
            assert got[c].astype(str).tolist() == want[c].astype(str).tolist(), (c, waiters, targets, group)
    assert _named(we, _arcs(we)) == _rank_to_rank_arcs(full)


def test_empty_tables_have_no_edges_and_no_arcs() -> None:
    we = WaitEdges()
    assert len(we) == 0 and list(we.select(waiters=[1]).columns) == EDGE_COLUMNS and _arcs(we) == {}
