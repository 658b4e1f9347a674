"""One entry point for every performance analysis: bubbles, stragglers,
communication, divergence, utilization, MoE/CP, memory.

    from ncclscope.load.trace import load
    from ncclscope.perf.performance import analyze_performance
    perf = analyze_performance(load("runs/a"))
    [print(f.title) for f in perf.findings]

Findings at `info` severity are measurements inside the run's own noise
(see each module's significance rule); they are listed but never make the
verdict or the exit code. The verdict line is made once, by
`ncclscope.verdict.compose`, from these findings and the hang diagnosis.

Why one entry: the report, the TUI and the CLI must show the same numbers,
so they all call this and only present what it returns. Each analysis runs
through the analyses' one error guard (`ncclscope.verdict.guard`): if one
fails on a strange trace, its error is one line in `errors` and the others
still run (a report with one section missing beats no report). Timings per
analysis are kept for the benchmark.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from ncclscope.findings import Finding, sort_findings
from ncclscope.load.trace import Trace
from ncclscope.perf.bubbles import BubbleResult, analyze_bubbles
from ncclscope.perf.comm_stats import CommResult, analyze_comm
from ncclscope.perf.divergence import DivergenceResult, analyze_divergence
from ncclscope.index.views import release_heap
from ncclscope.perf.memory import MemoryResult, analyze_memory
from ncclscope.perf.moe import MoEResult, analyze_moe
from ncclscope.perf.pipeline_straggler import analyze_pipeline_stragglers
from ncclscope.perf.stragglers import StragglerResult, analyze_stragglers
from ncclscope.perf.utilization import UtilResult, analyze_utilization
from ncclscope.verdict.guard import Guard


@dataclass
class PerfResult:
    """Every table and finding of the performance analyses (see each module for columns)."""

    bubbles: BubbleResult = field(default_factory=BubbleResult)
    stragglers: StragglerResult = field(default_factory=StragglerResult)
    comm: CommResult = field(default_factory=CommResult)
    divergence: DivergenceResult = field(default_factory=DivergenceResult)
    utilization: UtilResult = field(default_factory=UtilResult)
    moe: MoEResult = field(default_factory=MoEResult)
    memory: MemoryResult = field(default_factory=MemoryResult)
    findings: list[Finding] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        """Headline numbers for JSON output."""
        b = self.bubbles
        return {
            "bubble": {"schedule": b.schedule, "p": b.p, "m": b.m, "v": b.v, "theory": b.theory,
                       "measured": b.measured} if b.p > 1 else None,
            "first_divergent_step": self.divergence.first_divergent_step,
            "errors": list(self.errors),
            "timings_s": dict(self.timings),
        }


def analyze_performance(trace: Trace, only: tuple[str, ...] | None = None) -> PerfResult:
    """Run every performance analysis (or those named in `only`)."""
    res = PerfResult()
    guard = Guard(errors=res.errors, timings=res.timings, after=lambda: release_heap(trace))

    def run(name: str, fn: Callable[[], Any]) -> Any:
        # the next analysis starts from the tables, not this one's copies (release_heap after each)
        return guard(name, fn) if only is None or name in only else None

    res.bubbles = run("bubbles", lambda: analyze_bubbles(trace)) or BubbleResult()
    res.stragglers = run("stragglers", lambda: analyze_stragglers(trace)) or StragglerResult()
    _join_pipeline_stragglers(res.stragglers, run("stragglers", lambda: analyze_pipeline_stragglers(trace)))
    inst = res.stragglers.instances if len(res.stragglers.instances) else None
    res.comm = run("comm", lambda: analyze_comm(trace, instances=inst)) or CommResult()
    res.divergence = run("divergence", lambda: analyze_divergence(trace)) or DivergenceResult()
    res.utilization = run("utilization", lambda: analyze_utilization(trace)) or UtilResult()
    res.moe = run("moe", lambda: analyze_moe(trace)) or MoEResult()
    res.memory = run("memory", lambda: analyze_memory(trace)) or MemoryResult()
    found: list[Finding] = []
    for part in (res.divergence, res.stragglers, res.bubbles, res.comm, res.moe, res.utilization, res.memory):
        found.extend(part.findings)
    res.findings = sort_findings(found)
    return res


def _join_pipeline_stragglers(res: StragglerResult, found: list[Finding] | None) -> None:
    """A rank that holds up its pipeline from outside the schedule (pipeline_straggler.py) joins the peer
    comparison's findings unless that already warns about it; its `info` there (within the peers' noise)
    gives way to the pipeline's evidence."""
    warned = {r for f in res.findings if f.severity in ("warning", "error") for r in f.ranks}
    new = [f for f in (found or []) if not set(f.ranks) & warned]
    named = {r for f in new for r in f.ranks}
    res.findings = [f for f in res.findings if not (f.severity == "info" and set(f.ranks) & named)] + new
