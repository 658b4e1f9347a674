"""A rank blocked in a call that comes, in this iteration, before the instance the others wait in has not
skipped that instance, even where its own history cannot place the instance (a call its loop never issued
before): its peers' calls since the instance before it say so (`since_last.since_last_says`)."""
from __future__ import annotations

from pathlib import Path

from ncclscope.load.foreign.flight_recorder import load_flight_recorder
from ncclscope.load.trace import load
from ncclscope.verdict.compose import run
from ncclscope.verdict.diagnose import diagnose
from randprog_data import timed_dumps
from trace_builder import TraceBuilder

DATA = Path(__file__).parent / "data" / "randprog"
DT = 0.01


def test_a_rank_still_in_the_call_before_a_one_off_broadcast_did_not_skip_it(tmp_path) -> None:
    """Seed 20261221 #73 (unseen; its run directory and dumps as written): 4 ranks, 2 x 2 mesh, DDP. In
    iteration 2 rank 1 skips its all_gather on its fsdp pair [1,3] (line 70) and goes on to the DDP forward,
    whose bucket-order broadcast on the world runs only in the second iteration. Rank 3 waits in the
    all_gather; ranks 0 and 2 did theirs and are in the broadcast. 3 of 4 began the broadcast, and rank 3's
    own history has no earlier broadcast to place it by, so the majority rule named rank 3 ("never posted
    broadcast #9 ... and went on to all_gather #4"). Ranks 0 and 2 made that all_gather before the
    broadcast, as many times as rank 3 has since the instance before: rank 3 has not got there. Rank 1, the
    one that left its loop, is named, from the run trace and from the dumps alike."""
    for trace in (load(DATA / "rp20261221_073_skip"),
                  load_flight_recorder(timed_dumps("rp20261221_073_skip_fr", tmp_path))):
        a = run(trace)
        assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("hang", [1]), a.verdict
        assert "rp20261221_073_skip.py:70" in a.verdict, a.verdict


def _past_a_one_off(skipper: int) -> TraceBuilder:
    """3 ranks, one group "w" and one "p" of all three. Step 0: a world all_reduce (a.py:1), a p all_gather
    (a.py:2). Step 1: the all_reduce, the all_gather, a one-off world barrier (a.py:3), the all_gather again.
    The skipper leaves the barrier out and is in its second all_gather of the step; the others wait in the
    barrier."""
    b = TraceBuilder(3, groups={"w": [0, 1, 2], "p": [0, 1, 2]})
    for r in range(3):
        b.collective(r, "w", 1, start=0.0, end=DT, call_site="a.py:1", step=0)
        b.collective(r, "p", 1, op="all_gather", start=0.1, end=0.1 + DT, call_site="a.py:2", step=0)
        b.collective(r, "w", 2, start=0.2, end=0.2 + DT, call_site="a.py:1", step=1)
        b.collective(r, "p", 2, op="all_gather", start=0.3, end=0.3 + DT, call_site="a.py:2", step=1)
        if r == skipper:
            b.collective(r, "p", 3, op="all_gather", start=0.4, end=None, call_site="a.py:2", step=1)
        else:
            b.collective(r, "w", 3, op="barrier", start=0.4, end=None, call_site="a.py:3", step=1)
        b.heartbeats(r, 0.0, 5.0)
    return b


def test_a_rank_that_went_past_the_one_off_call_to_a_later_call_of_the_same_statement_skipped_it() -> None:
    """The count is what tells "not there yet" from "went past": a statement that runs before and after the
    one-off barrier, and a rank in its second call of the step, has made more of it since the all_reduce
    before the barrier than the others had when they entered the barrier: it went past, and is named."""
    d = diagnose(_past_a_one_off(skipper=2).build())
    assert d.headline is not None and d.headline.ranks == [2], d.verdict
