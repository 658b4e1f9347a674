"""ncclscope: a debugger and trace analyzer for distributed training.

This package is the analyzer and the CLI. It never imports torch, so a run
directory copied off a cluster can be opened on any laptop. The instrumented
training runtime lives in `ncclscope.runtime` (the only subpackage that
imports torch).

`step()` and `annotate()` are the explicit API a user's script may call under
`ncclscope run` (`torchrun ... -m ncclscope.run SCRIPT`); they do nothing when
the script runs without ncclscope, and reach the tracer only through
`sys.modules`, so importing `ncclscope` never imports torch.
"""
from __future__ import annotations

import sys
from typing import Any

__version__ = "0.1.0"


def _active_tracer() -> Any:
    mod = sys.modules.get("ncclscope.runtime.usertrace.tracer")
    return None if mod is None else mod.ACTIVE


def step(n: int | None = None) -> None:
    """Mark a step boundary (the next ops belong to step `n`, or the next step).
    Once called, optimizer steps no longer advance the step counter."""
    t = _active_tracer()
    if t is not None:
        t.explicit_step(n)


def annotate(name: str) -> None:
    """Write a marker row named `name` into this rank's trace (no-op untraced)."""
    t = _active_tracer()
    if t is not None:
        t.annotate(name)
