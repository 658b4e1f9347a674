"""The tie-break for a hang in a two-member group: the rank that left its own loop (analysis/loop_order.py).

4 ranks, tp groups {0,1} {2,3}, dp groups {0,2} {1,3}; each iteration issues a tp all_reduce (model.py:5)
then a dp all_reduce (train.py:9). In iteration 2 rank 1 also all-reduces its loss on the world group
(train.py:30), behind an `if` on its rank. Its dp partner 3 then waits alone in dp #3 ("1 of 2 members
began it": no majority), rank 0 waits in tp #4 on rank 1, rank 1 in world #2 on everyone: a cycle. The
sequences say who left: rank 1's stops repeating at train.py:30, where its loop issues the dp op.
"""
from __future__ import annotations

import pytest

from ncclscope.verdict import run
from ncclscope.hang.loop_order import departure, keeps_loop
from ncclscope.index.views import as_index
from trace_builder import TraceBuilder

GROUPS = {"world": [0, 1, 2, 3], "tp0": [0, 1], "tp1": [2, 3], "dp0": [0, 2], "dp1": [1, 3]}
TP = {0: "tp0", 1: "tp0", 2: "tp1", 3: "tp1"}
DP = {0: "dp0", 2: "dp0", 1: "dp1", 3: "dp1"}


def _job(step: int, extra: bool = True, iterations: int = 4) -> TraceBuilder:
    """`iterations` of tp then dp; with `extra`, rank 1's world all_reduce at iteration 2 (see the module)."""
    b = TraceBuilder(4, groups=GROUPS)
    for r in range(4):
        t = 0.1
        b.collective(r, "world", 1, op="broadcast", start=t, end=t + 0.01, call_site="train.py:3", step=step)
        for i in range(iterations):
            last = extra and i == 2
            t += 0.1
            # rank 0's tp #4 and rank 2's tp #4 wait on partners that never come
            stuck_tp = extra and i == 3
            b.collective(r, TP[r], i + 1, start=t, end=None if stuck_tp else t + 0.01, call_site="model.py:5",
                         step=step)
            if stuck_tp:
                break
            if last and r == 1:
                b.collective(r, "world", 2, start=t + 0.02, end=None, call_site="train.py:30", step=step)
                break
            t += 0.1
            stuck_dp = last and r == 3
            b.collective(r, DP[r], i + 1, start=t, end=None if stuck_dp else t + 0.01, call_site="train.py:9",
                         step=step, sizes="[[256]]")
            if stuck_dp:
                break
        b.heartbeats(r, 0.0, 5.0)
    return b


@pytest.mark.parametrize("step", [-1, 0], ids=["no-steps-like-a-dump", "one-step-like-a-run"])
def test_the_rank_that_left_its_loop_is_the_root(step):
    a = run(_job(step).build())
    assert a.root_ranks == [1], a.verdict
    assert a.verdict.startswith("HANG: rank 1 never posted all_reduce #3 on dp1[1,3] (1 of 2 members did; "
                                "every earlier iteration of its loop did) and went on to all_reduce #2 on world"), \
        a.verdict


def test_departure_and_regularity_on_the_sequences():
    trace = _job(-1).build()
    coll = as_index(trace).coll
    d = departure(coll, 1)
    assert d is not None and (d.expected_group, d.expected_site) == ("dp1", "train.py:9")
    assert not keeps_loop(coll, 1)
    assert all(keeps_loop(coll, r) and departure(coll, r) is None for r in (0, 2, 3))


def test_a_first_iteration_swap_stays_a_deadlock():
    """No repetition before the hang: nothing says which of the two left, so nobody is blamed alone."""
    b = TraceBuilder(2, groups={"a": [0, 1], "b": [0, 1]})
    b.collective(0, "a", 1, start=0.1, end=None, call_site="x.py:1")
    b.collective(1, "b", 1, start=0.1, end=None, call_site="x.py:2")
    for r in (0, 1):
        b.heartbeats(r, 0.0, 3.0)
    a = run(b.build())
    assert a.verdict.startswith("DEADLOCK"), a.verdict
    assert a.root_ranks == [0, 1]


def test_the_loop_without_the_extra_call_is_healthy():
    a = run(_job(-1, extra=False).build())
    assert a.verdict.startswith("OK"), a.verdict


def _ring(wrong_at: int | None) -> TraceBuilder:
    """4 ranks in a ring (0 -> 1 -> 2 -> 3 -> 0), send (ring.py:5) and recv (ring.py:6) then an all_reduce
    (ring.py:7) per iteration, every op in step 0; at iteration `wrong_at` rank 0 sends to rank 2."""
    b = TraceBuilder(4, groups={"world": [0, 1, 2, 3]})
    sent = {(r, q): 0 for r in range(4) for q in range(4)}
    got = dict(sent)
    for r in range(4):
        t = 0.0
        for i in range(4):
            nxt, prv = (r + 1) % 4, (r - 1) % 4
            wrong = r == 0 and i == wrong_at
            nxt = 2 if wrong else nxt
            stuck = wrong_at is not None and i == wrong_at
            calls = [("send", nxt, "ring.py:5"), ("recv", prv, "ring.py:6")]
            calls = calls if r % 2 == 0 else calls[::-1]
            for op, q, site in calls:
                t += 0.1
                box = sent if op == "send" else got
                box[(r, q)] += 1
                b.p2p(r, op, q, box[(r, q)], start=t, end=None if stuck else t + 0.01, call_site=site, step=0)
                if stuck:
                    break
            if stuck:
                break
            t += 0.1
            b.collective(r, "world", i + 1, start=t, end=t + 0.01, call_site="ring.py:7", step=0)
        b.heartbeats(r, 0.0, 5.0)
    return b


def test_a_send_to_the_wrong_peer_in_a_loop_names_the_sender():
    a = run(_ring(wrong_at=2).build())
    assert a.root_ranks == [0], a.verdict
    assert a.verdict.startswith("UNMATCHED P2P: rank 0 departed from its loop in iteration 3: where its previous "
                                "iteration posted send to rank 1 (ring.py:5), it posted send to rank 2 (ring.py:5)"), \
        a.verdict


def test_a_healthy_ring_is_ok():
    a = run(_ring(wrong_at=None).build())
    assert a.verdict.startswith("OK"), a.verdict


def _seq(calls: list[tuple[str, str, str]]):
    import pandas as pd
    return pd.DataFrame({"op_name": [c[0] for c in calls], "process_group": [c[1] for c in calls],
                         "call_site": [c[2] for c in calls], "op_id": list(range(len(calls)))})


def test_a_statement_of_two_back_to_back_calls_is_one_visit_of_the_loop():
    """broadcast_object_list issues two broadcasts from one line: its previous visit is one pass of the loop,
    so the all_reduce the rank made before it last iteration and not this one was passed (seed 20261222 #26)."""
    from ncclscope.hang.loop_order import passed_in_loop
    it = [("broadcast", "fsdp", "a.py:48"), ("all_reduce", "cp", "a.py:66"), ("broadcast", "fsdp", "a.py:68"),
          ("broadcast", "world", "a.py:71"), ("broadcast", "world", "a.py:71"), ("reduce", "cp", "a.py:73")]
    now = [("broadcast", "fsdp", "a.py:48"), ("broadcast", "fsdp", "a.py:68"), ("broadcast", "world", "a.py:71")]
    seq = _seq(it + now)
    assert passed_in_loop(seq, len(seq) - 1, "all_reduce", "cp", "a.py:66") is True
    seq = _seq(it + now + [("broadcast", "world", "a.py:71")])     # blocked in the visit's second call
    assert passed_in_loop(seq, len(seq) - 1, "all_reduce", "cp", "a.py:66") is True
    # the reduce follows the statement in the loop: not reached yet, however many calls the visit makes
    assert passed_in_loop(seq, len(seq) - 1, "reduce", "cp", "a.py:73") is False


def test_a_skip_before_a_broadcast_object_list_is_read_from_the_dumps(tmp_path):
    """Seed 20261222 #26 (unseen; its dumps as written): 4 ranks, cp pairs [0,2] [1,3] and fsdp pairs [0,1]
    [2,3]. In iteration 1 rank 1 skips its reduce_scatter on cp (line 66) and goes on to the world
    broadcast_object_list (line 71). Rank 3 waits on it in cp, rank 2 on rank 3 in fsdp, rank 1 on both in
    the world broadcast: a cycle, called a deadlock of ranks 1-3 while rank 1's loop, read a statement visit
    at a time (the object list's two broadcasts are one), says it went past the reduce_scatter."""
    from ncclscope.load.foreign.flight_recorder import load_flight_recorder
    from randprog_data import timed_dumps
    a = run(load_flight_recorder(timed_dumps("rp20261222_026_skip_fr", tmp_path)))
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("hang", [1]), a.verdict
    assert "went on to broadcast #4" in a.verdict, a.verdict


def _short_shard(short: int = 1, iterations: int = 3) -> TraceBuilder:
    """Seed 20261229 #18, in small: a loop of an all_to_all and an all_gather on each rank's pair group
    ({0,1}, {2,3}), then a world barrier, the world's first call. Rank `short`'s shard is one batch short: it
    reaches the barrier after `iterations - 1` passes; its partner waits in the next pass's all_to_all, the
    other pair finished every pass and waits in the barrier."""
    pairs = {0: "tp0", 1: "tp0", 2: "tp1", 3: "tp1"}
    b = TraceBuilder(4, groups=GROUPS)
    for r in range(4):
        t, seq = 0.1, 0
        for i in range(iterations - 1 if r == short else iterations):
            stuck = r == (short ^ 1) and i == iterations - 1
            seq += 1
            b.collective(r, pairs[r], seq, op="all_to_all", start=t, end=None if stuck else t + 0.01,
                         call_site="prog.py:41")
            if stuck:
                break
            seq += 1
            b.collective(r, pairs[r], seq, op="all_gather", start=t + 0.02, end=t + 0.03, call_site="prog.py:43")
            t += 0.1
        else:
            b.collective(r, "world", 1, op="barrier", start=t, end=None, call_site="prog.py:60")
        b.heartbeats(r, 0.0, 5.0)
    return b


@pytest.mark.parametrize("short", [0, 1, 3])
def test_a_rank_whose_loop_ran_out_before_a_first_world_barrier_is_the_root_not_its_partner(short):
    """Its partner, still in the loop, never posted the barrier (3 of 4 did) and "went on" to the next
    all_to_all: the skip rule named the partner. The group's first instance has no instance before it to
    count the posters' calls from; they are counted from the start of each record (complete in a run trace):
    two of the three posters made the partner's blocked call as often as it has, so it has not reached the
    barrier yet."""
    a = run(_short_shard(short).build())
    assert a.root_ranks == [short], a.verdict
    assert f"rank {short} left its loop" in a.verdict or f"rank {short} never posted" in a.verdict, a.verdict
