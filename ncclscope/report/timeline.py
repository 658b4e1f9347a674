"""The report's timeline: per-rank spans of the last steps, microbatches coloured, bubbles shaded.

How it reads (the legend says each of these):
  * hue = microbatch (one legend entry per hue; with more microbatches than
    hues the entry names every microbatch that shares it);
  * forward solid, backward a lighter tint of the same hue, hatched;
  * communication in a thin lane under the compute: p2p cyan, collectives
    grey (no microbatch hue is grey or cyan, so neither reads as a microbatch);
  * light grey = idle inside the pipeline window (the bubble).
Rows: stage, then rank. The x axis opens on the last healthy steps; when a
long final wait (a hang, a timeout) would squash them, a button shows the
full span.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import plotly.graph_objects as go

from ncclscope.perf.bubbles import pipeline_layout
from ncclscope.perf.performance import PerfResult
from ncclscope.load.trace import Trace
from ncclscope.report.style import MS, esc, layout

# microbatch hues: no red, grey or cyan (those are communication and idle)
MB_PALETTE = ["#4C78A8", "#F58518", "#54A24B", "#B279A2", "#EECA3B", "#9D755D", "#FF9DA6"]
NO_MB_COLOR = "#3d3d8f"   # compute outside any microbatch (a DP step, a hung forward)
P2P_COLOR = "#17becf"
COLLECTIVE_COLOR = "#7a7a7a"
OTHER_COMPUTE = "#c9c9c9"
IDLE_COLOR = "rgba(150,150,150,0.22)"
# (width, offset) in row units: compute above, communication in a thin lane under it
COMPUTE_LANE = (0.55, -0.17)
COMM_LANE = (0.18, -0.42)
HATCH = dict(shape="/", size=6, solidity=0.35, fillmode="overlay")


def tint(hex_color: str, amount: float = 0.5) -> str:
    """hex_color mixed with white (amount 1 = white)."""
    r, g, b = (int(hex_color[i:i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{int(round(c + (255 - c) * amount)):02x}" for c in (r, g, b))


def focus_ranks(trace: Trace, perf: PerfResult, findings: list | None = None, limit: int = 32) -> list[int]:
    """Ranks worth a timeline: the whole pipeline of the first rank a finding names, and the
    other named ranks; without a pipeline, the lowest ranks fill up to 16. Returned in
    display order: stage, then rank (ranks without a stage after, by rank)."""
    named: list[int] = []
    for f in (findings if findings is not None else perf.findings):
        named += [int(r) for r in f.ranks if int(r) not in named]
    named = named[:8]
    lay = pipeline_layout(trace)
    ranks: list[int] = []
    if len(lay):
        pipe_of = dict(zip(lay["rank"], lay["pipeline"]))
        pipe = next((pipe_of[r] for r in named if r in pipe_of), 0)
        ranks = lay[lay["pipeline"] == pipe].sort_values("pp_pos")["rank"].astype(int).tolist()
    fill = [] if ranks else trace.present_ranks[:16]
    for r in named + fill:
        if len(ranks) >= limit:
            break
        if r not in ranks:
            ranks.append(r)
    stage = dict(zip(lay["rank"].astype(int), lay["pp_pos"].astype(int))) if len(lay) else {}
    return sorted(ranks[:limit], key=lambda r: (stage.get(r, 1 << 30), r))


def step_health(sel: pd.DataFrame) -> pd.DataFrame:
    """Per step of the selected ops: start, end, and whether it is healthy (every op ended
    ok, and the step is not over 3x the median step)."""
    g = sel.assign(bad=(sel["end_ns"] < 0) | ~sel["status"].astype(str).isin(["ok", ""]),
                   end=sel["end_ns"].where(sel["end_ns"] >= 0, sel["start_ns"]))
    s = g.groupby("step").agg(start=("start_ns", "min"), end=("end", "max"), bad=("bad", "any"),
                              last_start=("start_ns", "max"))
    dur = s["end"] - s["start"]
    med = dur[~s["bad"]].median() if (~s["bad"]).any() else dur.median()
    s["healthy"] = ~s["bad"] & (dur <= 3 * med)
    return s


def pick_steps(trace: Trace, ranks: list[int], n_healthy: int = 2, n_after: int = 2) -> list[int]:
    """The last n_healthy healthy steps and up to n_after steps after them (a hang, a timeout)."""
    ops = trace.ops
    sel = ops[ops["rank"].isin(ranks) & (ops["step"] >= 0) & (ops["kind"] != "marker")]
    if not len(sel):
        m = trace.metrics
        return [int(s) for s in sorted(m["step"].unique())[-n_healthy:]] if len(m) else []
    h = step_health(sel)
    good = h.index[h["healthy"]]
    if not len(good):
        return [int(s) for s in h.index[-n_healthy:]]
    keep = list(good[-n_healthy:]) + [s for s in h.index if s > good[-1]][:n_after]
    return sorted(int(s) for s in keep)


def timeline(trace: Trace, perf: PerfResult, findings: list | None = None, max_ranks: int = 32,
             n_steps: int = 2) -> go.Figure | None:
    """Per-rank timeline of the last steps: microbatches coloured, comm thin, bubbles shaded."""
    ranks = focus_ranks(trace, perf, findings, max_ranks)
    steps = pick_steps(trace, ranks, n_steps)
    ops = trace.ops
    sel = ops[ops["rank"].isin(ranks) & ops["step"].isin(steps) & (ops["kind"] != "marker")]
    if not len(sel):
        return None
    lay = pipeline_layout(trace)
    pos = dict(zip(lay["rank"].astype(int), lay["pp_pos"].astype(int)))
    label = {r: (f"stage {pos[r]} · rank {r}" if r in pos else f"rank {r}") for r in ranks}
    t0 = int(sel["start_ns"].min())
    done = sel["end_ns"] >= 0
    # an op that never ended is drawn to just past the last completed one (a hang would squash the rest)
    last = int(sel.loc[done, "end_ns"].max()) if done.any() else int(sel["start_ns"].max())
    cap = max(last + (last - t0) // 20, int(sel["start_ns"].max()) + 1)
    end = np.where(done, sel["end_ns"], cap)
    # rows are numbers (top row = highest) labelled by tick text: a label per bar would be most of the JSON
    shown = [r for r in ranks if r in set(sel["rank"].astype(int))]
    row = {r: len(shown) - 1 - i for i, r in enumerate(shown)}
    # int16 / float32 go into the figure JSON as typed arrays, half the size of float64; `base` is
    # written as decimals, so it is rounded to the microsecond
    d = pd.DataFrame({"y": sel["rank"].astype(int).map(row).to_numpy().astype("int16"), "rank": sel["rank"].to_numpy(),
                      "x0": ((sel["start_ns"] - t0) / MS).round(3).to_numpy(),
                      "dur": ((end - sel["start_ns"].to_numpy()) / MS).astype("float32"), "kind": sel["kind"].astype(str).to_numpy(),
                      "name": sel["op_name"].astype(str).to_numpy(), "mb": sel["microbatch"].to_numpy(),
                      "step": sel["step"].to_numpy(), "group": sel["process_group"].astype(str).to_numpy(),
                      "status": sel["status"].astype(str).to_numpy()})
    d["hover"] = [f"{esc(n)}" + (f" mb {m}" if m >= 0 else "") + f" · step {s}" + (f" · {esc(g)}" if g else "")
                  + (f"<br>{du:.2f} ms" if st != "inflight" else "<br>never ended (in flight)")
                  + (f" · {esc(st)}" if st not in ("ok", "", "inflight") else "")
                  for n, m, s, g, du, st in zip(d["name"], d["mb"], d["step"], d["group"], d["dur"], d["status"])]
    fig = go.Figure()
    comp = d[d["kind"] == "compute"]
    fb = comp[comp["name"].isin(["forward", "backward"])]
    _microbatch_traces(fig, fb)
    other = comp[~comp["name"].isin(["forward", "backward"])]
    if len(other):
        fig.add_trace(go.Bar(y=other["y"], x=other["dur"], base=other["x0"], orientation="h", name="other compute",
                             width=COMPUTE_LANE[0], offset=COMPUTE_LANE[1], marker=dict(color=OTHER_COMPUTE, line=dict(width=0)),
                             hovertext=other["hover"], hoverinfo="text", legendrank=300))
    for kind, color in (("p2p", P2P_COLOR), ("collective", COLLECTIVE_COLOR)):
        c = d[d["kind"] == kind]
        if len(c):
            # communication in a lane of its own under the compute (async p2p overlaps compute)
            fig.add_trace(go.Bar(y=c["y"], x=c["dur"], base=c["x0"], orientation="h", name=kind, width=COMM_LANE[0],
                                 offset=COMM_LANE[1], marker=dict(color=color, opacity=0.85, line=dict(width=0)),
                                 hovertext=c["hover"], hoverinfo="text", legendrank=300))
    gaps = _idle_gaps(comp, perf, t0)
    if len(gaps):
        fig.add_trace(go.Bar(y=gaps["y"], x=gaps["dur"], base=gaps["x0"], orientation="h", name="idle (bubble)",
                             width=COMPUTE_LANE[0], offset=COMPUTE_LANE[1], marker=dict(color=IDLE_COLOR, line=dict(width=0)),
                             hovertext=[f"idle {v:.2f} ms" for v in gaps["dur"]], hoverinfo="text",
                             legendrank=300))
    layout(fig, f"Timeline, steps {', '.join(map(str, steps))} ({len(shown)} ranks; hue = microbatch, "
                f"hatched = backward)",
           height=max(360, 40 * len(shown) + 230), barmode="overlay", xaxis_title="ms since the first op shown",
           yaxis=dict(tickmode="array", tickvals=[row[r] for r in shown], ticktext=[esc(label[r]) for r in shown],
                      range=[-0.6, len(shown) - 0.4], zeroline=False, showgrid=False), legend=dict(yref="container", y=0, yanchor="bottom"),
           margin=dict(l=70, r=20, t=65, b=115))
    _zoom(fig, sel, steps, t0, float((d["x0"] + d["dur"]).max()))
    return fig


def _microbatch_traces(fig: go.Figure, fb: pd.DataFrame) -> None:
    """One trace per (hue, phase): forward solid, backward tinted and hatched; a legend entry per hue
    (named by its microbatches) and one per phase."""
    if not len(fb):
        return
    mbs = sorted(int(m) for m in fb["mb"].unique())
    hue = {m: (m % len(MB_PALETTE) if m >= 0 else -1) for m in mbs}
    for h in sorted(set(hue.values())):
        members = [m for m in mbs if hue[m] == h]
        color = MB_PALETTE[h] if h >= 0 else NO_MB_COLOR
        name = ("no microbatch" if h < 0 else
                "mb " + ", ".join(map(str, members[:4])) + (", ..." if len(members) > 4 else ""))
        for i, (phase, solid) in enumerate((("forward", True), ("backward", False))):
            c = fb[(fb["name"] == phase) & fb["mb"].isin(members)]
            if not len(c):
                continue
            marker = dict(color=color, line=dict(width=0)) if solid else dict(
                color=tint(color, 0.55), line=dict(width=0), pattern=dict(HATCH, fgcolor=color))
            fig.add_trace(go.Bar(y=c["y"], x=c["dur"], base=c["x0"], orientation="h", name=name, width=COMPUTE_LANE[0],
                                 offset=COMPUTE_LANE[1], marker=marker, hovertext=c["hover"], hoverinfo="text",
                                 legendgroup=f"mb{h}", showlegend=False, legendrank=100 + h))
        # the legend entry: a plain swatch of the hue (clicking it toggles both phases)
        fig.add_trace(go.Bar(y=[None], x=[None], orientation="h", name=name, legendgroup=f"mb{h}",
                             marker=dict(color=color), legendrank=100 + h, hoverinfo="skip"))
    phases = set(fb["name"])
    for phase, solid in (("forward", True), ("backward", False)):
        if phase in phases:
            base = MB_PALETTE[0]
            marker = dict(color=base, line=dict(width=0)) if solid else dict(
                color=tint(base, 0.55), line=dict(width=0), pattern=dict(HATCH, fgcolor=base))
            fig.add_trace(go.Bar(y=[None], x=[None], orientation="h", name=f"{phase} ({'solid' if solid else 'hatched'})",
                                 marker=marker, legendrank=200, hoverinfo="skip"))


def _zoom(fig: go.Figure, sel: pd.DataFrame, steps: list[int], t0: int, full_end: float) -> None:
    """Open on the healthy steps (plus where the later ops began) when a long final wait would
    squash them; buttons switch between that and the full span."""
    h = step_health(sel)
    good = h[h["healthy"]]
    if not len(good):
        return
    end_ns = max(int(good["end"].max()), int(h["last_start"].max()))
    span = (end_ns - t0) / MS
    right = span * 1.06
    if right >= 0.8 * full_end:
        return
    fig.update_layout(
        xaxis_range=[-0.01 * right, right], margin_t=95,   # room for the buttons under the title
        updatemenus=[dict(type="buttons", direction="right", showactive=True, active=0, x=1, xanchor="right",
                          y=1.01, yanchor="bottom", pad=dict(r=0, t=0, b=0), font=dict(size=11), buttons=[
                              dict(label="healthy steps", method="relayout",
                                   args=[{"xaxis.range": [-0.01 * right, right]}]),
                              dict(label="full span", method="relayout", args=[{"xaxis.autorange": True}])])])


def _idle_gaps(comp: pd.DataFrame, perf: PerfResult, t0: int) -> pd.DataFrame:
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
    return g.dropna().astype({"dur": "float32"}).round({"x0": 3})
