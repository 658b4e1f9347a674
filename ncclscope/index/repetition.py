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
    late = best is None
    if late:
        best = _late_loop(codes, min_repeats)
    if best is None:
        return None
    brk, p, o = best[0], -best[1], -best[2]
    if not late:
        p = _true_period(codes, brk, p, o)
    idx = np.arange(n)
    steps = np.where(idx >= o, (idx - o) // p, -1)
    if late:          # the irregular iterations before the run: each began with the loop's first call
        is_head = codes[:o] == codes[o]
        heads = np.flatnonzero(is_head)
        if len(heads):
            early = np.cumsum(is_head) - 1
            steps = np.where(idx >= o, steps + len(heads), -1)
            steps[heads[0]:o] = early[heads[0]:o]
    return steps, brk


def _true_period(codes: np.ndarray, brk: int, p: int, o: int) -> int:
    """The shortest divisor d of the period p found whose repetition from the same phase o holds to the same
    break: the phase is searched below the period only, so a loop whose set-up calls outnumber its period is
    found at a multiple of it (two calls of set-up, then a pull and a push per round: period 4, every
    iteration numbered as two rounds, the round a worker skipped its push called iteration 3 of 5)."""
    for d in range(1, p):
        if p % d == 0 and o + d <= brk and bool((codes[o + d:brk] == codes[o:brk - d]).all()) \
                and codes[brk] != codes[brk - d]:
            return d
    return p


def _late_loop(codes: np.ndarray, min_repeats: int) -> tuple[int, int, int] | None:
    """`virtual_steps`' (break index, -p, -start) when the repetition starts later than its first period:
    calls the loop made once, in an early iteration, break the repetition from the start (DDP broadcasts
    its rebuilt bucket order at the start of the second iteration; seed 20261218 #57). A run of
    `min_repeats` periods or more that starts anywhere, covers at least half of the calls before its
    break and breaks within the sequence's last two periods (the loop ran up to where the rank left it,
    not two calls that happened to repeat early on); the latest break, then the shortest period. Only
    where no repetition from the start exists, so every sequence `virtual_steps` read before reads the
    same."""
    n = len(codes)
    best: tuple[int, int, int] | None = None
    for p in range(1, min(MAX_PERIOD, n // min_repeats) + 1):
        bad = np.flatnonzero(codes[p:] != codes[:-p])     # call i + p does not repeat call i
        starts = np.r_[0, bad[:-1] + 1]
        for u, v in zip(starts.tolist(), bad.tolist()):
            brk = v + p                                   # the periodic calls are [u, brk)
            if brk - u >= min_repeats * p and 2 * (brk - u) >= brk and n - brk <= 2 * p:
                cand = (brk, -p, -u)
                if best is None or cand > best:
                    best = cand
    return best


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
