"""Trace columns to display values: vectorised helpers, mesh coordinates, per-rank state.

Everything here is one pandas / numpy pass over the trace's tables, so it
runs in the loading worker in milliseconds even at 1,024 ranks.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ncclscope import schema as S
from ncclscope.findings import Finding
from ncclscope.load.opsjoin import STATUS_INFLIGHT
from ncclscope.load.trace import RankInfo, RunInfo, Trace
from ncclscope.tui.presenters import MESH_KEYS, NS

COORD_KEYS = ("pp", "dp", "cp", "tp", "ep")   # label order: coarsest first

# ---- Small helpers ---------------------------------------------------------
def plain(s: pd.Series) -> pd.Series:
    """Categorical or object column -> plain str values (vectorised via the codes)."""
    if isinstance(s.dtype, pd.CategoricalDtype):
        cats = np.append(s.cat.categories.astype(str).to_numpy(dtype=object), "")
        return pd.Series(cats.take(s.cat.codes.to_numpy()), index=s.index, dtype=object)
    return s.astype(object).where(s.notna(), "").astype(str)


def describe_ops(df: pd.DataFrame) -> pd.Series:
    """Vectorised `summary.describe_op`: `all_reduce #2 on dp0`, `recv #3 peer 2`, `backward mb 1`."""
    if not len(df):
        return pd.Series([], dtype=object, index=df.index)
    name = plain(df["op_name"])
    kind = plain(df["kind"])
    seq = np.where(df["collective_seq_id"] >= 0, df["collective_seq_id"], df["p2p_seq_id"])
    comm = kind.isin([S.KIND_COLLECTIVE, S.KIND_P2P])
    group = plain(df["process_group"])
    out = name + np.where(seq >= 0, " #" + pd.Series(seq, index=df.index).astype(str), "")
    out = out + np.where(comm & (group != ""), " on " + group, "")
    out = out + np.where((kind == S.KIND_P2P) & (df["peer"] >= 0), " peer " + df["peer"].astype(str), "")
    out = out + np.where(df["microbatch"] >= 0, " mb " + df["microbatch"].astype(str), "")
    return out.astype(str)


def fmt_seconds(ns: float) -> str:
    s = ns / NS
    if s < 0.001:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.1f} s"


def degrees(run: RunInfo, ranks: dict[int, RankInfo]) -> dict[str, int]:
    """Mesh degrees from run.json's config, else from the largest coordinate seen."""
    cfg = run.config
    out = {}
    for k in MESH_KEYS + ("ep",):
        v = cfg.get(k)
        if not isinstance(v, int) or v < 1:
            v = 1 + max((info.coords.get(k, 0) for info in ranks.values()), default=0)
        out[k] = int(v)
    return out


def coords_of(rank: int, info: RankInfo | None, deg: dict[str, int]) -> dict[str, int]:
    """The rank's recorded coordinates, else Megatron order (tp fastest, then cp, dp, pp)."""
    if info is not None and all(k in info.coords for k in MESH_KEYS):
        return {k: int(info.coords[k]) for k in MESH_KEYS}
    r, out = rank, {}
    for k in ("tp", "cp", "dp", "pp"):
        out[k] = r % deg[k]
        r //= deg[k]
    return out


# ---- Per-rank summary (one groupby pass) and cell states -------------------
def rank_frame(trace: Trace) -> pd.DataFrame:
    """Per rank: op count, last / in-flight op text, timeout, error and suspect flags, steps done."""
    idx = pd.Index(sorted(trace.ranks), name="rank")
    ops = trace.ops
    real = ops[(ops["kind"] != S.KIND_MARKER).to_numpy()]
    out = pd.DataFrame(index=idx)
    out["n_ops"] = real.groupby("rank", observed=True).size().reindex(idx).fillna(0).astype(int)
    status = plain(real["status"])
    last = real.groupby("rank", observed=True).tail(1).set_index("rank")
    out["last_op"] = describe_ops(last).reindex(idx).fillna("")
    infl = real[(status == STATUS_INFLIGHT).to_numpy()]
    infl_last = infl.groupby("rank", observed=True).tail(1).set_index("rank")
    out["inflight_op"] = describe_ops(infl_last).reindex(idx).fillna("")
    out["inflight_kind"] = plain(infl_last["kind"]).reindex(idx).fillna("") if len(infl_last) else ""
    out["inflight_start"] = infl_last["start_ns"].reindex(idx).fillna(-1).astype("int64")
    for flag, value in (("timeout", S.STATUS_TIMEOUT), ("error", S.STATUS_ERROR)):
        hit = real.loc[(status == value).to_numpy(), "rank"].unique()
        out[flag] = idx.isin(hit)
    ev = trace.events
    sus = ev[(ev["status"] == S.STATUS_SUSPECT).to_numpy()][["rank", "op_id"]]
    if len(sus) and len(infl):
        still = sus.merge(infl[["rank", "op_id"]], on=["rank", "op_id"])
        out["suspect"] = idx.isin(still["rank"].unique())
    else:
        out["suspect"] = False
    if len(trace.metrics):
        steps = trace.metrics.groupby("rank", observed=True)["step"].max() + 1
    else:
        steps = real.groupby("rank", observed=True)["step"].max() + 1 if len(real) else pd.Series(dtype=int)
    out["steps"] = steps.reindex(idx).fillna(0).astype(int).clip(lower=0)
    return out


def cell_states(trace: Trace, frame: pd.DataFrame, findings: list[Finding], live: bool,
                rank_states: pd.DataFrame | None = None) -> pd.Series:
    """Display state per rank, most specific evidence first.

    Findings win (dead_rank -> dead, stuck_in_compute -> stuck); then how the
    process ended; then what the trace shows (timeout rows, suspect markers,
    an op still in flight at the end of a post-mortem)."""
    idx = frame.index
    info = pd.Series([trace.ranks[r].state for r in idx], index=idx)
    dead = [r for f in findings if f.kind == "dead_rank" for r in f.ranks]
    stuck = [r for f in findings if f.kind == "stuck_in_compute" for r in f.ranks]
    role = rank_states["role"].reindex(idx) if rank_states is not None and "role" in rank_states else None
    post = ~pd.Series(live, index=idx) & info.isin(["stopped", "unknown", "failed"])   # post-mortem, unfinished
    conds = [
        (info == "killed") | ((info == "missing") & (not live)) | idx.isin(dead) | (role == "dead" if role is not None
                                                                                    else False),
        idx.isin(stuck) | (post & (frame["inflight_kind"] == S.KIND_COMPUTE) & ~frame["timeout"] & ~frame["error"]
                           & (info != "failed")),
        frame["timeout"],
        frame["suspect"] | (post & (frame["inflight_op"] != "") & ~frame["error"]),
        info == "finished",
        (info == "failed") | frame["error"],
        pd.Series(live, index=idx) & info.isin(["unknown", "missing"]),
    ]
    choices = ["dead", "stuck", "timeout", "suspect", "finished", "failed", "running"]
    return pd.Series(np.select([np.asarray(c, dtype=bool) for c in conds], choices, "unknown"), index=idx)


def varying_keys(trace: Trace) -> list[str]:
    """Mesh coordinates that take more than one value in this run (tp, cp, pp, dp, ep), coarsest first."""
    deg = degrees(trace.run, trace.ranks)
    return [k for k in COORD_KEYS if deg.get(k, 1) > 1]


def coord_label(rank: int, trace: Trace, keys: list[str] | None = None, sep: str = " ") -> str:
    """"pp0 dp1 tp1": every coordinate that varies in the run, so no two ranks share a label."""
    deg = degrees(trace.run, trace.ranks)
    keys = varying_keys(trace) if keys is None else keys
    info = trace.ranks.get(rank)
    c = coords_of(rank, info, deg)
    if "ep" in keys:
        c["ep"] = int(info.coords.get("ep", -1)) if info is not None and "ep" in info.coords else -1
    return sep.join(f"{k}{c[k]}" for k in keys if c.get(k, -1) >= 0)
