"""Communication statistics: bytes, latency, bandwidth, who talks to whom.

Why: "the all-reduce is slow" means nothing until it is a number next to
what the link can do. We use the nccl-tests definitions so figures compare
with what users already measured on their cluster:

    algbw = S / t          S = the operation's buffer size in bytes
    busbw = algbw * factor all_reduce 2(n-1)/n; all_gather, reduce_scatter,
                           all_to_all (n-1)/n; broadcast, reduce, send/recv 1

`bytes` in our trace is this rank's input tensor, so S = n * bytes for
all_gather (its input is one shard of the output) and S = bytes otherwise.

Latency of a collective instance is measured from the *last* arrival to the
last completion: the time the operation itself took once everyone was there.
Waiting for a late peer is a straggler (stragglers.py), not a slow link, so
it must not pollute the bandwidth numbers.

`slow_collective`: an instance whose latency is far above the median of the
same operation (same op, group kind and size, at least `min_count` of them),
i.e. off its own baseline. On ranks that share cores a single instance now
and then takes 5-10x its median (the process was descheduled), so a finding
is a `warning` only when the slow instances are a pattern that costs time.
Counted are instances in training steps after the first (the first carries
gloo's lazy connection set-up) whose excess over the median is at least
STALL_FLOOR_MS (50 ms: the largest scheduler hiccup seen in healthy runs of
8 ranks on 2 cores was about 22 ms, and 5-10x the median is common there).
Their excess must sum to at least MIN_COST_FRAC (5%) of the run's step time,
and either there are at least MIN_SLOW (3) of them and they are at least
MIN_SLOW_FRAC (2%) of that operation's instances, or one alone stalled for
at least max(1 s, 10% of the run). Anything else that is off its median is
reported at `info` with the same numbers.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ncclscope.findings import Evidence, Finding
from ncclscope.load.trace import Trace
from ncclscope.perf.stragglers import collective_instances, group_table, step_times

MS = 1e6
SEND_OPS = ("send", "isend")
STALL_FLOOR_MS = 50.0     # an instance counts towards a warning when this far over its median
MIN_COST_FRAC = 0.05      # slow instances' total excess, fraction of the run's step time
MIN_SLOW = 3              # a pattern: at least this many slow instances ...
MIN_SLOW_FRAC = 0.02      # ... and this share of the operation's instances
SINGLE_STALL_S = 1.0      # or one stall of at least this long ...
SINGLE_STALL_FRAC = 0.10  # ... and this share of the run


def bus_factor(op_name: pd.Series, n: pd.Series) -> np.ndarray:
    """nccl-tests busbw factor for each (op, group size)."""
    name = op_name.astype(str).str.replace("_into_tensor", "", regex=False).str.replace("_tensor", "", regex=False)
    n = n.astype("float64").clip(lower=1)
    return np.select(
        [name.str.startswith("all_reduce"),
         name.str.startswith("all_gather") | name.str.startswith("reduce_scatter") | name.str.startswith("all_to_all")],
        [2 * (n - 1) / n, (n - 1) / n], default=1.0)


def size_bytes(op_name: pd.Series, nbytes: pd.Series, n: pd.Series) -> np.ndarray:
    """The nccl-tests S from our per-rank input bytes."""
    gather = op_name.astype(str).str.startswith("all_gather").to_numpy()
    return np.where(gather, nbytes.to_numpy() * n.to_numpy(), nbytes.to_numpy()).astype("float64")


@dataclass
class CommResult:
    instances: pd.DataFrame = field(default_factory=pd.DataFrame)   # one row per collective instance
    by_op: pd.DataFrame = field(default_factory=pd.DataFrame)       # per op name and process group
    by_kind: pd.DataFrame = field(default_factory=pd.DataFrame)     # per op name and group kind
    p2p: pd.DataFrame = field(default_factory=pd.DataFrame)         # src, dst, bytes, count, latency
    findings: list[Finding] = field(default_factory=list)


def _group_kinds(trace: Trace) -> dict[str, str]:
    g = group_table(trace)
    return dict(zip(g["process_group"], g["group_kind"]))


def _latency_stats(df: pd.DataFrame, keys: list[str], lat: str) -> pd.DataFrame:
    g = df.groupby(keys, observed=True, sort=True)
    out = g.agg(count=(lat, "size"), bytes_total=("bytes", "sum"), bytes_median=("bytes", "median"),
                lat_p50_ms=(lat, "median"), lat_max_ms=(lat, "max"), algbw_gbs=("algbw_gbs", "median"),
                busbw_gbs=("busbw_gbs", "median"))
    q = g[lat].quantile([0.9, 0.99]).unstack().reindex(columns=[0.9, 0.99])   # no columns when all are NaN
    out["lat_p90_ms"], out["lat_p99_ms"] = q[0.9], q[0.99]
    cols = ["count", "bytes_total", "bytes_median", "lat_p50_ms", "lat_p90_ms", "lat_p99_ms", "lat_max_ms",
            "algbw_gbs", "busbw_gbs"]
    return out[cols].reset_index()


def analyze_comm(trace: Trace, slow_factor: float = 5.0, min_excess_ms: float = 1.0, min_count: int = 5,
                 instances: pd.DataFrame | None = None) -> CommResult:
    """`instances` may be passed in from stragglers.collective_instances to avoid recomputing it."""
    res = CommResult()
    kinds = _group_kinds(trace)
    inst = collective_instances(trace, ())[1] if instances is None else instances
    if len(inst):
        inst = inst.copy()
        # object first: where no group has a kind the map is all-NaN float64, which a str fill would not fit
        inst["group_kind"] = inst["process_group"].map(kinds).astype(object).fillna("custom")
        done = inst["complete"] & (inst["op_ns"] >= 0)
        inst["latency_ms"] = np.where(done, inst["op_ns"] / MS, np.nan)
        inst["size_bytes"] = size_bytes(inst["op_name"], inst["bytes"], inst["members"])
        sec = inst["latency_ms"] / 1e3
        inst["algbw_gbs"] = np.where(sec > 0, inst["size_bytes"] / sec / 1e9, np.nan)
        inst["busbw_gbs"] = inst["algbw_gbs"] * bus_factor(inst["op_name"], inst["members"])
        inst.loc[inst["op_name"] == "barrier", ["algbw_gbs", "busbw_gbs"]] = np.nan
        ok = inst[done]
        res.by_op = _latency_stats(ok, ["op_name", "group_kind", "process_group"], "latency_ms")
        res.by_kind = _latency_stats(ok, ["op_name", "group_kind"], "latency_ms")
        g = ok.groupby(["op_name", "group_kind", "bytes"])["latency_ms"]
        # a median needs a few instances before anything is "far off" it
        base = g.transform("median").where(g.transform("size") >= min_count)
        inst["baseline_ms"] = base.reindex(inst.index)
        res.instances = inst
        res.findings += _slow_findings(inst, slow_factor, min_excess_ms, _run_ns(trace))
    res.p2p = p2p_transfers(trace)
    if len(res.p2p):
        p2p_rows = res.p2p.assign(op_name="p2p send", group_kind="p2p", process_group="",
                                  algbw_gbs=res.p2p["algbw_gbs"], busbw_gbs=res.p2p["algbw_gbs"])
        extra = _latency_stats(p2p_rows.rename(columns={"lat_ms": "latency_ms"}),
                               ["op_name", "group_kind"], "latency_ms")
        res.by_kind = pd.concat([res.by_kind, extra], ignore_index=True) if len(res.by_kind) else extra
    return res


def p2p_transfers(trace: Trace) -> pd.DataFrame:
    """Per op pairs (src, dst): send matched to its recv by (src, dst, p2p_seq_id).

    Latency = receive completion - send start (what the consumer saw); the
    matrix sums bytes per (src, dst). A left join of sends with recvs: where
    the recvs' keys are unique (every healthy trace) it is a sorted-key lookup
    over numpy columns (no copy of the p2p rows, no merge), else a merge."""
    ops = trace.ops
    mask = ((ops["kind"] == "p2p") & (ops["peer"] >= 0)).to_numpy()
    if not mask.any():
        return pd.DataFrame(columns=["src", "dst", "seq", "bytes", "lat_ms", "algbw_gbs"])
    rows = np.flatnonzero(mask)
    is_send = ops["op_name"].isin(SEND_OPS).to_numpy()[rows]
    srows, rrows = rows[is_send], rows[~is_send]
    del rows, is_send, mask
    rank, peer, seq = ops["rank"].to_numpy(), ops["peer"].to_numpy(), ops["p2p_seq_id"].to_numpy()
    start, end = ops["start_ns"].to_numpy(), ops["end_ns"].to_numpy()
    s = {"src": rank[srows].astype("int64"), "dst": peer[srows].astype("int64"), "seq": seq[srows],
         "bytes": ops["bytes"].to_numpy()[srows], "t0": start[srows], "s_end": end[srows]}
    r = {"src": peer[rrows].astype("int64"), "dst": rank[rrows].astype("int64"), "seq": seq[rrows],
         "r_end": end[rrows]}
    hit = (unique_lookup([s["src"], s["dst"], s["seq"]], [r["src"], r["dst"], r["seq"]])
           if len(srows) and len(rrows) else None)
    if hit is None:               # duplicate recv keys (or keys too wide to pack): the merge's many-to-many rows
        pairs = pd.DataFrame(s).merge(pd.DataFrame(r), on=["src", "dst", "seq"], how="left")
        end = pairs["r_end"].where(pairs["r_end"].notna() & (pairs["r_end"] >= 0), pairs["s_end"])
        lat = (end - pairs["t0"]).where(end >= 0) / MS
        pairs["lat_ms"] = lat
        pairs["algbw_gbs"] = np.where(lat > 0, pairs["bytes"] / (lat / 1e3) / 1e9, np.nan)
        return pairs[["src", "dst", "seq", "bytes", "lat_ms", "algbw_gbs"]].reset_index(drop=True)
    pos, found = hit
    r_end = r["r_end"][pos]
    if found.all():               # as the merge: int64 end times, int64 differences
        e = np.where(r_end >= 0, r_end, s["s_end"])
        diff = (e - s["t0"]).astype(np.float64)
    else:                         # a send without its recv: the merge's NaN makes the end times float64
        r_end = np.where(found, r_end.astype(np.float64), np.nan)
        e = np.where(found & (r_end >= 0), r_end, s["s_end"].astype(np.float64))
        diff = e - s["t0"].astype(np.float64)
    lat = np.where(e >= 0, diff, np.nan) / MS
    with np.errstate(divide="ignore", invalid="ignore"):
        bw = np.where(lat > 0, s["bytes"] / (lat / 1e3) / 1e9, np.nan)
    return pd.DataFrame({"src": s["src"], "dst": s["dst"], "seq": s["seq"], "bytes": s["bytes"], "lat_ms": lat,
                         "algbw_gbs": bw})


def unique_lookup(left: list[np.ndarray], right: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray] | None:
    """For each left key (tuple of int columns), the position of the equal right key and whether there is
    one; None when right keys repeat (a left join would multiply rows) or do not pack into one int64."""
    lo = [min(int(a.min()) if len(a) else 0, int(b.min()) if len(b) else 0) for a, b in zip(left, right)]
    hi = [max(int(a.max()) if len(a) else 0, int(b.max()) if len(b) else 0) for a, b in zip(left, right)]
    width = [h - l + 1 for l, h in zip(lo, hi)]
    if float(np.prod([float(w) for w in width])) >= 2.0**62:
        return None

    def pack(cols: list[np.ndarray]) -> np.ndarray:
        key = np.zeros(len(cols[0]), dtype=np.int64)
        for c, l, w in zip(cols, lo, width):
            key *= w
            key += c.astype(np.int64) - l
        return key

    rk = pack(right)
    order = np.argsort(rk, kind="stable")
    rk = rk[order]
    if len(rk) > 1 and bool((rk[1:] == rk[:-1]).any()):
        return None
    lk = pack(left)
    if not len(rk):
        return np.zeros(len(lk), dtype=np.int64), np.zeros(len(lk), dtype=bool)
    at = np.minimum(np.searchsorted(rk, lk), len(rk) - 1)
    return order[at], rk[at] == lk


def p2p_matrix(p2p: pd.DataFrame) -> pd.DataFrame:
    """(src, dst) -> bytes and message count: the traffic matrix."""
    if not len(p2p):
        return pd.DataFrame(columns=["src", "dst", "bytes", "count"])
    return p2p.groupby(["src", "dst"], as_index=False).agg(bytes=("bytes", "sum"), count=("bytes", "size"))


def _run_ns(trace: Trace) -> float:
    t = step_times(trace)
    return float(t.sum()) if len(t) else float("nan")


def _slow_findings(inst: pd.DataFrame, factor: float, min_excess_ms: float, run_ns: float = float("nan")) -> list[Finding]:
    slow = inst[(inst["latency_ms"] > factor * inst["baseline_ms"])
                & (inst["latency_ms"] - inst["baseline_ms"] >= min_excess_ms)]
    steps = np.sort(inst.loc[inst["step"] >= 0, "step"].unique())
    first = int(steps[0]) if len(steps) >= 3 else -1
    out: list[Finding] = []
    for (op, kind), sub in slow.groupby(["op_name", "group_kind"], sort=True):
        same = inst[(inst["op_name"] == op) & (inst["group_kind"] == kind) & inst["latency_ms"].notna()]
        worst = sub.sort_values("latency_ms", ascending=False)
        ev = [Evidence(rank=int(x["last_rank"]), note=(
            f"took {x['latency_ms']:.1f} ms after the last arrival, median {x['baseline_ms']:.2f} ms "
            f"for {int(x['bytes'])} B (step {int(x['step'])})"),
            op_name=str(op), process_group=str(x["process_group"]), seq=int(x["collective_seq_id"]),
            op_id=int(x["last_op_id"]), time_ns=int(x["last_ns"])) for _, x in worst.head(8).iterrows()]
        top = worst.iloc[0]
        counted = sub[(sub["step"] >= 0) & (sub["step"] != first)
                      & (sub["latency_ms"] - sub["baseline_ms"] >= STALL_FLOOR_MS)]
        excess_ms = (counted["latency_ms"] - counted["baseline_ms"]).clip(lower=0)
        cost = float(excess_ms.sum() * MS / run_ns) if np.isfinite(run_ns) and run_ns > 0 else float("nan")
        n_same = max(1, int(((same["step"] >= 0) & (same["step"] != first)).sum()))
        pattern = len(counted) >= MIN_SLOW and len(counted) >= MIN_SLOW_FRAC * n_same
        single = len(excess_ms) > 0 and float(excess_ms.max()) * MS >= max(
            SINGLE_STALL_S * 1e9, SINGLE_STALL_FRAC * (run_ns if np.isfinite(run_ns) else np.inf))
        significant = bool(np.isfinite(cost) and cost >= MIN_COST_FRAC and (pattern or single))
        title = (f"{len(sub)} of {len(same)} {op} on {kind} groups took over {factor:g}x their median; worst "
                 f"{top['latency_ms']:.1f} ms vs {top['baseline_ms']:.2f} ms ({top['process_group']} "
                 f"#{int(top['collective_seq_id'])}, step {int(top['step'])})")
        cost_txt = f"{cost:.0%} of the run" if np.isfinite(cost) else "cost unknown"
        if significant:
            title += f"; together {excess_ms.sum():.1f} ms over the median ({cost_txt})"
        else:
            title += (f"; within this run's noise ({len(counted)} after the first step over the median by "
                      f"{STALL_FLOOR_MS:g} ms or more, {cost_txt}; a warning needs {MIN_SLOW}+ costing "
                      f"{MIN_COST_FRAC:.0%})")
        out.append(Finding(
            "slow_collective", "warning" if significant else "info", title,
            sorted({int(r) for r in worst["last_rank"].head(8)}), ev,
            {"op_name": str(op), "group_kind": str(kind), "count": int(len(sub)),
             "worst_ms": float(top["latency_ms"]), "median_ms": float(top["baseline_ms"]),
             "cost_frac": cost if np.isfinite(cost) else None, "significant": significant}))
    return out
