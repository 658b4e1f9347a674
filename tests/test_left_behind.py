"""Ranks that all stopped outside collectives (gloo's dumps record no send/recv): those the others went past
stopped first (`hang/behind.left_behind`), on hand-built tables and on a random program's dumps."""
from __future__ import annotations

import pandas as pd

from ncclscope.hang.behind import left_behind
from ncclscope.load.foreign.flight_recorder import load_flight_recorder
from ncclscope.verdict import run

from randprog_data import timed_dumps


def _coll(rows: list[tuple[int, str, int, int]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["rank", "process_group", "collective_seq_id", "start_ns"])


def test_the_ranks_the_others_went_past_stopped_first() -> None:
    coll = _coll([(r, "world", 8, 100 + r) for r in range(4)] + [(2, "sp", 14, 200), (3, "sp", 14, 201)])
    assert left_behind(coll, [0, 1, 2, 3]) == ([0, 1], [2, 3])


def test_ranks_at_one_point_or_a_rank_past_nobody_say_nothing() -> None:
    same = _coll([(r, "world", 8, 100 + r) for r in range(4)])
    assert left_behind(same, [0, 1, 2, 3]) == ([], [])
    # rank 3 went on on a group of its own without passing anyone's last collective: no clean split
    odd = _coll([(r, "world", 8, 100 + r) for r in range(3)] + [(2, "sp", 9, 200), (3, "solo", 4, 300)])
    assert left_behind(odd, [0, 1, 2, 3]) == ([], [])
    # a rank with no collective at all: nothing is known of where it stopped
    assert left_behind(same, [0, 1, 2, 3, 4]) == ([], [])


def test_a_deadlocked_pair_is_named_where_the_others_went_past_it(tmp_path) -> None:
    """Seed 20261216 #38: 4 ranks; rank 1 swaps its send/recv order with rank 0 in step 3 and the pair
    deadlocks after all_reduce #8 on the world. Ranks 2 and 3 went on to a broadcast on their own group and
    then waited in a send/recv on the pair. Every rank sat idle past its timeout: before, STOPPED named all
    four."""
    a = run(load_flight_recorder(timed_dumps("rp20261216_038_swap_order_fr", tmp_path)))
    h = a.headline
    assert h is not None and (h.kind, h.ranks) == ("no_op_in_flight", [0, 1]), a.verdict
    assert "ranks 2,3 went on to collectives on mesh_sp:4 and stopped there later" in a.verdict, a.verdict
