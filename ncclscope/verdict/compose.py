"""The one place the verdict is made: every face (analyze, report, tui, demo,
export) shows what `run(trace)` returns and composes nothing of its own.

    from ncclscope.load.trace import load
    from ncclscope.verdict import run
    a = run(load("runs/b"))
    print(a.verdict)                  # HANG: rank 2 (dp 2) never posted all_reduce #5 ...
    for f in a.findings: ...          # headlines first, then what supports them, then the rest
    a.exit_code                       # 0 nothing wrong, 1 problems found

Order of authority: the hang diagnosis speaks first (a hung job's slowness is
a symptom). When it finds nothing, the most severe performance or numerics
finding at warning level or above makes the line. An analysis that fails is
recorded in `errors` and the others still run (`guard.py`, the one error guard,
shared with the performance analyses); the verdict then says that part of the
analysis is missing instead of calling the run healthy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from ncclscope.findings import Finding, FindingKind, Role, Severity, sort_findings
from ncclscope.verdict.guard import Guard
from ncclscope.verdict.headline import OK_VERDICT, prefix

if TYPE_CHECKING:
    from ncclscope.load.trace import Trace
    from ncclscope.verdict.diagnose import Diagnosis
    from ncclscope.perf.performance import PerfResult

EXIT_OK, EXIT_PROBLEMS = 0, 1


@dataclass
class Analysis:
    """Everything the faces show, composed once."""

    verdict: str
    level: str                                   # error | warning | ok (the verdict line's colour)
    findings: list[Finding]                      # ordered: severity, then headline / independent / supporting
    diagnosis: "Diagnosis | None" = None
    perf: "PerfResult | None" = None
    errors: list[str] = field(default_factory=list)      # one line per analysis that failed
    warnings: list[str] = field(default_factory=list)    # what the loader could not read (shown first)
    timings_s: dict[str, float] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.level == "ok"

    @property
    def headline(self) -> Finding | None:
        """The finding the verdict line names, if any."""
        return next((f for f in self.findings if f.role == Role.HEADLINE), None) or (
            self.findings[0] if self.findings and self.level != "ok" else None)

    @property
    def root_ranks(self) -> list[int]:
        """Ranks the faces mark as root causes: every headline's ranks, else the verdict finding's."""
        heads = [f for f in self.findings if f.role == Role.HEADLINE and f.severity == Severity.ERROR]
        if not heads and self.headline is not None and self.level != "ok":
            heads = [self.headline]
        return sorted({int(r) for f in heads for r in f.ranks})

    @property
    def exit_code(self) -> int:
        """0 when nothing at warning level or above was found, else 1."""
        serious = any(f.severity in (Severity.ERROR, Severity.WARNING) for f in self.findings)
        return EXIT_PROBLEMS if serious or self.errors else EXIT_OK

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "level": self.level, "findings": [f.to_json() for f in self.findings],
                "errors": list(self.errors), "performance": self.perf.summary() if self.perf is not None else None}


def compose_verdict(diagnosis: "Diagnosis | None", perf_findings: list[Finding], errors: list[str]) -> tuple[str, str]:
    """(verdict line, level) from the hang diagnosis and the performance findings."""
    if diagnosis is not None and not diagnosis.ok:
        return diagnosis.verdict, "error"
    # A rank that died with nobody waiting on it is no hang, but the job did not end well: never OK
    # (a healthy run has no dead rank, so this costs no false alarm); nor dumps of ranks that all stopped
    # outside collectives whose write times are unknown (hang/stopped._times_unknown: copied files)
    dead = [f for f in (diagnosis.findings if diagnosis is not None else [])
            if f.kind in (FindingKind.DEAD_RANK, FindingKind.NO_OP_IN_FLIGHT) and f.severity == Severity.WARNING]
    if dead:
        return f"{prefix(dead[0].kind)}: {dead[0].title}", "warning"
    serious = sort_findings([f for f in perf_findings if f.severity in (Severity.ERROR, Severity.WARNING)])
    if serious:
        top = serious[0]
        return f"{prefix(top.kind)}: {top.title}", top.severity.value
    if errors:
        n = len(errors)
        return (f"INCOMPLETE: {n} analys{'is' if n == 1 else 'es'} failed, no problem found by the rest "
                f"({errors[0].split(':', 1)[0]})"), "warning"
    base = diagnosis.verdict if diagnosis is not None else OK_VERDICT
    return base, "ok"


def run(trace: "Trace", *, hang: bool = True, performance: bool = True,
        on_verdict: Callable[[Analysis], None] | None = None, reuse_perf: "PerfResult | None" = None) -> Analysis:
    """Run every analysis on `trace` once and compose the one verdict every face shows.

    The hang diagnosis speaks first, so once it has found a hang the verdict line is settled before the
    performance analyses run (seconds at 16,384 ranks): `on_verdict`, when given, receives that verdict
    then, as an `Analysis` with the hang findings only (`perf` None); the one returned adds the rest.
    `reuse_perf`: performance results of an earlier trace of the same live run, composed instead of running
    the performance analyses again (tui/live_pace.py: a live view refreshes them every few seconds)."""
    from ncclscope.verdict.diagnose import diagnose
    from ncclscope.index.views import release_views
    from ncclscope.perf.performance import analyze_performance

    guard = Guard()
    errors, timings = guard.errors, guard.timings
    diagnosis = guard("hang diagnosis", lambda: diagnose(trace)) if hang else None
    if on_verdict is not None and diagnosis is not None and not diagnosis.ok and performance:
        verdict, level = compose_verdict(diagnosis, [], errors)     # the hang's line: perf cannot change it
        on_verdict(Analysis(verdict=verdict, level=level, findings=sort_findings(list(diagnosis.findings)),
                            diagnosis=diagnosis, errors=list(errors),
                            warnings=list(getattr(trace, "warnings", []) or []), timings_s=dict(timings)))
    if reuse_perf is not None:
        perf = reuse_perf
    else:
        release_views(trace)    # the performance analyses read the tables, not the index's per-op views
        perf = guard("performance", lambda: analyze_performance(trace)) if performance else None
    if perf is not None:
        errors += perf.errors
        timings.update({f"perf.{k}": v for k, v in perf.timings.items()})
    hang_findings = list(diagnosis.findings) if diagnosis is not None else []
    perf_findings = list(perf.findings) if perf is not None else []
    seen = {(f.kind, f.title) for f in hang_findings}
    findings = sort_findings(hang_findings + [f for f in perf_findings if (f.kind, f.title) not in seen])
    verdict, level = compose_verdict(diagnosis, perf_findings, errors)
    return Analysis(verdict=verdict, level=level, findings=findings, diagnosis=diagnosis, perf=perf,
                    errors=errors, warnings=list(getattr(trace, "warnings", []) or []), timings_s=timings)
