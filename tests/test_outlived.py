"""Ranks the launcher had to stop after their peers finished (hang/outlived.py).

Hand-built traces of the shape seed 20261213 #14 left: four ranks run the script to its end (exit 0), one
hangs in compute after its last collective and is still running when the launcher stops the job. Nobody
waits on anybody, so the wait-for graph has no root; the verdict read OK. The rule must name the ranks
that never ended and where their last stack dump has them, and stay silent when every rank finished,
when no rank finished (the whole job stopped: nothing tells them apart), and when a rank failed.
"""
from __future__ import annotations

from trace_builder import TraceBuilder

from ncclscope.verdict import run


def _stack(b: TraceBuilder, rank: int, at_s: float, line: int) -> None:
    b.stacks(rank, f"\n=== ncclscope rank {rank}: no traced op or step for 3.0 s: stacks dumped at {b.ns(at_s)} ns ===\n"
                   "Thread 0x00007f0000000002 (most recent call first):\n"
                   f'  File "/app/train.py", line {line} in <module>\n'
                   '  File "<frozen runpy>", line 88 in _run_code\n')


def _job(states: dict[int, str]) -> TraceBuilder:
    """5 ranks, three all_reduces each on world; then each rank ends as `states` says (finished, stopped,
    failed); the stopped ones left a stack dump in the user's compute at /app/train.py:41."""
    b = TraceBuilder(5, groups={"world": list(range(5))})
    for r in range(5):
        b.heartbeats(r, 0.0, 3.0 if states[r] == "finished" else 60.0)
        for k in (1, 2, 3):
            b.collective(r, "world", k, start=0.5 * k, end=0.5 * k + 0.05, call_site="/app/train.py:35")
        if states[r] == "finished":
            b.rank_state(r, exitcode=0)
        elif states[r] == "stopped":
            b.rank_state(r, signal="SIGTERM", stopped_by_launcher=True)
            _stack(b, r, 5.0, 41)
        else:
            b.rank_state(r, exitcode=1)
    return b


def test_the_rank_still_running_when_its_peers_had_finished_is_stuck_in_compute_at_its_stack_line():
    a = run(_job({0: "finished", 1: "finished", 2: "stopped", 3: "finished", 4: "finished"}).build())
    h = a.headline
    assert h is not None and (h.kind, h.ranks) == ("stuck_in_compute", [2]), a.verdict
    assert a.verdict.startswith("STUCK IN COMPUTE: rank 2 never ended: ranks 0,1,3,4 finished (exit 0)"), a.verdict
    assert "has it at /app/train.py:41 in <module>" in a.verdict, a.verdict
    assert h.data["finished"] == [0, 1, 3, 4] and h.data["stopped"] == [2]


def test_every_rank_stopped_is_not_told_apart_by_this_rule():
    a = run(_job({r: "stopped" for r in range(5)}).build())
    assert not any("never ended" in f.title for f in a.findings), a.verdict


def test_a_job_that_finished_everywhere_stays_ok():
    a = run(_job({r: "finished" for r in range(5)}).build())
    assert a.ok and a.verdict.startswith("OK"), a.verdict


def test_a_failed_rank_speaks_for_itself():
    a = run(_job({0: "finished", 1: "failed", 2: "stopped", 3: "finished", 4: "finished"}).build())
    assert not any("never ended" in f.title for f in a.findings), a.verdict
