"""Tracing a user's own job: `ncclscope run -- SCRIPT ARGS` / `torchrun ... -m ncclscope.run SCRIPT ARGS`.

    ncclscope run --nproc 2 -- examples/ddp.py --steps 3
    torchrun --standalone --nproc-per-node 2 -m ncclscope.run examples/ddp.py --steps 3

This package is the torch-free half: `step()` / `annotate()` here and the
loader's `fr_merge.py` (Flight Recorder entries the Python tracer did not see,
such as DDP's reducer or DTensor, become rows of the rank's events). The
tracer, the per-rank bootstrap and the launcher import torch and live in
`ncclscope.runtime.usertrace`.

`step()` and `annotate()` are the explicit API a script may call (re-exported
as `ncclscope.step` / `ncclscope.annotate`); they do nothing when the script
runs without ncclscope.
"""
from __future__ import annotations

import sys
from typing import Any


def _active() -> Any:
    mod = sys.modules.get("ncclscope.runtime.usertrace.tracer")
    return None if mod is None else mod.ACTIVE


def step(n: int | None = None) -> None:
    """Mark a step boundary (the next ops belong to step `n`, or the next step).
    Once called, optimizer steps no longer advance the step counter."""
    t = _active()
    if t is not None:
        t.explicit_step(n)


def annotate(name: str) -> None:
    """Write a marker row named `name` into this rank's trace (no-op untraced)."""
    t = _active()
    if t is not None:
        t.annotate(name)
