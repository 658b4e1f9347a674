"""Stragglers: which rank everyone waits for, and what fixing it would save.

Why: in a synchronous job the slowest rank sets the pace; every collective
makes its peers wait for it. The evidence is in the arrival times: for each
collective instance (aligned across members by (process_group,
collective_seq_id)) the last arriver is the one the others waited on, and
the skew (last arrival - first arrival) is what they waited.

Tables:
- `instances`  per collective instance: members arrived, first/last arrival,
               last arriver, skew, total rank-time the others waited.
- `rank_step`  per (rank, step): arrival lateness summed over its
               collectives (the report's heat-map), skew it caused as last
               arriver, compute time and its ratio to the peers' median.
- `ranks`      per rank: times last, compute ratio, what-if saving.

What-if: if rank r ran at its peers' median speed, a step would get shorter
by the delay r imposed as last arriver, but never by more than r's excess
compute over that median: saving(step) = min(skew caused, compute excess).
Peers are ranks at the same pipeline position (same work), else everyone; the
median is the peers' (with two ranks, the other one's time).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ..findings import Evidence, Finding
from ..trace import Trace
from .groups import rank_label

MS = 1e6


@dataclass
class StragglerResult:
    instances: pd.DataFrame = field(default_factory=pd.DataFrame)
    rank_step: pd.DataFrame = field(default_factory=pd.DataFrame)
    ranks: pd.DataFrame = field(default_factory=pd.DataFrame)
    findings: list[Finding] = field(default_factory=list)


def group_table(trace: Trace) -> pd.DataFrame:
    """One row per process group: name, kind, size, members (the majority view).

    Membership comes from `Trace.group_members`, which votes over the distinct
    group views (one per distinct groups.json, not one per rank), so this stays
    cheap at 1,024 ranks. Cached on the trace (the table is read-only)."""
    cache = vars(trace).setdefault("_perf_cache", {})
    key = ("groups", id(trace.groups))
    if key in cache:
        return cache[key]
    cols = ["process_group", "group_kind", "size", "members"]
    members = trace.group_members()
    if not members:
        out = pd.DataFrame(columns=cols)
    else:
        kinds = trace.groups.drop_duplicates("process_group").set_index("process_group")["group_kind"]
        names = list(members)
        out = pd.DataFrame({"process_group": names,
                            "group_kind": [str(kinds.get(n, "custom")) for n in names],
                            "size": [len(members[n]) for n in names],
                            "members": [list(members[n]) for n in names]})
    cache[key] = out.reset_index(drop=True)
    return cache[key]


def collective_instances(trace: Trace) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(member rows with lateness, one row per instance). Shared with comm_stats.

    Expected size comes from the group table (majority view); an instance
    with fewer arrivals than members is incomplete (a hang, not a straggler).
    Rows are sorted by (group, seq, arrival) once and every per-instance
    value is a numpy segment reduction over that order."""
    ops = trace.ops
    mask = ((ops["kind"] == "collective") & (ops["collective_seq_id"] >= 0) & (ops["process_group"] != "")).to_numpy()
    coll = ops.loc[mask, ["rank", "op_id", "op_name", "process_group", "collective_seq_id", "step", "bytes",
                          "start_ns", "end_ns"]]
    if not len(coll):
        return coll, pd.DataFrame()
    pg_code = coll["process_group"].cat.codes.to_numpy().astype(np.int64)
    seq = coll["collective_seq_id"].to_numpy()
    start = coll["start_ns"].to_numpy()
    order = np.lexsort((start, seq, pg_code))
    coll = coll.iloc[order].reset_index(drop=True)
    pg_code, seq, start = pg_code[order], seq[order], start[order]
    end = coll["end_ns"].to_numpy()
    new = np.ones(len(coll), dtype=bool)
    new[1:] = (pg_code[1:] != pg_code[:-1]) | (seq[1:] != seq[:-1])
    first = np.flatnonzero(new)
    last = np.r_[first[1:], len(coll)] - 1
    arrived = last - first + 1
    inst_id = np.cumsum(new) - 1
    end_for_min = np.where(end < 0, -1, end)
    sizes = group_table(trace).set_index("process_group")["size"]
    names = coll["process_group"].cat.categories.astype(str)
    pg_names = names[pg_code[first]]
    expected = pd.Series(pg_names).map(sizes).fillna(0).to_numpy(dtype=np.int64)
    inst = pd.DataFrame({
        "process_group": pg_names, "collective_seq_id": seq[first],
        "op_name": coll["op_name"].to_numpy()[first].astype(str),
        "step": np.maximum.reduceat(coll["step"].to_numpy(), first),
        "bytes": np.maximum.reduceat(coll["bytes"].to_numpy(), first),
        "arrived": arrived, "first_ns": start[first], "last_ns": start[last],
        "last_rank": coll["rank"].to_numpy()[last].astype(np.int64), "last_op_id": coll["op_id"].to_numpy()[last],
        "min_end_ns": np.minimum.reduceat(end_for_min, first), "max_end_ns": np.maximum.reduceat(end, first),
        "members": np.maximum(expected, arrived),
    })
    inst["complete"] = (inst["arrived"] == inst["members"]) & (inst["min_end_ns"] >= 0)
    inst["skew_ns"] = inst["last_ns"] - inst["first_ns"]
    inst["waited_ns"] = inst["arrived"] * inst["last_ns"] - np.add.reduceat(start, first)
    inst["op_ns"] = np.where(inst["complete"], inst["max_end_ns"] - inst["last_ns"], -1)
    coll["late_ns"] = start - start[first][inst_id]
    coll["instance"] = inst_id
    return coll, inst


def _peer_key(trace: Trace, ranks: np.ndarray) -> np.ndarray:
    pp = {r: info.coords.get("pp", 0) for r, info in trace.ranks.items()}
    return np.array([pp.get(int(r), 0) for r in ranks], dtype="int64")


def analyze_stragglers(trace: Trace, min_saving_frac: float = 0.05, min_last_frac: float = 0.5) -> StragglerResult:
    res = StragglerResult()
    coll, inst = collective_instances(trace)
    ops = trace.ops
    cm = ((ops["kind"] == "compute") & (ops["end_ns"] >= 0) & (ops["step"] >= 0)).to_numpy()
    comp = ops.loc[cm, ["rank", "step", "duration_ns"]]
    cstep = comp.groupby(["rank", "step"])["duration_ns"].sum().rename("compute_ns").reset_index()
    if len(cstep):
        cstep["peer"] = _peer_key(trace, cstep["rank"].to_numpy())
        g = cstep.groupby(["peer", "step"])["compute_ns"]
        n, total = g.transform("size"), g.transform("sum")
        # the others' median: with two peers that is simply the other one
        cstep["peer_median_ns"] = np.where(n == 2, total - cstep["compute_ns"],
                                           np.where(n >= 3, g.transform("median"), np.nan))
        cstep["compute_ratio"] = cstep["compute_ns"] / cstep["peer_median_ns"].where(cstep["peer_median_ns"] > 0)
        cstep["excess_ns"] = (cstep["compute_ns"] - cstep["peer_median_ns"]).clip(lower=0)
    res.instances = inst
    if not len(inst) and not len(cstep):
        return res
    done = inst[inst["complete"]] if len(inst) else inst
    empty = pd.DataFrame({"rank": pd.Series(dtype="int64"), "step": pd.Series(dtype="int64")})
    late_df, caused_df = empty.assign(late_ns=0.0), empty.assign(caused_ns=0.0)
    n_last = n_in = pd.Series(dtype="int64")
    if len(coll) and len(done):
        ok = coll[inst["complete"].to_numpy()[coll["instance"].to_numpy()]]
        late_df = ok[ok["step"] >= 0].groupby(["rank", "step"], as_index=False)["late_ns"].sum()
        caused_df = (done[done["step"] >= 0].groupby(["last_rank", "step"], as_index=False)["skew_ns"].sum()
                     .rename(columns={"last_rank": "rank", "skew_ns": "caused_ns"}))
        # set-up and tear-down collectives (step -1) are not training: leave them out of the counts
        n_last = done[done["step"] >= 0].groupby("last_rank").size()
        n_in = ok[ok["step"] >= 0].groupby("rank").size()
    rs = late_df.merge(caused_df, on=["rank", "step"], how="outer")
    cols = ["compute_ns", "peer_median_ns", "compute_ratio", "excess_ns"]
    base = cstep[["rank", "step"] + cols] if len(cstep) else empty.assign(**{c: np.nan for c in cols})
    rs = rs.merge(base, on=["rank", "step"], how="outer")
    rs[["late_ns", "caused_ns"]] = rs[["late_ns", "caused_ns"]].fillna(0)
    rs["saving_ns"] = np.minimum(rs["caused_ns"], rs["excess_ns"].fillna(0))
    res.rank_step = rs.sort_values(["rank", "step"]).reset_index(drop=True)

    step_time = _step_times(trace)
    per = rs.groupby("rank").agg(steps=("step", "nunique"), late_ns=("late_ns", "sum"), caused_ns=("caused_ns", "sum"),
                                 saving_ns=("saving_ns", "sum"), compute_ratio=("compute_ratio", "median"))
    per["times_last"] = n_last.reindex(per.index).fillna(0).astype("int64")
    per["collectives"] = n_in.reindex(per.index).fillna(0).astype("int64")
    per["last_frac"] = per["times_last"] / per["collectives"].where(per["collectives"] > 0)
    total_step = float(step_time.sum()) if len(step_time) else float(rs.groupby("step")["compute_ns"].max().sum())
    per["saving_frac"] = per["saving_ns"] / total_step if total_step > 0 else np.nan
    res.ranks = per.reset_index().sort_values("saving_ns", ascending=False).reset_index(drop=True)

    cand = res.ranks[(res.ranks["saving_frac"] >= min_saving_frac) & (res.ranks["last_frac"] >= min_last_frac)
                     & (res.ranks["saving_ns"] >= 1e6)].head(4)
    n_steps = max(1, len(step_time))
    for _, row in cand.iterrows():
        r = int(row["rank"])
        mine = done[done["last_rank"] == r].sort_values("skew_ns", ascending=False).head(5)
        ev = [Evidence(rank=r, note=f"arrived {x['skew_ns'] / MS:.1f} ms after the first of {int(x['members'])} "
                                     f"(step {int(x['step'])})",
                       op_name=str(x["op_name"]), process_group=str(x["process_group"]),
                       seq=int(x["collective_seq_id"]), op_id=int(x["last_op_id"]), time_ns=int(x["last_ns"]))
              for _, x in mine.iterrows()]
        if not ev:
            continue
        ratio = row["compute_ratio"]
        rtext = f", compute {ratio:.1f}x its peers' median" if np.isfinite(ratio) else ""
        res.findings.append(Finding(
            "straggler", "warning",
            f"{rank_label(trace, [r])} is a straggler: last to arrive at {row['last_frac']:.0%} of its collectives"
            f"{rtext}; at the median speed each step would be {row['saving_ns'] / n_steps / MS:.1f} ms shorter "
            f"({row['saving_frac']:.0%} of run time)",
            [r], ev, {"rank": r, "saving_ns": float(row["saving_ns"]), "saving_frac": float(row["saving_frac"]),
                      "saving_per_step_ns": float(row["saving_ns"]) / n_steps,
                      "compute_ratio": float(ratio) if np.isfinite(ratio) else None,
                      "last_frac": float(row["last_frac"])}))
    return res


def _step_times(trace: Trace) -> pd.Series:
    """Wall time per step: the median of ranks' step_time_s, else the span of all ops in the step."""
    m = trace.metrics
    if len(m) and m["step_time_s"].notna().any():
        return (m.groupby("step")["step_time_s"].median() * 1e9).dropna()
    mask = ((trace.ops["step"] >= 0) & (trace.ops["end_ns"] >= 0)).to_numpy()
    ops = trace.ops.loc[mask, ["step", "start_ns", "end_ns"]]
    if not len(ops):
        return pd.Series(dtype="float64")
    g = ops.groupby("step")
    return (g["end_ns"].max() - g["start_ns"].min()).astype("float64")
