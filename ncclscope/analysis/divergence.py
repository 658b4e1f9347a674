"""Divergence: do data-parallel replicas still hold the same model? First NaN?

Why: a replica that silently skipped a gradient reduction (or applied a
different update) keeps training on different weights; the loss curve looks
fine for a long time. Ranks at the same tp/pp/ep position in different dp
replicas hold the same parameters, so after every step they must agree on
the parameter checksum and on the norm of the reduced gradient. The first
step where one does not is where to look; the rank that disagrees with the
majority of its replicas is the one to blame.

With two replicas there is no majority. Then the tie is broken by a
signature of a skipped reduction: a rank whose "reduced" grad norm equals its
own local grad norm, while its peers' differ, never applied the reduction.
Otherwise the replica with the highest dp index is named, and the finding
says that the choice is a guess.

NaN/Inf: the first non-finite value. A rank's local grad norm (before any
reduction) names the origin; the reduced norm, loss and checksum only show
where it spread. A marker row named "nonfinite" (or "nan") in the events
names the microbatch when the runtime records one.

Grad-norm spikes: a norm above `spike_factor` x the running median of the
previous `window` steps of the same rank.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ..findings import Evidence, Finding
from ..trace import Trace
from .groups import fmt_ranks, rank_label

CHECKED = ("param_checksum", "grad_norm_global")
NONFINITE_ORDER = ("grad_norm_local", "loss", "grad_norm_global", "param_checksum")
REL_TOL = 1e-6


@dataclass
class DivergenceResult:
    replicas: pd.DataFrame = field(default_factory=pd.DataFrame)    # rank -> replica set
    deviations: pd.DataFrame = field(default_factory=pd.DataFrame)  # rank, step, metric, value, reference
    nonfinite: pd.DataFrame = field(default_factory=pd.DataFrame)   # rank, step, metric (first per rank)
    spikes: pd.DataFrame = field(default_factory=pd.DataFrame)      # rank, step, norm, running median
    norms: pd.DataFrame = field(default_factory=pd.DataFrame)       # rank, step, grad norms (for the report)
    first_divergent_step: int = -1
    findings: list[Finding] = field(default_factory=list)


def replica_sets(trace: Trace) -> pd.DataFrame:
    """rank -> replica set id: same (tp, pp, ep) coordinates; else the dp group; else all one set."""
    rows = [(r, info.coords) for r, info in trace.ranks.items() if info.present]
    if rows and all(c for _, c in rows) and any("dp" in c for _, c in rows):
        key = [(c.get("tp", 0), c.get("pp", 0), c.get("ep", 0)) for _, c in rows]
        codes = pd.Series(key).astype(str).factorize()[0]
        return pd.DataFrame({"rank": [r for r, _ in rows], "replica_set": codes, "dp": [c.get("dp", 0) for _, c in rows]})
    g = trace.groups
    if len(g):
        dp = g[g["group_kind"].astype(str) == "dp"].drop_duplicates("process_group")
        if len(dp):
            out = [(int(r), i, pos) for i, rs in enumerate(dp["ranks"]) for pos, r in enumerate(sorted(rs))]
            return pd.DataFrame(out, columns=["rank", "replica_set", "dp"]).drop_duplicates("rank")
    return pd.DataFrame({"rank": [r for r, _ in rows], "replica_set": 0, "dp": [r for r, _ in rows]})


def analyze_divergence(trace: Trace, spike_factor: float = 5.0, window: int = 10) -> DivergenceResult:
    res = DivergenceResult()
    m = trace.metrics
    if not len(m):
        return res
    cols = ["rank", "step", "time_ns", "loss", "grad_norm_local", "grad_norm_global", "param_checksum"]
    m = m[cols].drop_duplicates(["rank", "step"], keep="last").sort_values(["rank", "step"]).reset_index(drop=True)
    res.norms = m
    reps = replica_sets(trace)
    res.replicas = reps
    m = m.merge(reps, on="rank", how="left")
    _check_replicas(trace, m, res)
    _check_nonfinite(trace, m, res)
    _check_spikes(trace, m, res, spike_factor, window)
    return res


def _check_replicas(trace: Trace, m: pd.DataFrame, res: DivergenceResult) -> None:
    frames = []
    for metric in CHECKED:
        x = m[["rank", "step", "replica_set", "dp", metric, "grad_norm_local"]].rename(columns={metric: "value"})
        x = x[np.isfinite(x["value"])]
        g = x.groupby(["replica_set", "step"])["value"]
        x = x.assign(reference=g.transform("median"), n=g.transform("size"), total=g.transform("sum"))
        x = x[x["n"] > 1]
        off = (x["value"] - x["reference"]).abs() > REL_TOL * np.maximum(x["reference"].abs(), 1e-12)
        if not off.any():
            continue
        bad = x[off].copy()
        # a tie: every member is "off" the median (two replicas, or an even split)
        bad["tie"] = bad.groupby(["replica_set", "step"])["rank"].transform("size") == bad["n"]
        bad.loc[bad["tie"], "reference"] = (bad["total"] - bad["value"]) / (bad["n"] - 1)
        bad["same_local"] = (metric == "grad_norm_global") & (
            (bad["value"] - bad["grad_norm_local"]).abs() <= REL_TOL * np.maximum(bad["value"].abs(), 1e-12))
        frames.append(bad.assign(metric=metric))
    if not frames:
        return
    dev = pd.concat(frames, ignore_index=True)
    # Resolve ties once per replica set: the rank that kept its local gradient
    # at the earliest tied step, else (a guess) the highest dp index.
    tied = dev[dev["tie"]]
    dev["guess"] = False
    if len(tied):
        n_same = tied.groupby(["replica_set", "step", "metric"])["same_local"].transform("sum")
        sig = tied[tied["same_local"] & (n_same < tied["n"])].sort_values("step")
        blame = sig.drop_duplicates("replica_set").set_index("replica_set")["rank"]
        top = tied.sort_values(["dp", "rank"]).drop_duplicates("replica_set", keep="last").set_index("replica_set")["rank"]
        chosen = blame.reindex(top.index).fillna(top).astype("int64")
        keep = ~dev["tie"] | (dev["rank"].to_numpy() == dev["replica_set"].map(chosen).to_numpy())
        dev.loc[dev["tie"], "guess"] = ~dev.loc[dev["tie"], "replica_set"].isin(blame.index)
        dev = dev[keep]
    dev = dev[["rank", "step", "replica_set", "metric", "value", "reference", "guess"]]
    frames = [dev]
    if not frames:
        return
    dev = pd.concat(frames, ignore_index=True).sort_values(["step", "rank", "metric"]).reset_index(drop=True)
    res.deviations = dev
    first = int(dev["step"].min())
    res.first_divergent_step = first
    at = dev[dev["step"] == first]
    ranks = sorted(int(r) for r in at["rank"].unique())
    ev = []
    for _, row in at.head(8).iterrows():
        ev.append(Evidence(rank=int(row["rank"]), note=(
            f"step {first}: {row['metric']} {row['value']:.9g}, its replicas {row['reference']:.9g}"),
            time_ns=int(m.loc[(m["rank"] == row["rank"]) & (m["step"] == first), "time_ns"].iloc[0])))
    later = dev[dev["rank"].isin(ranks)]
    what = ", ".join(sorted(at["metric"].unique()))
    guess = bool(at["guess"].any())
    title = (f"{rank_label(trace, ranks)} diverged from {'its' if len(ranks) == 1 else 'their'} data-parallel "
             f"replicas at step {first} ({what} differ"
             + (f"; still off at step {int(later['step'].max())}" if later["step"].max() > first else "") + ")"
             + (" — two replicas disagree and nothing says which is wrong; the higher dp index is named" if guess else ""))
    res.findings.append(Finding("grad_divergence", "error", title, ranks, ev,
                                {"step": first, "ranks": ranks, "metrics": sorted(at["metric"].unique()),
                                 "ambiguous": guess}))


def _check_nonfinite(trace: Trace, m: pd.DataFrame, res: DivergenceResult) -> None:
    vals = m[list(NONFINITE_ORDER)].to_numpy(dtype="float64")
    fin = np.isfinite(vals)
    # NaN is also how the recorder writes "not applicable" (loss off the last pipeline
    # stage): a column counts for a rank if it is finite at some step of that rank, or,
    # for the norms and checksum that every rank records, of any rank.
    applies = pd.DataFrame(fin).groupby(m["rank"].to_numpy()).transform("any").to_numpy(dtype=bool)
    everyone = fin.any(axis=0) & np.array([c != "loss" for c in NONFINITE_ORDER])
    bad = ~fin & (applies | everyone[None, :])
    if not bad.any():
        return
    rows = []
    for j, metric in enumerate(NONFINITE_ORDER):
        idx = np.flatnonzero(bad[:, j])
        rows.append(pd.DataFrame({"rank": m["rank"].to_numpy()[idx], "step": m["step"].to_numpy()[idx],
                                  "metric": metric, "order": j, "value": vals[idx, j],
                                  "time_ns": m["time_ns"].to_numpy()[idx]}))
    nf = pd.concat(rows, ignore_index=True).sort_values(["step", "order", "rank"])
    res.nonfinite = nf.drop_duplicates(["rank", "metric"]).reset_index(drop=True)
    step = int(nf["step"].min())
    at = nf[nf["step"] == step]
    origin = at[at["metric"] == "grad_norm_local"]
    markers = _nonfinite_markers(trace)
    mk = markers[markers["step"] == step] if len(markers) else markers
    if len(mk):
        ranks = sorted(int(r) for r in mk["rank"].unique())
    elif len(origin):
        ranks = sorted(int(r) for r in origin["rank"].unique())
    else:
        ranks = sorted(int(r) for r in at["rank"].unique())
    mb = int(mk["microbatch"].min()) if len(mk) else -1
    ev = [Evidence(rank=int(x["rank"]), note=f"step {step}: {x['metric']} = {x['value']}", time_ns=int(x["time_ns"]))
          for _, x in at.drop_duplicates("rank").head(8).iterrows()]
    ev += [Evidence(rank=int(x["rank"]), note=f"step {step} microbatch {int(x['microbatch'])}: {x['message'] or 'non-finite'}",
                    op_name=str(x["op_name"]), time_ns=int(x["t_ns"])) for _, x in mk.head(4).iterrows()]
    if len(mk) or len(origin):
        where = f"first NaN/Inf at step {step}" + (f" microbatch {mb}" if mb >= 0 else "") + \
                f" on {rank_label(trace, ranks)}, in its own gradient before any reduction"
    else:
        where = (f"NaN/Inf at step {step} on {len(ranks)} ranks ({fmt_ranks(ranks)}) after the gradient reduction; "
                 f"no rank's local grad norm was non-finite, so the trace does not say which rank produced it")
    spread = nf["rank"].nunique()
    res.findings.append(Finding("nan", "error", where + (f"; it spread to {spread} ranks" if spread > len(ranks) else ""),
                                ranks, ev, {"step": step, "microbatch": mb, "ranks": ranks,
                                            "origin_known": bool(len(mk) or len(origin))}))


def _nonfinite_markers(trace: Trace) -> pd.DataFrame:
    ev = trace.events
    names = ev["op_name"].astype(str) if len(ev) else pd.Series(dtype=str)
    mk = ev[(ev["kind"] == "marker") & names.isin(["nonfinite", "nan"])] if len(ev) else ev
    return mk[["rank", "step", "microbatch", "op_name", "message", "t_ns"]] if len(mk) else pd.DataFrame(
        columns=["rank", "step", "microbatch", "op_name", "message", "t_ns"])


def _check_spikes(trace: Trace, m: pd.DataFrame, res: DivergenceResult, factor: float, window: int) -> None:
    norm = m["grad_norm_global"].where(np.isfinite(m["grad_norm_global"]), m["grad_norm_local"])
    x = pd.DataFrame({"rank": m["rank"], "step": m["step"], "norm": norm, "time_ns": m["time_ns"]})
    x = x[np.isfinite(x["norm"])]
    prev = x.groupby("rank")["norm"].transform(lambda s: s.shift(1).rolling(window, min_periods=3).median())
    x = x.assign(running_median=prev)
    sp = x[(x["norm"] > factor * x["running_median"]) & (x["running_median"] > 0)]
    res.spikes = sp.reset_index(drop=True)
    if not len(sp):
        return
    by_step = sp.groupby("step")
    first = int(sp["step"].min())
    at = sp[sp["step"] == first].sort_values("norm", ascending=False)
    ev = [Evidence(rank=int(r["rank"]), note=f"step {first}: grad norm {r['norm']:.4g}, running median "
                                             f"{r['running_median']:.4g}", time_ns=int(r["time_ns"]))
          for _, r in at.head(6).iterrows()]
    steps = sorted(int(s) for s in by_step.groups)
    res.findings.append(Finding(
        "grad_spike", "warning",
        f"grad norm spiked to {at['norm'].iloc[0] / at['running_median'].iloc[0]:.1f}x its running median at step "
        f"{first}" + (f" (and {len(steps) - 1} later steps)" if len(steps) > 1 else ""),
        sorted(int(r) for r in at["rank"].unique()[:8]), ev, {"steps": steps[:50]}))
