"""A monitored barrier's own report names the ranks that never arrived (hang/barrier_report.py), on hand-built
traces: the reporter's death is the consequence; and the barriers, numbered apart from the collectives of their
group, are aligned on a channel of their own with the group's members (schema.BARRIER_CHANNEL)."""
from __future__ import annotations

from trace_builder import TraceBuilder

from ncclscope.hang.barrier_report import REPORT
from ncclscope.verdict.diagnose import diagnose

MSG = "RuntimeError: [Rank 0]: Rank 2 failed to pass monitoredBarrier in 5000 ms"


def _job(message: str, raised: bool = False):
    """3 ranks: three steps of all_reduce + monitored_barrier (numbered on their group's "/barriers" channel, as
    the tracer records them);
    at step 3 rank 2 skips the barrier and waits in the next all_reduce; rank 0's barrier gives up and raises
    `message`, rank 1's fails after it and the launcher stops rank 2. With `raised`, rank 2 instead raised in
    step 3's compute, long before the barrier gave up, and rank 1 is still in the barrier when the launcher
    stops it (as `ncclscope run` recorded such a job)."""
    b = TraceBuilder(3, groups={"world": [0, 1, 2]})
    for r in range(3):
        b.heartbeats(r, 0.0, 3.0 if raised and r == 2 else 9.0)
        for s in range(4):
            b.collective(r, "world", s + 1, start=s, end=s + 0.1, call_site="train.py:6", step=s)
            if s < 3 or r != 2:
                end, status = (s + 0.2, "ok") if s < 3 else (s + 5.0, "error") if r == 0 or not raised else (None, "")
                b.collective(r, "world/barriers", s + 1, op="monitored_barrier", start=s + 0.1, end=end, status=status,
                             call_site="train.py:9", step=s, message=message if (r, s) == (0, 3) else "")
    if not raised:
        b.collective(2, "world", 5, start=3.2, end=None, call_site="train.py:6", step=4)
    b.rank_state(0, exitcode=1, end_status="error", end_message=message)
    if raised:
        b.rank_state(1, signal="SIGTERM", stopped_by_launcher=True)
    else:
        b.rank_state(1, exitcode=1, end_status="error",
                     end_message="RuntimeError: Rank 1 successfully reached monitoredBarrier, but received errors")
    if raised:
        b.rank_state(2, exitcode=1, end_status="error", end_message="ValueError: empty batch")
    else:
        b.rank_state(2, signal="SIGTERM", stopped_by_launcher=True)
    return b.build()


def test_the_rank_the_barrier_reports_is_the_root():
    d = diagnose(_job(MSG))
    h = d.headline
    assert (h.kind, h.ranks) == ("hang", [2]), d.verdict
    assert "never reached the monitored_barrier at train.py:9" in h.title and "rank 0's barrier" in h.title
    assert h.data["call_site"] == "train.py:6" and h.explains is not None and list(h.explains.ranks) == [0]


def test_a_rank_that_died_before_the_report_is_a_death_not_a_barrier_hang():
    d = diagnose(_job(MSG, raised=True))
    assert (d.headline.kind, d.headline.ranks) == ("dead_rank", [2]), d.verdict
    assert not any(f.data.get("basis") == "barrier-report" for f in d.findings), d.verdict


def test_without_a_report_the_barrier_names_nobody_by_itself():
    d = diagnose(_job("RuntimeError: something else"))
    assert d.headline is None or d.headline.data.get("basis") != "barrier-report", d.verdict


def test_report_wording_of_both_modes():
    assert REPORT.search("[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 30000 ms").group(1) == "1, 3"
    assert REPORT.search("Rank 1 successfully reached monitoredBarrier, but received errors") is None


def test_barriers_and_collectives_of_one_number_are_not_one_instance():
    """A healthy job: the k-th barrier and the k-th all_reduce share a number, never an instance."""
    b = TraceBuilder(3, groups={"world": [0, 1, 2]})
    for r in range(3):
        b.heartbeats(r, 0.0, 4.0)
        for s in range(3):
            b.collective(r, "world", s + 1, start=s, end=s + 0.1, call_site="train.py:6", step=s)
            b.collective(r, "world/barriers", s + 1, op="monitored_barrier", start=s + 0.1, end=s + 0.2,
                         call_site="train.py:9", step=s)
        b.rank_state(r, exitcode=0)
    d = diagnose(b.build())
    assert d.ok and not d.findings, d.verdict
