"""Steps and markers: where the script's training loop is.

A step ends when an optimizer steps (torch's global optimizer step post-hook:
no change to the script), or where the script calls `ncclscope.step()`; once
it has called that, optimizer steps no longer count. Several optimizers
stepping together are one step. Each step boundary writes one metrics row for
the step that ended (its wall time) and a `step` marker row for the next;
`ncclscope.annotate(name)` writes a marker row. `StepsMixin` is one facet of
`tracer.Tracer`.
"""
from __future__ import annotations

import time
from typing import Any

from ncclscope import schema as S


def metric_blank(rank: int) -> tuple[Any, ...]:
    """A metrics row with every field at its null value (rank filled in)."""
    import pyarrow as pa   # imported by the recorder already
    blank = []
    for fname, typ in S.METRIC_FIELDS:
        blank.append(rank if fname == "rank" else float("nan") if pa.types.is_floating(typ) else
                     [] if pa.types.is_list(typ) else "" if pa.types.is_string(typ) else -1)
    return tuple(blank)


_MI_STEP, _MI_TIME, _MI_DT = (S.METRIC_COLUMNS.index(c) for c in ("step", "time_ns", "step_time_s"))


class StepsMixin:
    rec: Any
    _explicit: bool
    _opt_steps: dict[int, int]
    _step_t: float
    _last_activity: float
    _metric_blank: tuple[Any, ...]

    def _optimizer_stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._explicit:
            return
        k = id(optimizer)
        n = self._opt_steps.get(k, 0) + 1
        self._opt_steps[k] = n
        if n > self.rec.context.step:      # several optimizers stepping together are one step
            self._close_step(n)

    def _close_step(self, next_step: int) -> None:
        """One metrics row for the step that ended (its wall time), one marker row for the next.

        On the hot path of every optimizer step, so the metrics row is a prebuilt
        tuple filled in place (Recorder.metric builds it field by field: ~15 us) and
        memory is left to the sampler's 10 Hz RSS / NVML samples (reading
        /proc/self/statm every step costs another ~20 us)."""
        now = time.perf_counter()
        ctx = self.rec.context
        if ctx.step >= 0:
            row = list(self._metric_blank)
            row[_MI_STEP], row[_MI_TIME] = ctx.step, time.time_ns()
            row[_MI_DT] = now - self._step_t
            self.rec.metrics.rows.append(tuple(row))
        self._step_t = self._last_activity = now
        ctx.step = next_step
        self.rec.instant(S.KIND_MARKER, "step", message=f"step {next_step} begins")

    def explicit_step(self, n: int | None = None) -> None:
        self._explicit = True
        self._close_step(self.rec.context.step + 1 if n is None else int(n))

    def annotate(self, name: str) -> None:
        self.rec.instant(S.KIND_MARKER, "annotation", message=str(name)[:500])
