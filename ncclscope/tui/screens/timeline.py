"""Timeline: a text Gantt chart of one step, one line per rank.

For a pipeline run this is the schedule as it actually ran: `F0` / `B0`
forward / backward of microbatch 0, `c` collectives, `p` p2p, `·` idle (the
bubble). Compute wins over communication where they overlap: with tensor
parallelism every forward is full of tp all-reduces, and drawing those on top
would hide the 1F1B pattern; a collective shows where the rank did nothing
else (the data-parallel all-reduce after the backward, a wait). Each row is
labelled with every mesh coordinate that varies (pp0 dp1 tp1). An op that did not end ok (in flight at the end, timed out, failed) is
drawn in reverse video; in a hung step the view zooms on the schedule up to
the last op that ended ok and the waits run off the right edge. The rank
whose line looks different is where to look. `[` and `]` change the step.
"""
from __future__ import annotations

import numpy as np
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import Static

from ncclscope.tui.frame import coord_label, fmt_seconds, plain, varying_keys
from ncclscope.tui.presenters import TimelineModel
from ncclscope.load.opsjoin import STATUS_INFLIGHT
from ncclscope.load.trace import Trace
from ncclscope.tui.widgets.plots import CODES, gantt_lines

LABEL_W = 13                 # at least; wider when the coordinates need it


def default_step(trace: Trace) -> int:
    """The step where something went wrong (first op not ok), else the last step."""
    ops = trace.ops
    if not len(ops):
        return -1
    real = ops[(ops["kind"] != "marker").to_numpy() & (ops["step"] >= 0).to_numpy()]
    if not len(real):
        return -1
    bad = real[(plain(real["status"]) != "ok").to_numpy()]
    return int(bad["step"].min()) if len(bad) else int(real["step"].max())


def build_timeline(trace: Trace, step: int) -> TimelineModel:
    """The spans of `step` on every rank, aligned to rank 0's clock."""
    ops = trace.ops
    ranks = sorted(trace.ranks)
    keys = varying_keys(trace)
    digits = len(str(max(ranks, default=0)))

    def label(r: int) -> str:
        return f"{r:>{digits}} " + coord_label(r, trace, keys)

    empty = np.array([], dtype=np.int64)
    real = ops[(ops["kind"] != "marker").to_numpy() & (ops["step"] >= 0).to_numpy()] if len(ops) else ops
    steps = sorted(int(s) for s in real["step"].unique()) if len(real) else []
    sub = real[(real["step"] == step).to_numpy()] if len(real) else real
    if not len(sub):
        return TimelineModel(step=step, steps=steps, t0=0, t1=1, ranks=ranks, labels=[label(r) for r in ranks],
                               rank_idx=empty, start=empty, end=empty, code=np.array([], dtype=object),
                               mb=empty, open_=np.array([], dtype=bool))
    status = plain(sub["status"]).to_numpy()
    inflight = status == STATUS_INFLIGHT
    open_ = status != "ok"                    # in flight, timed out or failed: drawn as a wait
    start = sub["start_ns"].to_numpy(dtype=np.int64)
    t0 = int(start.min())
    end = np.where(inflight, trace.end_ns, sub["end_ns"].to_numpy(dtype=np.int64))
    full = int(max(end.max(), t0 + 1))
    t1 = full
    if open_.any() and (~open_).any():        # a hung step: zoom on the schedule, let the waits run off
        t_ok = int(end[~open_].max())
        t1 = min(full, t_ok + max((t_ok - t0) // 6, 1))
    end = np.minimum(end, t1)
    name = plain(sub["op_name"]).to_numpy()
    kind = plain(sub["kind"]).to_numpy()
    code = np.select([name == "forward", name == "backward", kind == "collective", kind == "p2p"],
                     ["F", "B", "C", "P"], "O").astype(object)
    row_of = {r: i for i, r in enumerate(ranks)}
    rank_idx = pd_map(sub["rank"].to_numpy(), row_of)
    return TimelineModel(step=step, steps=steps, t0=t0, t1=t1, ranks=ranks, labels=[label(r) for r in ranks],
                           rank_idx=rank_idx, start=start, end=end, code=code,
                           mb=sub["microbatch"].to_numpy(dtype=np.int64), open_=open_, full_t1=full)


def pd_map(values: np.ndarray, mapping: dict[int, int]) -> np.ndarray:
    """Vectorised dict lookup for small integer keys (rank -> row)."""
    lut = np.full(max(mapping) + 1 if mapping else 1, -1, dtype=np.int64)
    for k, v in mapping.items():
        lut[k] = v
    return lut[np.clip(values.astype(np.int64), 0, len(lut) - 1)]


class TimelineView(Vertical):
    COMPONENT_CLASSES = {f"gantt--{c}" for c in CODES} | {"gantt--idle", "gantt--open", "gantt--label"}

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.model: TimelineModel | None = None
        self._trace: Trace | None = None
        self.step = -1
        self._filter = ""

    def compose(self) -> ComposeResult:
        yield Static(id="tl-head")
        with VerticalScroll(id="tl-box"):
            yield Static(id="tl-body")

    def show(self, trace: Trace, step: int | None = None) -> None:
        self._trace = trace
        if step is None:
            step = self.step if self.step >= 0 else default_step(trace)
        self.step = step
        self.model = build_timeline(trace, step)
        self.render_chart()

    def change_step(self, delta: int) -> None:
        if self.model is None or not self.model.steps or self._trace is None:
            return
        steps = self.model.steps
        i = steps.index(self.step) if self.step in steps else 0
        self.show(self._trace, steps[max(0, min(len(steps) - 1, i + delta))])

    def on_resize(self) -> None:
        self.render_chart()

    def render_chart(self) -> None:
        tl = self.model
        if tl is None:
            return
        box = self.query_one("#tl-box")
        label_w = max([LABEL_W] + [len(x) + 1 for x in tl.labels])
        width = max(10, (box.content_region.width or self.size.width) - label_w - 3)   # 2 bars + scrollbar
        styles = {c: self.get_component_rich_style(f"gantt--{c}", partial=True) for c in CODES}
        styles["idle"] = self.get_component_rich_style("gantt--idle", partial=True)
        styles["open"] = self.get_component_rich_style("gantt--open", partial=True)
        label_style = self.get_component_rich_style("gantt--label", partial=True)
        head = Text(no_wrap=True, overflow="ellipsis")
        if not tl.steps:
            head.append("no steps recorded yet")
        else:
            head.append(f"step {tl.step}", style="bold")
            head.append(f" of {tl.steps[0]}–{tl.steps[-1]} ([ ] change)")
            head.append(f" · {fmt_seconds(tl.t1 - tl.t0)}, col {fmt_seconds((tl.t1 - tl.t0) / width)}")
            if tl.full_t1 > tl.t1:
                head.append(f" · waits run on to {fmt_seconds(tl.full_t1 - tl.t0)}", style="bold red")
            head.append("\n")
        for c, what in (("F", "fwd"), ("B", "bwd"), ("C", "coll"), ("P", "p2p"), ("O", "other")):
            head.append(f" {c} ", style=styles[c])
            head.append(f"{what} ")
        head.append(" · ", style=styles["idle"])
        head.append("idle ")
        head.append(" open ", style=styles["open"])
        head.append(" wait / failed")
        self.query_one("#tl-head", Static).update(head)
        lines = gantt_lines(tl, width, styles) if len(tl.start) else [Text("") for _ in tl.ranks]
        body = Text(no_wrap=True, overflow="crop")
        f = self._filter
        for r, lab, line in zip(tl.ranks, tl.labels, lines):
            if f and not all(w in lab.lower() for w in f.split()) and f != str(r):
                continue
            body.append(f"{lab:<{label_w}}", style=label_style)
            body.append("│")
            body.append_text(line)
            body.append("│\n")
        self.query_one("#tl-body", Static).update(body)

    def set_filter(self, text: str) -> None:
        self._filter = text.strip().lower()
        self.render_chart()
