"""A rank that reached a collective after its peer timed out waiting for it (analysis/late_arrival.py).

Hand-built traces: the rule must name the late rank, its user frame from the stack dump
inside the gap, and stay silent when the late rank was itself blocked in another op,
when a member never arrived (a skip: other rules), or when nobody timed out.
"""
from __future__ import annotations

from trace_builder import TraceBuilder

from ncclscope.verdict import run
from ncclscope.index.views import index_of
from ncclscope.hang.late_arrival import find_late_arrivals

TIMEOUT = "RuntimeError: [gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation"


def _stack(b: TraceBuilder, rank: int, at_s: float, file: str, line: int) -> None:
    b.stacks(rank, f"\n=== ncclscope rank {rank}: no traced op or step for 1.0 s: stacks dumped at {b.ns(at_s)} ns ===\n"
                   "Thread 0x00007f0000000001 (most recent call first):\n"
                   '  File "/x/site-packages/torch/distributed/elastic/agent.py", line 9 in _loop\n'
                   '  File "/usr/lib/python3.11/threading.py", line 982 in run\n\n'
                   "Thread 0x00007f0000000002 (most recent call first):\n"
                   f'  File "{file}", line {line} in main\n'
                   f'  File "{file}", line 60 in <module>\n'
                   '  File "<frozen runpy>", line 88 in _run_code\n')


def _job(late_blocked: bool = False, absent: bool = False, timed_out: bool = True,
         died_first: bool = False) -> TraceBuilder:
    """2 ranks on world: all_reduce #1 together, then rank 0 waits in #2 from 1.0 s and times out after 3 s;
    rank 1 arrives at 9.0 s (or never: the launcher stops it at 5.0 s, or it died at 2.0 s)."""
    b = TraceBuilder(2, groups={"world": [0, 1]})
    b.heartbeats(1, 0.0, 1.5 if died_first else 5.0)
    for r in (0, 1):
        b.collective(r, "world", 1, start=0.5, end=0.6, call_site="train.py:45")
    b.collective(0, "world", 2, start=1.0, end=4.0 if timed_out else 9.1, status="timeout" if timed_out else "ok",
                 call_site="train.py:45", timeout_ms=3000)
    if late_blocked:     # rank 1 was stuck in a recv from a third party, not idle
        b.p2p(1, "recv", peer=0, seq=1, start=0.7, end=8.9)
    if not absent:
        b.collective(1, "world", 2, start=9.0, end=9.1 if not timed_out else None, call_site="train.py:45",
                     timeout_ms=3000)
    _stack(b, 1, 2.0, "examples/train.py", 51)
    if timed_out:
        b.rank_state(0, exitcode=1, end_status="error", end_message=TIMEOUT)
        b.rank_state(1, signal="SIGTERM")
    return b


def test_the_rank_that_arrived_after_the_timeout_is_the_root_with_its_user_frame() -> None:
    trace = _job().build()
    found = find_late_arrivals(index_of(trace))
    assert len(found) == 1
    f = found[0]
    assert f.kind == "stuck_in_compute" and f.ranks == [1] and f.severity == "error"
    assert "8.0 s after rank 0" in f.title and "gave up after 3.0 s" in f.title
    assert "examples/train.py:51 in main" in f.title        # the user's frame, not torch's or threading's
    a = run(trace)
    assert a.verdict.startswith("STUCK IN COMPUTE: rank 1 ") and a.exit_code == 1, a.verdict


def test_silent_when_the_late_rank_was_blocked_in_another_op() -> None:
    assert find_late_arrivals(index_of(_job(late_blocked=True).build())) == []


def test_a_member_alive_and_idle_at_the_timeout_that_never_arrived_is_named() -> None:
    trace = _job(absent=True).build()      # kept: the index holds its trace weakly
    found = find_late_arrivals(index_of(trace))
    assert [f.ranks for f in found] == [[1]]
    assert "never reached all_reduce #2" in found[0].title and "examples/train.py:51 in main" in found[0].title


def test_silent_when_the_absent_member_died_before_the_timeout() -> None:
    assert find_late_arrivals(index_of(_job(absent=True, died_first=True).build())) == []


def test_silent_when_the_absent_member_went_on_to_other_ops() -> None:
    b = _job(absent=True)
    b.collective(1, "world", 3, op="barrier", start=4.5, call_site="train.py:70")   # it skipped #2
    assert find_late_arrivals(index_of(b.build())) == []


def test_silent_without_a_timeout() -> None:
    assert find_late_arrivals(index_of(_job(timed_out=False).build())) == []


def test_a_member_blocked_in_another_collective_that_timed_out_just_before_is_not_stalled() -> None:
    """The skipper went on to a world barrier that began just before the waiter's dp all_reduce, so its own
    timeout ended the barrier a moment before the waiter gave up: it spent the wait blocked there, not idle."""
    b = TraceBuilder(2, groups={"world": [0, 1], "dp0": [0, 1]})
    b.heartbeats(1, 0.0, 5.0)
    for r in (0, 1):
        b.collective(r, "dp0", 1, start=0.5, end=0.6, call_site="train.py:45")
    b.collective(1, "world", 1, op="barrier", start=0.95, end=3.95, status="timeout", call_site="train.py:50",
                 timeout_ms=3000)
    b.collective(0, "dp0", 2, start=1.0, end=4.0, status="timeout", call_site="train.py:45", timeout_ms=3000)
    b.rank_state(0, exitcode=3, end_status="error", end_message=TIMEOUT)
    b.rank_state(1, exitcode=3, end_status="error", end_message=TIMEOUT)
    assert find_late_arrivals(index_of(b.build())) == []
