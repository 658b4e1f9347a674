"""The one error guard of the analyses: the composer (`compose.run`) and the performance analyses
(`perf.performance.analyze_performance`) both run each analysis through a `Guard`.

    guard = Guard()
    diagnosis = guard("hang diagnosis", lambda: diagnose(trace))    # None if it raised
    guard.errors      # ["hang diagnosis failed: KeyError: 'x' at views.py:120"], one line per failure
    guard.timings     # {"hang diagnosis": 0.41}

Why: one analysis that fails on a strange trace must not take the others (or the face) down; a report
with one section missing beats no report. Each failure is one line (name, exception, where it was
raised), which the verdict then reports as missing analysis instead of calling the run healthy.
"""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable


def error_line(name: str, exc: BaseException) -> str:
    """`<name> failed: <Type>: <message> at <file>:<line>` (the innermost frame of the traceback)."""
    where = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    at = f" at {where.filename.rsplit('/', 1)[-1]}:{where.lineno}" if where else ""
    return f"{name} failed: {type(exc).__name__}: {exc}{at}"


@dataclass
class Guard:
    """Runs named analyses: returns what each returns, or None (and one line in `errors`) when it raises.
    `timings` sums the seconds per name; `after`, when given, runs after each analysis, failed or not
    (inside its timing)."""

    errors: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    after: Callable[[], Any] | None = None

    def __call__(self, name: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        try:
            return fn()
        except Exception as exc:  # one analysis must not take the others (or the face) down
            self.errors.append(error_line(name, exc))
            return None
        finally:
            if self.after is not None:
                self.after()
            self.timings[name] = self.timings.get(name, 0.0) + time.perf_counter() - t0
