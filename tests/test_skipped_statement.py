"""A 1 vs 1 tie decided by the statement one member skipped (hang/skipped_statement.py).

Seen on seed 20261229 #7 (dumps): rank 3 all-reduced on a dp slice it is not a member of at its second
iteration, so torch skipped the call and rank 3 went on to its next statement on its own dp group, an
all_gather from a shared helper, while its partner 2 issued the all_reduce. Each call is what its call site
always issued and one iteration is too little for either sequence to predict its next call: the vote was a
tie naming the lowest rank, 2.
"""
from __future__ import annotations

import pandas as pd

from ncclscope.verdict import run
from ncclscope.hang.skipped_statement import skipped_statement
from trace_builder import TraceBuilder


def _coll(calls: dict[int, list[str]]) -> pd.DataFrame:
    """rank -> its calls on group "g" as "op@site", numbered 1.. in order."""
    rows = [{"rank": r, "process_group": "g", "collective_seq_id": i + 1, "op_name": c.split("@")[0],
             "call_site": c.split("@")[1]} for r, cs in calls.items() for i, c in enumerate(cs)]
    return pd.DataFrame(rows)


def _last(coll: pd.DataFrame) -> pd.DataFrame:
    return coll[coll["collective_seq_id"] == coll["collective_seq_id"].max()]


def test_the_member_that_skipped_a_statement_is_named():
    coll = _coll({0: ["all_reduce@a", "all_gather@b", "all_reduce@c", "all_reduce@a"],
                  1: ["all_reduce@a", "all_gather@b", "all_reduce@c", "all_gather@b"]})
    assert skipped_statement(coll, _last(coll), "g") == (1, "all_reduce", "a", 1)


def test_a_swap_after_two_iterations_names_the_rank_that_swapped():
    coll = _coll({0: ["all_reduce@a", "all_gather@b"] * 2 + ["all_reduce@a"],
                  1: ["all_reduce@a", "all_gather@b"] * 2 + ["all_gather@b"]})
    assert skipped_statement(coll, _last(coll), "g") == (1, "all_reduce", "a", 2)


def test_a_set_up_call_does_not_blame_the_rank_that_keeps_its_loop():
    """Rank 1 adds a call; rank 0's loop has only one set-up broadcast before it, which rank 1 did not
    repeat either: nothing says rank 0 skipped anything, and rank 1's new call has no history."""
    coll = _coll({0: ["broadcast@s", "all_reduce@a", "all_reduce@a"],
                  1: ["broadcast@s", "all_reduce@a", "barrier@x"]})
    assert skipped_statement(coll, _last(coll), "g") is None


def test_both_flagged_or_neither_decides_nothing():
    first = _coll({0: ["all_reduce@a", "all_gather@b"], 1: ["all_gather@b", "all_reduce@a"]})
    assert skipped_statement(first, _last(first), "g") is None          # no earlier iteration


def test_the_dumps_verdict_names_the_skipper_not_the_lowest_rank():
    b = TraceBuilder(2, groups={"g": [0, 1]})
    plan = {0: [("all_reduce", "train.py:50", "[[1]]"), ("all_gather", "helpers.py:15", "[[256]]"),
                ("all_reduce", "train.py:50", "[[1]]")],
            1: [("all_reduce", "train.py:50", "[[1]]"), ("all_gather", "helpers.py:15", "[[256]]"),
                ("all_gather", "helpers.py:15", "[[256]]")]}
    for r, calls in plan.items():
        for i, (op, site, sizes) in enumerate(calls):
            last = i == len(calls) - 1
            b.collective(r, "g", i + 1, op=op, start=0.1 * (i + 1), end=None if last else 0.1 * (i + 1) + 0.01,
                         sizes=sizes, call_site=site, step=-1)
        b.heartbeats(r, 0.0, 30.0)
    a = run(b.build())
    assert a.root_ranks == [1], a.verdict
    assert a.verdict.startswith("MISMATCH: rank 1 deviates in all_gather #3 on g[0,1]: called all_gather at "
                                "helpers.py:15 without the all_reduce from train.py:50 on g"), a.verdict
