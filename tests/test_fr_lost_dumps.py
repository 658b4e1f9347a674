"""A rank whose process died leaves no Flight Recorder dump: what the survivors' dumps say, and what they do not.

Three gloo jobs of the random-program benchmark (seed 20261213), their dumps as written (tests/data/randprog).
Each read wrong on its dumps: a survivor's call read as a deviation where every rank's program made that call
(#322, #365), or the death stood in front of the mismatch that came before it (#381).
"""
from __future__ import annotations

from ncclscope.load.foreign.flight_recorder import load_flight_recorder
from ncclscope.verdict import run

from randprog_data import timed_dumps


def test_a_call_every_rank_made_at_that_point_is_no_deviation_of_the_one_whose_partner_died(tmp_path) -> None:
    """#322: rank 2 raises in step 1's compute, no dump. Rank 3, its tensor-parallel partner, made four
    per-parameter all_reduces (line 63) then one from line 68, as ranks 0 and 1 did in their own pair; its own
    run of identical calls predicted a fifth. Before: MISMATCH on rank 3. The dead rank is all there is."""
    a = run(load_flight_recorder(timed_dumps("rp20261213_322_exception_fr", tmp_path)))
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("dead_rank", [2]), a.verdict
    assert not any(f.kind == "collective_mismatch" and f.severity == "error" for f in a.findings), a.verdict


def test_the_first_call_after_the_loop_is_not_read_as_leaving_it_when_the_partner_left_no_record(tmp_path) -> None:
    """#365: 2 ranks, rank 0 raises in its 4th and last iteration's compute, after its collectives. Rank 1
    finishes the loop and calls the barrier after it (line 68), a line it never called from before: the
    loop's normal end as much as a departure, and rank 0's record that could tell is gone. Before: MISMATCH on
    rank 1 ("its own earlier calls issue all_gather at this point of its loop")."""
    a = run(load_flight_recorder(timed_dumps("rp20261213_365_exception_fr", tmp_path)))
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("dead_rank", [0]), a.verdict


def test_a_size_mismatch_right_before_the_instance_a_dead_rank_never_reached_comes_first(tmp_path) -> None:
    """#381: rank 1 broadcasts 1007 elements where ranks 0 and 2 pass 1000 (#18 on the default group); rank 3
    left no dump (gloo aborted it) and ranks 0-2 wait in #19 on the same group. The dead rank left no record
    of #18 and the survivors wait in the very next instance: the mismatch is the first deviation, the death its
    consequence. Before: DEAD RANK on rank 3."""
    a = run(load_flight_recorder(timed_dumps("rp20261213_381_size_fr", tmp_path)))
    h = a.headline
    assert h is not None and (h.kind, h.ranks) == ("collective_mismatch", [1]), a.verdict
    assert "passed sizes [[1007]] where ranks 0,2 passed [[1000]]" in a.verdict, a.verdict
    assert "rank 3 left no Flight Recorder dump" in a.verdict, a.verdict


def test_a_group_every_dumped_rank_used_takes_back_the_rank_that_left_no_dump(tmp_path) -> None:
    """#59: a 1-d mesh of 5 ranks built with new_group; rank 1 calls os._exit in step 5's compute. Group "1"
    was rebuilt from the ranks that used it, 0 and 2-4, so ranks 2 and 4 waiting in its broadcast #22 seemed
    to wait on ranks 0 and 3 only. Every rank that dumped used it: it is the whole world's, rank 1 with it.
    Before: HANG on rank 0 (the lowest of two that stopped at the same point)."""
    a = run(load_flight_recorder(timed_dumps("rp20261213_059_exit_fr", tmp_path)))
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("dead_rank", [1]), a.verdict
    assert "1[0-4]" in a.verdict, a.verdict
