"""How a rank's end reads when its peers wait on it (analysis/rank_states.py).

A data-parallel job where rank 2 skipped one backward (a rank-local `continue`): its DDP all_reduces
paired one off and it ran out one before its peers. It then ended exit 0, but only after the others:
it sat in destroy_process_group and exit handlers, heartbeating, while they waited in all_reduce #10.
Heartbeats to the end are not work: a rank that ended of itself finished its script.
"""
from __future__ import annotations

from ncclscope.analysis import run
from trace_builder import TraceBuilder


def _job(exitcode: int | None) -> TraceBuilder:
    b = TraceBuilder(4, groups={"world": [0, 1, 2, 3]})
    for r in range(4):
        last = 9 if r == 2 else 10
        for k in range(1, last + 1):
            stuck = k == 10
            b.collective(r, "world", k, start=0.1 * k, end=None if stuck else 0.1 * k + 0.01,
                         call_site="train.py:17", step=k // 2)
        b.heartbeats(r, 0.0, 7.0)
    for r in (0, 1, 3):
        b.rank_state(r, signal="SIGTERM", stopped_by_launcher=True)
    b.rank_state(2, exitcode=exitcode)
    return b


def test_a_rank_that_ended_exit_0_after_its_peers_finished_and_is_not_computing():
    a = run(_job(exitcode=0).build())
    assert a.verdict.startswith("HANG: rank 2 finished (exit 0) without posting all_reduce #10 on world[0-3]"), \
        a.verdict
    assert a.root_ranks == [2]


def test_a_rank_still_running_with_heartbeats_is_computing():
    a = run(_job(exitcode=None).build())
    assert a.verdict.startswith("STUCK IN COMPUTE: rank 2"), a.verdict
