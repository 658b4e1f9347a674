"""Most of a group finished cleanly after the same last call; a minority posted one call more and waits in
it: the minority is the root (`hang/lone_posters.py`), not the ranks that ran their program out."""
from __future__ import annotations

from pathlib import Path

import pytest

from ncclscope.load.trace import load
from ncclscope.verdict.diagnose import diagnose
from trace_builder import TraceBuilder

DT = 0.01


def test_a_rank_that_syncs_more_often_than_its_peers_is_named() -> None:
    """A plain DDP script run under `ncclscope run` (tests/data/user_runs/grad_accum, program.py beside it):
    gradient accumulation with no_sync(), the count taken from the local batch size; rank 2's batch is
    bigger, so it syncs every 2 micro-steps where the others sync every 4. The others finish (exit 0) and
    rank 2 waits in an all_reduce none of them makes. The chain's ends were the three finishers ("rank 0
    finished without posting all_reduce #8", +2 more roots); rank 2 is what differs."""
    d = diagnose(load(Path(__file__).parent / "data" / "user_runs" / "grad_accum"))
    assert d.headline is not None and (d.headline.kind, d.headline.ranks) == ("hang", [2]), d.verdict
    assert "a call the other 3 members never made" in d.verdict and "grad_accum.py:30" in d.verdict, d.verdict


def _end(world: int, waiting: list[int]) -> TraceBuilder:
    """`world` ranks, three all_reduces each on the world; the `waiting` ranks post a fourth and wait in it,
    the others finish (exit 0)."""
    b = TraceBuilder(world, groups={"w": list(range(world))})
    for r in range(world):
        for k in range(1, 4):
            b.collective(r, "w", k, start=0.1 * k, end=0.1 * k + DT, call_site="t.py:5", step=k - 1)
        if r in waiting:
            b.collective(r, "w", 4, start=0.4, end=None, call_site="t.py:5", step=3)
            b.heartbeats(r, 0.0, 6.0)
        else:
            b.rank_state(r, exitcode=0)
    return b


@pytest.mark.parametrize("waiting,named", [([2], [2]), ([1, 3, 4, 5, 6], None), ([0, 3], [0, 3])])
def test_the_minority_side_of_a_group_that_ended_unevenly_is_named(waiting: list[int], named) -> None:
    """One rank (or two of eight) posting one call more than everyone else: the posters. Five of eight
    waiting on three finishers: the finishers skipped it (they ran out of calls early), as before."""
    world = 4 if len(waiting) == 1 else 8
    d = diagnose(_end(world, waiting).build())
    assert d.headline is not None, d.verdict
    if named is not None:
        assert d.headline.ranks == named and "never made" in d.verdict, d.verdict
    else:
        assert "never made" not in d.verdict and not set(d.headline.ranks) & set(waiting), d.verdict
