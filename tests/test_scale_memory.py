"""The third scale round's fast paths against the code they replace (same frames, dtypes and order).

Each path exists to save memory or CPU at 10-30 M events (docs/scale.md, "Issue 11, third round"); what
must not change is the result, so each one is compared here with the plain pandas or per-table code on
small random inputs that exercise the edge cases (nulls, "" values, unsorted rows, missing sides).
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from ncclscope.load import columns as C
from ncclscope.index import p2p_pairs as P
from ncclscope.perf import utilization as U
from ncclscope.index import wait_edges as W
from ncclscope.load.columns import force_rank

SCHEMA = pa.schema([("rank", pa.int32()), ("op_name", pa.string()), ("kind", pa.string()), ("step", pa.int32())])
VALUES = ["a", "b", "", "ccc", None]


def _tables(rng: np.random.Generator) -> list[pa.Table]:
    out = []
    for r in range(int(rng.integers(1, 10))):
        n = int(rng.integers(0, 6))
        out.append(pa.table({"rank": pa.array(rng.integers(0, 99, n), pa.int32()),
                             "op_name": pa.array([VALUES[i] for i in rng.integers(0, 5, n)], pa.string()),
                             "kind": pa.array([VALUES[i] for i in rng.integers(3, 5, n)], pa.string()),
                             "step": pa.array(rng.integers(-1, 3, n), pa.int32())}, schema=SCHEMA))
    return out


def _frame(tables: list[pa.Table], batch_rows: int, ranks: list[int] | None, chunked: bool) -> pd.DataFrame:
    cols = C.Columns(SCHEMA)
    cols.BATCH_ROWS = batch_rows
    if not chunked:                                      # the per-table coding, as before the round
        cols._codes_chunked = lambda name, chunks: C.Columns._codes(cols, name, chunks[:1]) if len(chunks) == 1 \
            else np.concatenate([C.Columns._codes(cols, name, [c]) for c in chunks])
    for i, t in enumerate(tables):
        if ranks is None:
            cols.add(t)
        elif chunked:
            cols.add(t, rank=ranks[i])
        else:
            cols.add(force_rank(t, ranks[i]))
    return cols.frame()


@pytest.mark.parametrize("seed", range(40))
def test_batch_coding_and_rank_are_the_per_table_ones(seed: int) -> None:
    rng = np.random.default_rng(seed)
    tables = _tables(rng)
    ranks = [int(r) for r in rng.integers(0, 50, len(tables))]
    for batch in (1, 4, 1000):
        for rk in (None, ranks):
            got, want = _frame(tables, batch, rk, True), _frame(tables, batch, rk, False)
            pd.testing.assert_frame_equal(got, want, check_exact=True)
            for c in ("op_name", "kind"):          # category order is first appearance, as before
                assert list(got[c].cat.categories) == list(want[c].cat.categories)


def test_p2p_fast_join_with_int32_keys_is_the_merge() -> None:
    rng = np.random.default_rng(3)
    n = 400
    src = rng.integers(0, 6, n).astype(np.int32)
    dst = ((src + rng.integers(1, 3, n)) % 6).astype(np.int32)
    send = rng.random(n) < 0.5
    p2p = pd.DataFrame({
        "rank": np.where(send, src, dst).astype(np.int32), "op_id": np.arange(n, dtype=np.int64),
        "op_name": pd.Categorical(np.where(send, "isend", "irecv")), "process_group": pd.Categorical(["pp0"] * n),
        "peer": np.where(send, dst, src).astype(np.int32), "tag": rng.integers(0, 2, n).astype(np.int32),
        "seq": rng.integers(0, 30, n).astype(np.int64), "status": pd.Categorical(rng.choice(["ok", "inflight"], n)),
        "start_ns": rng.integers(0, 10**9, n), "step": rng.integers(0, 3, n).astype(np.int32),
        "microbatch": rng.integers(0, 4, n).astype(np.int32), "call_site": pd.Categorical(["a.py:1"] * n),
        "direction": pd.Categorical(np.where(send, "send", "recv"), categories=["recv", "send"]),
        "src": src, "dst": dst})
    assert P._outer_by_keys(p2p) is not None
    sends, recvs = p2p[p2p["direction"] == "send"], p2p[p2p["direction"] == "recv"]
    s = sends[P.KEY + P.SIDE_COLUMNS].rename(columns={c: f"send_{c}" for c in P.SIDE_COLUMNS}).drop_duplicates(P.KEY)
    r = recvs[P.KEY + P.SIDE_COLUMNS].rename(columns={c: f"recv_{c}" for c in P.SIDE_COLUMNS}).drop_duplicates(P.KEY)
    want = s.merge(r, on=P.KEY, how="outer", indicator=True)
    want["state"] = want["_merge"].cat.rename_categories({"both": "matched", "left_only": "send_only",
                                                          "right_only": "recv_only"})
    want = want.drop(columns="_merge").reset_index(drop=True)
    pd.testing.assert_frame_equal(P.match_p2p(p2p), want, check_exact=True)


@pytest.mark.parametrize("seed", range(10))
def test_rank_span_is_the_group_by(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 300))
    ops = pd.DataFrame({"rank": np.sort(rng.integers(0, 9, n)).astype(np.int32),
                        "start_ns": rng.integers(0, 10**6, n), "end_ns": rng.integers(-1, 10**6, n)})
    want = ops.groupby("rank").agg(first=("start_ns", "min"), last=("end_ns", "max"))
    pd.testing.assert_frame_equal(U._rank_span(ops), want, check_exact=True)
    shuffled = ops.sample(frac=1.0, random_state=seed).reset_index(drop=True)      # not in rank order
    pd.testing.assert_frame_equal(U._rank_span(shuffled), want, check_exact=True)


@pytest.mark.parametrize("seed", range(10))
def test_sorted_edges_are_the_filtered_sort(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 200))
    edges = pd.DataFrame({"waiter": rng.integers(0, 5, n), "target": rng.integers(-1, 6, n),
                          "via": pd.Categorical(rng.choice(["p2p", "collective"], n)),
                          "start_ns": rng.integers(0, 4, n), "n_began": rng.integers(0, 3, n)})
    if seed % 2:
        edges = edges.sort_values(["start_ns", "waiter", "target"], kind="stable").reset_index(drop=True)
    keep = rng.random(n) < 0.7
    want = edges[keep].sort_values(["start_ns", "waiter", "target"], kind="stable").reset_index(drop=True)
    pd.testing.assert_frame_equal(W._sorted(edges[keep]), want, check_exact=True)
