"""Iterations from repetition, for a rank's calls that carry no step numbers.

`skips.sequence_skips` finds a skipped collective by comparing a rank's call
sites in its last step with its previous step. A script traced by `ncclscope
run` that never calls an optimizer's `step()` (an evaluation loop, hand-written
SGD, a benchmark) has every op in one step, so there is no previous step to
compare with. Its loop still repeats: the call sites a rank issues on a group
form a periodic sequence (A B A B A B ...) until the iteration where it
deviates. The period and its phase are read off the sequence itself, and each
repetition becomes a virtual step; setup calls before the loop are left out.

    >>> virtual_steps(["init", "a", "b", "a", "b", "a", "b", "b"])
    (array([-1,  0,  0,  1,  1,  2,  2,  3]), 7)
"""
from __future__ import annotations

import numpy as np
import pandas as pd

MAX_PERIOD = 64          # call sites per iteration, at most (a longer loop body is not searched)
MIN_REPEATS = 2          # whole iterations before the deviation: one is not a pattern


def virtual_steps(sites: list[str], min_repeats: int = MIN_REPEATS) -> tuple[np.ndarray, int] | None:
    """(virtual step of each call, index of the first call that breaks the repetition), or None when the
    sequence never repeats MIN_REPEATS times or never breaks. Calls before the loop get step -1.

    The period p and phase o chosen are those whose repetition lasts longest (the first j >= o + p with
    sites[j] != sites[j - p] is as late as possible), the shortest such period on a tie."""
    n = len(sites)
    if n < 2 * min_repeats + 1:
        return None
    codes = pd.factorize(pd.Series(sites, dtype=object))[0]
    best: tuple[int, int, int] | None = None          # (break index, -p, -o)
    for p in range(1, min(MAX_PERIOD, n // min_repeats) + 1):
        ok = codes[p:] == codes[:-p]                  # ok[j - p]: call j repeats call j - p
        for o in range(p):
            tail = ok[o:]
            bad = np.flatnonzero(~tail)
            brk = o + p + int(bad[0]) if len(bad) else n
            if brk - o < min_repeats * p or brk >= n:
                continue
            cand = (brk, -p, -o)
            if best is None or cand > best:
                best = cand
    if best is None:
        return None
    brk, p, o = best[0], -best[1], -best[2]
    idx = np.arange(n)
    return np.where(idx >= o, (idx - o) // p, -1), brk


def repeats_to_end(sites: list[str], min_repeats: int = MIN_REPEATS) -> bool:
    """Does the sequence, to its last call, repeat one loop body at least MIN_REPEATS times (setup calls
    before the loop aside)? The poster of an unmatched op, or a waiter, that does what it does every
    iteration."""
    n = len(sites)
    if n < 2 * min_repeats + 1:
        return False
    codes = pd.factorize(pd.Series(sites, dtype=object))[0]
    for p in range(1, min(MAX_PERIOD, n // min_repeats) + 1):
        bad = np.flatnonzero(codes[p:] != codes[:-p])
        start = int(bad[-1]) + 1 if len(bad) else 0       # calls from here on repeat with period p
        if n - start >= min_repeats * p + 1:
            return True
    return False


MIN_ITERATIONS = 3       # loop_iterations: fewer whole repetitions are not a loop to count on


def loop_iterations(sites: list[str]) -> np.ndarray | None:
    """Iteration of each call of a sequence that repeats one loop body (calls before the loop, and after it:
    a final barrier, a teardown, get -1), or None when no period repeats MIN_ITERATIONS times. The period is
    the one whose unbroken repetition covers most calls, the shortest on a tie. A healthy run's iterations:
    what a rank did per pass of its training loop when the script marks no steps.

        >>> loop_iterations(["init", "a", "b", "a", "b", "a", "b"]).tolist()
        [-1, 0, 0, 1, 1, 2, 2]
        >>> loop_iterations(["a", "b", "a", "b", "a", "b", "barrier"]).tolist()
        [0, 0, 1, 1, 2, 2, -1]
    """
    n = len(sites)
    if n < MIN_ITERATIONS:
        return None
    codes = pd.factorize(pd.Series(sites, dtype=object))[0]
    best: tuple[int, int, int, int] | None = None     # (-covered, p, start, end)
    for p in range(1, min(MAX_PERIOD, n // MIN_ITERATIONS) + 1):
        same = np.r_[False, codes[p:] == codes[:-p], False]          # same[j + 1]: call j + p repeats call j
        edges = np.diff(same.astype(np.int8))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        if not len(starts):
            continue
        k = int(np.argmax(ends - starts))                            # the longest unbroken repetition
        start, end = int(starts[k]), int(ends[k]) + p                # calls [start, end) repeat with period p
        if end - start >= MIN_ITERATIONS * p:
            cand = (-(end - start), p, start, end)
            if best is None or cand < best:
                best = cand
    if best is None:
        return None
    _, p, start, end = best
    idx = np.arange(n)
    return np.where((idx >= start) & (idx < end), (idx - start) // p, -1)
