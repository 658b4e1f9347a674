"""The numpy fast paths of issue 11 ("Scale") return what the pandas code they replace returned.

Run: python -m pytest tests/test_scale_paths.py -q

Each fast path keeps the old pandas code as its fallback (a merge, a whole-array sweep); these tests run
both on random inputs with the awkward cases (unmatched sides, repeated keys, one key with more intervals
than a block) and require the same frame, dtypes included, or the same floats bit for bit.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from ncclscope.perf import bubbles
from ncclscope.index import p2p_pairs as P
from ncclscope.perf.comm_stats import unique_lookup

pytestmark = pytest.mark.timeout(60)


def _merge_pairs(p2p: pd.DataFrame) -> pd.DataFrame:
    """match_p2p's merge path, called directly."""
    sends = p2p[p2p["direction"] == "send"]
    recvs = p2p[p2p["direction"] == "recv"]
    s = sends[P.KEY + P.SIDE_COLUMNS].rename(columns={c: f"send_{c}" for c in P.SIDE_COLUMNS}).drop_duplicates(P.KEY)
    r = recvs[P.KEY + P.SIDE_COLUMNS].rename(columns={c: f"recv_{c}" for c in P.SIDE_COLUMNS}).drop_duplicates(P.KEY)
    pairs = s.merge(r, on=P.KEY, how="outer", indicator=True)
    pairs["state"] = pairs["_merge"].cat.rename_categories({"both": "matched", "left_only": "send_only",
                                                            "right_only": "recv_only"})
    return pairs.drop(columns="_merge").reset_index(drop=True)


def _p2p_frame(rng: np.random.Generator, n: int) -> pd.DataFrame:
    """p2p rows in p2p_ops' shape: pairs of sends and recvs, some of either side dropped, a few repeated."""
    src = rng.integers(0, 6, n)
    dst = (src + rng.integers(1, 3, n)) % 6
    seq = rng.integers(0, 40, n)
    tag = rng.integers(0, 2, n)
    rows = []
    for i in range(n):
        if rng.random() > 0.15:
            rows.append((src[i], dst[i], src[i], dst[i], tag[i], seq[i], "isend", "send"))
        if rng.random() > 0.15:
            rows.append((dst[i], src[i], src[i], dst[i], tag[i], seq[i], "irecv", "recv"))
    df = pd.DataFrame(rows, columns=["rank", "peer", "src", "dst", "tag", "seq", "op_name", "direction"])
    k = len(df)
    out = pd.DataFrame({
        "rank": df["rank"].astype("int64"), "op_id": np.arange(k, dtype=np.int64),
        "op_name": pd.Categorical(df["op_name"]), "process_group": pd.Categorical(["pp0"] * k),
        "peer": df["peer"].astype("int64"), "tag": df["tag"].astype("int64"), "seq": df["seq"].astype("int64"),
        "status": pd.Categorical(rng.choice(["ok", "inflight"], k)),
        "start_ns": rng.integers(0, 10**9, k), "end_ns": rng.integers(-1, 10**9, k),
        "input_sizes": pd.Categorical(["[[4]]"] * k), "step": rng.integers(0, 3, k).astype(np.int32),
        "microbatch": rng.integers(0, 4, k).astype(np.int32), "stage": rng.integers(0, 2, k).astype(np.int32),
        "call_site": pd.Categorical(["a.py:1"] * k),
        "direction": pd.Categorical(df["direction"], categories=["recv", "send"]),
        "src": df["src"].astype("int64"), "dst": df["dst"].astype("int64"),
    })
    return out


@pytest.mark.parametrize("seed", range(6))
def test_match_p2p_fast_path_is_the_merge(seed: int) -> None:
    rng = np.random.default_rng(seed)
    p2p = _p2p_frame(rng, 300)
    assert P._outer_by_keys(p2p) is not None            # the fast path is taken
    pd.testing.assert_frame_equal(P.match_p2p(p2p), _merge_pairs(p2p), check_exact=True)
    every = P.match_p2p(p2p.iloc[::3].reset_index(drop=True))   # more unmatched rows: float columns with NaN
    pd.testing.assert_frame_equal(every, _merge_pairs(p2p.iloc[::3].reset_index(drop=True)), check_exact=True)


def test_match_p2p_one_sided_uses_the_merge() -> None:
    p2p = _p2p_frame(np.random.default_rng(9), 50)
    sends = p2p[p2p["direction"] == "send"].reset_index(drop=True)
    assert P._outer_by_keys(sends) is None
    pd.testing.assert_frame_equal(P.match_p2p(sends), _merge_pairs(sends), check_exact=True)


def test_unique_lookup_is_a_left_join_or_declines() -> None:
    rng = np.random.default_rng(3)
    left = [rng.integers(0, 5, 200), rng.integers(0, 5, 200), rng.integers(-1, 30, 200)]
    keys = sorted({(a, b, c) for a, b, c in zip(*[x[:150] for x in left])})
    right = [np.array([k[i] for k in keys]) for i in range(3)]
    pos, found = unique_lookup(left, right)
    lk = list(zip(*left))
    for i, k in enumerate(lk):
        assert found[i] == (k in keys)
        if found[i]:
            assert tuple(int(r[pos[i]]) for r in right) == k
    dup = [np.concatenate([r, r[:1]]) for r in right]
    assert unique_lookup(left, dup) is None            # repeated right keys: the merge multiplies rows


def _whole(key: np.ndarray, start: np.ndarray, end: np.ndarray, n_keys: int) -> np.ndarray:
    return bubbles._union_core(key.astype(np.int64), start, end, n_keys)


@pytest.mark.parametrize("block", [1, 5, 64])
def test_union_length_in_blocks_is_bit_identical(monkeypatch: pytest.MonkeyPatch, block: int) -> None:
    rng = np.random.default_rng(block)
    monkeypatch.setattr(bubbles, "UNION_BLOCK", block)
    for _ in range(40):
        n = int(rng.integers(1, 400))
        key = np.sort(rng.integers(0, 12, n)) if rng.random() < 0.5 else rng.integers(0, 12, n)
        start = rng.integers(10**12, 10**12 + 10**5, n)
        end = start + rng.integers(-3, 5000, n)
        got = bubbles.union_length(key, start, end, 15)
        want = _whole(key, start, end, 15)
        assert got.view(np.int64).tolist() == want.view(np.int64).tolist()


def _pipeline_ops(rng: np.random.Generator, n: int) -> pd.DataFrame:
    """Ops in the loader's shape (categorical strings, int32 tags) for the schedule check: compute spans,
    p2p ops and others, tagged or not, some ranks outside the pipeline, repeated op ids."""
    kinds = rng.choice(["compute", "p2p", "collective", "marker"], n, p=[0.4, 0.4, 0.1, 0.1])
    names = np.where(kinds == "compute", rng.choice(["forward", "backward", "optimizer"], n),
                     np.where(kinds == "p2p", rng.choice(["isend", "irecv", "send", "recv", "batch"], n),
                              "all_reduce"))
    return pd.DataFrame({
        "rank": rng.integers(0, 5, n).astype(np.int32), "op_id": rng.integers(0, n // 2, n).astype(np.int64),
        "kind": pd.Categorical(kinds), "op_name": pd.Categorical(names),
        "peer": rng.integers(-1, 6, n).astype(np.int32), "step": rng.integers(-1, 3, n).astype(np.int32),
        "stage": rng.integers(-1, 2, n).astype(np.int32), "microbatch": rng.integers(-1, 2, n).astype(np.int32),
        "start_ns": rng.integers(0, 10**9, n), "call_site": pd.Categorical(rng.choice(["a.py:1", "b.py:2"], n)),
        "status": pd.Categorical(rng.choice(["ok", "timeout"], n)),
    })


@pytest.mark.parametrize("seed", range(5))
def test_schedule_deviations_on_codes_are_the_merge(seed: int) -> None:
    from ncclscope.hang import schedule_check as SC
    from ncclscope.hang.schedule_fast import deviating_tokens
    from ncclscope.schedules import build_schedule
    rng = np.random.default_rng(seed)
    ops = _pipeline_ops(rng, 600 if seed else 3)
    pp_of = {0: 0, 1: 1, 2: 0, 3: 1, 4: -1}
    exp = SC.expected_table(build_schedule("1f1b", 2, 2, 1), 2, 2)
    got = deviating_tokens(ops, pp_of, exp, 2)
    want = SC._deviating_tokens_merge(ops, pp_of, exp, 2)
    assert got is not None and list(got.columns) == list(want.columns)
    assert len(got) == len(want)
    for c in want.columns:
        a, b = got[c].astype(object).tolist(), want[c].astype(object).tolist()
        assert all(x == y or (pd.isna(x) and pd.isna(y)) for x, y in zip(a, b)), c
    plain = ops.assign(kind=ops["kind"].astype(str))
    assert deviating_tokens(plain, pp_of, exp, 2) is None       # not categorical: the merge path


@pytest.mark.parametrize("seed", range(5))
def test_inflight_join_on_packed_keys_is_merge_asof(seed: int) -> None:
    from ncclscope.perf import utilization as U
    rng = np.random.default_rng(seed)
    n, k = 400, 150
    start = rng.integers(1000, 1300, n)
    ops = pd.DataFrame({
        "rank": rng.integers(0, 4, n).astype(np.int32),
        "kind": pd.Categorical(rng.choice(["compute", "p2p", "collective"], n)),
        "op_name": pd.Categorical(rng.choice(["forward", "isend", "all_reduce"], n)),
        "process_group": pd.Categorical(rng.choice(["", "dp0", "pp1"], n)),
        "peer": rng.integers(-1, 4, n).astype(np.int32),
        "start_ns": start, "end_ns": np.where(rng.random(n) < 0.1, -1, start + rng.integers(0, 40, n)),
    })
    samples = pd.DataFrame({"rank": rng.integers(0, 5, k).astype("int64"), "time_ns": rng.integers(990, 1400, k),
                            "util": rng.random(k) * 10})
    got = U._join_inflight(samples, ops)
    pd.testing.assert_frame_equal(got, U._join_inflight_merge(samples, ops), check_exact=True)
    plain = ops.astype({"op_name": object, "process_group": object, "kind": object})   # labels from values
    pd.testing.assert_frame_equal(U._join_inflight(samples, plain), U._join_inflight_merge(samples, plain))
    in_order = ops.sort_values(["rank", "start_ns"], kind="stable").reset_index(drop=True)   # the loader's order
    pd.testing.assert_frame_equal(U._join_inflight(samples, in_order), U._join_inflight_merge(samples, in_order),
                                  check_exact=True)
    series = samples.sort_values(["rank", "time_ns"]).reset_index(drop=True)     # _util_series' order
    pd.testing.assert_frame_equal(U._join_inflight(series, in_order), U._join_inflight_merge(series, in_order),
                                  check_exact=True)
