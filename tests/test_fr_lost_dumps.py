"""A rank whose process died leaves no Flight Recorder dump: what the survivors' dumps say, and what they do not.

Gloo jobs of the random-program benchmark, their dumps as written (tests/data/randprog). Each read wrong on
its dumps: a survivor's call read as a deviation where every rank's program made that call (seed 20261213 #322,
#365), the death stood in front of the mismatch that came before it (#381, seed 20261219 #7) or of the
survivor's own skip (seed 20261219 #42), the dead rank was not put back
into the group it shared with the deviant (seed 20261214 #366), a lone dump read as a healthy job of one
rank (seed 20261214 #37), or a survivor's run of identical calls read as its loop (seed 20261214 #313).
"""
from __future__ import annotations

import pytest

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


@pytest.mark.parametrize("fixture, survivors", [("rp20261213_381_size_fr", "0,2"), ("rp20261219_007_size_fr", "0,2,4")])
def test_a_size_mismatch_right_before_what_a_dead_rank_never_reached_comes_first(fixture: str, survivors: str,
                                                                                   tmp_path) -> None:
    """#381: rank 1 broadcasts 1007 elements where ranks 0 and 2 pass 1000 (#18 on the default group); rank 3
    left no dump (gloo aborted it) and ranks 0-2 wait in #19 on the same group. The dead rank left no record
    of #18 and the survivors wait in the very next instance: the mismatch is the first deviation, the death its
    consequence. Seed 20261219 #7 (unseen): the same mismatch on group "1" (the whole world); the survivors'
    next call is a barrier on the default group, and they wait in it: what they issued right after the
    mismatched instance, on whatever group, is where a rank that died inside it is first missed. Before: DEAD
    RANK on rank 3, both."""
    a = run(load_flight_recorder(timed_dumps(fixture, tmp_path)))
    h = a.headline
    assert h is not None and (h.kind, h.ranks) == ("collective_mismatch", [1]), a.verdict
    assert f"passed sizes [[1007]] where ranks {survivors} passed [[1000]]" in a.verdict, a.verdict
    assert "then rank 3 left no Flight Recorder dump" in a.verdict, a.verdict


def test_a_survivor_whose_own_loop_jumped_ahead_where_its_partner_died_without_a_dump_skipped(tmp_path) -> None:
    """Seed 20261219 #42 (unseen): 2 ranks; each iteration calls a helper's all_gather from line 42 (3 int64)
    and from line 44 (1024 float32). In iteration 2 rank 0 skips line 42: its #9 (line 44) pairs with rank
    1's line 42, gloo aborts rank 1, no dump. Rank 0's #9 returned (its partner posted #9) and its own loop
    went 42, 44 at that point before: it jumped ahead. Before: DEAD RANK on rank 1."""
    a = run(load_flight_recorder(timed_dumps("rp20261219_042_skip_fr", tmp_path)))
    h = a.headline
    assert h is not None and (h.kind, h.ranks) == ("hang", [0]), a.verdict
    assert "skipped all_gather" in a.verdict and ".py:42" in a.verdict, a.verdict
    assert "then rank 1 left no Flight Recorder dump" in a.verdict, a.verdict

def test_a_line_that_issues_two_calls_is_compared_call_by_call(tmp_path) -> None:
    """Seed 20261220 #113 (unseen): 8 ranks on a 2 x 4 mesh, no step marks. Each iteration calls
    all_gather_object on the row group, which issues two all_gathers from that one line (the sizes, then the
    bytes). Rank 3 skipped a row all_gather in iteration 1, gloo aborted it and it left no dump; its row
    partner, rank 7, holds the group's only record. Read one call per iteration, rank 7's bytes all_gather
    was "another iteration" of its sizes ones and called a size deviation: MISMATCH on rank 7, innocent.
    Read call by call (the line always issues two), nothing rank 7 did deviates: the dead rank is the root."""
    a = run(load_flight_recorder(timed_dumps("rp20261220_113_skip_fr", tmp_path)))
    h = a.headline
    assert h is not None and (h.kind, h.ranks) == ("dead_rank", [3]), a.verdict
    assert "MISMATCH" not in a.verdict, a.verdict


def test_a_group_every_dumped_rank_used_takes_back_the_rank_that_left_no_dump(tmp_path) -> None:
    """#59: a 1-d mesh of 5 ranks built with new_group; rank 1 calls os._exit in step 5's compute. Group "1"
    was rebuilt from the ranks that used it, 0 and 2-4, so ranks 2 and 4 waiting in its broadcast #22 seemed
    to wait on ranks 0 and 3 only. Every rank that dumped used it: it is the whole world's, rank 1 with it.
    Before: HANG on rank 0 (the lowest of two that stopped at the same point)."""
    a = run(load_flight_recorder(timed_dumps("rp20261213_059_exit_fr", tmp_path)))
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("dead_rank", [1]), a.verdict
    assert "1[0-4]" in a.verdict, a.verdict


def test_a_lone_group_takes_back_a_rank_whose_dump_is_missing_between_others(tmp_path) -> None:
    """Seed 20261214 #366 (unseen): a (sp 2, inner 2) mesh, sp groups {0,2} and {1,3}; rank 0 reduces a
    float64 tensor on its sp group at step 1 where it passed float32 at step 0 (line 58); rank 2 died (gloo
    aborted it), no dump. Rank 0's sp group was rebuilt as {0}, and {1,3} alone is no mesh to complete it
    from, so the dead partner was not in it and the dtype change had no one to differ from. Rank 2's dump is
    missing between others: {0} fits the shape of {1,3} with rank 2 alone put back. Before: DEAD RANK on
    rank 2."""
    from ncclscope.index.views import as_index
    trace = load_flight_recorder(timed_dumps("rp20261214_366_dtype_fr", tmp_path))
    assert as_index(trace).members["1"] == [0, 2]
    a = run(trace)
    h = a.headline
    assert h is not None and (h.kind, h.ranks) == ("collective_mismatch", [0]), a.verdict
    assert "float64" in h.title and "program.py" not in h.title and ":58" in h.title, h.title


def test_a_lone_dump_is_a_job_of_two_and_its_own_loop_says_what_changed(tmp_path) -> None:
    """Seed 20261214 #37 (unseen): 2 ranks; rank 0 reduces 101 elements on its group at step 1 where it passed
    100 at step 0 (line 39); gloo aborted rank 1, no dump. Rank 0's dump alone was read as a healthy job of one
    rank: OK. Torch writes these dumps on a timeout or an error and one rank has nothing to hang on, so the
    job had at least 2 ranks; in a world of two a group of more than one rank is both, and rank 0's own
    earlier call from the very line says what the op should have been."""
    trace = load_flight_recorder(timed_dumps("rp20261214_037_size_fr", tmp_path))
    assert trace.world_size == 2 and any("read as a job of at least 2 ranks" in w for w in trace.warnings)
    a = run(trace)
    h = a.headline
    assert h is not None and (h.kind, h.ranks) == ("collective_mismatch", [0]), a.verdict
    assert "[[101]]" in h.title and "[[100]]" in h.title and ":39" in h.title, h.title


def test_a_run_of_one_call_says_nothing_about_its_length_when_the_partner_left_no_record(tmp_path) -> None:
    """Seed 20261214 #313 (unseen): 2 ranks; rank 0 passes a 1-element object list at step 1 and dies (no
    dump). Rank 1's calls on its group: a barrier (line 40), four per-parameter all_reduces (line 79), then the
    next iteration's barrier. Once a world of two puts rank 0 back into that group, the run of four
    all_reduces predicted a fifth and the barrier read as rank 1 leaving its loop: MISMATCH on rank 1. No
    earlier run of those all_reduces was longer; the dead rank is all the dumps show."""
    from ncclscope.hang.loop_order import run_extrapolated
    a = run(load_flight_recorder(timed_dumps("rp20261214_313_short_objlist_fr", tmp_path)))
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("dead_rank", [0]), a.verdict
    tok = {c: f"{op}\x1fg\x1f{c}" for c, op in (("40", "barrier"), ("79", "all_reduce"))}
    b, ar = tok["40"], tok["79"]
    assert run_extrapolated([b, ar, ar, ar, ar], ar)
    # an earlier, longer run of it does say the run goes on (a skipped fifth all_reduce)
    assert not run_extrapolated([b, ar, ar, ar, ar, ar, b, ar, ar, ar, ar], ar)
    # ... and a prediction of another call than the run's is not a run's extrapolation
    assert not run_extrapolated([b, ar, ar, ar, ar], b)


def test_the_second_broadcast_of_one_broadcast_object_list_is_not_a_deviation_from_the_first(tmp_path) -> None:
    """Seed 20261216 #1: 4 ranks; rank 3 calls os._exit in step 1, no dump. Rank 1, its partner in group
    {1,3}, made one broadcast_object_list there (line 70): the objects' sizes (int64, 2 elements), then their
    bytes (uint8, 47). Its partner dead, one earlier call from the very line was history enough, and the bytes
    read as a deviation from the sizes: MISMATCH on rank 1. They are two halves of one call; no earlier call
    of that line says what its second half should be. The dead rank is all the dumps show."""
    a = run(load_flight_recorder(timed_dumps("rp20261216_001_exit_fr", tmp_path)))
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("dead_rank", [3]), a.verdict
    assert not any(f.kind == "collective_mismatch" and f.severity == "error" for f in a.findings), a.verdict


def test_a_mesh_dimension_whose_groups_hold_more_ranks_than_dumped_brings_back_the_highest(tmp_path) -> None:
    """Seed 20261216 #28: 4 ranks on a (2, 2) mesh, rank 3 builds its groups in another order and dies
    (SIGABRT), no dump; the highest rank, so the dumps end at rank 2 and nothing counted it. Rank 1 waited in
    its first all_gather on group 2, which no other dump used, and gloo's inferred completion (a collective
    every member entered is done) called it done: OK on a job that died. Groups 1 {0,2} and 2 {1} were
    created one after the other, both of width 2 by their shapes, with no rank in common: a mesh dimension of
    4 ranks. Rank 3 is back, and the rank everyone waits on."""
    trace = load_flight_recorder(timed_dumps("rp20261216_028_group_order_fr", tmp_path))
    assert trace.world_size == 4 and any("a mesh dimension" in w for w in trace.warnings), trace.warnings
    a = run(trace)
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("dead_rank", [3]), a.verdict


def test_a_rank_that_left_no_dump_is_not_said_to_be_in_no_group(tmp_path) -> None:
    """Seed 20261217 #209 (unseen): a (cp 2, ep 2) mesh of 4 ranks; rank 3 passes 101 elements to an ep
    all_reduce, gloo aborts ranks 2 and 3, and neither leaves a dump. The mesh checks then found "cp groups do
    not cover the world: ranks 2,3 are in no cp group" (and the same for ep): two warnings about ranks whose
    groups nobody recorded, naming the dead ranks for a reason that is not theirs. Absence of a record is not
    absence from a group."""
    a = run(load_flight_recorder(timed_dumps("rp20261217_209_size_fr", tmp_path)))
    assert a.headline is not None and a.headline.kind == "dead_rank" and a.headline.ranks == [2, 3], a.verdict
    assert not [f for f in a.findings if f.kind == "group_mismatch"], [f.title for f in a.findings]


def test_a_loop_with_an_irregular_second_iteration_still_says_who_left_it(tmp_path) -> None:
    """Seed 20261218 #57 (unseen): 4 ranks on an (ep 2, fsdp 2) mesh, DDP on ep; at step 3 rank 1
    all-reduces on the fsdp slice [2, 3] it is not a member of, which torch makes a no-op, so its fsdp
    all_reduce (line 67) is missing and it goes on to the next step. Ranks 0 and 1 then wait on each other
    in a cycle. DDP broadcast its rebuilt bucket order at the start of the second iteration, so no ranks'
    calls repeated from the start and nobody was found to have left the loop: DEADLOCK on ranks 0-2. (Since
    rank 1's loop is read a statement visit at a time, its own loop says it went past the fsdp all_reduce
    to the next step's all_gather: the skip is worded before the loop departure is looked for.)"""
    a = run(load_flight_recorder(timed_dumps("rp20261218_057_wrong_group_fr", tmp_path)))
    h = a.headline
    assert h is not None and (h.kind, h.ranks) == ("hang", [1]), a.verdict
    assert a.verdict.startswith("HANG: rank 1 never posted all_reduce #4 on 3[0,1] (1 of 2 members did) and "
                                "went on to all_gather #9"), a.verdict
    assert "the others post it at rp20261218_057_wrong_group/rp20261218_057_wrong_group.py:67" in a.verdict


def test_a_tie_at_the_call_one_party_made_on_the_wrong_group_is_that_partys(tmp_path) -> None:
    """Seed 20261218 #185 (unseen): 4 ranks on a (pp 2, tp 2) mesh; at step 1 rank 3 all-reduces on the world
    group at its loop's line 31, where every earlier call from that line went to its pp group {1,3}. Rank 0
    later all-reduces on the world group after its loop (line 47), and the two calls meet as world #1: 1 vs 1
    on size and dtype; rank 2 died without a dump. The tie named the lowest rank, 0. The wrong group breaks
    it: rank 3's call is the one out of place."""
    a = run(load_flight_recorder(timed_dumps("rp20261218_185_wrong_group_fr", tmp_path)))
    h = a.headline
    assert h is not None and (h.kind, h.ranks) == ("wrong_group", [3]), a.verdict
    assert ".py:31" in a.verdict and "rank 2 left no Flight Recorder dump" in a.verdict, a.verdict
    tied = [f for f in a.findings if f.kind == "collective_mismatch" and f.cause.ambiguous]
    assert tied and all(f.role.value == "supporting" for f in tied), [(f.kind, f.role) for f in a.findings]
