"""What the bubble analysis returns: `BubbleResult` (the tables, times in ns,
and the findings). Shared by `bubbles.py` (which fills it) and `bubble_findings.py`
(which judges it), so judging needs nothing from the module that measures.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from ncclscope.findings import Finding


@dataclass
class BubbleResult:
    """Tables (times in ns) and findings of the bubble analysis; empty when pp == 1."""

    schedule: str = ""
    p: int = 1
    m: int = 0
    v: int = 1
    theory: float = float("nan")
    stage_step: pd.DataFrame = field(default_factory=pd.DataFrame)   # per pipeline, step, stage
    steps: pd.DataFrame = field(default_factory=pd.DataFrame)        # per pipeline, step
    stages: pd.DataFrame = field(default_factory=pd.DataFrame)       # per stage position, summary
    microbatches: pd.DataFrame = field(default_factory=pd.DataFrame) # per stage, kind, microbatch
    findings: list[Finding] = field(default_factory=list)
    p2p_latency_ns: float = float("nan")                              # the run's median p2p latency
    baseline: dict[str, float] = field(default_factory=dict)          # what the warnings were measured against

    @property
    def measured(self) -> float:
        """Mean measured bubble fraction over the summary steps."""
        return float(self.stages["bubble"].mean()) if len(self.stages) else float("nan")

