"""What the hand-built hang cases check of a diagnosis (tests/test_hang_analysis.py,
tests/test_mismatch_analysis.py)."""
from __future__ import annotations

import json

from trace_builder import TraceBuilder

from ncclscope.verdict.diagnose import Diagnosis


def headline(d: Diagnosis):
    assert d.findings, d.verdict
    json.dumps(d.to_json())            # the CLI writes findings as JSON: everything must serialise
    h = d.findings[0]
    assert h.role == "headline", [(f.kind, f.role) for f in d.findings]
    return h


def kinds(d: Diagnosis, severity: str = "error") -> list[tuple[str, list[int]]]:
    return [(f.kind, f.ranks) for f in d.findings if f.severity == severity]


def alive(b: TraceBuilder, ranks, until: float = 10.0) -> None:
    for r in ranks:
        b.heartbeats(r, 0.0, until)
