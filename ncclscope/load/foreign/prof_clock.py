"""Profiler traces: were the ranks' traces taken together?

Each trace's times are `baseTimeNanoseconds` + ts (µs), the wall clock. The
ranks of one job profile the same steps (the profiler's schedule counts steps,
and every rank steps in lockstep with its collectives), so their traces overlap
or nearly: ranks that reach the active steps at different moments at startup,
or hosts whose clocks differ by what NTP leaves, put them seconds apart, never
minutes. The rule: the ranks' traces, in start order, are cut wherever the next
one starts more than `max(10 x the longest trace, 1 minute)` after all earlier
ones ended. Ten traces' worth is far beyond any startup skew; the minute keeps
short traces (a 30 ms window) from being split by an ordinary seconds-long skew.
Two or more such groups are traces of different runs put in one folder (a
re-run writes the same ts against a later base), or of one job profiled at
different times, or of hosts whose clocks disagree: in each case cross-rank
times (arrival skew, stragglers, latency) mean nothing, so a person is told in
one line, and the analysis goes on (per-rank questions still hold).

    line = time_base_warning({0: (t0, t1), 1: (u0, u1)})
"""
from __future__ import annotations

from ncclscope.ranklists import fmt_ranks

NS = 1_000_000_000
FAR_FACTOR = 10              # groups further apart than 10x the longest trace...
FAR_FLOOR_NS = 60 * NS       # ...and than a minute were not taken together

Window = tuple[int, int]     # (first, last) ns of a rank's events


def time_base_warning(windows: dict[int, Window]) -> str | None:
    """One warning line when the ranks' trace windows fall into groups that lie far apart (which ranks, how
    far); None when they were taken together."""
    if len(windows) < 2:
        return None
    longest = max(hi - lo for lo, hi in windows.values())
    groups = _groups(windows, max(FAR_FACTOR * longest, FAR_FLOOR_NS))
    if len(groups) < 2:
        return None
    first, second = groups[0], groups[1]
    gap = min(windows[r][0] for r in second) - min(windows[r][0] for r in first)
    more = f" (and {len(groups) - 2} more such group{'s' if len(groups) > 3 else ''})" if len(groups) > 2 else ""
    return (f"the traces of {_ranks(second)} start {_span(gap)} after those of {_ranks(first)}{more}, far more "
            f"than a trace lasts ({_span(longest)}): they look like different jobs (or one job profiled at "
            "different times, or hosts whose clocks disagree); analyzed together, but times across them are not "
            "comparable")


def _groups(windows: dict[int, Window], far: int) -> list[list[int]]:
    """Ranks in start order, cut wherever the next trace starts more than `far` after all earlier ones end."""
    order = sorted(windows, key=lambda r: (windows[r][0], r))
    groups = [[order[0]]]
    end = windows[order[0]][1]
    for r in order[1:]:
        lo, hi = windows[r]
        if lo - end > far:
            groups.append([])
        groups[-1].append(r)
        end = max(end, hi)
    return groups


def _ranks(ranks: list[int]) -> str:
    """"ranks 0-3,7" (ranges of three or more as a-b), "rank 5"."""
    return f"rank{'s' if len(set(ranks)) > 1 else ''} {fmt_ranks(ranks, limit=8)}"


def _span(ns: int) -> str:
    """A duration as a person reads it: "2.0 days", "3.5 h", "12 min", "1.2 s", "30 ms"."""
    for unit, size in (("days", 86400 * NS), ("h", 3600 * NS), ("min", 60 * NS), ("s", NS)):
        if ns >= size:
            return f"{ns / size:.1f} {unit}" if unit != "min" else f"{ns // size} min"
    return f"{ns / 1e6:.0f} ms"
