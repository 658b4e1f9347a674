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

from ncclscope.load.trace import Trace
from ncclscope.perf.bubbles import union_length
from ncclscope.index.views import release_heap


@dataclass
class UtilResult:
    per_rank: pd.DataFrame = field(default_factory=pd.DataFrame)   # rank, source, util stats, compute_frac, top wait
    idle: pd.DataFrame = field(default_factory=pd.DataFrame)       # idle samples joined to the op in flight
    waits: pd.DataFrame = field(default_factory=pd.DataFrame)      # rank, waiting_on, samples
    series: pd.DataFrame = field(default_factory=pd.DataFrame)     # rank, time_ns, util (for the report)
    source: str = ""
    findings: list = field(default_factory=list)


def _util_series(s: pd.DataFrame) -> tuple[pd.DataFrame, str]:
    """(rank, time_ns, util) of every sample with a finite value, in (rank, time) order, and its source."""
    if not len(s):
        return pd.DataFrame(columns=["rank", "time_ns", "util"]), ""
    nvml = s["source"] == "nvml"                 # on the categorical as it is: no string per sample
    util = np.where(nvml, s["gpu_util"], s["cpu_percent"])
    source = "nvml gpu_util" if nvml.any() else "host cpu_percent"
    rank, t = s["rank"].to_numpy().astype(np.int64), s["time_ns"].to_numpy()
    finite = np.isfinite(util)
    if not finite.all():
        rank, t, util = rank[finite], t[finite], util[finite]
    else:
        t = t.copy()                             # the frame owns its columns (the samples' stay as they are)
    out = pd.DataFrame({"rank": rank, "time_ns": t, "util": util}, copy=False)
    # the loader gives samples in (rank, time) order: then the (stable, multi-key) sort would only copy them.
    # Stable, so that the ranks of an engine's chunks, sorted chunk by chunk, are in this order too
    ordered = len(rank) < 2 or bool(((rank[1:] > rank[:-1]) | ((rank[1:] == rank[:-1]) & (t[1:] >= t[:-1]))).all())
    return (out if ordered else out.sort_values(["rank", "time_ns"], kind="stable").reset_index(drop=True)), source


@dataclass
class UtilParts:
    """The per-rank half of the analysis: every row of it is one rank's own, so an engine computes it where
    each chunk of ranks was read (engine/ops_chunks.py) and `merge_util_parts` puts the chunks together
    into what one pass over the whole trace gives. The rest (waits, top waits) is `analyze_utilization`'s."""

    per: pd.DataFrame             # index rank: active_ns, compute_ns, compute_frac [, samples, util_mean, ...]
    idle: pd.DataFrame | None     # WAIT_COLUMNS in (rank, time) order; None without samples
    series: pd.DataFrame          # rank, time_ns, util
    source: str
    idle_pct: float


def utilization_parts(o: pd.DataFrame, samples: pd.DataFrame, idle_pct: float = 10.0,
                      trace: Trace | None = None) -> UtilParts:
    """Per rank: its active span, compute time, sample statistics and idle samples joined to the op in
    flight, from its ops `o` and `samples` (any set of whole ranks). `trace`: whose heap to release."""
    series, source = _util_series(samples)
    real = (o["kind"] != "marker").to_numpy()
    cols = ["rank", "kind", "op_name", "process_group", "peer", "start_ns", "end_ns"]
    ops = o[cols] if real.all() else o.loc[real, cols]     # no copy of every op when none is a marker
    # traced busy fraction: union of compute spans over the rank's active span
    comp = ops.loc[((ops["kind"] == "compute") & (ops["end_ns"] >= 0)).to_numpy(), ["rank", "start_ns", "end_ns"]]
    span = _rank_span(ops)
    per = pd.DataFrame({"active_ns": span["last"] - span["first"]})
    busy = union_length(comp["rank"].to_numpy().astype("int64"), comp["start_ns"].to_numpy(), comp["end_ns"].to_numpy(),
                        int(per.index.max()) + 1 if len(per) else 0)
    del comp            # the compute spans (~50 MB at 10 M events) are done before the samples are joined
    release_heap(trace)  # and their heap, with the sweep's, goes back before the join's bigger arrays are mapped
    per["compute_ns"] = busy[per.index.to_numpy()] if len(busy) else 0.0
    per["compute_frac"] = per["compute_ns"] / per["active_ns"].where(per["active_ns"] > 0)
    idle = None
    if len(series):
        g = series.groupby("rank")["util"]
        st = pd.DataFrame({"samples": g.size(), "util_mean": g.mean(), "util_p10": g.quantile(0.1),
                           "idle_frac": (series["util"] < idle_pct).groupby(series["rank"]).mean()})
        per = per.join(st, how="outer")
        idle = _join_inflight(series[series["util"] < idle_pct], ops)
    return UtilParts(per=per, idle=idle, series=series, source=source, idle_pct=idle_pct)


PER_COLUMNS = ["active_ns", "compute_ns", "compute_frac", "samples", "util_mean", "util_p10", "idle_frac"]


def merge_util_parts(parts: list[UtilParts]) -> UtilParts:
    """Chunks of whole ranks, in rank order, as one UtilParts: the one `utilization_parts` gives on them all
    (columns in one order, the wait labels' categories sorted over every chunk as `_label_column` sorts
    them; an empty chunk adds nothing that would change a column's type)."""
    if len(parts) == 1:
        return parts[0]
    pers = [p.per for p in parts if len(p.per)] or [parts[0].per]
    per = pd.concat(pers) if len(pers) > 1 else pers[0]
    per = per[[c for c in PER_COLUMNS if c in per.columns]]
    sers = [p.series for p in parts if len(p.series)]
    series = pd.concat(sers, ignore_index=True) if sers else parts[0].series
    sources = [p.source for p in parts if p.source]
    source = "nvml gpu_util" if "nvml gpu_util" in sources else (sources[0] if sources else "")
    idles = [p.idle for p in parts if p.idle is not None]
    idle = None
    if idles:
        full = [d for d in idles if len(d)]
        idle = _concat_idle(full) if full else idles[0]
    return UtilParts(per=per, idle=idle, series=series, source=source, idle_pct=parts[0].idle_pct)


def _concat_idle(frames: list[pd.DataFrame]) -> pd.DataFrame:
    """Joined idle samples of several chunks: their `waiting_on` labels made one categorical by
    `_label_column`, as one pass over all of them makes it (distinct labels, sorted)."""
    if len(frames) == 1:
        return frames[0]
    labels = np.concatenate([f["waiting_on"].to_numpy(dtype=object) for f in frames])
    out = pd.concat([f.drop(columns="waiting_on") for f in frames], ignore_index=True)
    out["waiting_on"] = _label_column(labels)
    return out


def analyze_utilization(trace: Trace, idle_pct: float = 10.0) -> UtilResult:
    """Per rank, how busy it was and what it waited on. The per-rank half comes from the engine's workers
    when they computed it (`trace.partials`), else from the whole trace here: the same either way."""
    parts = (getattr(trace, "partials", None) or {}).get("utilization")
    if parts is not None and parts.idle_pct != idle_pct and getattr(trace, "ops_only", False):
        # the samples stayed on the workers: another threshold cannot be computed here (never silently empty)
        raise ValueError(f"utilization: this trace's samples were reduced on the workers at idle_pct "
                         f"{parts.idle_pct}; load it without ops_only for idle_pct {idle_pct}")
    if parts is None or parts.idle_pct != idle_pct:
        parts = utilization_parts(trace.ops, trace.samples, idle_pct, trace)
    res = UtilResult(series=parts.series, source=parts.source)
    per = parts.per.copy()
    if parts.idle is not None:
        res.idle = parts.idle
        if len(res.idle):
            w = res.idle.groupby(["rank", "waiting_on"]).size().rename("samples").reset_index()
            res.waits = w.sort_values(["rank", "samples"], ascending=[True, False]).reset_index(drop=True)
            top = res.waits.drop_duplicates("rank").set_index("rank")["waiting_on"]
            per["top_wait"] = top.reindex(per.index)
    per.index.name = "rank"
    res.per_rank = per.reset_index()
    return res


WAIT_COLUMNS = ["rank", "time_ns", "util", "waiting_on"]


def _rank_span(ops: pd.DataFrame) -> pd.DataFrame:
    """Per rank (the index, sorted): `first` start and `last` end of its ops, as
    `ops.groupby("rank").agg(first=("start_ns", "min"), last=("end_ns", "max"))` gives it. On ops in rank
    order (the loader's) one reduction per run of a rank instead of the group-by, whose factorized codes
    and sorted copies of 15 M ops at 16,384 ranks are ~0.4 GB."""
    rank = ops["rank"].to_numpy()
    st, en = ops["start_ns"].to_numpy(), ops["end_ns"].to_numpy()
    if (len(rank) < 2 or rank.dtype.kind not in "iu" or st.dtype.kind != "i" or en.dtype.kind != "i"
            or not bool((rank[1:] >= rank[:-1]).all())):
        return ops.groupby("rank").agg(first=("start_ns", "min"), last=("end_ns", "max"))
    starts = np.flatnonzero(np.r_[True, rank[1:] != rank[:-1]])
    index = pd.Index(rank[starts], name="rank")
    return pd.DataFrame({"first": np.minimum.reduceat(st, starts), "last": np.maximum.reduceat(en, starts)},
                        index=index)


def _join_inflight(samples: pd.DataFrame, ops: pd.DataFrame) -> pd.DataFrame:
    """Each sample -> the latest-started op on its rank still running at that time.

    As-of join on start time, then a check that the op had not ended; an op
    nested inside a longer one may hide the outer one, an accepted blur.
    Labels are built per distinct (op, group, peer), not per sample.

    The as-of join is one searchsorted over (rank, start) packed into one int64 (`_asof_running`), and
    only the ops the running samples land on are taken (`_join_inflight_merge`, the pandas merge_asof, is
    kept for the inputs that do not pack; tests/test_scale_paths.py compares the two)."""
    if not len(samples):
        return pd.DataFrame(columns=WAIT_COLUMNS)
    t = samples["time_ns"].to_numpy()
    st = ops["start_ns"].to_numpy()
    if not len(st) or t.dtype.kind != "i" or st.dtype.kind != "i":
        return _join_inflight_merge(samples, ops)
    srank = samples["rank"].to_numpy()
    found = _asof_running(srank, t, ops)
    if found is None:
        return _join_inflight_merge(samples, ops)
    take, running = found
    jr = pd.DataFrame({c: ops[c].array.take(take) if isinstance(ops[c].dtype, pd.CategoricalDtype)
                       else ops[c].to_numpy()[take] for c in ("op_name", "process_group", "kind")})
    jr["peer"] = ops["peer"].to_numpy()[take].astype("int64")
    out = np.full(len(t), "outside traced ops", dtype=object)
    if running.any():
        out[running] = _running_labels(jr)
    del jr, take, running
    # (rank, time) order, ties in input order: what sorting by time, then by (rank, time), both stable, gives
    rs, ts = srank, t
    ordered = len(rs) < 2 or bool(((rs[1:] > rs[:-1]) | ((rs[1:] == rs[:-1]) & (ts[1:] >= ts[:-1]))).all())
    if ordered:       # columns as they are (the frame below copies them once)
        return pd.DataFrame({"rank": rs, "time_ns": ts, "util": samples["util"].to_numpy(),
                             "waiting_on": _label_column(out)})
    order = np.lexsort((ts, rs))
    return pd.DataFrame({"rank": rs[order], "time_ns": ts[order], "util": samples["util"].to_numpy()[order],
                         "waiting_on": _label_column(out[order])}, copy=False)


def _asof_running(srank: np.ndarray, t: np.ndarray, ops: pd.DataFrame) -> tuple[np.ndarray, np.ndarray] | None:
    """(the row in `ops` of the op each running sample landed on, which samples landed on a running op):
    per sample (rank `srank`, integer time `t`) the latest-started op of its rank, kept where it had not
    ended by then. None when the (rank, start) keys do not pack into one int64 (or no op is near)."""
    orank = ops["rank"].to_numpy()
    st, en = ops["start_ns"].to_numpy(), ops["end_ns"].to_numpy()
    lo, hi = int(t.min()), int(t.max())
    near_mask = (st <= hi) & ((en < 0) | (en >= lo))
    # every op near the samples (the usual case): positions are the identity, no index array of all ops
    near = None if near_mask.all() else np.flatnonzero(near_mask)
    del near_mask
    if near is not None and not len(near):
        return None
    r_near = orank if near is None else orank[near]
    s_near = st if near is None else st[near]
    r0, r1 = min(int(r_near.min()), int(srank.min())), max(int(r_near.max()), int(srank.max()))
    t0 = min(int(s_near.min()), lo)
    width = max(hi, int(s_near.max())) - t0 + 1
    if float(width) * float(r1 - r0 + 1) >= 2.0**62:
        return None
    # okey = (rank - r0) * width + (start - t0), in place: at 16,384 ranks (15 M ops, 7 M samples) every
    # temporary of either length is 60-120 MB
    okey = r_near.astype(np.int64)
    del r_near
    okey -= r0
    okey *= width
    okey += s_near
    okey -= t0
    del s_near
    if len(okey) > 1 and not bool((okey[1:] >= okey[:-1]).all()):
        order = np.argsort(okey, kind="stable")       # (rank, start); ties keep ops order, as merge_asof's right
        okey = okey[order]
        near = order if near is None else near[order]
        del order
    skey = srank.astype(np.int64)                     # the samples in their own order: no copy of them
    skey -= r0
    skey *= width
    skey += t
    skey -= t0
    at = np.searchsorted(okey, skey, side="right")
    at -= 1
    hit = at >= 0
    # the op found is on the sample's rank: same (rank - r0) as the sample's key, which is >= the op's
    hit[hit] = (okey[at[hit]] // width) == (skey[hit] // width)
    del okey, skey
    at[~hit] = 0
    op = at if near is None else near[at]
    del at, near
    e_op = en[op]
    running = hit & ((e_op < 0) | (e_op >= t))
    del e_op, hit
    return op[running], running


def _label_column(labels: np.ndarray) -> pd.Categorical:
    """The per-sample labels (an object array of a few distinct strings, shared) as a categorical whose
    categories are sorted: grouped and sorted it orders as the strings do, at an int code a sample. As a
    string column it was 1.7 s and 180 MB at 7 M samples (16,384 ranks); this is 0.5 s and 14 MB."""
    codes, uniq = pd.factorize(labels)
    names = np.asarray([str(u) for u in uniq], dtype=object)
    order = np.argsort(names.astype(str), kind="stable")
    remap = np.empty(len(order), dtype=np.int64)
    remap[order] = np.arange(len(order))
    small = np.int8 if len(order) < 127 else np.int16 if len(order) < 32_000 else np.int32
    return pd.Categorical.from_codes(remap[codes].astype(small), categories=pd.Index(names[order], dtype=object))


def _running_labels(j: pd.DataFrame) -> np.ndarray:
    """The label of each row of `j` (op_name, process_group, kind, peer of the op a sample landed on)."""
    coded = _labels_by_codes(j, np.ones(len(j), dtype=bool))
    if coded is not None:
        return coded
    key = j[["op_name", "process_group", "kind", "peer"]].astype(
        {"op_name": object, "process_group": object, "kind": object})
    uniq = key.drop_duplicates()
    labels = [_label(n, g, k, pe) for n, g, k, pe in uniq.itertuples(index=False)]
    lab = pd.Series(labels, index=pd.MultiIndex.from_frame(uniq), dtype=object)
    return lab.reindex(pd.MultiIndex.from_frame(key)).to_numpy()


def _join_inflight_merge(samples: pd.DataFrame, ops: pd.DataFrame) -> pd.DataFrame:
    """`_join_inflight` with pandas' merge_asof (the path for inputs whose keys do not pack)."""
    cols = WAIT_COLUMNS
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
    j["waiting_on"] = _label_column(out)
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
