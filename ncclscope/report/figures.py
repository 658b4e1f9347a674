"""Plotly figures for the HTML report, built only from what the analyses return.

Why a separate module: the figures decide how much of a 1,024-rank run a
browser can take. Every function here bounds its output (ranks sampled or
binned, points capped, WebGL scatter for point clouds), so the report stays
usable and under its size budget whatever the trace holds.

Every string that came from a trace goes through `style.esc` before it
reaches a label, a hover text or a title. The timeline is in timeline.py.
"""
from __future__ import annotations

from typing import Iterable

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ncclscope.perf.comm_stats import SEND_OPS
from ncclscope.perf.performance import PerfResult
from ncclscope.load.trace import Trace
from ncclscope.report.style import MS, esc, int_axis, layout as _layout

MAX_LINES = 16          # ranks drawn as individual lines; above this, aggregate
MAX_POINTS = 20_000     # scatter points per figure
MAX_BINS = 200          # time bins for heat maps
PALETTE = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2", "#FF9DA6", "#9D755D",
           "#BAB0AC"]
CLOCK_SYNC_TAG = 7      # runtime/telemetry.measure_clock_offsets: 8-byte pings with rank 0 before step 0


def bubbles_by_stage(perf: PerfResult) -> go.Figure | None:
    b = perf.bubbles
    st = b.stages
    if not len(st):
        return None
    x = [f"stage {int(s)}" for s in st["stage"]]
    fig = go.Figure()
    for col, name, color in (("warmup_cooldown_ns", "warm-up / cool-down", "#9ecae1"),
                             ("imbalance_ns", "waiting on a slower stage", "#fd8d3c"),
                             ("comm_stall_ns", "communication stall", "#d62728")):
        fig.add_trace(go.Bar(x=x, y=100 * st[col] / st["window_ns"], name=name, marker_color=color,
                             hovertemplate="%{y:.1f}% of the step<extra>" + esc(name) + "</extra>"))
    if np.isfinite(b.theory):
        # the label is a legend entry: an annotation on the line sat on top of a bar
        label = (f"theory {100 * b.theory:.1f}% ({esc(b.schedule)}, p={b.p}, m={b.m}"
                 + (f", v={b.v}" if b.v > 1 else "") + ")")
        fig.add_hline(y=100 * b.theory, line_dash="dash", line_color="black")
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", name=label,
                                 line=dict(color="black", dash="dash"), hoverinfo="skip"))
    return _layout(fig, f"Bubble per stage: measured {100 * b.measured:.1f}% vs theory {100 * b.theory:.1f}%",
                   barmode="stack", yaxis_title="% of the step idle")


def skew_heatmap(perf: PerfResult, max_steps: int = 300) -> go.Figure | None:
    rs = perf.stragglers.rank_step
    if not len(rs) or not rs["late_ns"].any():
        return None
    piv = rs.pivot_table(index="rank", columns="step", values="late_ns", aggfunc="sum", fill_value=0) / MS
    if piv.shape[1] > max_steps:
        bins = np.arange(piv.shape[1]) * max_steps // piv.shape[1]
        piv = piv.T.groupby(bins).mean().T
        piv.columns = [f"bin {c}" for c in piv.columns]
    fig = go.Figure(go.Heatmap(z=piv.to_numpy(), x=[str(c) for c in piv.columns], y=piv.index.to_numpy(),
                               colorscale="Reds", colorbar=dict(title="ms late"),
                               hovertemplate="rank %{y} step %{x}<br>%{z:.2f} ms after the first arriver<extra></extra>"))
    return _layout(fig, "Arrival lateness at collectives (rank × step): who everyone waits for",
                   height=min(900, max(320, 16 * len(piv) + 150)), xaxis=dict(title="step", type="category"),
                   yaxis=dict(title="rank", **int_axis(piv.index, pad=False)))


def utilization(perf: PerfResult) -> go.Figure | None:
    u = perf.utilization
    s = u.series
    if not len(s):
        return None
    t0 = s["time_ns"].min()
    ranks = s["rank"].unique()
    if len(ranks) <= MAX_LINES:
        fig = go.Figure([go.Scattergl(x=(g["time_ns"] - t0) / 1e9, y=g["util"], mode="lines", name=f"rank {r}")
                         for r, g in s.groupby("rank")])
    else:
        bins = np.minimum(((s["time_ns"] - t0) * MAX_BINS // max(1, s["time_ns"].max() - t0 + 1)).to_numpy(), MAX_BINS - 1)
        piv = s.assign(b=bins).pivot_table(index="rank", columns="b", values="util", aggfunc="mean")
        width_s = (s["time_ns"].max() - t0) / 1e9 / MAX_BINS
        fig = go.Figure(go.Heatmap(z=piv.to_numpy().round(1), x=piv.columns.to_numpy() * width_s, y=piv.index.to_numpy(),
                                   colorscale="Viridis", zmin=0, zmax=100, colorbar=dict(title="%"),
                                   hovertemplate="rank %{y}, t=%{x:.1f} s: %{z}%<extra></extra>"))
    return _layout(fig, f"Utilization over time ({u.source})", xaxis_title="s since the first sample",
                   yaxis=dict(title="%") if len(ranks) <= MAX_LINES else dict(title="rank", **int_axis(ranks, pad=False)))


def grad_norms(perf: PerfResult) -> go.Figure | None:
    n = perf.divergence.norms
    if not len(n) or not n["grad_norm_global"].notna().any() and not n["grad_norm_local"].notna().any():
        return None
    col = "grad_norm_global" if n["grad_norm_global"].notna().any() else "grad_norm_local"
    fig = go.Figure()
    named = {r for f in perf.findings if f.kind in ("grad_divergence", "nan", "grad_spike") for r in f.ranks}
    ranks = sorted(n["rank"].unique())
    if len(ranks) > MAX_LINES:
        agg = n.groupby("step")[col].agg(["min", "median", "max"]).reset_index()
        fig.add_trace(go.Scatter(x=agg["step"], y=agg["max"], mode="lines", line=dict(width=0), showlegend=False))
        fig.add_trace(go.Scatter(x=agg["step"], y=agg["min"], mode="lines", line=dict(width=0), fill="tonexty",
                                 fillcolor="rgba(76,120,168,0.25)", name="min–max over ranks"))
        fig.add_trace(go.Scatter(x=agg["step"], y=agg["median"], mode="lines", name="median"))
        ranks = sorted(named)[:MAX_LINES]
    for r in ranks:
        g = n[n["rank"] == r]
        fig.add_trace(go.Scattergl(x=g["step"], y=g[col], mode="lines+markers", name=f"rank {r}"))
    bad = n[~np.isfinite(n[col]) & n["rank"].isin(ranks or named)]
    if len(bad):
        fig.add_trace(go.Scatter(x=bad["step"], y=np.zeros(len(bad)), mode="markers", name="NaN / Inf",
                                 marker=dict(symbol="x", size=12, color="red"),
                                 hovertext=[f"rank {r}: non-finite" for r in bad["rank"]], hoverinfo="text"))
    return _layout(fig, f"Gradient norm per rank per step ({col})", xaxis=dict(title="step", **int_axis(n["step"])),
                   yaxis_title="norm")


def _log_dtick(values: pd.Series) -> int | str:
    """Every decade when the data spans two or more, else 1-2-5 (one label would be too few)."""
    v = values[values > 0]
    if not len(v):
        return 1
    return 1 if np.log10(float(v.max()) / float(v.min())) >= 2 else "D2"


def collectives(perf: PerfResult) -> go.Figure | None:
    inst = perf.comm.instances
    if not len(inst) or "latency_ms" not in inst or not inst["latency_ms"].notna().any():
        return None
    ok = inst[inst["latency_ms"].notna()]
    sized = ok["size_bytes"] > 0
    zero = sorted({esc(f"{op} on {kind}") for op, kind in zip(ok.loc[~sized, "op_name"], ok.loc[~sized, "group_kind"])})
    ok = ok[sized]                 # a barrier moves no bytes: it has no place on a log-bytes axis (its row stays)
    if not len(ok):
        return None
    if len(ok) > MAX_POINTS:
        ok = ok.sample(MAX_POINTS, random_state=0)
    fig = make_subplots(rows=1, cols=2, subplot_titles=("latency after the last arrival (ms)", "bus bandwidth (GB/s)"))
    for i, ((op, kind), g) in enumerate(ok.groupby(["op_name", "group_kind"], sort=True)):
        name = esc(f"{op} on {kind}")
        color = PALETTE[i % len(PALETTE)]
        hover = [f"{name} {esc(pg)} #{seq} step {st}" for pg, seq, st in
                 zip(g["process_group"], g["collective_seq_id"], g["step"])]
        fig.add_trace(go.Scattergl(x=g["size_bytes"], y=g["latency_ms"], mode="markers", name=name, legendgroup=name,
                                   marker=dict(color=color, size=5, opacity=0.6), hovertext=hover), 1, 1)
        fig.add_trace(go.Scattergl(x=g["size_bytes"], y=g["busbw_gbs"], mode="markers", name=name, legendgroup=name,
                                   showlegend=False, marker=dict(color=color, size=5, opacity=0.6), hovertext=hover), 1, 2)
    # one labelled tick per decade: plotly's default labels every minor tick of a short log range
    fig.update_xaxes(type="log", dtick=_log_dtick(ok["size_bytes"]), title_text="bytes (nccl-tests size)")
    fig.update_yaxes(type="log", dtick=_log_dtick(ok["latency_ms"]), row=1, col=1)
    title = "Collective latency and bandwidth per instance"
    if zero:
        title += f" (not drawn, no bytes: {', '.join(zero)})"
    return _layout(fig, title, height=460)


def p2p_traffic(trace: Trace) -> pd.DataFrame:
    """(src, dst) -> bytes and count of the job's own point-to-point sends: the clock-sync pings
    (8-byte sends with tag 7 before step 0, runtime/telemetry.py) are not traffic."""
    ops = trace.ops
    send = ops[(ops["kind"] == "p2p") & (ops["peer"] >= 0) & ops["op_name"].isin(SEND_OPS)]
    clock = (send["tag"] == CLOCK_SYNC_TAG) & (send["step"] < 0) & (send["bytes"] <= 8)
    send = send[~clock]
    if not len(send):
        return pd.DataFrame(columns=["src", "dst", "bytes", "count"])
    return (send.assign(src=send["rank"].astype("int64"), dst=send["peer"].astype("int64"))
            .groupby(["src", "dst"], as_index=False).agg(bytes=("bytes", "sum"), count=("bytes", "size")))


def comm_matrix(trace: Trace, perf: PerfResult, max_cells: int = 128) -> go.Figure | None:
    mat = p2p_traffic(trace)
    mat = mat[mat["bytes"] > 0]
    if not len(mat):
        return None      # pure data parallel: no matrix rather than one of clock pings
    n = max(trace.world_size, int(mat[["src", "dst"]].to_numpy().max()) + 1)
    block = max(1, -(-n // max_cells))
    src, dst = mat["src"] // block, mat["dst"] // block
    agg = mat.groupby([src, dst])["bytes"].sum()
    size = -(-n // block)
    z = np.zeros((size, size))
    z[agg.index.get_level_values(0), agg.index.get_level_values(1)] = agg.to_numpy() / 1e6
    axis = np.arange(size) * block
    unit = f" (blocks of {block} ranks)" if block > 1 else ""
    ticks = int_axis(axis, pad=False)
    if block > 1 and ticks.get("tickmode") == "array":
        ticks["ticktext"] = [f"{a}–{min(a + block, n) - 1}" for a in axis]
    fig = go.Figure(go.Heatmap(z=np.where(z > 0, z, np.nan), x=axis, y=axis, colorscale="Blues",
                               zmin=0, zmax=float(z.max()), colorbar=dict(title="MB"),
                               hovertemplate="from %{y} to %{x}: %{z:.3g} MB<extra></extra>"))
    return _layout(fig, f"Point-to-point traffic matrix{unit}", height=520,
                   xaxis=dict(title="receiver rank", **ticks),
                   yaxis=dict(title="sender rank", autorange="reversed", **ticks))


def expert_heatmap(perf: PerfResult, max_steps: int = 300) -> go.Figure | None:
    el = perf.moe.expert_load
    if not len(el):
        return None
    piv = el.pivot_table(index="expert", columns="step", values="load", aggfunc="sum", fill_value=0)
    if piv.shape[1] > max_steps:
        bins = np.arange(piv.shape[1]) * max_steps // piv.shape[1]
        piv = piv.T.groupby(bins).mean().T
    fig = go.Figure(go.Heatmap(z=piv.to_numpy(), x=[str(c) for c in piv.columns], y=piv.index.to_numpy(),
                               colorscale="YlOrRd", colorbar=dict(title="tokens"),
                               hovertemplate="expert %{y}, step %{x}: %{z} tokens<extra></extra>"))
    return _layout(fig, "Expert load (tokens routed per expert per step)", xaxis=dict(title="step", type="category"),
                   yaxis=dict(title="expert", **int_axis(piv.index, pad=False)),
                   height=min(700, max(300, 18 * len(piv) + 150)))


def memory(perf: PerfResult) -> go.Figure | None:
    ps = perf.memory.per_step
    if not len(ps):
        return None
    fig = go.Figure()
    ranks = sorted(ps["rank"].unique())
    if len(ranks) <= MAX_LINES:
        for r in ranks:
            g = ps[ps["rank"] == r]
            fig.add_trace(go.Scattergl(x=g["step"], y=g["memory_bytes"] / 2**30, mode="lines+markers", name=f"rank {r}"))
    else:
        agg = ps.groupby("step")["memory_bytes"].agg(["min", "median", "max"]) / 2**30
        for c in agg.columns:
            fig.add_trace(go.Scatter(x=agg.index, y=agg[c], mode="lines", name=f"{c} over ranks"))
    est = perf.memory.estimate.get("model_state_bytes")
    if est:
        fig.add_hline(y=est / 2**30, line_dash="dash",
                      annotation_text=f"model states {est / 2**30:.2f} GiB (Φ = {perf.memory.n_params:,})")
    return _layout(fig, "Memory per rank per step vs the model-state estimate",
                   xaxis=dict(title="step", **int_axis(ps["step"])), yaxis_title="GiB")


def table_html(df: pd.DataFrame, columns: Iterable[str] | None = None, max_rows: int = 20, floatfmt: str = "{:.3g}") -> str:
    """A small escaped HTML table (pandas escapes cell text; headers are ours)."""
    if df is None or not len(df):
        return "<p class='muted'>nothing to show</p>"
    d = df[list(columns)] if columns else df
    # headers with spaces, so they can wrap: a table must fit its card at 1000 px
    d = d.rename(columns={c: str(c).replace("_", " ") for c in d.columns})
    more = len(d) - max_rows
    out = d.head(max_rows).to_html(index=False, escape=True, border=0, classes="tbl", na_rep="",
                                   float_format=lambda v: floatfmt.format(v))
    return out + (f"<p class='muted'>... {more} more rows</p>" if more > 0 else "")
