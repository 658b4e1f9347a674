"""A rank that failed of its own error after its last collective, the others stopped by the launcher for it: the
job died at that rank; it did not hang outside collectives (`stopped.failed_alone`)."""
from __future__ import annotations

from pathlib import Path

import pytest

from ncclscope.findings import FindingKind
from ncclscope.load.trace import load
from ncclscope.verdict.compose import run
from trace_builder import TraceBuilder

DATA = Path(__file__).parent / "data" / "randprog"


def test_an_assertion_after_the_last_collective_is_the_verdict_not_a_stop() -> None:
    """Seed 20261222 #142 (unseen; its run directory as written): 2 ranks, a dp group created and never used.
    In the last iteration rank 0 raises AssertionError in compute (line 63), after every collective it had
    to make; torchrun stops rank 1, in destroy_process_group. Nothing waits on rank 0, and the unused group
    read as "all ranks stopped ... in group creation" (STOPPED, both ranks) over the failure."""
    a = run(load(DATA / "rp20261222_142_exception"))
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("dead_rank", [0]), a.verdict
    assert a.verdict.startswith("DEAD RANK: rank 0"), a.verdict
    assert "rp20261222_142_exception.py:63" in a.verdict, a.verdict
    assert not any(f.kind == FindingKind.NO_OP_IN_FLIGHT for f in a.findings), a.verdict
    assert a.exit_code == 1


def _unused_group_job(message: str) -> TraceBuilder:
    """2 ranks, a world all_reduce each, a group "dp" of both created and never used; rank 0 then fails with
    `message`, rank 1 is stopped by the launcher with nothing in flight."""
    b = TraceBuilder(2, groups={"world": [0, 1], "dp": [0, 1]})
    for r in range(2):
        b.collective(r, "world", 1, start=0.1, end=0.2, call_site="train.py:5")
        b.heartbeats(r, 0.0, 1.0)
    b.rank_state(0, exitcode=1, end_status="error", end_message=message)
    b.rank_state(1, exitcode=-15, signal="SIGTERM", stopped_by_launcher=True)
    return b


@pytest.mark.parametrize("message, stopped", [
    ("AssertionError: corrupt sample in batch 4", False),
    # a rank that gave up waiting is the victim of whatever hung: the stop is still said
    ("RuntimeError: Timed out waiting 30000ms for new_group", True),
])
def test_only_a_failure_of_the_rank_s_own_error_ends_the_stop(message: str, stopped: bool) -> None:
    a = run(_unused_group_job(message).build())
    kinds = [f.kind for f in a.findings if f.severity == "error"]
    assert (FindingKind.NO_OP_IN_FLIGHT in kinds) is stopped, a.verdict
    if not stopped:
        assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("dead_rank", [0]), a.verdict
