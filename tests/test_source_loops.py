"""Which loop a rank left (index/source_loops.py), on a source file written here: the innermost loop of the
nest around its peers' op that holds the last place the rank was inside the nest."""
from __future__ import annotations

from pathlib import Path

import pytest

from ncclscope.index.source_loops import left_loop_note

SOURCE = """\
def step(x):
    return x


for epoch in range(3):               # line 5: the outer loop
    for p in range(2):               # line 6: the inner loop
        step(p)                      # line 7: the peers' op (per parameter)
    step(epoch)                      # line 8: a barrier after the inner loop
    while epoch > 5:                 # line 9: a loop the peers are not in
        step(0)                      # line 10
step(-1)                             # line 11: after the loops
"""


@pytest.fixture()
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text(SOURCE)
    return str(path)


def _note(script: str, own: list[int] | None, history: list[int] | None) -> str:
    def site(line: int) -> str:
        return f"{script}:{line}"
    return left_loop_note([], site(7), [site(x) for x in own] if own is not None else None,
                          [site(x) for x in history] if history is not None else None)


def test_a_rank_that_ran_the_inner_loop_out_and_then_the_body_left_the_outer_loop(script: str) -> None:
    # its last op inside the nest was the barrier after the inner loop: the peers went round the outer loop
    assert _note(script, [11], [11, 8, 7, 7]) == f", in the loop at {script}:5; it left that loop early"


def test_a_rank_whose_last_op_was_in_the_inner_loop_broke_out_of_it(script: str) -> None:
    assert _note(script, [11], [11, 7, 8, 7]) == f", in the loop at {script}:6; it left that loop early"


def test_a_rank_still_in_the_outer_loop_left_the_inner_one_whatever_its_history(script: str) -> None:
    assert _note(script, [8], [8, 8, 7]) == f", in the loop at {script}:6; it left that loop early"


def test_without_history_the_innermost_loop_it_is_not_in_is_named(script: str) -> None:
    assert _note(script, [11], None) == f", in the loop at {script}:6; it left that loop early"
    assert _note(script, None, []) == f", in the loop at {script}:6; it left that loop early"


def test_a_rank_still_in_the_peers_innermost_loop_left_nothing(script: str) -> None:
    assert _note(script, [7], [7, 8]) == ""


def test_a_finished_rank_is_judged_by_its_history(script: str) -> None:
    assert _note(script, None, [8, 7]) == f", in the loop at {script}:5; it left that loop early"


def test_an_unreadable_source_gives_no_note(tmp_path: Path) -> None:
    gone = str(tmp_path / "gone.py")
    assert left_loop_note([], f"{gone}:7", [f"{gone}:11"], [f"{gone}:8"]) == ""
