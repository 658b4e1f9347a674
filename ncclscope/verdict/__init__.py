"""The analyzer's questions, one module each, and the one composer of the verdict.

    from ncclscope.verdict import run
    analysis = run(trace)          # verdict, ordered findings, diagnosis, performance, errors

`run` and `Analysis` live in `compose.py`; they are imported lazily here so that
importing one analysis module does not import all of them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ncclscope.verdict.compose import Analysis

__all__ = ["Analysis", "run"]


def run(trace: Any, **kwargs: Any) -> "Analysis":
    """Every analysis on `trace`, composed into one Analysis (see compose.run)."""
    from ncclscope.verdict.compose import run as _run
    return _run(trace, **kwargs)


def __getattr__(name: str) -> Any:
    if name == "Analysis":
        from ncclscope.verdict.compose import Analysis
        return Analysis
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
