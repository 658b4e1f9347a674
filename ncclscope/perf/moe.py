"""MoE and context parallelism: expert load balance, dropped tokens, ring traffic.

Why: an MoE layer is only as fast as its busiest expert, and a capacity
limit silently drops the tokens that overflow it. The metrics rows carry, per
rank and step, the tokens routed to each *local* expert and the tokens
dropped; with expert parallelism rank r holds experts
[ep_index * n_local, (ep_index + 1) * n_local). Summing over the ranks that
hold the same expert (data-parallel copies) gives its global load.

Imbalance of a step = max expert load / mean expert load (1.0 is perfect).
`expert_imbalance` fires when the median step is above `max_ratio` or more
than `max_dropped` of the tokens were dropped.

Context parallelism: ring attention exchanges K/V blocks around the cp
group; the bytes per step on `cp` groups (p2p and collectives) are reported
so an unexpectedly large exchange shows up next to its step time.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ncclscope.findings import Evidence, Finding
from ncclscope.load.trace import Trace
from ncclscope.perf.stragglers import group_table


@dataclass
class MoEResult:
    expert_load: pd.DataFrame = field(default_factory=pd.DataFrame)  # step, expert, load, ranks
    steps: pd.DataFrame = field(default_factory=pd.DataFrame)        # step, max, mean, imbalance, dropped, tokens
    cp_volume: pd.DataFrame = field(default_factory=pd.DataFrame)    # step, process_group, op_name, bytes
    findings: list[Finding] = field(default_factory=list)


def analyze_moe(trace: Trace, max_ratio: float = 2.0, max_dropped: float = 0.01) -> MoEResult:
    res = MoEResult()
    res.cp_volume = _cp_volume(trace)
    m = trace.metrics
    if not len(m):
        return res
    lens = m["expert_load"].map(lambda x: 0 if x is None else len(x))
    has = m[lens > 0]
    if not len(has):
        return res
    n_local = lens[lens > 0].to_numpy()
    flat = np.concatenate([np.asarray(x, dtype="int64") for x in has["expert_load"].to_numpy()])
    rank = np.repeat(has["rank"].to_numpy(), n_local)
    step = np.repeat(has["step"].to_numpy(), n_local)
    local = np.concatenate([np.arange(n) for n in n_local])
    ep = np.array([trace.ranks[int(r)].coords.get("ep", 0) if int(r) in trace.ranks else 0 for r in has["rank"]])
    expert = np.repeat(ep * n_local, n_local) + local
    long = pd.DataFrame({"rank": rank, "step": step, "expert": expert, "load": flat})
    load = long.groupby(["step", "expert"]).agg(load=("load", "sum"), ranks=("rank", "nunique")).reset_index()
    res.expert_load = load
    st = load.groupby("step")["load"].agg(["max", "mean", "sum"])
    st["imbalance"] = st["max"] / st["mean"].where(st["mean"] > 0)
    st["hot_expert"] = load.loc[load.groupby("step")["load"].idxmax(), ["step", "expert"]].set_index("step")["expert"]
    drop = has.assign(d=has["dropped_tokens"].clip(lower=0)).groupby("step")["d"].sum()
    st["dropped"] = drop.reindex(st.index).fillna(0)
    st["dropped_frac"] = st["dropped"] / (st["sum"] + st["dropped"]).where(st["sum"] + st["dropped"] > 0)
    res.steps = st.reset_index()
    med_ratio = float(st["imbalance"].median())
    dropped = float(st["dropped"].sum() / max(1.0, float((st["sum"] + st["dropped"]).sum())))
    if med_ratio > max_ratio or dropped > max_dropped:
        worst = st["imbalance"].idxmax()
        hot = int(st.loc[worst, "hot_expert"])
        holders = long[(long["step"] == worst) & (long["expert"] == hot)].sort_values("load", ascending=False)
        ev = [Evidence(rank=int(x["rank"]), note=f"step {int(worst)}: expert {hot} got {int(x['load'])} tokens "
                                                 f"(mean expert {st.loc[worst, 'mean']:.0f})") for _, x in holders.head(4).iterrows()]
        dr = has[has["dropped_tokens"] > 0].sort_values("dropped_tokens", ascending=False)
        ev += [Evidence(rank=int(x["rank"]), note=f"step {int(x['step'])}: dropped {int(x['dropped_tokens'])} tokens")
               for _, x in dr.head(3).iterrows()]
        res.findings.append(Finding(
            "expert_imbalance", "warning",
            f"MoE experts are unbalanced: the busiest expert gets {med_ratio:.1f}x the mean load (median step), "
            f"worst {st['imbalance'].max():.1f}x (expert {hot}, step {int(worst)}); {dropped:.1%} of tokens dropped",
            sorted(int(r) for r in holders["rank"].head(4)), ev,
            {"median_ratio": med_ratio, "max_ratio": float(st["imbalance"].max()), "dropped_frac": dropped,
             "hot_expert": hot, "step": int(worst)}))
    return res


def _cp_volume(trace: Trace) -> pd.DataFrame:
    g = group_table(trace)
    cols = ["step", "process_group", "op_name", "bytes", "ops"]
    cp_names = list(g.loc[(g["group_kind"] == "cp") & (g["size"] > 1), "process_group"])
    if not cp_names:
        return pd.DataFrame(columns=cols)
    ops = trace.ops
    sel = ops[ops["kind"].isin(["p2p", "collective"]) & ops["process_group"].isin(cp_names) & (ops["bytes"] > 0)]
    if not len(sel):
        return pd.DataFrame(columns=cols)
    out = sel.groupby(["step", "process_group", "op_name"], observed=True).agg(
        bytes=("bytes", "sum"), ops=("bytes", "size")).reset_index()
    out["process_group"] = out["process_group"].astype(str)
    out["op_name"] = out["op_name"].astype(str)
    return out[cols]
