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
# the three fields a step fills, next to each other after `rank`: the row is head + (3 values) + tail
_MI_ADJACENT = (_MI_STEP, _MI_TIME, _MI_DT) == (1, 2, 3)
_perf, _time_ns = time.perf_counter, time.time_ns
_MARKER = S.KIND_MARKER


class StepsMixin:
    rec: Any
    _explicit: bool
    _opt_steps: dict[int, int]
    _step_t: float
    _last_activity: float
    _metric_blank: tuple[Any, ...]
    _metric_sink: Any = None   # the metrics stream's row append, looked up at the first step
    _metric_tail: tuple[Any, ...] = ()

    def _optimizer_stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._explicit:
            return
        k = id(optimizer)
        steps = self._opt_steps
        n = steps.get(k, 0) + 1
        steps[k] = n
        if n > self.rec.context.step:      # several optimizers stepping together are one step
            self._close_step(n)

    def _close_step(self, next_step: int) -> None:
        """One metrics row for the step that ended (its wall time), one marker row for the next.

        On the hot path of every optimizer step (its cost is in every step: ~1.5 us in a tight
        loop, several times that in a real step, whose work leaves the caches cold; measured by
        benchmarks/run_overhead.py), so the metrics row is (rank, step, time, wall time) + the
        prebuilt blank's tail (Recorder.metric builds it field by field: ~15 us), appended with
        the stream's one `extend` (the row's width is the schema's by construction), and memory
        is left to the sampler's 10 Hz RSS / NVML samples (reading /proc/self/statm every step
        costs another ~20 us)."""
        now = _perf()
        rec = self.rec
        ctx = rec.context
        step = ctx.step
        if step >= 0:
            sink = self._metric_sink
            if sink is None:
                sink = self._metric_appender()
            if _MI_ADJACENT:
                sink((self._metric_blank[0], step, _time_ns(), now - self._step_t) + self._metric_tail)
            else:
                row = list(self._metric_blank)
                row[_MI_STEP], row[_MI_TIME], row[_MI_DT] = step, _time_ns(), now - self._step_t
                sink(tuple(row))
        self._step_t = self._last_activity = now
        ctx.step = next_step
        rec.instant(_MARKER, "step", f"step {next_step} begins")

    def _metric_appender(self) -> Any:
        """The metrics stream's raw row append (Recorder's `IpcStream.append_row`), else its checked
        one; looked up once, at the first step."""
        metrics = self.rec.metrics
        fast = getattr(metrics, "append_row", None)
        self._metric_tail = self._metric_blank[4:]
        sink = fast if fast is not None and getattr(metrics, "width", None) == len(self._metric_blank) \
            else metrics.rows.append
        self._metric_sink = sink
        return sink

    def explicit_step(self, n: int | None = None) -> None:
        self._explicit = True
        self._close_step(self.rec.context.step + 1 if n is None else int(n))

    def annotate(self, name: str) -> None:
        self.rec.instant(S.KIND_MARKER, "annotation", message=str(name)[:500])
