"""Metrics: loss and gradient norm per rank over steps, divergence in red.

Replicas (same tp / pp / ep position, different dp) must agree on the
parameter checksum and the reduced gradient norm after every step; one that
does not has silently diverged (a skipped all-reduce, a NaN, a desynchronised
optimizer). Which rank and step deviate is the divergence analysis's answer
(`perf.performance`); this screen only draws it: sparklines share one
scale across ranks so the odd one out is visible, deviating steps in red.
The sparklines are as wide as the pane allows (one character per step when
they fit, the largest value of each bucket of steps when not, so a one-step
spike is never lost) and logarithmic when the values span more than 10x.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical
from textual.widgets import DataTable, Static

from ncclscope.tui.frame import coord_label, varying_keys
from ncclscope.tui.presenters import MetricRow, MetricsModel
from ncclscope.load.trace import Trace
from ncclscope.tui.widgets.plots import sparkline, use_log_scale

SPARK_MIN = 8               # narrowest sparkline (an 80-column terminal with long rank labels)
FIXED_W = 8 + 8 + 12 + 12   # the two "last" columns, "diverges at", cell padding


def flagged(perf: Any) -> pd.DataFrame:
    """(rank, step, metric, value, reference) flagged by the divergence analysis: replica deviations and
    the first non-finite values. Empty when the performance analyses have not run (yet)."""
    div = getattr(perf, "divergence", None)
    frames = []
    for name in ("deviations", "nonfinite"):
        t = getattr(div, name, None)
        if isinstance(t, pd.DataFrame) and len(t) and {"rank", "step"} <= set(t.columns):
            frames.append(t.reindex(columns=["rank", "step", "metric", "value", "reference"]))
    if not frames:
        return pd.DataFrame(columns=["rank", "step", "metric", "value", "reference"])
    return pd.concat(frames, ignore_index=True)


def build_metrics(trace: Trace, perf: Any = None) -> MetricsModel:
    """Per-rank loss / local grad norm series; divergence from `perf` (perf.performance)."""
    m = trace.metrics
    ranks = sorted(trace.ranks)
    if not len(m):
        return MetricsModel(steps=[], rows=[], loss_range=(0, 1), gnorm_range=(0, 1),
                              notes=["no metrics recorded yet (one row per rank per finished step)"])
    steps = sorted(int(s) for s in m["step"].unique())

    def pivot(col: str) -> np.ndarray:
        t = m.pivot_table(index="rank", columns="step", values=col, aggfunc="last", dropna=False)
        return t.reindex(index=ranks, columns=steps).to_numpy(dtype=float)

    la, ga = pivot("loss"), pivot("grad_norm_local")
    div = flagged(perf)
    bad_by_rank = div.groupby("rank")["step"].agg(lambda s: sorted(set(int(x) for x in s))).to_dict()

    def rng(a: np.ndarray) -> tuple[float, float]:
        f = a[np.isfinite(a)]
        return (float(f.min()), float(f.max())) if len(f) else (0.0, 1.0)

    keys = varying_keys(trace)
    rows = []
    for i, r in enumerate(ranks):      # one row per rank: display objects only
        fl, fg = la[i][np.isfinite(la[i])], ga[i][np.isfinite(ga[i])]
        rows.append(MetricRow(rank=r, label=f"{r} " + coord_label(r, trace, keys), loss=la[i],
                                gnorm=ga[i], bad_steps=bad_by_rank.get(r, []),
                                last_loss=float(fl[-1]) if len(fl) else float("nan"),
                                last_gnorm=float(fg[-1]) if len(fg) else float("nan")))
    found = getattr(getattr(perf, "divergence", None), "findings", None) or []
    notes = [f.title for f in found]
    if perf is None:
        notes = ["divergence: waiting for the performance analyses"]
    return MetricsModel(steps=steps, rows=rows, loss_range=rng(la), gnorm_range=rng(ga),
                          notes=notes or ["replicas agree on parameter checksum and global grad norm"])


class MetricsView(Vertical):
    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.model: MetricsModel | None = None
        self._filter = ""

    def compose(self) -> ComposeResult:
        yield Static(id="mx-head")
        yield DataTable(id="mx-table", cursor_type="row")

    def show(self, trace: Trace, perf: Any = None) -> None:
        self.model = build_metrics(trace, perf)
        mm = self.model
        head = Text()
        diverged = any(r.bad_steps for r in mm.rows)
        for note in mm.notes[:3]:
            head.append(("⚠ " if diverged else "") + note + "\n", style="bold red" if diverged else "green")
        if mm.steps:
            def scale(r: tuple[float, float]) -> str:
                return f"{r[0]:.4g}–{r[1]:.4g}" + (" log" if use_log_scale(*r) else "")
            head.append(f"steps {mm.steps[0]}–{mm.steps[-1]} · loss {scale(mm.loss_range)}"
                        f" · grad norm {scale(mm.gnorm_range)} (shared scale)", style="dim")
        self.query_one("#mx-head", Static).update(head)
        self._fill()

    def on_resize(self) -> None:
        self._fill()

    def spark_width(self) -> int:
        """Characters per sparkline: the pane's width left over by the other columns, split in two."""
        mm = self.model
        label_w = max([8] + [len(r.label) for r in mm.rows]) if mm else 8
        free = (self.size.width or 80) - label_w - FIXED_W - 2
        n = len(mm.steps) if mm else 0
        return max(min(SPARK_MIN, max(n, 1)), min(n, free // 2))

    def _fill(self) -> None:
        mm = self.model
        table = self.query_one("#mx-table", DataTable)
        table.clear(columns=True)
        if mm is None:
            return
        spark_w = self.spark_width()
        label_w = max([8] + [len(r.label) for r in mm.rows])
        for label, w in (("rank", label_w), ("loss", max(spark_w, 4)), ("last", 8), ("grad norm", max(spark_w, 9)),
                         ("last", 8), ("diverges at", 12)):
            table.add_column(label, width=w)
        steps = np.array(mm.steps)
        for row in mm.rows:
            if self._filter and self._filter not in row.label.lower() and self._filter != str(row.rank):
                continue
            bad = np.isin(steps, row.bad_steps)
            style = "bold red" if row.bad_steps else ""
            table.add_row(Text(row.label, style=style),
                          sparkline(row.loss, *mm.loss_range, width=spark_w, bad=bad, style="cyan"),
                          _num(row.last_loss),
                          sparkline(row.gnorm, *mm.gnorm_range, width=spark_w, bad=bad, style="bright_blue"),
                          _num(row.last_gnorm),
                          Text(",".join(map(str, row.bad_steps[:4])) or "-", style=style))

    def set_filter(self, text: str) -> None:
        self._filter = text.strip().lower()
        self._fill()


def _num(v: float) -> str:
    return f"{v:.4g}" if np.isfinite(v) else ("–" if np.isnan(v) else str(v))
