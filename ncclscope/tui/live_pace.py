"""How a live view (`tui --follow`) keeps its one-second poll while the trace grows.

A poll reads only the appended batches (follow.py), but the verdict is composed over the whole trace, and
the performance analyses are two thirds of that composition and grow with the run: after ten minutes of a
4-rank job (~200 k ops) one composition took ~1 s on this machine, and the view refreshed every 2-8 s
(docs/benchmarks.md, follow_watch.py). What must be fresh every poll is the hang diagnosis: a wait that
has just outlived its history is the news a live view exists for. Bubbles, stragglers, bandwidth and
utilization are averages over the run; a few seconds' delay changes none of them.

So each poll runs the hang diagnosis on the new trace, and the performance analyses only when they are due:
at the first poll, when the job has ended, and otherwise at most once every `max(min_interval_s,
last cost / duty)`, so that they take at most `duty` of the view's time; in between the composer
(`verdict.compose.run(..., reuse_perf=...)`) reuses the last results, and the live note says how old they
are. The verdict line is still made once, by the composer, from the fresh diagnosis and those results.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

MIN_INTERVAL_S = 5.0      # the performance analyses run again no sooner than this ...
DUTY = 0.25               # ... nor sooner than their own last cost / DUTY (they take at most a quarter)


@dataclass
class LivePace:
    """One per followed run: the last performance results, when they were made and what they cost."""

    min_interval_s: float = MIN_INTERVAL_S
    duty: float = DUTY
    clock: Callable[[], float] = time.monotonic
    perf: Any = None                     # the last PerfResult, or None before the first composition
    made_at: float = field(default=float("-inf"))
    cost_s: float = 0.0

    def due(self, live: bool) -> bool:
        """Whether this poll re-runs the performance analyses."""
        if not live or self.perf is None:
            return True
        return self.clock() - self.made_at >= max(self.min_interval_s, self.cost_s / self.duty)

    def analyse(self, trace: Any, live: bool, on_verdict: Any = None) -> tuple[Any, str]:
        """(analysis, live note): the one composer on `trace`; while `live`, the hang diagnosis' premature
        findings held back (`follow.hold_premature_hang`) and the performance results reused when not due."""
        from ncclscope import verdict       # looked up at call time (a test may stand in for the composer)
        run = verdict.run
        if self.due(live):
            start = self.clock()
            analysis = run(trace, on_verdict=on_verdict)
            if analysis.perf is not None:
                self.perf, self.made_at = analysis.perf, start
                self.cost_s = float(analysis.timings_s.get("performance", 0.0))
            age = ""
        else:
            analysis = run(trace, on_verdict=on_verdict, reuse_perf=self.perf)
            age = f"performance as of {self.clock() - self.made_at:.0f} s ago"
        if not live:
            return analysis, ""
        from ncclscope.tui.follow import hold_premature_hang
        analysis, note = hold_premature_hang(analysis, trace)
        hang_shown = analysis.diagnosis is not None and not analysis.diagnosis.ok and not note
        # the age matters where the performance findings may make the line: not under a hang's verdict
        return analysis, "; ".join(x for x in (note, "" if hang_shown else age) if x)
