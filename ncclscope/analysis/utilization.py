"""Utilization: how busy each device was, and what it waited on when it was not.

Why: a GPU at 30% is a symptom; the cause is whatever the rank was doing
instead of computing. Two views are joined here:

- sampled: the NVML sampler's gpu_util (or, with no GPU, the host sampler's
  process cpu_percent) per rank over time. A sample below `idle_pct` is an
  idle sample; it is joined (as-of, per rank) to the op in flight at that
  moment, so "idle 40% of the time, mostly in all_reduce on dp3" falls out.
- traced: the fraction of each rank's active span spent in compute spans
  (a clock-based busy fraction that needs no sampler).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ..trace import Trace
from .bubbles import union_length


@dataclass
class UtilResult:
    per_rank: pd.DataFrame = field(default_factory=pd.DataFrame)   # rank, source, util stats, compute_frac, top wait
    idle: pd.DataFrame = field(default_factory=pd.DataFrame)       # idle samples joined to the op in flight
    waits: pd.DataFrame = field(default_factory=pd.DataFrame)      # rank, waiting_on, samples
    series: pd.DataFrame = field(default_factory=pd.DataFrame)     # rank, time_ns, util (for the report)
    source: str = ""
    findings: list = field(default_factory=list)


def _util_series(trace: Trace) -> tuple[pd.DataFrame, str]:
    s = trace.samples
    if not len(s):
        return pd.DataFrame(columns=["rank", "time_ns", "util"]), ""
    nvml = s["source"].astype(str) == "nvml"
    util = np.where(nvml, s["gpu_util"], s["cpu_percent"])
    source = "nvml gpu_util" if nvml.any() else "host cpu_percent"
    out = pd.DataFrame({"rank": s["rank"].astype("int64"), "time_ns": s["time_ns"], "util": util})
    return out[np.isfinite(out["util"])].sort_values(["rank", "time_ns"]).reset_index(drop=True), source


def analyze_utilization(trace: Trace, idle_pct: float = 10.0) -> UtilResult:
    res = UtilResult()
    series, res.source = _util_series(trace)
    res.series = series
    o = trace.ops
    real = (o["kind"] != "marker").to_numpy()
    cols = ["rank", "kind", "op_name", "process_group", "peer", "start_ns", "end_ns"]
    ops = o[cols] if real.all() else o.loc[real, cols]     # no copy of every op when none is a marker
    # traced busy fraction: union of compute spans over the rank's active span
    comp = ops.loc[((ops["kind"] == "compute") & (ops["end_ns"] >= 0)).to_numpy(), ["rank", "start_ns", "end_ns"]]
    span = ops.groupby("rank").agg(first=("start_ns", "min"), last=("end_ns", "max"))
    per = pd.DataFrame({"active_ns": span["last"] - span["first"]})
    busy = union_length(comp["rank"].to_numpy().astype("int64"), comp["start_ns"].to_numpy(), comp["end_ns"].to_numpy(),
                        int(per.index.max()) + 1 if len(per) else 0)
    per["compute_ns"] = busy[per.index.to_numpy()] if len(busy) else 0.0
    per["compute_frac"] = per["compute_ns"] / per["active_ns"].where(per["active_ns"] > 0)
    if len(series):
        g = series.groupby("rank")["util"]
        st = pd.DataFrame({"samples": g.size(), "util_mean": g.mean(), "util_p10": g.quantile(0.1),
                           "idle_frac": series.assign(i=series["util"] < idle_pct).groupby("rank")["i"].mean()})
        per = per.join(st, how="outer")
        idle = series[series["util"] < idle_pct]
        res.idle = _join_inflight(idle, ops)
        if len(res.idle):
            w = res.idle.groupby(["rank", "waiting_on"]).size().rename("samples").reset_index()
            res.waits = w.sort_values(["rank", "samples"], ascending=[True, False]).reset_index(drop=True)
            top = res.waits.drop_duplicates("rank").set_index("rank")["waiting_on"]
            per["top_wait"] = top.reindex(per.index)
    per.index.name = "rank"
    res.per_rank = per.reset_index()
    return res


def _join_inflight(samples: pd.DataFrame, ops: pd.DataFrame) -> pd.DataFrame:
    """Each sample -> the latest-started op on its rank still running at that time.

    As-of join on start time, then a check that the op had not ended; an op
    nested inside a longer one may hide the outer one, an accepted blur.
    Labels are built per distinct (op, group, peer), not per sample."""
    cols = ["rank", "time_ns", "util", "waiting_on"]
    if not len(samples):
        return pd.DataFrame(columns=cols)
    cols_w = ["rank", "start_ns", "end_ns", "op_name", "process_group", "peer", "kind"]
    t = samples["time_ns"].to_numpy()
    lo, hi = t.min(), t.max()
    st, en = ops["start_ns"].to_numpy(), ops["end_ns"].to_numpy()
    near = np.flatnonzero((st <= hi) & ((en < 0) | (en >= lo)))
    # the ops near the samples, ordered by start: one take per column (no copy before the sort)
    rows = near[np.argsort(st[near], kind="stable")]
    del near
    waits = pd.DataFrame({c: (ops[c].array.take(rows) if isinstance(ops[c].dtype, pd.CategoricalDtype)
                              else ops[c].to_numpy()[rows]) for c in cols_w}, index=ops.index[rows])
    waits["rank"] = waits["rank"].astype("int64")
    del rows
    smp = samples.iloc[np.argsort(t, kind="stable")]
    j = pd.merge_asof(smp, waits, left_on="time_ns", right_on="start_ns", by="rank", direction="backward")
    running = (j["start_ns"].notna() & ((j["end_ns"] < 0) | (j["end_ns"] >= j["time_ns"]))).to_numpy()
    j["peer"] = j["peer"].fillna(-1).astype("int64")
    out = np.full(len(j), "outside traced ops", dtype=object)
    coded = _labels_by_codes(j, running)
    if coded is not None:
        out[running] = coded
    else:
        key = j.loc[running, ["op_name", "process_group", "kind", "peer"]].astype(
            {"op_name": object, "process_group": object, "kind": object})
        uniq = key.drop_duplicates()
        labels = [_label(n, g, k, pe) for n, g, k, pe in uniq.itertuples(index=False)]
        lab = pd.Series(labels, index=pd.MultiIndex.from_frame(uniq), dtype=object)
        if len(key):
            out[running] = lab.reindex(pd.MultiIndex.from_frame(key)).to_numpy()
    j["waiting_on"] = out
    return j[cols].sort_values(["rank", "time_ns"], kind="stable").reset_index(drop=True)


def _label(n, g, k, pe) -> str:
    """What a sample waited on: "irecv peer 3", "all_reduce on dp0", "forward"."""
    return f"{n} peer {pe}" if k == "p2p" else (f"{n} on {g}" if g else str(n))


def _labels_by_codes(j: pd.DataFrame, running: np.ndarray) -> np.ndarray | None:
    """The labels of the running samples, built once per distinct (op, group, kind, peer) from the
    categorical codes: no Python object per sample. None (the caller builds them from values) when a
    column is not categorical, a code is missing or the codes do not pack into one int64."""
    cols = ("op_name", "process_group", "kind")
    if not running.any() or not all(isinstance(j[c].dtype, pd.CategoricalDtype) for c in cols):
        return None
    codes = [j[c].cat.codes.to_numpy()[running].astype(np.int64) for c in cols]
    peer = j["peer"].to_numpy()[running].astype(np.int64)
    if any(bool((c < 0).any()) for c in codes):
        return None
    widths = [len(j[c].cat.categories) for c in cols] + [int(peer.max()) - int(peer.min()) + 1]
    if float(np.prod([float(w) for w in widths])) >= 2.0**62:
        return None
    packed = np.zeros(len(peer), dtype=np.int64)
    for v, w in zip(codes + [peer - int(peer.min())], widths):
        packed *= w
        packed += v
    inv, uniq = pd.factorize(packed)
    first = np.unique(inv, return_index=True)[1]          # each combination's first sample
    cats = [j[c].cat.categories for c in cols]
    labels = [_label(cats[0][codes[0][i]], cats[1][codes[1][i]], cats[2][codes[2][i]], int(peer[i]))
              for i in first.tolist()]
    return np.asarray(labels, dtype=object)[inv]
