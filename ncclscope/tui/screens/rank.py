"""Rank detail: one rank's last ops (newest first), its in-flight op, its stack, its metrics.

Where a hang investigation ends: the op the rank was stuck in, the op that
timed out, and the Python stack that says which line of the user's code it
was on. The main thread's frames come first (the flusher and sampler threads
are noise); the full dump follows.
"""
from __future__ import annotations

import numpy as np
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Vertical, VerticalScroll
from textual.widgets import DataTable, Static

from ncclscope.tui.frame import coord_label, describe_ops, fmt_seconds, plain
from ncclscope.tui.presenters import STATE_LABEL, OpRow, RankDetail
from ncclscope.tui.stacks import hide_own_frames
from ncclscope.findings import Finding
from ncclscope.load.opsjoin import STATUS_INFLIGHT
from ncclscope.load.trace import Trace

MAX_OPS = 300
STATUS_STYLE = {"ok": "green", "inflight": "yellow", "suspect": "bold yellow", "timeout": "bold red",
                "error": "bold red"}


def _excerpt(text: str) -> str:
    try:
        try:
            from ncclscope.index.stack_excerpts import stack_excerpt
        except ImportError:          # before stacks.py was split out of waitfor.py
            from ncclscope.hang.waitfor import stack_excerpt
        return hide_own_frames(stack_excerpt(text, max_frames=16))
    except Exception:   # the analysis is optional here: show the raw dump
        return ""


def build_rank_detail(trace: Trace, rank: int, findings: list[Finding], states: dict[int, str],
                      roots: list[int]) -> RankDetail:
    """Everything the rank screen shows for `rank` (one searchsorted slice of the ops table)."""
    ops = trace.ops
    if len(ops):
        r = ops["rank"].to_numpy()
        lo, hi = np.searchsorted(r, [rank, rank + 1])
        mine = ops.iloc[lo:hi]
        mine = mine[(mine["kind"] != "marker").to_numpy()]
    else:
        mine = ops
    end = trace.end_ns
    ev = trace.events
    suspect = set()
    if len(ev):
        sus = ev[(ev["rank"] == rank).to_numpy() & (ev["status"] == "suspect").to_numpy()]
        suspect = set(int(x) for x in sus["op_id"])
    tail = mine.iloc[::-1].iloc[:MAX_OPS]
    rows: list[OpRow] = []
    if len(tail):
        text = describe_ops(tail)
        mb = tail["microbatch"].to_numpy()
        short = plain(tail["op_name"]).to_numpy(dtype=object)
        status = plain(tail["status"])
        inflight = (status == STATUS_INFLIGHT).to_numpy()
        dur = np.where(inflight, end - tail["start_ns"].to_numpy(), tail["duration_ns"].to_numpy())
        for i, row in enumerate(tail.itertuples(index=False)):   # ≤ MAX_OPS rows: display only
            st = str(status.iat[i])
            if inflight[i] and int(row.op_id) in suspect:
                st = "suspect"
            seq = int(row.collective_seq_id) if row.collective_seq_id >= 0 else int(row.p2p_seq_id)
            rows.append(OpRow(op_id=int(row.op_id), text=str(short[i]) + (f" mb {mb[i]}" if mb[i] >= 0 else ""),
                                desc=str(text.iat[i]), group=str(row.process_group),
                                seq=seq, peer=int(row.peer), step=int(row.step),
                                duration=fmt_seconds(dur[i]) + ("+" if inflight[i] else ""), status=st))
    info = trace.ranks.get(rank)
    coords = coord_label(rank, trace)
    state = states.get(rank, "unknown")
    how = info.state if info else "missing"
    try:
        from ncclscope.index.summary import exit_text
        how += f", {exit_text(info)}" if info else ""
    except Exception:
        pass
    header = f"rank {rank}" + (f" {coords}" if coords else "") + f" · {STATE_LABEL[state]} · {how}"
    infl = [o for o in rows if o.status in ("inflight", "suspect")]
    inflight_line = ""
    if infl:
        o = infl[0]
        inflight_line = f"in flight: {o.desc}" + (f" step {o.step}" if o.step >= 0 else "") + \
            f" for {o.duration.rstrip('+')}" + (" — SUSPECT: far over its own history" if o.status == "suspect" else "")
    raw = trace.stacks.get(rank, "")
    if raw.strip():
        ex = _excerpt(raw)
        stack = (f"main thread (top frames):\n{ex}\n\n── full dump ──\n{raw.strip()}" if ex else raw.strip())
    else:
        stack = ("no stack dump for this rank (stacks are written when an op times out or the launcher "
                 "stops a live rank)")
    mentions = [f.title for f in findings if rank in f.ranks] + \
        [f.title for f in findings if rank not in f.ranks and any(e.rank == rank for e in f.evidence)]
    return RankDetail(rank=rank, header=header, state=state, root=rank in roots, inflight=inflight_line,
                        ops=rows, n_ops=len(mine), stack=stack, metrics=_metric_lines(trace, rank),
                        findings=mentions[:4])


def _metric_lines(trace: Trace, rank: int) -> list[str]:
    m = trace.metrics
    if not len(m):
        return ["no metrics recorded (the rank finished no step)"]
    mine = m[(m["rank"] == rank).to_numpy()].sort_values("step")
    if not len(mine):
        return ["no metrics recorded (the rank finished no step)"]

    def arrow(col: str, fmt: str = "{:.4g}") -> str:
        v = mine[col].to_numpy(dtype=float)
        if np.isnan(v).all():
            return "–"               # this rank computes no loss (an early pipeline stage)
        v = v[np.isfinite(v)] if np.isfinite(v).any() else v
        return fmt.format(v[0]) if len(v) == 1 else f"{fmt.format(v[0])} → {fmt.format(v[-1])}"

    last = mine.iloc[-1]
    line = (f"steps {int(mine['step'].min())}-{int(mine['step'].max())} · loss {arrow('loss')} · grad norm "
            f"{arrow('grad_norm_local')} · step time {float(last['step_time_s']):.3g} s")
    if int(last["memory_bytes"]) > 0:
        line += f" · mem {int(last['memory_bytes']) / 2**20:.0f} MiB"
    return [line]


class RankView(Vertical):
    """Header, ops table (cursor on the evidence op after a jump), stack, metrics."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.detail: RankDetail | None = None
        self._filter = ""
        self._focus_op = -1

    def compose(self) -> ComposeResult:
        yield Static("no rank selected: pick one in the Ranks tab or press Enter on a finding", id="rk-head")
        yield DataTable(id="rk-ops", cursor_type="row")
        with VerticalScroll(id="rk-stack-box"):
            yield Static(id="rk-stack")
        yield Static(id="rk-metrics")

    def show(self, detail: RankDetail, focus_op: int = -1) -> None:
        self.detail = detail
        self._focus_op = focus_op
        head = Text(no_wrap=True, overflow="ellipsis")
        if detail.root:
            head.append("◆ ROOT CAUSE ", style="bold red")
        head.append(detail.header, style="bold")
        head.append("\n")
        if detail.inflight:
            head.append(detail.inflight, style="yellow" if "SUSPECT" not in detail.inflight else "bold yellow")
        elif detail.findings:
            head.append(detail.findings[0], style="dim")
        self.query_one("#rk-head", Static).update(head)
        self._fill(columns=True)
        self.query_one("#rk-stack-box").border_title = f"stack of rank {detail.rank}"
        self.query_one("#rk-stack", Static).update(Text(detail.stack))
        self.query_one("#rk-metrics", Static).update(Text(" · ".join(detail.metrics)))

    def _fill(self, columns: bool = False) -> None:
        table = self.query_one("#rk-ops", DataTable)
        table.clear(columns=columns)
        if self.detail is None:
            return
        if columns or not table.columns:
            # the op column is as wide as its longest name: all_gather_into_tensor is never cut
            op_w = max([len(o.text) for o in self.detail.ops] + [12])
            grp_w = max([len(o.group) for o in self.detail.ops] + [5])
            for label, width in (("op", op_w), ("group", grp_w), ("seq", 4), ("peer", 4), ("step", 4),
                                 ("duration", 9), ("status", 8)):
                table.add_column(label, width=width, key=label)
        f = self._filter
        target = 0
        shown = [o for o in self.detail.ops if not f or f in f"{o.text} {o.status} step {o.step}".lower()]
        for i, o in enumerate(shown):
            if o.op_id == self._focus_op:
                target = i
            table.add_row(Text(o.text), Text(o.group), o.seq if o.seq >= 0 else "", o.peer if o.peer >= 0 else "",
                          o.step if o.step >= 0 else "", Text(o.duration),
                          Text(o.status, style=STATUS_STYLE.get(o.status, "")), key=str(o.op_id))
        extra = self.detail.n_ops - len(self.detail.ops)
        table.border_title = f"ops of rank {self.detail.rank}, newest first" + (
            f" (latest {len(self.detail.ops)} of {self.detail.n_ops})" if extra > 0 else "")
        if shown:
            table.move_cursor(row=target)

    def set_filter(self, text: str) -> None:
        self._filter = text.strip().lower()
        self._fill()
