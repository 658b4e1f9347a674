"""`hang/site_visits.same_call_history` on hand-built tables: a line that issues several collectives per run
is compared position by position with its earlier runs; a line that issues one keeps all its earlier calls."""
from __future__ import annotations

import pandas as pd

from ncclscope.hang.site_visits import same_call_history


def _coll(calls: list[tuple[str, str]]) -> pd.DataFrame:
    """Rank 0's collectives on group "g", in order: (call site, size)."""
    return pd.DataFrame({"rank": 0, "process_group": "g", "collective_seq_id": range(len(calls)),
                         "start_ns": [10 * i for i in range(len(calls))], "call_site": [c for c, _ in calls],
                         "input_sizes": [s for _, s in calls], "status": "ok"})


def _history(coll: pd.DataFrame, seq: int) -> list[int]:
    row = next(coll[coll["collective_seq_id"] == seq].itertuples(index=False))
    same = coll[(coll["collective_seq_id"] < seq) & (coll["call_site"] == row.call_site)]
    return [int(k) for k in same_call_history(coll, row, same)["collective_seq_id"]]


def test_each_half_of_a_two_call_line_is_compared_with_the_same_half_before() -> None:
    # line 70 issues (sizes, bytes) each iteration, line 60 one all_reduce between
    coll = _coll([("a:60", "[4]"), ("a:70", "[2]"), ("a:70", "[47]"), ("a:60", "[4]"), ("a:70", "[2]"),
                  ("a:70", "[47]"), ("a:60", "[4]"), ("a:70", "[2]"), ("a:70", "[47]")])
    assert _history(coll, 8) == [2, 5]          # the bytes halves only
    assert _history(coll, 7) == [1, 4]          # the sizes halves only
    assert _history(coll, 2) == []              # the first run's second half: nothing says what it should be


def test_a_line_that_issues_one_call_per_run_keeps_every_earlier_call() -> None:
    coll = _coll([("a:60", "[4]"), ("a:70", "[2]"), ("a:60", "[4]"), ("a:70", "[2]"), ("a:60", "[4]")])
    assert _history(coll, 4) == [0, 2]
    assert _history(coll, 3) == [1]
