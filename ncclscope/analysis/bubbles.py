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

Warnings state their baseline and must stand out of this machine's noise
(`_findings`): a `pipeline_bubble` is a warning when the measured bubble is
over theory by EXCESS_FLOOR (10 points) and 1.25x, *and* its excess is
explained by something other than the run's own latency: the stages are
imbalanced (slowest stage >= IMBALANCE_RATIO 1.3x the median and balancing
saves >= IMBALANCE_SAVING 10% of the step) or the communication stall is at
least STALL_FACTOR (2x) its baseline and STALL_FLOOR (10 points) above it.
The comm-stall baseline is each p2p op of a stage at the run's own median
p2p latency (capped at the stage's idle time): on ranks sharing cores a
healthy 2-stage pipeline of tiny microbatches idles 30-80% of the step
waiting for messages, and that is latency, not a fault. `stage_imbalance` is
a warning under the same imbalance floor. Anything below is `info`, with the
same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ..findings import Evidence, Finding
from ..trace import Trace

MS = 1e6
FB = ("forward", "backward")
COMM_KINDS = ("p2p", "collective")


def theoretical_bubble(schedule: str, p: int, m: int, v: int = 1) -> float:
    """Textbook idle fraction of a step: the one definition in ncclscope.schedules
    (pure Python, shared with the runtime); the fallback, for names or counts it
    refuses, is the same two formulas."""
    try:
        from ..schedules import theoretical_bubble as rt
        return float(rt(schedule, int(p), int(m), int(v)))
    except (ImportError, ValueError):
        if p < 1 or m < 1:
            return float("nan")
        vv = v if schedule == "interleaved" else 1
        return (p - 1) / (vv * m + p - 1)


def union_length(key: np.ndarray, start: np.ndarray, end: np.ndarray, n_keys: int | None = None) -> np.ndarray:
    """Total length of the union of intervals per dense integer key (vectorised sweep).

    Intervals sorted by (key, start); each contributes only the part past the
    running maximum of the ends before it. Keys are laid end to end on one
    axis (key * span + time) so a single `maximum.accumulate` serves all of
    them; a per-key pandas cummax is the fallback when that would overflow."""
    n_keys = int(key.max()) + 1 if n_keys is None and len(key) else (n_keys or 0)
    if not len(key):
        return np.zeros(n_keys)
    key = key.astype(np.int64)
    base = int(start.min())
    span = int(end.max()) - base + 1
    if n_keys * span < 2**62:
        off = key * span - base
        ss, ee = start.astype(np.int64) + off, end.astype(np.int64) + off
        order = np.argsort(ss, kind="stable")   # one int64 key; input is mostly sorted already
        k, ss, ee = key[order], ss[order], ee[order]
        run = np.maximum.accumulate(ee)
        prev = np.empty_like(run)
        prev[0], prev[1:] = np.iinfo(np.int64).min, run[:-1]
        contrib = np.clip(ee - np.maximum(ss, prev), 0, None)
    else:
        order = np.lexsort((start, key))
        k, s, e = key[order], start[order].astype(np.int64), end[order].astype(np.int64)
        run = pd.Series(e).groupby(k).cummax().to_numpy()
        prev = pd.Series(run).groupby(k).shift(1).fillna(np.iinfo(np.int64).min).to_numpy(dtype=np.int64)
        contrib = np.clip(e - np.maximum(s, prev), 0, None)
    return np.bincount(k, weights=contrib.astype(np.float64), minlength=n_keys)


def pipeline_layout(trace: Trace) -> pd.DataFrame:
    """rank -> (pipeline, pp_pos, p): one row per rank in a pp group of size > 1.

    A pipeline is one `pp` process group; stage position is the member's pp
    coordinate when known, else its position in the member list (Megatron
    order: pp varies slowest, so rank order is stage order)."""
    from .stragglers import group_table
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


@dataclass
class BubbleResult:
    """Tables (times in ns) and findings of the bubble analysis; empty when pp == 1."""

    schedule: str = ""
    p: int = 1
    m: int = 0
    v: int = 1
    theory: float = float("nan")
    stage_step: pd.DataFrame = field(default_factory=pd.DataFrame)   # per pipeline, step, stage
    steps: pd.DataFrame = field(default_factory=pd.DataFrame)        # per pipeline, step
    stages: pd.DataFrame = field(default_factory=pd.DataFrame)       # per stage position, summary
    microbatches: pd.DataFrame = field(default_factory=pd.DataFrame) # per stage, kind, microbatch
    findings: list[Finding] = field(default_factory=list)
    p2p_latency_ns: float = float("nan")                              # the run's median p2p latency
    baseline: dict[str, float] = field(default_factory=dict)          # what the warnings were measured against

    @property
    def measured(self) -> float:
        """Mean measured bubble fraction over the summary steps."""
        return float(self.stages["bubble"].mean()) if len(self.stages) else float("nan")


def _config(trace: Trace, spans: pd.DataFrame, p: int) -> tuple[str, int, int]:
    cfg = trace.run.get("config") if isinstance(trace.run.get("config"), dict) else {}
    schedule = str(cfg.get("schedule") or "1f1b")
    n_stages = int(spans["stage"].max()) + 1 if len(spans) else p
    v = int(cfg.get("vpp") or max(1, n_stages // max(p, 1)))
    per = spans.groupby(["rank", "step", "stage"], observed=True)["microbatch"].nunique()
    m = int(cfg.get("microbatches") or (per.max() if len(per) else 0))
    return schedule, m, v


def _replay(nodes: pd.DataFrame, durations: np.ndarray, n_stages: int) -> np.ndarray:
    """Zero-communication makespan of each replay (`sim`) for each duration column.

    nodes: one row per action, sorted by (sim, rank, observed start), with
    sim, rank, stage (virtual), is_b, microbatch. An action starts when the
    previous action on its rank and its data dependency have finished:
    F(s, mb) needs F(s-1, mb); B(s, mb) needs B(s+1, mb), or F(s, mb) on the
    last stage. Nodes are levelled once (longest chain, integer relaxation),
    then one vectorised pass per level computes the times: O(nodes) work.
    A replay whose observed order has a cycle gets NaN."""
    n = len(nodes)
    sim = nodes["sim"].to_numpy()
    stage = nodes["stage"].to_numpy().astype(np.int64)
    is_b = nodes["is_b"].to_numpy().astype(bool)
    mb = nodes["microbatch"].to_numpy().astype(np.int64)
    n_mb = int(mb.max()) + 1
    def key(st: np.ndarray, b: np.ndarray) -> np.ndarray:
        return ((sim * n_stages + st) * 2 + b) * n_mb + mb
    index = pd.Index(key(stage, is_b.astype(np.int64)))
    last = stage == n_stages - 1
    dep_stage = np.where(is_b, np.where(last, stage, stage + 1), stage - 1)
    dep_b = (is_b & ~last).astype(np.int64)
    dep = np.where(~is_b & (stage == 0), -1, index.get_indexer(key(dep_stage, dep_b)))
    rank = nodes["rank"].to_numpy()
    pred = np.arange(n) - 1
    same = np.zeros(n, dtype=bool)
    same[1:] = (sim[1:] == sim[:-1]) & (rank[1:] == rank[:-1])
    pred[~same] = -1
    level = np.zeros(n, dtype=np.int64)
    cap = int(np.bincount(sim).max()) + 1 if n else 0
    for _ in range(cap + 1):
        new = np.maximum(np.where(pred >= 0, level[pred] + 1, 0), np.where(dep >= 0, level[dep] + 1, 0))
        if np.array_equal(new, level):
            break
        level = new
    cyclic = level > cap
    finish = np.zeros_like(durations, dtype=np.float64)
    order = np.argsort(level, kind="stable")
    bounds = np.searchsorted(level[order], np.arange(level.max() + 2 if n else 1))
    for lv in range(len(bounds) - 1):
        idx = order[bounds[lv]:bounds[lv + 1]]
        if not len(idx):
            continue
        st = np.zeros((len(idx), durations.shape[1]))
        p_, d_ = pred[idx], dep[idx]
        hp, hd = p_ >= 0, d_ >= 0
        st[hp] = finish[p_[hp]]
        st[hd] = np.maximum(st[hd], finish[d_[hd]])
        finish[idx] = st + durations[idx]
    out = pd.DataFrame(finish).groupby(sim).max()
    bad = pd.Series(cyclic).groupby(sim).any()
    out[bad.to_numpy()] = np.nan
    return out.to_numpy()


def analyze_bubbles(trace: Trace) -> BubbleResult:
    layout = pipeline_layout(trace)
    if not len(layout):
        return BubbleResult()
    ops = trace.ops
    p = int(layout["p"].max())
    n_rank = int(max(layout["rank"].max(), ops["rank"].max() if len(ops) else 0)) + 1
    pipe_of = np.full(n_rank, -1, dtype=np.int64)
    pos_of = np.full(n_rank, -1, dtype=np.int64)
    pipe_of[layout["rank"].to_numpy()] = layout["pipeline"].to_numpy()
    pos_of[layout["rank"].to_numpy()] = layout["pp_pos"].to_numpy()
    o_rank = ops["rank"].to_numpy().astype(np.int64)
    o_step = ops["step"].to_numpy().astype(np.int64)
    in_pipe = (pipe_of[o_rank] >= 0) & (o_step >= 0)
    fb = (ops["kind"] == "compute").to_numpy() & ops["op_name"].isin(FB).to_numpy() & in_pipe
    spans = pd.DataFrame({c: ops[c].to_numpy()[fb] for c in ("rank", "step", "microbatch", "stage", "start_ns",
                                                              "end_ns")})
    spans["is_b"] = (ops["op_name"] == "backward").to_numpy()[fb].astype(np.int64)
    spans["rank"] = spans["rank"].astype(np.int64)
    spans["pipeline"], spans["pp_pos"] = pipe_of[spans["rank"]], pos_of[spans["rank"]]
    schedule, m, v = _config(trace, spans, p)
    res = BubbleResult(schedule=schedule, p=p, m=m, v=v, theory=theoretical_bubble(schedule, p, max(m, 1), v))
    if not len(spans):
        return res

    # Windows per (pipeline, step); a step with an unfinished F/B is a hang, not a bubble.
    steps_u = np.unique(spans["step"].to_numpy())
    n_st = len(steps_u)
    spans["wkey"] = spans["pipeline"] * n_st + np.searchsorted(steps_u, spans["step"])
    g = spans.groupby("wkey")
    win = pd.DataFrame({"w0": g["start_ns"].min(), "w1": g["end_ns"].max(), "inflight": (spans["end_ns"] < 0).groupby(spans["wkey"]).sum(),
                        "ranks": g["rank"].nunique()})
    win = win[(win["inflight"] == 0) & (win["ranks"] == p)]
    if not len(win):
        return res
    n_w = int(n_st * (layout["pipeline"].max() + 1))
    w0 = np.full(n_w, -1, dtype=np.int64)
    w1 = np.full(n_w, -1, dtype=np.int64)
    w0[win.index.to_numpy()], w1[win.index.to_numpy()] = win["w0"].to_numpy(), win["w1"].to_numpy()
    spans = spans[w0[spans["wkey"].to_numpy()] >= 0].reset_index(drop=True)
    spans["dur"] = spans["end_ns"] - spans["start_ns"]

    # Per stage and step: compute, backward, exposed communication (dense key rank * n_st + step index).
    n_rs = n_rank * n_st
    rs_key = spans["rank"].to_numpy() * n_st + np.searchsorted(steps_u, spans["step"].to_numpy())
    dur = spans["dur"].to_numpy().astype(np.float64)
    compute = np.bincount(rs_key, weights=dur, minlength=n_rs)
    backward = np.bincount(rs_key, weights=dur * spans["is_b"].to_numpy(), minlength=n_rs)
    cm = ops["kind"].isin(COMM_KINDS).to_numpy() & in_pipe & (ops["end_ns"].to_numpy() >= 0)
    c_rank, c_step = o_rank[cm], o_step[cm]
    c_si = np.searchsorted(steps_u, c_step)
    ok = (c_si < n_st) & (steps_u[np.minimum(c_si, n_st - 1)] == c_step)
    c_w = pipe_of[c_rank] * n_st + np.minimum(c_si, n_st - 1)
    ok &= w0[c_w] >= 0
    c_s = np.maximum(ops["start_ns"].to_numpy()[cm], w0[c_w])[ok]
    c_e = np.minimum(ops["end_ns"].to_numpy()[cm], w1[c_w])[ok]
    c_key = (c_rank * n_st + c_si)[ok]
    keep = c_e > c_s
    all_key = np.concatenate([c_key[keep], rs_key])
    u_all = union_length(all_key, np.concatenate([c_s[keep], spans["start_ns"].to_numpy()]),
                         np.concatenate([c_e[keep], spans["end_ns"].to_numpy()]), n_rs)
    u_cmp = union_length(rs_key, spans["start_ns"].to_numpy(), spans["end_ns"].to_numpy(), n_rs)

    wk = win.index.to_numpy()
    ss = pd.DataFrame({"pipeline": wk // n_st, "step": steps_u[wk % n_st], "window_start_ns": win["w0"].to_numpy(),
                       "window_ns": (win["w1"] - win["w0"]).to_numpy()})
    ss = ss.merge(layout, on="pipeline").sort_values(["pipeline", "step", "pp_pos"]).reset_index(drop=True)
    k = ss["rank"].to_numpy() * n_st + np.searchsorted(steps_u, ss["step"].to_numpy())
    ss["compute_ns"], ss["backward_ns"] = compute[k], backward[k]
    ss["forward_ns"] = ss["compute_ns"] - ss["backward_ns"]
    ss["comm_ns"] = np.clip(u_all[k] - u_cmp[k], 0, None)
    ss["idle_ns"] = (ss["window_ns"] - ss["compute_ns"]).clip(lower=0)
    # the comm-stall baseline: each p2p op this stage issued, at the run's own median p2p latency
    pm = (ops["kind"] == "p2p").to_numpy() & in_pipe
    n_p2p = pd.Series(1, index=pd.MultiIndex.from_arrays([o_rank[pm], o_step[pm]])).groupby(level=[0, 1]).size()
    ss["p2p_ops"] = n_p2p.reindex(pd.MultiIndex.from_arrays([ss["rank"].to_numpy(dtype=np.int64),
                                                             ss["step"].to_numpy(dtype=np.int64)])).fillna(0).to_numpy()
    ss["bubble"] = ss["idle_ns"] / ss["window_ns"].where(ss["window_ns"] > 0)

    # Replays: measured durations, uniform (mean F / mean B), slowest stage at the median stage's speed.
    nodes = spans[spans["microbatch"] >= 0]
    nodes = nodes.groupby(["wkey", "rank", "pp_pos", "stage", "is_b", "microbatch"], as_index=False, sort=False).agg(
        start_ns=("start_ns", "min"), dur=("dur", "sum"))
    nodes = nodes.sort_values(["wkey", "rank", "start_ns"], kind="stable").reset_index(drop=True)
    nodes["sim"] = nodes.groupby("wkey", sort=True).ngroup()
    mean_fb = nodes.groupby(["sim", "is_b"])["dur"].transform("mean").to_numpy()
    stage_load = ss.groupby("pp_pos")["compute_ns"].mean()
    slowest = int(stage_load.idxmax())
    pos_mean = nodes.groupby(["sim", "pp_pos", "is_b"])["dur"].mean()
    med = pos_mean.groupby(level=["sim", "is_b"]).median()
    med_d = med.reindex(pd.MultiIndex.from_arrays([nodes["sim"], nodes["is_b"]])).to_numpy()
    fixed = np.where(nodes["pp_pos"].to_numpy() == slowest, med_d, nodes["dur"].to_numpy())
    n_stages = int(nodes["stage"].max()) + 1 if len(nodes) else p
    durs = np.column_stack([nodes["dur"].to_numpy(), mean_fb, fixed]).astype(np.float64)
    makespans = _replay(nodes, durs, n_stages) if len(nodes) else np.zeros((0, 3))
    sim_w = nodes.drop_duplicates("sim").sort_values("sim")["wkey"].to_numpy()
    sims = pd.DataFrame({"pipeline": sim_w // n_st, "step": steps_u[sim_w % n_st], "replay_ns": makespans[:, 0],
                         "uniform_ns": makespans[:, 1], "fixed_ns": makespans[:, 2],
                         "sim_compute_ns": nodes.groupby("sim")["dur"].sum().to_numpy() / p})
    steps = ss.drop_duplicates(["pipeline", "step"])[["pipeline", "step", "window_start_ns", "window_ns"]]
    steps = steps.merge(sims, on=["pipeline", "step"], how="left")

    # Exact split of idle: warm-up/cool-down, imbalance, communication stall.
    ss = ss.merge(steps[["pipeline", "step", "replay_ns", "uniform_ns", "sim_compute_ns"]], on=["pipeline", "step"])
    idle = ss["idle_ns"].to_numpy(dtype="float64")
    wc = np.clip((ss["uniform_ns"] - ss["sim_compute_ns"]).fillna(0).to_numpy(), 0, idle)
    imb = np.clip((ss["replay_ns"] - ss["compute_ns"]).fillna(0).to_numpy() - wc, 0, idle - wc)
    ss["warmup_cooldown_ns"], ss["imbalance_ns"], ss["comm_stall_ns"] = wc, imb, idle - wc - imb
    ss = ss.drop(columns=["replay_ns", "uniform_ns", "sim_compute_ns"])
    tot = ss.groupby(["pipeline", "step"])[["idle_ns", "window_ns"]].sum()
    steps = steps.merge((tot["idle_ns"] / tot["window_ns"]).rename("measured_bubble").reset_index(),
                        on=["pipeline", "step"])
    steps["theory"] = res.theory
    steps["saving_ns"] = (steps["replay_ns"] - steps["fixed_ns"]).clip(lower=0)

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
    res.p2p_latency_ns = _p2p_latency_ns(trace)
    res.findings = _findings(trace, res, sel, steps[steps["step"].isin(summary_steps)], slowest, stage_load)
    return res


def _p2p_latency_ns(trace: Trace) -> float:
    """The run's own median p2p latency (send start to receive completion), the comm-stall baseline's unit."""
    from .comm_stats import _p2p
    lat = _p2p(trace)["lat_ms"].astype("float64")
    lat = lat[np.isfinite(lat) & (lat >= 0)]
    return float(lat.median() * MS) if len(lat) else float("nan")


# Warnings must stand out of this machine's own noise (ranks sharing cores make
# every p2p wait include process scheduling; healthy runs here idle 30-80%).
EXCESS_FLOOR = 0.10        # measured bubble over theory, fraction of the step (and >= 1.25x theory)
STALL_FACTOR = 2.0         # comm stall over its baseline: >= 2x the baseline ...
STALL_FLOOR = 0.10         # ... and >= 10% of the step above it
IMBALANCE_RATIO = 1.30     # slowest stage's compute over the median stage's
IMBALANCE_SAVING = 0.10    # and balancing it saves >= 10% of the step


def _findings(trace: Trace, res: BubbleResult, sel: pd.DataFrame, steps: pd.DataFrame, slowest: int,
              stage_load: pd.Series) -> list[Finding]:
    """pipeline_bubble and stage_imbalance: a warning only when significant against the stated baseline,
    else `info` with the same numbers.

    Baselines: the textbook bubble for the schedule (warm-up/cool-down); for the
    communication stall, every p2p op of a stage at the run's own median p2p
    latency (what a healthy run on this machine idles waiting for messages);
    for imbalance, the structural floor above (noise on shared cores makes
    stages differ by ~20% here)."""
    out: list[Finding] = []
    measured = res.measured
    theory = res.theory
    cfg = f"{res.schedule}, p={res.p}, m={res.m}" + (f", v={res.v}" if res.v > 1 else "")
    med = float(stage_load.median())
    slow = float(stage_load.loc[slowest])
    window = float(steps["window_ns"].mean()) if len(steps) else 0.0
    saving = float(steps["saving_ns"].mean()) if len(steps) else 0.0
    ratio = slow / med if med > 0 else float("nan")
    imbalanced = bool(len(stage_load) > 1 and med > 0 and window > 0 and ratio >= IMBALANCE_RATIO
                      and saving >= IMBALANCE_SAVING * window)
    lat = res.p2p_latency_ns
    win = sel["window_ns"].sum() if len(sel) else 0.0
    base_ns = np.minimum(sel["p2p_ops"] * (lat if np.isfinite(lat) else 0.0), sel["idle_ns"]) if len(sel) else sel
    stall_base = float(base_ns.sum() / win) if win > 0 else 0.0
    stall = float(sel["comm_stall_ns"].sum() / win) if win > 0 else 0.0
    stall_sig = stall >= STALL_FACTOR * stall_base and stall - stall_base >= STALL_FLOOR
    n_ops = float(sel["p2p_ops"].mean()) if len(sel) else 0.0
    res.baseline = {"theory": theory, "comm_stall": stall_base, "p2p_latency_ns": lat, "p2p_ops_per_stage_step": n_ops,
                    "imbalance_ratio": IMBALANCE_RATIO, "imbalance_saving": IMBALANCE_SAVING}
    base_txt = (f"comm-stall baseline {stall_base:.0%} of the step = {n_ops:.0f} p2p ops per stage and step at this "
                f"run's median p2p latency {lat / MS:.2f} ms" if np.isfinite(lat) else "no p2p latency measured")
    if np.isfinite(measured) and np.isfinite(theory) and measured > theory + EXCESS_FLOOR and measured > 1.25 * theory:
        parts = sel[["idle_ns", "warmup_cooldown_ns", "imbalance_ns", "comm_stall_ns", "window_ns"]].sum()
        share = {k: float(parts[k] / parts["window_ns"]) for k in ("warmup_cooldown_ns", "imbalance_ns", "comm_stall_ns")}
        worst = res.stages.sort_values("bubble", ascending=False).head(4)
        ev = []
        for _, row in worst.iterrows():
            r = sel[sel["pp_pos"] == row["stage"]].sort_values("idle_ns").iloc[-1]
            ev.append(Evidence(rank=int(r["rank"]), note=(
                f"stage {int(row['stage'])} idles {row['bubble']:.0%} of the step ({row['idle_ns'] / MS:.1f} of "
                f"{row['window_ns'] / MS:.1f} ms; imbalance {row['imbalance_ns'] / MS:.1f} ms, "
                f"comm stall {row['comm_stall_ns'] / MS:.1f} ms)"), time_ns=int(r["window_start_ns"])))
        saturated = _saturated_host(trace)
        if stall_sig and saturated and not imbalanced:
            # ranks >= cores on a host: a rank waiting for its peer's message is mostly waiting for
            # the peer's process to be scheduled, which no interconnect or schedule change fixes
            stall_sig = False
        significant = imbalanced or stall_sig
        if imbalanced and (not stall_sig or share["imbalance_ns"] >= share["comm_stall_ns"] - stall_base):
            why = "uneven stages (move layers off the slowest stage)"
        elif stall_sig:
            why = "communication stalls above their baseline (p2p latency or host overhead between ops)"
        else:
            why = "communication at this run's own p2p latency (latency-bound: fewer, larger microbatches help)"
        title = (f"pipeline bubble {measured:.0%} vs {theory:.0%} in theory ({cfg}); the excess is mostly {why}: "
                 f"imbalance {share['imbalance_ns']:.0%}, comm stall {share['comm_stall_ns']:.0%} of the step "
                 f"({base_txt})")
        if not significant and saturated:
            title += (f"; not a warning: {saturated} (stalls between ops are host scheduling), "
                      f"slowest stage {ratio:.2f}x the median (needs {IMBALANCE_RATIO:g}x)")
        elif not significant:
            title += (f"; not a warning: comm stall under {STALL_FACTOR:g}x its baseline + {STALL_FLOOR:.0%}, "
                      f"slowest stage {ratio:.2f}x the median (needs {IMBALANCE_RATIO:g}x)")
        out.append(Finding(
            "pipeline_bubble", "warning" if significant else "info", title,
            sorted(int(r) for r in sel.loc[sel["pp_pos"].isin(worst["stage"]), "rank"].unique()[:8]), ev,
            {"measured": measured, "theory": theory, **{k[:-3]: v for k, v in share.items()},
             "comm_stall_baseline": stall_base, "p2p_latency_ns": lat, "significant": bool(significant)}))
    if len(stage_load) > 1 and med > 0 and slow >= 1.15 * med and window > 0 and saving >= 0.05 * window:
        at = sel[sel["pp_pos"] == slowest].sort_values("compute_ns", ascending=False)
        ev = [Evidence(rank=int(r["rank"]), note=(
            f"stage {slowest} step {int(r['step'])}: compute {r['compute_ns'] / MS:.1f} ms "
            f"(median stage {med / MS:.1f} ms)"), time_ns=int(r["window_start_ns"])) for _, r in at.head(5).iterrows()]
        title = (f"pipeline stage {slowest} is the slowest: compute {ratio:.2f}x the median stage; balancing it would "
                 f"save {saving / MS:.1f} ms per step ({saving / window:.0%})")
        if not imbalanced:
            title += (f"; within this machine's noise (a warning needs {IMBALANCE_RATIO:g}x and "
                      f"{IMBALANCE_SAVING:.0%} of the step)")
        out.append(Finding(
            "stage_imbalance", "warning" if imbalanced else "info", title,
            sorted(int(r) for r in at["rank"].unique()[:8]), ev,
            {"stage": slowest, "ratio": ratio, "saving_ns": saving, "saving_frac": saving / window,
             "significant": imbalanced}))
    return out


def _saturated_host(trace: Trace) -> str:
    """'N ranks share C cores on host H' for the most loaded host where ranks >= cores, else ''.

    Each rank runs its training thread plus a flusher and a sampler, so a host
    with as many ranks as cores has none to spare. Traces that did not record
    `host_cpus` are never called saturated."""
    per_host: dict[str, list[int]] = {}
    for info in trace.ranks.values():
        if info.present and info.host_cpus > 0:
            per_host.setdefault(info.host, []).append(info.host_cpus)
    worst = ""
    load = 0.0
    for host, cpus in per_host.items():
        n, c = len(cpus), max(cpus)
        if n >= c and n / c > load:
            load, worst = n / c, f"{n} ranks share {c} cores on host {host}"
    return worst


def step_windows(res: BubbleResult) -> pd.DataFrame:
    """(pipeline, step, w0, w1) of the analysed steps, for the report's shading."""
    return res.steps[["pipeline", "step", "w0", "w1"]] if len(res.steps) else pd.DataFrame(
        columns=["pipeline", "step", "w0", "w1"])


def to_json(res: BubbleResult) -> dict[str, Any]:
    return {"schedule": res.schedule, "p": res.p, "m": res.m, "v": res.v, "theory": res.theory,
            "measured": res.measured, "stages": res.stages.to_dict(orient="records")}
