"""How a rank's end reads when its peers wait on it (analysis/rank_states.py).

A data-parallel job where rank 2 skipped one backward (a rank-local `continue`): its DDP all_reduces
paired one off and it ran out one before its peers. It then ended exit 0, but only after the others:
it sat in destroy_process_group and exit handlers, heartbeating, while they waited in all_reduce #10.
Heartbeats to the end are not work: a rank that ended of itself finished its script.
"""
from __future__ import annotations

from ncclscope.verdict import run
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


def _raised_in_op(message: str) -> TraceBuilder:
    """4 ranks in all_gather #3 on world; rank 3's ended with an error and the process with `message`;
    the others' with gloo's "connection closed by peer" once rank 3 was gone."""
    b = TraceBuilder(4, groups={"world": [0, 1, 2, 3]})
    closed = "RuntimeError: [gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:17812"
    for r in range(4):
        for k in (1, 2, 3):
            last = k == 3
            b.collective(r, "world", k, op="all_gather", start=0.1 * k, end=0.1 * k + (2.5 if last else 0.01),
                         status="error" if last else "ok", call_site="gather.py:10", step=0)
        b.heartbeats(r, 0.0, 2.8)
        b.rank_state(r, exitcode=1, end_message=message if r == 3 else closed)
    return b


def test_a_rank_whose_op_raised_its_own_error_is_the_dead_root():
    a = run(_raised_in_op("RuntimeError: ProcessGroupGloo::allgather: invalid output tensor list at index 0 "
                          "(expected length 4, got 3)").build())
    assert a.verdict.startswith("DEAD RANK: rank 3 failed (exit code 1: RuntimeError: ProcessGroupGloo::allgather: "
                                "invalid output tensor list"), a.verdict
    assert a.root_ranks == [3]


def test_ranks_whose_ops_failed_of_a_peer_or_a_timeout_are_not_dead_roots():
    a = run(_raised_in_op("RuntimeError: Timed out waiting 5000ms for recv operation to complete").build())
    assert not a.verdict.startswith("DEAD RANK"), a.verdict
