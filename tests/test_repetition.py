"""A skipped collective in a loop without step numbers (a script traced by `ncclscope run` that never calls
an optimizer step): the loop's repetitions stand in for steps (analysis/repetition.py)."""
from __future__ import annotations

import numpy as np

from ncclscope.verdict import run
from ncclscope.index.repetition import virtual_steps
from trace_builder import TraceBuilder


def test_period_and_phase_come_from_the_sequence():
    steps, brk = virtual_steps(["init", "a", "b", "a", "b", "a", "b", "b"])
    assert brk == 7 and list(steps) == [-1, 0, 0, 1, 1, 2, 2, 3]
    steps, brk = virtual_steps(["a", "b", "c"] * 3 + ["a", "c"])
    assert brk == 10 and list(steps[:9]) == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    assert virtual_steps(["a", "b"] * 5) is None               # never breaks: nothing to find
    assert virtual_steps(["a", "b", "a", "c"]) is None         # never repeats twice
    assert virtual_steps(list("abcdefgh")) is None


def test_a_loop_whose_second_iteration_made_extra_calls_is_still_a_loop():
    """DDP broadcasts its rebuilt bucket order at the start of the second iteration: two calls the loop
    makes once. The repetition from the start breaks there, two calls after one iteration; the one that
    follows covers most of the sequence and names the break where the rank left it (seed 20261218 #57).
    The iterations before it are counted by the loop's first call."""
    seq = ["init", "b", "b"] + ["A", "x", "x", "Y"] + ["c", "c", "A", "x", "x", "Y"] + ["A", "x", "x", "Y"] * 2
    steps, brk = virtual_steps(seq + ["A", "x", "x", "A", "x"])
    assert brk == 24 and steps[brk] == 4 and list(steps[:3]) == [-1, -1, -1]
    assert list(steps[3:9]) == [0] * 6 and list(steps[9:13]) == [1] * 4
    assert virtual_steps(seq + ["A", "x", "x", "Y"]) is None                      # it never breaks
    # a late run must cover half of the calls before its break: two repeats after a long irregular prefix
    # say nothing
    assert virtual_steps(list("abcdefghijkl") + ["A", "x", "A", "x", "A", "y"]) is None


def _loop(skip_at: int | None) -> TraceBuilder:
    """4 ranks, every op in step 0: all_reduce of the gradients (train.py:8, 256 floats) then of a metric
    (train.py:9, 8 floats), 5 times; rank 2 leaves out the first at iteration `skip_at`."""
    b = TraceBuilder(4, groups={"world": [0, 1, 2, 3]})
    for r in range(4):
        seq, t = 0, 0.0
        for i in range(5):
            for site, sizes in (("train.py:8", "[[256]]"), ("train.py:9", "[[8]]")):
                if r == 2 and i == skip_at and site == "train.py:8":
                    continue
                seq, t = seq + 1, t + 0.1
                stuck = skip_at is not None and seq >= 2 * skip_at + 1
                b.collective(r, "world", seq, start=t, end=None if stuck else t + 0.05, sizes=sizes,
                             call_site=site, step=0)
                if stuck:
                    break
            else:
                continue
            break
        b.heartbeats(r, 0.0, 9.0)
    return b


def test_a_skip_in_a_loop_without_steps_is_named_as_the_skip():
    a = run(_loop(skip_at=3).build())
    assert a.verdict.startswith("HANG: rank 2 skipped all_reduce on world[0-3] (train.py:8, #7 for ranks 0,1,3)"), \
        a.verdict
    assert "its previous iteration" in a.verdict and a.root_ranks == [2]


def test_a_loop_that_only_repeats_is_healthy():
    a = run(_loop(skip_at=None).build())
    assert a.verdict.startswith("OK"), a.verdict
    assert np.all([f.severity == "info" for f in a.findings])


def test_set_up_calls_that_outnumber_the_period_keep_the_shortest_period():
    """Two set-up calls, then a pull and a push per round; the fifth round has no push (hand program
    ps_unlabeled_push_skip): the phase is searched below the period only, so the loop was found at period 4
    and the round called iteration 3 of 5. Its true period is the shortest that repeats to the same break."""
    calls = ["bcast_obj", "bcast"] + ["recv", "send"] * 4 + ["recv", "recv"]
    steps, brk = virtual_steps(calls)
    assert brk == 11
    assert steps.tolist() == [-1, -1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4]
    # a period that is not a multiple of a shorter one is kept
    steps, brk = virtual_steps(["x", "y", "z", "a", "b", "c", "a", "b", "c", "a", "b", "d"])
    assert brk == 11 and steps.tolist() == [-1, -1, -1, 0, 0, 0, 1, 1, 1, 2, 2, 2]
