"""ncclscope: a debugger and trace analyzer for distributed training.

This package is the analyzer and the CLI. It never imports torch, so a run
directory copied off a cluster can be opened on any laptop. The instrumented
training runtime lives in `ncclscope.runtime` (source folder `runtime/`).
"""
__version__ = "0.1.0"


def step(n=None):
    """Under `ncclscope run`: mark a step boundary (no-op otherwise). See ncclscope/usertrace."""
    from .usertrace import step as _step
    _step(n)


def annotate(name):
    """Under `ncclscope run`: write a marker row named `name` (no-op otherwise)."""
    from .usertrace import annotate as _annotate
    _annotate(name)
