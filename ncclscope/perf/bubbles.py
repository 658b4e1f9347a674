"""Pipeline bubbles: where each pipeline stage idles in a step, and why.

Why: a pipeline-parallel job that is "slow but not hung" usually loses its
time in bubbles. The textbook says GPipe and 1F1B idle (p-1)/(m+p-1) of a
step and interleaved 1F1B (p-1)/(v*m+p-1); real runs idle more, and the fix
depends on *why*: more microbatches (warm-up/cool-down), moving layers
between stages (imbalance), or the interconnect (communication stall).

Model. Per pipeline (one `pp` process group) and step, the window W runs from
the first forward to the last backward on any of its stages (the optimizer
and the data-parallel reduction after it are not pipeline time, as in the
textbook formula). For each stage: compute C_s = its forward+backward time,
idle I_s = W - C_s, exposed communication = time in p2p/collective ops not
overlapped by compute. The idle time is split exactly into three parts by
replaying the step's observed action order with zero communication cost
(a critical-path computation over the F/B dependency graph):

- warm-up/cool-down: idle of the replay where every stage takes the mean
  forward and mean backward time (T_uniform - mean C). This equals the
  textbook (p-1)/(m+p-1) share of the step for GPipe/1F1B.
- imbalance: extra idle of the replay with each action's measured duration
  (T_replay - C_s - warm-up): waiting on a slower stage.
- communication stall: the rest, W - T_replay: time that a free interconnect
  (and no host overhead between ops) would have saved.

The summary skips the first step when at least three steps completed: it
carries one-time costs (allocator warm-up, lazy init) that are not bubbles.

Whether the result is worth a warning, against which baseline, is
`bubble_findings.py`; the replay is `bubble_replay.py`; the result type
`bubble_result.py`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ncclscope.load.trace import Trace
from ncclscope.perf.bubble_findings import judge_bubbles, median_p2p_latency_ns
from ncclscope.perf.bubble_replay import replay_makespans
from ncclscope.perf.bubble_result import BubbleResult
from ncclscope.index.views import release_heap

FB = ("forward", "backward")
COMM_KINDS = ("p2p", "collective")


def theoretical_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Textbook idle fraction of a step: the one definition in ncclscope.schedules
    (pure Python, shared with the runtime); the fallback, for names or counts it
    refuses, is the same two formulas."""
    try:
        from ncclscope.schedules import theoretical_bubble as rt
        return float(rt(schedule, int(p), int(m), int(v)))
    except (ImportError, ValueError):
        if p < 1 or m < 1:
            return float("nan")
        vv = v if schedule == "interleaved" else 1
        return (p - 1) / (vv * m + p - 1)


def _robust_stage_load(nodes: pd.DataFrame) -> pd.Series:
    """Compute per step per pipeline position: spans per step x the median span (forward and backward
    apart). Uneven stages make every span of a stage longer; one descheduling of a rank on shared cores
    makes one span longer, which moves a mean over a few steps but not the median of all its spans."""
    g = nodes.groupby(["pp_pos", "is_b"], sort=True)
    per = g["dur"].median() * g.size() / g["wkey"].nunique()
    return per.groupby(level="pp_pos").sum().astype(np.float64)


def union_length(key: np.ndarray, start: np.ndarray, end: np.ndarray, n_keys: int | None = None) -> np.ndarray:
    """Total length of the union of intervals per dense integer key (vectorised sweep).

    Intervals sorted by (key, start); each contributes only the part past the
    running maximum of the ends before it. Keys are laid end to end on one
    axis (key * span + time) so a single `maximum.accumulate` serves all of
    them; a per-key pandas cummax is the fallback when that would overflow."""
    n_keys = int(key.max()) + 1 if n_keys is None and len(key) else (n_keys or 0)
    if not len(key):
        return np.zeros(n_keys)
    key = key.astype(np.int64, copy=False)
    if len(key) > UNION_BLOCK:
        return _union_blocks(key, start, end, n_keys)
    return _union_core(key, start, end, n_keys)


def _union_core(key: np.ndarray, start: np.ndarray, end: np.ndarray, n_keys: int) -> np.ndarray:
    """union_length of one block (int64 keys, at least one interval)."""
    base = int(start.min())
    span = int(end.max()) - base + 1
    if n_keys * span < 2**62:
        # in place where it can be: on 5 M intervals every full-length temporary is 40 MB
        off = key * span
        off -= base
        ss = start.astype(np.int64)
        ss += off
        ee = end.astype(np.int64)
        ee += off
        del off
        order = np.argsort(ss, kind="stable")   # one int64 key; input is mostly sorted already
        ss = ss[order]
        ee = ee[order]
        k = key[order]
        del order
        run = np.maximum.accumulate(ee)
        # each interval contributes what lies past the running maximum of the ends before it
        np.maximum(ss[1:], run[:-1], out=ss[1:])
        del run
        ee -= ss
        del ss
        contrib = np.clip(ee, 0, None, out=ee)
    else:
        order = np.lexsort((start, key))
        k, s, e = key[order], start[order].astype(np.int64), end[order].astype(np.int64)
        run = pd.Series(e).groupby(k).cummax().to_numpy()
        prev = pd.Series(run).groupby(k).shift(1).fillna(np.iinfo(np.int64).min).to_numpy(dtype=np.int64)
        contrib = np.clip(e - np.maximum(s, prev), 0, None)
    return np.bincount(k, weights=contrib.astype(np.float64), minlength=n_keys)


UNION_BLOCK = 1 << 20      # intervals per pass of union_length: its temporaries are ~10 arrays this long


def _union_blocks(key: np.ndarray, start: np.ndarray, end: np.ndarray, n_keys: int) -> np.ndarray:
    """union_length over blocks of consecutive keys, ~UNION_BLOCK intervals each. Keys never interact (each
    one's intervals are swept on their own), and each block keeps the input order of its rows, so every
    key's contributions are the same numbers summed in the same order: the result is the same, bit for bit,
    with a tenth of the temporaries on 10 M intervals."""
    counts = np.bincount(key, minlength=n_keys)
    edges = np.searchsorted(np.cumsum(counts), np.arange(UNION_BLOCK, len(key), UNION_BLOCK), side="right")
    bounds = np.unique(np.concatenate([[0], edges, [n_keys]]))
    out = np.zeros(n_keys)
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        rows = np.flatnonzero((key >= lo) & (key < hi))
        if len(rows):
            out += _union_core(key[rows], start[rows], end[rows], n_keys)
    return out


def pipeline_layout(trace: Trace) -> pd.DataFrame:
    """rank -> (pipeline, pp_pos, p): one row per rank in a pp group of size > 1.

    A pipeline is one `pp` process group; stage position is the member's pp
    coordinate when known, else its position in the member list (Megatron
    order: pp varies slowest, so rank order is stage order)."""
    from ncclscope.perf.stragglers import group_table
    g = group_table(trace)
    cols = ["rank", "pipeline", "pp_pos", "p"]
    g = g[(g["group_kind"] == "pp") & (g["size"] > 1)]
    rows = []
    for pipe, ranks in enumerate(sorted(g["members"], key=lambda rs: rs[0])):
        keyed = sorted(ranks, key=lambda r: (trace.ranks[r].coords.get("pp", ranks.index(r))
                                             if r in trace.ranks else ranks.index(r), r))
        rows.extend((r, pipe, pos, len(ranks)) for pos, r in enumerate(keyed))
    out = pd.DataFrame(rows, columns=cols, dtype="int64")
    return out.drop_duplicates("rank")


def _config(trace: Trace, spans: pd.DataFrame, p: int) -> tuple[str, int, int]:
    cfg = trace.run.config
    schedule = str(cfg.get("schedule") or "1f1b")
    n_stages = int(spans["stage"].max()) + 1 if len(spans) else p
    v = int(cfg.get("vpp") or max(1, n_stages // max(p, 1)))
    per = spans.groupby(["rank", "step", "stage"], observed=True)["microbatch"].nunique()
    m = int(cfg.get("microbatches") or (per.max() if len(per) else 0))
    return schedule, m, v


def analyze_bubbles(trace: Trace) -> BubbleResult:
    """Per pipeline and step, each stage's idle time split into warm-up/cool-down, imbalance and
    communication stall (see the module docstring); the findings are judged in bubble_findings.py."""
    layout = pipeline_layout(trace)
    if not len(layout):
        return BubbleResult()
    ops = trace.ops
    p = int(layout["p"].max())
    pipe_of, pos_of = _rank_lookups(layout, ops)
    # the ops' own columns, not int64 copies (2 x 40 MB at 10 M events): products that could pass 2**31
    # (rank x steps) are taken in int64 below
    in_pipe = (pipe_of[ops["rank"].to_numpy()] >= 0) & (ops["step"].to_numpy() >= 0)
    spans = _fb_spans(ops, in_pipe, pipe_of, pos_of)
    schedule, m, v = _config(trace, spans, p)
    res = BubbleResult(schedule=schedule, p=p, m=m, v=v, theory=theoretical_bubble(schedule, p, max(m, 1), v))
    if not len(spans):
        return res
    win = _step_windows(spans, p, int(layout["pipeline"].max()) + 1)
    if win is None:
        return res
    spans = spans[win.w0[spans["wkey"].to_numpy()] >= 0].reset_index(drop=True)
    spans["dur"] = spans["end_ns"] - spans["start_ns"]
    ss = _stage_step(trace, layout, spans, win, in_pipe, pipe_of)
    steps, slowest, stage_load = _replays(spans, ss, win, p)
    ss, steps = _split_idle(ss, steps, res.theory)
    sel, summary_steps = _summarise(res, ss, steps, spans)
    # the F/B spans (~300 MB at 10 M events, with the replay's nodes freed on return) go before the p2p
    # latencies are matched: else both are resident at once, the analysis' peak
    del spans, in_pipe
    release_heap(trace)
    res.p2p_latency_ns = median_p2p_latency_ns(trace)
    res.findings = judge_bubbles(trace, res, sel, steps[steps["step"].isin(summary_steps)], slowest, stage_load)
    return res


def _rank_lookups(layout: pd.DataFrame, ops: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(pipeline of each rank, its stage position), -1 for ranks in no pipeline; indexed by rank."""
    n_rank = int(max(layout["rank"].max(), ops["rank"].max() if len(ops) else 0)) + 1
    pipe_of = np.full(n_rank, -1, dtype=np.int64)
    pos_of = np.full(n_rank, -1, dtype=np.int64)
    pipe_of[layout["rank"].to_numpy()] = layout["pipeline"].to_numpy()
    pos_of[layout["rank"].to_numpy()] = layout["pp_pos"].to_numpy()
    return pipe_of, pos_of


def _fb_spans(ops: pd.DataFrame, in_pipe: np.ndarray, pipe_of: np.ndarray, pos_of: np.ndarray) -> pd.DataFrame:
    """The forward and backward compute spans of the pipelines' ranks in training steps, with is_b,
    pipeline and pp_pos."""
    fb = (ops["kind"] == "compute").to_numpy() & ops["op_name"].isin(FB).to_numpy() & in_pipe
    spans = pd.DataFrame({c: ops[c].to_numpy()[fb] for c in ("rank", "step", "microbatch", "stage", "start_ns",
                                                              "end_ns")})
    spans["is_b"] = (ops["op_name"] == "backward").to_numpy()[fb].astype(np.int64)
    spans["rank"] = spans["rank"].astype(np.int64)
    spans["pipeline"], spans["pp_pos"] = pipe_of[spans["rank"]], pos_of[spans["rank"]]
    return spans


@dataclass
class _Windows:
    """The analysed windows, one per (pipeline, step) whose forwards and backwards all ended on all p
    stages (a step with an unfinished F/B is a hang, not a bubble). A window's key `wkey` is
    pipeline * n_st + the index of its step in `steps`."""

    steps: np.ndarray          # every step with an F/B span, sorted
    table: pd.DataFrame        # per analysed wkey (the index): w0, w1, inflight, ranks
    w0: np.ndarray             # per wkey: first F/B start, -1 where not analysed
    w1: np.ndarray             # per wkey: last F/B end

    @property
    def n_st(self) -> int:
        return len(self.steps)


def _step_windows(spans: pd.DataFrame, p: int, n_pipes: int) -> _Windows | None:
    """The windows from the first forward to the last backward on any stage; adds `wkey` to `spans`.
    None when no window is complete."""
    steps_u = np.unique(spans["step"].to_numpy())
    n_st = len(steps_u)
    spans["wkey"] = spans["pipeline"] * n_st + np.searchsorted(steps_u, spans["step"])
    g = spans.groupby("wkey")
    win = pd.DataFrame({"w0": g["start_ns"].min(), "w1": g["end_ns"].max(), "inflight": (spans["end_ns"] < 0).groupby(spans["wkey"]).sum(),
                        "ranks": g["rank"].nunique()})
    del g                      # it holds every F/B span: the caller's filtered copy replaces them
    win = win[(win["inflight"] == 0) & (win["ranks"] == p)]
    if not len(win):
        return None
    n_w = n_st * n_pipes
    w0 = np.full(n_w, -1, dtype=np.int64)
    w1 = np.full(n_w, -1, dtype=np.int64)
    w0[win.index.to_numpy()], w1[win.index.to_numpy()] = win["w0"].to_numpy(), win["w1"].to_numpy()
    return _Windows(steps_u, win, w0, w1)


def _stage_step(trace: Trace, layout: pd.DataFrame, spans: pd.DataFrame, win: _Windows, in_pipe: np.ndarray,
                pipe_of: np.ndarray) -> pd.DataFrame:
    """Per pipeline, step and stage: window, compute, forward, backward, exposed communication, idle,
    p2p ops and bubble (dense key rank * n_st + step index)."""
    n_st, steps_u = win.n_st, win.steps
    n_rs = len(pipe_of) * n_st
    rs_key = spans["rank"].to_numpy() * n_st + np.searchsorted(steps_u, spans["step"].to_numpy())
    dur = spans["dur"].to_numpy().astype(np.float64)
    compute = np.bincount(rs_key, weights=dur, minlength=n_rs)
    backward = np.bincount(rs_key, weights=dur * spans["is_b"].to_numpy(), minlength=n_rs)
    del dur
    u_all, u_cmp = _busy_union(trace, spans, rs_key, win, in_pipe, pipe_of)
    del rs_key
    wk = win.table.index.to_numpy()
    ss = pd.DataFrame({"pipeline": wk // n_st, "step": steps_u[wk % n_st], "window_start_ns": win.table["w0"].to_numpy(),
                       "window_ns": (win.table["w1"] - win.table["w0"]).to_numpy()})
    ss = ss.merge(layout, on="pipeline").sort_values(["pipeline", "step", "pp_pos"]).reset_index(drop=True)
    k = ss["rank"].to_numpy() * n_st + np.searchsorted(steps_u, ss["step"].to_numpy())
    ss["compute_ns"], ss["backward_ns"] = compute[k], backward[k]
    ss["forward_ns"] = ss["compute_ns"] - ss["backward_ns"]
    ss["comm_ns"] = np.clip(u_all[k] - u_cmp[k], 0, None)
    ss["idle_ns"] = (ss["window_ns"] - ss["compute_ns"]).clip(lower=0)
    # the comm-stall baseline: each p2p op this stage issued, at the run's own median p2p latency
    ops = trace.ops
    o_rank, o_step = ops["rank"].to_numpy(), ops["step"].to_numpy()
    pm = (ops["kind"] == "p2p").to_numpy() & in_pipe
    n_p2p = pd.Series(1, index=pd.MultiIndex.from_arrays([o_rank[pm].astype(np.int64),
                                                          o_step[pm].astype(np.int64)])).groupby(level=[0, 1]).size()
    ss["p2p_ops"] = n_p2p.reindex(pd.MultiIndex.from_arrays([ss["rank"].to_numpy(dtype=np.int64),
                                                             ss["step"].to_numpy(dtype=np.int64)])).fillna(0).to_numpy()
    ss["bubble"] = ss["idle_ns"] / ss["window_ns"].where(ss["window_ns"] > 0)
    return ss


def _busy_union(trace: Trace, spans: pd.DataFrame, rs_key: np.ndarray, win: _Windows, in_pipe: np.ndarray,
                pipe_of: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(union of compute and communication, union of compute) per dense (rank, step index) key: their
    difference is the exposed communication. Comm ops are clipped to their window; rows are picked once
    (4 M of them at 10 M events: every full-length temporary here is ~30 MB, so none outlives its use)."""
    ops = trace.ops
    n_st, steps_u, w0, w1 = win.n_st, win.steps, win.w0, win.w1
    n_rs = len(pipe_of) * n_st
    o_rank, o_step = ops["rank"].to_numpy(), ops["step"].to_numpy()
    start_all, end_all = ops["start_ns"].to_numpy(), ops["end_ns"].to_numpy()
    rows = np.flatnonzero(ops["kind"].isin(COMM_KINDS).to_numpy() & in_pipe & (end_all >= 0))
    if len(ops) < 2**31:       # row numbers and step indices in int32: half of each of these 4 M-row arrays
        rows = rows.astype(np.int32)
    # step -> its index in steps_u (-1: a step with no F/B span), by table lookup (steps are small ints >= 0)
    step_lut = np.full(int(o_step.max()) + 1, -1, dtype=np.int32 if n_st < 2**31 else np.int64)
    step_lut[steps_u] = np.arange(n_st)
    c_si = step_lut[o_step[rows]]
    sel = np.flatnonzero(c_si >= 0)
    rows, c_si = rows[sel], c_si[sel]
    c_rank = o_rank[rows]
    c_w = pipe_of[c_rank] * n_st + c_si
    sel = np.flatnonzero(w0[c_w] >= 0)
    rows, c_w = rows[sel], c_w[sel]
    c_key = c_rank[sel].astype(np.int64) * n_st + c_si[sel]
    del c_rank, c_si, sel
    c_s = np.maximum(start_all[rows], w0[c_w])
    c_e = np.minimum(end_all[rows], w1[c_w])
    del rows, c_w
    keep = c_e > c_s
    # each comm column goes as soon as it is joined to the spans' (three fewer full-length arrays at the sweep)
    u_key = np.concatenate([c_key[keep], rs_key])
    del c_key
    u_s = np.concatenate([c_s[keep], spans["start_ns"].to_numpy()])
    del c_s
    u_e = np.concatenate([c_e[keep], spans["end_ns"].to_numpy()])
    del c_e, keep
    u_all = union_length(u_key, u_s, u_e, n_rs)
    del u_key, u_s, u_e
    release_heap(trace)     # the sweep's freed heap, before the replay's arrays (index.release_heap says why)
    u_cmp = union_length(rs_key, spans["start_ns"].to_numpy(), spans["end_ns"].to_numpy(), n_rs)
    return u_all, u_cmp


def _replays(spans: pd.DataFrame, ss: pd.DataFrame, win: _Windows, p: int) -> tuple[pd.DataFrame, int, pd.Series]:
    """(per pipeline and step: window, the three replays' makespans and the saving of fixing the slowest
    stage; the slowest stage position; the load per stage position). Replays: measured durations, uniform
    (mean F / mean B), slowest stage at the median stage's speed."""
    n_st, steps_u = win.n_st, win.steps
    nodes = spans[spans["microbatch"] >= 0]
    nodes = nodes.groupby(["wkey", "rank", "pp_pos", "stage", "is_b", "microbatch"], as_index=False, sort=False).agg(
        start_ns=("start_ns", "min"), dur=("dur", "sum"))
    nodes = nodes.sort_values(["wkey", "rank", "start_ns"], kind="stable").reset_index(drop=True)
    nodes["sim"] = nodes.groupby("wkey", sort=True).ngroup()
    mean_fb = nodes.groupby(["sim", "is_b"])["dur"].transform("mean").to_numpy()
    stage_load = _robust_stage_load(nodes) if len(nodes) else ss.groupby("pp_pos")["compute_ns"].mean()
    slowest = int(stage_load.idxmax())
    pos_mean = nodes.groupby(["sim", "pp_pos", "is_b"])["dur"].mean()
    med = pos_mean.groupby(level=["sim", "is_b"]).median()
    med_d = med.reindex(pd.MultiIndex.from_arrays([nodes["sim"], nodes["is_b"]])).to_numpy()
    fixed = np.where(nodes["pp_pos"].to_numpy() == slowest, med_d, nodes["dur"].to_numpy())
    n_stages = int(nodes["stage"].max()) + 1 if len(nodes) else p
    durs = np.column_stack([nodes["dur"].to_numpy(), mean_fb, fixed]).astype(np.float64)
    del mean_fb, med_d, fixed
    makespans = replay_makespans(nodes, durs, n_stages) if len(nodes) else np.zeros((0, 3))
    del durs
    sim_w = nodes.drop_duplicates("sim").sort_values("sim")["wkey"].to_numpy()
    sims = pd.DataFrame({"pipeline": sim_w // n_st, "step": steps_u[sim_w % n_st], "replay_ns": makespans[:, 0],
                         "uniform_ns": makespans[:, 1], "fixed_ns": makespans[:, 2],
                         "sim_compute_ns": nodes.groupby("sim")["dur"].sum().to_numpy() / p})
    steps = ss.drop_duplicates(["pipeline", "step"])[["pipeline", "step", "window_start_ns", "window_ns"]]
    steps = steps.merge(sims, on=["pipeline", "step"], how="left")
    return steps, slowest, stage_load


def _split_idle(ss: pd.DataFrame, steps: pd.DataFrame, theory: float) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The exact split of each stage's idle time: warm-up/cool-down, imbalance, communication stall; and
    per step the measured bubble, theory and the saving of fixing the slowest stage."""
    ss = ss.merge(steps[["pipeline", "step", "replay_ns", "uniform_ns", "sim_compute_ns"]], on=["pipeline", "step"])
    idle = ss["idle_ns"].to_numpy(dtype="float64")
    wc = np.clip((ss["uniform_ns"] - ss["sim_compute_ns"]).fillna(0).to_numpy(), 0, idle)
    imb = np.clip((ss["replay_ns"] - ss["compute_ns"]).fillna(0).to_numpy() - wc, 0, idle - wc)
    ss["warmup_cooldown_ns"], ss["imbalance_ns"], ss["comm_stall_ns"] = wc, imb, idle - wc - imb
    ss = ss.drop(columns=["replay_ns", "uniform_ns", "sim_compute_ns"])
    tot = ss.groupby(["pipeline", "step"])[["idle_ns", "window_ns"]].sum()
    steps = steps.merge((tot["idle_ns"] / tot["window_ns"]).rename("measured_bubble").reset_index(),
                        on=["pipeline", "step"])
    steps["theory"] = theory
    steps["saving_ns"] = (steps["replay_ns"] - steps["fixed_ns"]).clip(lower=0)
    return ss, steps


def _summarise(res: BubbleResult, ss: pd.DataFrame, steps: pd.DataFrame, spans: pd.DataFrame
               ) -> tuple[pd.DataFrame, np.ndarray]:
    """Fills res's tables (stage_step, steps, stages, microbatches); returns the summary steps' rows of
    stage_step and the summary steps (all but the first when three or more completed: warm-up)."""
    summary_steps = np.sort(steps["step"].unique())
    if len(summary_steps) >= 3:
        summary_steps = summary_steps[1:]
    sel = ss[ss["step"].isin(summary_steps)]
    cols = ["window_ns", "compute_ns", "forward_ns", "backward_ns", "comm_ns", "idle_ns",
            "warmup_cooldown_ns", "imbalance_ns", "comm_stall_ns"]
    stages = sel.groupby("pp_pos")[cols].mean()
    stages["bubble"] = stages["idle_ns"] / stages["window_ns"]
    stages["theory"] = res.theory
    stages = stages.reset_index().rename(columns={"pp_pos": "stage"})
    mbt = spans.groupby(["pp_pos", "is_b", "microbatch"])["dur"].mean().rename("mean_ns").reset_index()
    mbt["op_name"] = np.where(mbt["is_b"] == 1, "backward", "forward")
    res.stage_step, res.steps, res.stages = ss, steps, stages
    res.microbatches = mbt.drop(columns="is_b")
    return sel, summary_steps
