"""Plotly figures for the HTML report, built only from what the analyses return.

Why a separate module: the figures decide how much of a 1,024-rank run a
browser can take. Every function here bounds its output (ranks sampled or
binned, points capped, WebGL scatter for point clouds), so the report stays
usable and under its size budget whatever the trace holds.

Every string that came from a trace (op names, group names, messages) goes
through `esc` before it reaches a label, a hover text or a title: Plotly
renders a subset of HTML in those, and a trace is untrusted input.
"""
from __future__ import annotations

import html
from typing import Any, Iterable

import numpy as np
import pandas as pd
import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..analysis.bubbles import pipeline_layout
from ..analysis.comm_stats import p2p_matrix
from ..analysis.performance import PerfResult
from ..trace import Trace

MS = 1e6
TEMPLATE = "plotly_white"
MAX_LINES = 16          # ranks drawn as individual lines; above this, aggregate
MAX_POINTS = 20_000     # scatter points per figure
MAX_BINS = 200          # time bins for heat maps
PALETTE = ["#4C78A8", "#F58518", "#54A24B", "#E45756", "#72B7B2", "#EECA3B", "#B279A2", "#FF9DA6", "#9D755D",
           "#BAB0AC"]


def esc(value: Any) -> str:
    """html.escape for anything from a trace (quote=True: also safe inside attributes)."""
    return html.escape(str(value), quote=True)


def _layout(fig: go.Figure, title: str, height: int = 420, **kw: Any) -> go.Figure:
    fig.update_layout(template=TEMPLATE, title=dict(text=esc(title), x=0.01), height=height,
                      margin=dict(l=70, r=20, t=50, b=50), legend=dict(orientation="h", y=-0.18), **kw)
    return fig


def _focus_ranks(trace: Trace, perf: PerfResult, findings: list | None = None, limit: int = 32) -> list[int]:
    """Ranks worth a timeline: the ranks findings name (hang findings first, as given), and
    the whole pipeline of the first of them; without a pipeline, the lowest ranks fill up to 16."""
    named: list[int] = []
    for f in (findings if findings is not None else perf.findings):
        named += [int(r) for r in f.ranks if int(r) not in named]
    named = named[:8]
    layout = pipeline_layout(trace)
    ranks: list[int] = []
    if len(layout):
        pipe_of = dict(zip(layout["rank"], layout["pipeline"]))
        pipe = next((pipe_of[r] for r in named if r in pipe_of), 0)
        ranks = layout[layout["pipeline"] == pipe].sort_values("pp_pos")["rank"].astype(int).tolist()
    fill = [] if ranks else trace.present_ranks[:16]
    for r in named + fill:
        if len(ranks) >= limit:
            break
        if r not in ranks:
            ranks.append(r)
    return ranks[:limit]


def _focus_steps(trace: Trace, perf: PerfResult, n: int = 2) -> list[int]:
    if len(perf.bubbles.steps):
        steps = sorted(perf.bubbles.steps["step"].unique())
    else:
        m = trace.metrics
        steps = sorted(m["step"].unique()) if len(m) else sorted(trace.ops.loc[trace.ops["step"] >= 0, "step"].unique())
    return [int(s) for s in steps[-n:]]


def timeline(trace: Trace, perf: PerfResult, findings: list | None = None, max_ranks: int = 32,
             n_steps: int = 2) -> go.Figure | None:
    """Per-rank timeline of the last steps: microbatches coloured, comm thin, bubbles shaded."""
    ranks = _focus_ranks(trace, perf, findings, max_ranks)
    steps = _focus_steps(trace, perf, n_steps)
    ops = trace.ops
    sel = ops[ops["rank"].isin(ranks) & ops["step"].isin(steps) & (ops["kind"] != "marker")]
    if not len(sel):
        return None
    lay = pipeline_layout(trace)
    pos = dict(zip(lay["rank"], lay["pp_pos"]))
    label = {r: f"rank {r}" + (f" · stage {pos[r]}" if r in pos else "") for r in ranks}
    t0 = int(sel["start_ns"].min())
    done = sel["end_ns"] >= 0
    # an op that never ended is drawn to just past the last completed one (a hang would squash the rest)
    last = int(sel.loc[done, "end_ns"].max()) if done.any() else int(sel["start_ns"].max())
    cap = max(last + (last - t0) // 20, int(sel["start_ns"].max()) + 1)
    end = np.where(done, sel["end_ns"], cap)
    d = pd.DataFrame({"y": sel["rank"].map(label), "rank": sel["rank"].to_numpy(), "x0": (sel["start_ns"] - t0) / MS,
                      "dur": (end - sel["start_ns"].to_numpy()) / MS, "kind": sel["kind"].astype(str).to_numpy(),
                      "name": sel["op_name"].astype(str).to_numpy(), "mb": sel["microbatch"].to_numpy(),
                      "step": sel["step"].to_numpy(), "group": sel["process_group"].astype(str).to_numpy(),
                      "status": sel["status"].astype(str).to_numpy()})
    d["hover"] = [f"{esc(n)}" + (f" mb {m}" if m >= 0 else "") + f" · step {s}" + (f" · {esc(g)}" if g else "")
                  + (f"<br>{du:.2f} ms" if st != "inflight" else "<br>never ended (in flight)")
                  + (f" · {esc(st)}" if st not in ("ok", "", "inflight") else "")
                  for n, m, s, g, du, st in zip(d["name"], d["mb"], d["step"], d["group"], d["dur"], d["status"])]
    fig = go.Figure()
    comp = d[d["kind"] == "compute"]
    for nm, opacity in (("forward", 1.0), ("backward", 0.65)):
        c = comp[comp["name"] == nm]
        if len(c):
            colors = [PALETTE[m % len(PALETTE)] if m >= 0 else "#888" for m in c["mb"]]
            fig.add_trace(go.Bar(y=c["y"], x=c["dur"], base=c["x0"], orientation="h", name=nm, width=0.55,
                                 offset=-0.38,
                                 marker=dict(color=colors, opacity=opacity, line=dict(width=0)),
                                 hovertext=c["hover"], hoverinfo="text"))
    other = comp[~comp["name"].isin(["forward", "backward"])]
    if len(other):
        fig.add_trace(go.Bar(y=other["y"], x=other["dur"], base=other["x0"], orientation="h", name="other compute",
                             width=0.55, offset=-0.38, marker_color="#555", hovertext=other["hover"], hoverinfo="text"))
    for kind, color in (("p2p", "#17becf"), ("collective", "#d62728")):
        c = d[d["kind"] == kind]
        if len(c):
            # communication in a lane of its own under the compute (async p2p overlaps compute)
            fig.add_trace(go.Bar(y=c["y"], x=c["dur"], base=c["x0"], orientation="h", name=kind, width=0.2,
                                 offset=0.2, marker=dict(color=color, opacity=0.6, line=dict(width=0)), hovertext=c["hover"], hoverinfo="text"))
    gaps = _idle_gaps(comp, perf, t0, label)
    if len(gaps):
        fig.add_trace(go.Bar(y=gaps["y"], x=gaps["dur"], base=gaps["x0"], orientation="h", name="idle (bubble)",
                             width=0.6, offset=-0.4, marker=dict(color="rgba(120,120,120,0.25)", line=dict(width=0)),
                             hovertext=[f"idle {v:.2f} ms" for v in gaps["dur"]], hoverinfo="text"))
    order = [label[r] for r in ranks if label[r] in set(d["y"])]
    _layout(fig, f"Timeline, steps {', '.join(map(str, steps))} ({len(order)} ranks; colour = microbatch)",
            height=max(300, 28 * len(order) + 140), barmode="overlay",
            xaxis_title="ms since the first op shown",
            yaxis=dict(categoryorder="array", categoryarray=order[::-1]))
    return fig


def _idle_gaps(comp: pd.DataFrame, perf: PerfResult, t0: int, label: dict[int, str]) -> pd.DataFrame:
    """Gaps between consecutive compute spans of a rank within its step (bounded: shown ranks only)."""
    fb = comp[comp["name"].isin(["forward", "backward"])].sort_values(["rank", "step", "x0"])
    if not len(fb):
        return pd.DataFrame(columns=["y", "x0", "dur"])
    end = fb["x0"] + fb["dur"]
    prev_end = end.groupby([fb["rank"], fb["step"]]).shift(1)
    gap = fb["x0"] - prev_end
    g = pd.DataFrame({"y": fb["y"], "x0": prev_end, "dur": gap})[gap > 0]
    ss = perf.bubbles.stage_step
    if len(ss):   # leading and trailing idle inside the pipeline window
        first = fb.groupby(["rank", "step"]).agg(a=("x0", "min"), y=("y", "first"))
        last = fb.assign(e=end).groupby(["rank", "step"])["e"].max()
        w = ss.set_index(["rank", "step"])[["window_start_ns", "window_ns"]]
        w = w.reindex(first.index)
        ws = (w["window_start_ns"] - t0) / MS
        we = ws + w["window_ns"] / MS
        lead = pd.DataFrame({"y": first["y"], "x0": ws, "dur": first["a"] - ws})
        trail = pd.DataFrame({"y": first["y"], "x0": last, "dur": we - last})
        g = pd.concat([g, lead[lead["dur"] > 0], trail[trail["dur"] > 0]])
    return g.dropna()


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
        fig.add_hline(y=100 * b.theory, line_dash="dash", line_color="black",
                      annotation_text=f"theory {100 * b.theory:.1f}% ({esc(b.schedule)}, p={b.p}, m={b.m}"
                                      + (f", v={b.v}" if b.v > 1 else "") + ")")
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
                   height=min(900, max(320, 3 * len(piv) + 150)), xaxis_title="step", yaxis_title="rank")


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
                   yaxis_title="%" if len(ranks) <= MAX_LINES else "rank")


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
    return _layout(fig, f"Gradient norm per rank per step ({col})", xaxis_title="step", yaxis_title="norm")


def collectives(perf: PerfResult) -> go.Figure | None:
    inst = perf.comm.instances
    if not len(inst) or "latency_ms" not in inst or not inst["latency_ms"].notna().any():
        return None
    ok = inst[inst["latency_ms"].notna()]
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
    fig.update_xaxes(type="log", title_text="bytes (nccl-tests size)")
    fig.update_yaxes(type="log", row=1, col=1)
    return _layout(fig, "Collective latency and bandwidth per instance", height=460)


def comm_matrix(trace: Trace, perf: PerfResult, max_cells: int = 128) -> go.Figure | None:
    mat = p2p_matrix(perf.comm.p2p)
    if not len(mat):
        return None
    n = trace.world_size
    block = max(1, -(-n // max_cells))
    src, dst = mat["src"] // block, mat["dst"] // block
    agg = mat.groupby([src, dst])["bytes"].sum()
    size = -(-n // block)
    z = np.zeros((size, size))
    z[agg.index.get_level_values(0), agg.index.get_level_values(1)] = agg.to_numpy() / 1e6
    axis = np.arange(size) * block
    unit = f" (blocks of {block} ranks)" if block > 1 else ""
    fig = go.Figure(go.Heatmap(z=np.where(z > 0, z, np.nan), x=axis, y=axis, colorscale="Blues",
                               colorbar=dict(title="MB"),
                               hovertemplate="from %{y} to %{x}: %{z:.1f} MB<extra></extra>"))
    return _layout(fig, f"Point-to-point traffic matrix{unit}", height=520, xaxis_title="receiver rank",
                   yaxis_title="sender rank", yaxis_autorange="reversed")


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
    return _layout(fig, "Expert load (tokens routed per expert per step)", xaxis_title="step", yaxis_title="expert",
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
    return _layout(fig, "Memory per rank per step vs the model-state estimate", xaxis_title="step", yaxis_title="GiB")


def table_html(df: pd.DataFrame, columns: Iterable[str] | None = None, max_rows: int = 20, floatfmt: str = "{:.3g}") -> str:
    """A small escaped HTML table (pandas escapes cell text; headers are ours)."""
    if df is None or not len(df):
        return "<p class='muted'>nothing to show</p>"
    d = df[list(columns)] if columns else df
    more = len(d) - max_rows
    out = d.head(max_rows).to_html(index=False, escape=True, border=0, classes="tbl", na_rep="",
                                   float_format=lambda v: floatfmt.format(v))
    return out + (f"<p class='muted'>... {more} more rows</p>" if more > 0 else "")
