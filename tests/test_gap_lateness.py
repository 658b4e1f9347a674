"""`straggler_arrival.with_release`'s gap lateness on hand-built tables: a member's lateness of its own doing is
its gap before the op (how long it was out of communication) minus the others', and never more than its own
gap, whether the others' gaps are unknown or negative (an op nested in another)."""
from __future__ import annotations

import numpy as np
import pandas as pd

from ncclscope.perf.straggler_arrival import with_release

MS = 1_000_000


def _late(ops: list[tuple[int, int, float, float]], members: list[tuple[int, int, int]]) -> dict[tuple[int, int], float]:
    """ops: (rank, op_id, start ms, end ms; end -1 unknown); members: (instance, rank, op_id) -> gap_late ms."""
    o = pd.DataFrame([(r, i, int(s * MS), int(e * MS) if e >= 0 else -1, "collective") for r, i, s, e in ops],
                     columns=["rank", "op_id", "start_ns", "end_ns", "kind"])
    coll = pd.DataFrame(members, columns=["instance", "rank", "op_id"])
    out = with_release(o, coll)
    return {(int(a.rank), int(a.op_id)): float(a.gap_late_ns) / MS for a in out.itertuples()}


def test_a_rank_that_posted_right_after_its_previous_op_is_not_late_by_its_own_doing() -> None:
    # rank 1's recv from the slow side ended at 150, it sent at 150.2: gap 0.2 ms; rank 2's gap is unknown
    late = _late([(1, 0, 0, 150), (1, 1, 150.2, 151), (2, 1, 1, 151)], [(0, 1, 1), (0, 2, 1)])
    assert abs(late[(1, 1)] - 0.2) < 1e-6
    assert late[(2, 1)] == np.inf                       # its own gap unknown: the arrival lateness counts


def test_a_negative_gap_of_another_member_does_not_make_anyone_late() -> None:
    # rank 0's op 1 is nested in its op 0 (starts before it ends): gap -150 ms; rank 1 posts 0.5 ms after its last
    late = _late([(0, 0, 0, 300), (0, 1, 150, 301), (1, 0, 0, 299), (1, 1, 299.5, 301)], [(0, 0, 1), (0, 1, 1)])
    assert abs(late[(1, 1)] - 0.5) < 1e-6 and late[(0, 1)] <= 0.0       # capped at its 0.5 ms, not 150.5


def test_a_slow_rank_keeps_its_own_gap() -> None:
    # rank 0 computed 150 ms before posting, rank 1 2 ms: rank 0 is late by 148 ms of its own
    late = _late([(0, 0, 0, 10), (0, 1, 160, 170), (1, 0, 0, 10), (1, 1, 12, 170)], [(0, 0, 1), (0, 1, 1)])
    assert abs(late[(0, 1)] - 148) < 1e-6 and late[(1, 1)] <= 0.0
