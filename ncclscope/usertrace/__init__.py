"""Tracing a user's own job: `ncclscope run -- SCRIPT ARGS` / `torchrun ... -m ncclscope.run SCRIPT ARGS`.

    ncclscope run --nproc 2 -- examples/ddp.py --steps 3
    torchrun --standalone --nproc-per-node 2 -m ncclscope.run examples/ddp.py --steps 3

Modules (only `tracer`, `bootstrap` and `launcher` import torch; this package
and `fr_merge` never do, so the analyzer stays torch-free):
  bootstrap.py  the per-rank entry: recorder, telemetry, tracer, then the
                script via runpy as `__main__` with its own argv
  tracer.py     wraps the public torch.distributed API (begin/end rows in the
                schema `ncclscope train` writes), records process groups,
                steps from optimizer hooks, dumps Flight Recorder + stacks
  launcher.py   `ncclscope run --nproc N`: torch's elastic launch API
                (torchrun's own machinery), then run.json with exit codes
  fr_merge.py   loader step: Flight Recorder entries the Python tracer did not
                see (DDP's reducer, DTensor) become rows of the rank's events

`step()` and `annotate()` are the explicit API a script may call (re-exported
as `ncclscope.step` / `ncclscope.annotate`); they do nothing when the script
runs without ncclscope.
"""
from __future__ import annotations

import sys
from typing import Any


def _active() -> Any:
    mod = sys.modules.get("ncclscope.usertrace.tracer")
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
