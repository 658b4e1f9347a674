"""How long each rank sat outside any collective before its Flight Recorder dump (index/dump_gaps.py,
hang/dump_idle.py).

Two gloo jobs of the random-program benchmark (seed 20261210), their dumps as the tracer wrote them and
the times the files were written (`dump_times.json`: a clone does not keep file times). Both read "OK" before
the pace yardstick: their ranks sat 1.7 to 6 s outside any collective, shorter than the collective timeout,
over 60 times longer than any interval between two of their ops. The same dumps re-timed as a healthy job's
(dumped right after the last op, or within the floor) must stay OK.
"""
from __future__ import annotations

import os

from ncclscope.load.foreign.flight_recorder import load_flight_recorder
from ncclscope.verdict import run

from randprog_data import timed_dumps as _dumps


def test_a_rank_that_ended_while_its_peers_sat_outside_collectives_is_the_root(tmp_path) -> None:
    """#89: rank 1's data shard is one batch short, so it leaves its loop after 5 steps and its program ends;
    ranks 0, 2 and 3 wait in the next step's send/recv with it (gloo records no p2p). Every rank's last op is
    broadcast #15; rank 1's dump was written right after it, the others' 1.7 to 4.0 s later."""
    a = run(load_flight_recorder(_dumps("rp20261210_089_uneven_loop_fr", tmp_path)))
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("hang", [1]), a.verdict
    assert a.verdict.startswith("HANG: rank 1 ended right after broadcast #15 on default_pg"), a.verdict
    assert "ranks 0,2,3 sat 1.7 s to 4.0 s outside any collective" in a.verdict, a.verdict
    assert a.headline.data["ended"] == [1] and a.headline.data["waiting"] == [0, 2, 3]


def test_every_rank_idle_far_past_its_own_pace_is_stopped_though_within_the_timeout(tmp_path) -> None:
    """#178: 2 ranks, rank 1 flips its send/recv order, both block in a send. Each rank's dump was written
    6.0 s after its last collective (a broadcast on a group whose timeout is 30 min), its longest interval
    between two ops being 22 ms: not a job between two steps."""
    a = run(load_flight_recorder(_dumps("rp20261210_178_swap_order_fr", tmp_path)))
    assert not a.ok
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("no_op_in_flight", [0, 1]), a.verdict
    assert "over 10 times its longest interval between two ops" in a.verdict, a.verdict
    # ranks that ran their loop on gloo most likely wait in a send/recv: said before group creation
    assert "for example in a send/recv (gloo records none), in compute, or in group creation" in a.verdict


def test_the_same_dumps_written_right_after_the_last_op_stay_ok(tmp_path) -> None:
    for name, world in (("rp20261210_089_uneven_loop_fr", 4), ("rp20261210_178_swap_order_fr", 2)):
        a = run(load_flight_recorder(_dumps(name, tmp_path / "prompt", {r: 0.02 for r in range(world)})))
        assert a.ok and a.verdict.startswith("OK"), (name, a.verdict)


def test_a_gap_under_the_floor_is_not_idle_however_fast_the_loop(tmp_path) -> None:
    """0.4 s is 18 times the job's longest interval, but under the 0.5 s floor: a dump taken that soon after
    the last op says nothing (exit, interpreter teardown and the dump itself take time; 0.07 s at most over
    128 healthy random programs)."""
    d = _dumps("rp20261210_089_uneven_loop_fr", tmp_path, {0: 0.4, 1: 0.05, 2: 0.4, 3: 0.4})
    a = run(load_flight_recorder(d))
    assert a.ok, a.verdict


def test_a_rank_the_launcher_stopped_a_second_after_its_peer_left_is_not_a_healthy_end(tmp_path) -> None:
    """Seed 20261217 #366 (unseen): 2 ranks, rank 0's data shard is one batch short; it leaves its loop
    after 4 steps and its program ends (exit 0), while rank 1 starts a fifth step with a send/recv to it
    (gloo records none), fails and is dumped 0.7 s after its last op, when the launcher stopped it. Both
    dumps hold the same ops. Under the old 1 s floor that gap said nothing: OK on a job that failed. One
    rank ended, one sat: nothing says which left the program's course, so both are named."""
    a = run(load_flight_recorder(_dumps("rp20261217_366_uneven_loop_fr", tmp_path)))
    assert not a.ok, a.verdict
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("no_op_in_flight", [0, 1]), a.verdict
    assert "rank 1 sat 0.7 s outside any collective" in a.verdict, a.verdict



def test_three_ops_are_enough_for_a_pace(tmp_path) -> None:
    """Seed 20261219 #194 (unseen): 3 ranks, rank 2 raises in step 1 and leaves no dump; ranks 0 and 1 hold
    three all_reduces each (1-4 ms apart) and were dumped 0.9 s after the last, when the launcher stopped
    them. Four ops were needed for a pace: OK on a job that failed. Two intervals are a pace; one or two ops
    still say nothing. The dumps hold no trace of rank 2 (gloo's dumps list no group members), so the
    verdict says what is known and names no culprit; written right after their last op they stay OK."""
    a = run(load_flight_recorder(_dumps("rp20261219_194_exception_fr", tmp_path)))
    assert not a.ok, a.verdict
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("no_op_in_flight", [0, 1]), a.verdict
    assert "0.9 s after its last op, over 10 times its longest interval" in a.verdict, a.verdict
    a = run(load_flight_recorder(_dumps("rp20261219_194_exception_fr", tmp_path / "prompt", {0: 0.02, 1: 0.02})))
    assert a.ok, a.verdict

def test_when_every_rank_sat_idle_nobody_is_named_as_having_ended(tmp_path) -> None:
    """The same job with rank 1 dumped as late as its peers: no rank ended first, so the verdict is the
    stopped job's (every rank named), not a hang on rank 1."""
    d = _dumps("rp20261210_089_uneven_loop_fr", tmp_path, {0: 3.0, 1: 3.0, 2: 3.0, 3: 3.0})
    a = run(load_flight_recorder(d))
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("no_op_in_flight", [0, 1, 2, 3]), \
        a.verdict


def test_a_few_ranks_idle_where_most_ended_are_the_ones_that_stopped(tmp_path) -> None:
    """The other side of the same shape: in #89's dumps re-timed so that ranks 0 and 2 sat 3 s idle while
    ranks 1 and 3 were dumped right after the same op, then ranks 1-3 ended and rank 0 alone sat idle (seed
    20261209 #245 in small: a pair deadlocked in its last step's send/recv while four ranks finished). The
    smaller side is named; a tie names every rank, for nothing orders the two halves."""
    one = run(load_flight_recorder(_dumps("rp20261210_089_uneven_loop_fr", tmp_path / "a",
                                          {0: 3.0, 1: 0.05, 2: 0.05, 3: 0.05})))
    assert one.headline is not None and (one.headline.kind, one.headline.ranks) == ("no_op_in_flight", [0]), \
        one.verdict
    assert one.verdict.startswith("STOPPED: rank 0 stopped after broadcast #15 on default_pg and sat 3.0 s outside "
                                   "any collective before its dump, while ranks 1-3 ended right after it"), one.verdict
    tie = run(load_flight_recorder(_dumps("rp20261210_089_uneven_loop_fr", tmp_path / "b",
                                          {0: 3.0, 1: 0.05, 2: 3.0, 3: 0.05})))
    assert tie.headline is not None and (tie.headline.kind, tie.headline.ranks) == ("no_op_in_flight", [0, 1, 2, 3]), \
        tie.verdict
    assert "nothing recorded says which side" in tie.verdict


def test_a_dump_written_before_another_members_arrival_is_still_read(tmp_path) -> None:
    """gloo's end times are inferred from the members' arrivals: rank 2 created broadcast #15 first and was
    dumped 0.1 ms later, before rank 3 arrived at it, so its inferred end fell after its own dump. That once
    threw the whole table away (seed 20261212 #87 read OK: six ranks ended, two sat 9 s idle). The end is
    clamped to the dump now, and rank 2 reads as the one that ended while its peers sat idle."""
    import pickle
    d = _dumps("rp20261210_089_uneven_loop_fr", tmp_path, {0: 3.0, 1: 3.0, 2: 3.0, 3: 3.0})
    f2 = d / "nccl_trace_rank_2"
    t = pickle.loads(f2.read_bytes())["entries"][-1]["time_created_ns"] + 100_000
    os.utime(f2, ns=(t, t))
    a = run(load_flight_recorder(d))
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("hang", [2]), a.verdict
    assert a.verdict.startswith("HANG: rank 2 ended right after broadcast #15 on default_pg"), a.verdict


def test_one_rank_idle_past_its_timeout_while_every_peer_ended_is_stuck_in_compute(tmp_path) -> None:
    """Seed 20261213 #14: rank 2 sleeps after its last collective (broadcast #9) while ranks 0, 1, 3 and 4 run
    the program to its end; their dumps were written right after broadcast #9, rank 2's 134 s later, when the
    launcher stopped it. Alone, it waited on nobody (a send/recv with a peer that exited fails at once), and
    134 s is past its op's 6 s timeout: it was stuck outside communication. Before, `no_op_in_flight`."""
    a = run(load_flight_recorder(_dumps("rp20261213_014_hang_compute_fr", tmp_path)))
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("stuck_in_compute", [2]), a.verdict
    assert a.verdict.startswith("STUCK IN COMPUTE: rank 2 never ended: ranks 0,1,3,4 ended right after broadcast #9"), \
        a.verdict
    assert "sat 134.2 s outside any collective" in a.verdict, a.verdict


def test_one_rank_idle_within_its_timeout_may_still_be_inside_the_op_that_failed(tmp_path) -> None:
    """Within the op's timeout the lone idle rank is not read as stuck in compute: seed 20261209 #337, rank 1
    raised in an all_to_all (gloo's split-size check) and ended; rank 0, inside the same all_to_all, was
    stopped by the launcher 1.5 s later. And #14 re-timed with rank 2 dumped 3 s after its last op (its
    timeout is 6 s) says no more than that it stopped there."""
    a = run(load_flight_recorder(_dumps("rp20261209_337_size_fr", tmp_path / "a")))
    assert a.headline is None or a.headline.kind != "stuck_in_compute", a.verdict
    b = run(load_flight_recorder(_dumps("rp20261213_014_hang_compute_fr", tmp_path / "b",
                                        {0: 0.01, 1: 0.01, 2: 3.0, 3: 0.01, 4: 0.01})))
    assert b.headline is not None and (b.headline.kind, b.headline.ranks) == ("no_op_in_flight", [2]), b.verdict


def test_tied_ranks_ordered_by_their_dump_times_where_a_waiter_went_past_them(tmp_path) -> None:
    """Seed 20261219 #282 (unseen): 4 ranks; rank 1's data shard is a batch short and its program ends (exit
    0) after the third step's last all_gather; ranks 0 and 2 fail a second later in the fourth step's ring
    send/recv with it (gloo records none), and rank 3 waits in the fourth step's all_gather on group 1. Ranks
    0-2 never posted it and stopped after the same op: a tie, lowest named (rank 0). Rank 1 was dumped right
    after its last op, a second before ranks 0 and 2, and rank 3 went on from that point: rank 1 left the
    program before its end. Written all at once, the dumps give no order and the tie stands."""
    a = run(load_flight_recorder(_dumps("rp20261219_282_uneven_loop_fr", tmp_path)))
    h = a.headline
    assert h is not None and (h.kind, h.ranks) == ("hang", [1]), a.verdict
    assert "rank 1 ended right after its last op" in a.verdict and "left it before its end" in a.verdict, a.verdict
    assert not h.json_data().get("ambiguous"), h.json_data()
    same = {r: 1.0 for r in range(4)}
    a = run(load_flight_recorder(_dumps("rp20261219_282_uneven_loop_fr", tmp_path / "same", same)))
    assert a.headline is not None and a.headline.ranks == [0] and "the lowest rank is named" in a.verdict, a.verdict


def test_dumps_copied_without_their_times_are_not_called_healthy(tmp_path) -> None:
    """#178's dumps copied the way users move them off a cluster (scp, a bucket): every file time is the
    copy's, hours after the last op. When each dump was written is unknown, so the idle yardsticks cannot
    speak; nothing is in flight on any rank. It read "OK" (seed 20261230 #58 and #166, dumps copied without
    their times). Now: STOPPED, a warning that blames nobody and says why it cannot tell, and a loader
    warning that names the ranks whose write time is unknown. The same dumps with their times keep the
    error the timed test above expects."""
    d = _dumps("rp20261210_178_swap_order_fr", tmp_path)
    for f in d.glob("nccl_trace_rank_*"):
        t = f.stat().st_mtime_ns + 6 * 3600 * 10**9          # copied six hours later
        os.utime(f, ns=(t, t))
    trace = load_flight_recorder(d)
    assert any("ranks 0,1: the Flight Recorder dump's file time is not within" in w for w in trace.warnings), \
        trace.warnings
    a = run(trace)
    assert a.verdict.startswith("STOPPED: all ranks stopped after"), a.verdict
    assert "when their Flight Recorder dumps were written is unknown" in a.verdict
    assert a.level == "warning" and a.exit_code == 1
    assert not [f for f in a.findings if f.severity == "error"], [f.title for f in a.findings]
