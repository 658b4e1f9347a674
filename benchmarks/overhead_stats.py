"""The statistics of benchmarks/run_overhead.py: paired blocks, a moving-block bootstrap
interval, and the verdict an interval allows (see run_overhead.py's docstring for why the
blocks are paired and resampled in runs).

Kept apart from the harness so that the rules that decide "met" / "NOT met" / "cannot be
resolved" can be read (and checked by hand) without the process machinery around them.
"""
from __future__ import annotations

import math
import random
import statistics
from typing import Any, Callable

STEP_TARGET = 1.02      # traced / untraced step time
OP_TARGET_US = 20.0     # added per tiny all_reduce
BLOCK_TIMEOUT_S = 120.0
LEVEL = 0.95
MIN_PAIRS = 20          # fewer paired blocks: no interval, no verdict


def block_bootstrap(values: list[float], stat: Callable[[list[float]], float], block: int = 3,
                    reps: int = 4000, level: float = LEVEL, seed: int = 13) -> tuple[float, float]:
    """Percentile interval of stat(values) from a moving-block bootstrap (keeps neighbours' dependence)."""
    n = len(values)
    if n < MIN_PAIRS:   # a bootstrap of a handful of values claims far more than it knows
        return (math.nan, math.nan)
    rng = random.Random(seed)
    b = min(block, n)
    starts = n - b + 1
    k = -(-n // b)
    out = []
    for _ in range(reps):
        sample: list[float] = []
        for _ in range(k):
            s = rng.randrange(starts)
            sample.extend(values[s:s + b])
        out.append(stat(sample[:n]))
    out.sort()
    lo = out[int((1 - level) / 2 * reps)]
    hi = out[min(reps - 1, int((1 + level) / 2 * reps))]
    return lo, hi


def verdict(lo: float, hi: float, target: float) -> str:
    if math.isnan(lo) or math.isnan(hi):
        return f"no verdict (fewer than {MIN_PAIRS} pairs)"
    if hi <= target:
        return "target met"
    if lo > target:
        return "target NOT met"
    return "cannot be resolved at this noise"


def bound_verdict(lo: float, hi: float, target: float) -> str:
    """For a figure that can only overstate the cost: below the target proves it; above proves nothing."""
    if math.isnan(lo) or math.isnan(hi):
        return f"no verdict (fewer than {MIN_PAIRS} pairs)"
    if hi <= target:
        return "target met even by this bound"
    return "this bound cannot prove the target" + (" (all of it above)" if lo > target else "")


def ratio_summary(ratios: list[float]) -> dict[str, float]:
    """Median ratio and its interval, computed on logs (a ratio's noise is multiplicative)."""
    logs = [math.log(r) for r in ratios]
    lo, hi = block_bootstrap(logs, statistics.median)
    return {"median": math.exp(statistics.median(logs)) if logs else math.nan,
            "lo": math.exp(lo) if not math.isnan(lo) else math.nan,
            "hi": math.exp(hi) if not math.isnan(hi) else math.nan, "n": len(ratios)}


def diff_summary(diffs: list[float]) -> dict[str, float]:
    lo, hi = block_bootstrap(diffs, statistics.median)
    return {"median": statistics.median(diffs) if diffs else math.nan, "lo": lo, "hi": hi, "n": len(diffs)}


def paired(blocks: list[dict[str, Any]], kind: str, field: str, ratio: bool = True) -> list[float]:
    """Each `kind` block against its neighbouring untraced blocks (the nearest one before and after)."""
    out = []
    for i, b in enumerate(blocks):
        if b["kind"] != kind or b.get("result") is None:
            continue
        before = next((blocks[j] for j in range(i - 1, -1, -1) if blocks[j]["kind"] == "untraced"), None)
        after = next((blocks[j] for j in range(i + 1, len(blocks)) if blocks[j]["kind"] == "untraced"), None)
        if before is None or after is None or before.get("result") is None or after.get("result") is None:
            continue   # a lost neighbour: this pair is dropped, not patched
        t, u0, u1 = field_of(b, field), field_of(before, field), field_of(after, field)
        out.append(t / math.sqrt(u0 * u1) if ratio else t - (u0 + u1) / 2)
    return out


def field_of(block: dict[str, Any], field: str) -> float:
    """A block's figure per step (per op), from its ranks' results:

    wall         the slowest rank's mean step over the block (everything, other load included)
    robust       the slowest rank's 10th-percentile step, plus every rank's ncclscope-thread CPU per step
    cpu<r>       rank r's mean process CPU per step (all threads)
    cpu_robust<r>  rank r's 10th-percentile process CPU per step, plus its ncclscope threads' CPU"""
    ranks = block["result"]
    if field == "wall":
        return max(r["wall_mean"] for r in ranks)
    if field == "robust":
        return max(r["wall_q10"] for r in ranks) + sum(r["bg"] for r in ranks)
    if field.startswith("cpu_robust"):
        r = ranks[int(field[10:])]
        return r["cpu_q10"] + r["bg"]
    return ranks[int(field[3:])]["cpu_mean"]
