"""The loop-shape search of a cycle formed in its loop's second iteration (`loop_departures._best_shape`):
the same answer as reading every shape one by one, and in time linear in the history (issue 25, class 10:
a live poll of a healthy 10-minute pipeline job caught a transient isend cycle and spent 149 s here)."""
from __future__ import annotations

import random
import time

import numpy as np
import pytest

from ncclscope.hang.loop_departures import _best_shape
from ncclscope.index.repetition import MAX_PERIOD


def _shape_by_shape(toks: dict[int, list[str]], at: dict[int, np.ndarray]):
    """The definition, read literally: every (o, p), every member."""
    shortest = min(len(t) for t in toks.values())
    best: dict[int, set] = {}
    for p in range(1, min(MAX_PERIOD, shortest) + 1):
        for o in range(0, shortest - p):
            left, kept, rep, fits = set(), 0, 0, True
            for r, t in toks.items():
                bad = next((k for k in range(o + p, len(t)) if t[k] != t[k - p]), None)
                if bad is None:
                    kept += 1
                    rep += len(t) - o - p
                elif bad in set(at[r].tolist()):
                    left.add(r)
                    rep += bad - o - p
                else:
                    fits = False
                    break
            if fits and left and kept:
                best.setdefault(rep, set()).add((frozenset(left), p, o))
    if not best:
        return None
    top = best[max(best)]
    if len({left for left, _, _ in top}) != 1:
        return None
    return min(top, key=lambda x: (x[1], x[2]))


def _program(rng: random.Random) -> tuple[dict[int, list[str]], dict[int, np.ndarray]]:
    period, setup = rng.randint(1, 5), rng.randint(0, 3)
    body = [rng.choice("abcdef") for _ in range(period)]
    prefix = [rng.choice("xyz") for _ in range(setup)]
    toks, at = {}, {}
    for r in range(rng.randint(2, 5)):
        t = prefix + body * rng.randint(1, 4) + body[:rng.randint(0, period)]
        if rng.random() < 0.5:
            t.append(rng.choice("abcdefg"))               # a departure, or by chance the loop's own call
        toks[r] = t
        last = len(t) - 1
        at[r] = np.array(sorted({max(last - (rng.random() < 0.2), 0), last}))
    return toks, at


def test_best_shape_is_the_definition_on_random_programs():
    rng = random.Random(20261206)
    named = 0
    for _ in range(1500):
        toks, at = _program(rng)
        want = _shape_by_shape(toks, at)
        assert _best_shape(toks, at) == want, (toks, at)
        named += want is not None
    assert named > 500                          # the cases are not all "nobody": the comparison means something


@pytest.mark.timeout(60)
def test_best_shape_on_a_long_history_is_fast():
    """Two ranks of a 1F1B pipeline after 4,000 iterations, each in an isend to the other (a transient
    cycle a live poll catches): shape by shape this took minutes; it must take well under a second a rank."""
    body = ["isend\x1f\x1f1\x1fpp.py:10", "irecv\x1f\x1f1\x1fpp.py:11", "all_reduce\x1fdp0\x1f-1\x1fdp.py:5"]
    toks = {0: body * 4000 + body[:1], 1: body * 4000 + body[:1]}
    at = {r: np.array([len(t) - 1]) for r, t in toks.items()}
    t0 = time.perf_counter()
    assert _best_shape(toks, at) is None           # both keep their loops: nobody left it
    assert time.perf_counter() - t0 < 10
