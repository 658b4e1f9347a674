"""Stragglers without compute spans: the effect size from the arrival skew itself.

Why: a user's own script traced by `ncclscope run` has no `compute` rows (its
DDP all-reduces come from Flight Recorder, on gloo with inferred end times), so
the compute ratio that stragglers.py measures a slow rank by does not exist.
What does exist, and is measured, is when each rank posted each collective: a
rank whose data loader sleeps 50 ms a step posts every collective 50 ms after
its peers. The durations of such rows are not evidence (an inferred end is the
next op's creation); their starts are.

The rule (stragglers.py states the rest of the tests, which are the same):

- per complete collective instance, each member's lateness = its start minus
  the median start of the instance's other members (with two members, the
  other one's start), and the delay it caused = its start minus the latest
  other start when it arrived last (what the instance would have saved had it
  come with the runner-up), else 0;
- per (rank, step) -- per instance when the trace has no steps -- the largest
  of each over the step's collectives (collectives posted back to back carry
  one delay, not one each: the what-if saving never counts it twice);
- the effect of a rank: per counted step its lateness minus the median of its
  healthy peers' (every other rank) that step, the median over the steps;
  each healthy peer measured the same way against the others. It must be at
  least (MIN_RATIO - 1) of the median step time and MIN_Z above the noise:
  z = effect / max(sigma, NOISE_FLOOR * step time), sigma the larger of the
  spread of the healthy peers' effects and the spread of one step's lateness
  of a healthy peer (their per-step lateness pooled; with one healthy peer,
  the candidate's own step-to-step spread of the difference). Not the
  standard error of a median over the steps, as for compute: on shared cores
  who posts first is decided by the scheduler in a pattern that repeats step
  after step (gloo's ring releases the ranks in order), so a healthy rank can
  be late by a scheduler slice at most steps; only a lateness beyond what a
  healthy rank shows in one step is a straggler's;
- the last-arrival binomial and the saving floors are stragglers.py's.

effect_ratio is reported as (step time + effect) / step time, so the floors of
straggler_stats (MIN_RATIO, NOISE_FLOOR in log units) read the same here.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ncclscope import schema as S
from ncclscope.index.repetition import loop_iterations
from ncclscope.load.fr_merge import INFERRED
from ncclscope.perf.straggler_stats import ARRIVAL, NOISE_FLOOR, robust_sigma, spread_sigma


def arrival_lateness(coll: pd.DataFrame, inst: pd.DataFrame) -> pd.DataFrame:
    """Per (rank, step) of complete training collectives: arrival_late_ns (lateness against the median of the
    other members, the largest over the step) and arrival_caused_ns (the delay caused as last arriver over
    the runner-up, the largest over the step). `coll` is `collective_instances`' member rows (sorted by
    instance, then arrival; with late_ns, instance, rank, step)."""
    cols = {"rank": pd.Series(dtype="int64"), "step": pd.Series(dtype="int64"),
            "arrival_late_ns": pd.Series(dtype="float64"), "arrival_caused_ns": pd.Series(dtype="float64")}
    if not len(coll) or not len(inst):
        return pd.DataFrame(cols)
    idx = coll["instance"].to_numpy()
    late = coll["late_ns"].to_numpy().astype(np.float64)
    new = np.r_[True, idx[1:] != idx[:-1]]
    first = np.flatnonzero(new)
    seg = np.cumsum(new) - 1
    n = np.diff(np.r_[first, len(idx)])[seg]
    j = np.arange(len(idx)) - first[seg]
    m = np.maximum(n - 1, 1)
    lo, hi = (m - 1) // 2, m // 2

    def other(k: np.ndarray) -> np.ndarray:         # k-th of the other members (sorted), by position
        return late[np.minimum(first[seg] + k + (k >= j), len(late) - 1)]

    med_other = (other(lo) + other(hi)) / 2.0
    runner_up = late[np.maximum(first[seg] + n - 2, 0)]
    caused = np.where((j == n - 1) & (n >= 2), late - runner_up, 0.0)
    behind = late - med_other
    if "gap_late_ns" in coll.columns:  # a rank late only because an earlier op held it is not late here
        behind = np.minimum(behind, coll["gap_late_ns"].to_numpy())
        caused = np.minimum(caused, np.maximum(behind, 0.0))
    ok = (inst["complete"].to_numpy()[idx] & (coll["step"].to_numpy() >= 0) & (n >= 2))
    out = pd.DataFrame({"rank": coll["rank"].to_numpy()[ok], "step": coll["step"].to_numpy()[ok],
                        "arrival_late_ns": behind[ok], "arrival_caused_ns": caused[ok]})
    if not len(out):
        return pd.DataFrame(cols)
    return out.groupby(["rank", "step"], as_index=False, sort=True).max()


def with_release(ops: pd.DataFrame, coll: pd.DataFrame) -> pd.DataFrame:
    """`coll` with gap_ns: how long each member was out of communication before posting (its start minus the
    end of its previous collective or p2p op; NaN where that end is not known), and gap_late_ns: that gap
    minus the smallest of the instance's other members' (+inf where unknown), read by held_by and
    arrival_lateness. Lateness propagates: a rank
    that waited in a barrier for a slow peer posts its next collective late too, by no doing of its own.
    Its gap before that next collective is its usual one; the slow rank's gap holds the delay."""
    comm = ops["kind"].isin([S.KIND_COLLECTIVE, S.KIND_P2P]).to_numpy()
    rank, op_id = ops["rank"].to_numpy()[comm], ops["op_id"].to_numpy()[comm]
    start, end = ops["start_ns"].to_numpy()[comm], ops["end_ns"].to_numpy()[comm].copy()
    if "message" in ops.columns:   # an end inferred from the next op's start (gloo Flight Recorder) is no end
        msg = ops["message"]
        if isinstance(msg.dtype, pd.CategoricalDtype):     # one test per distinct note, not per row
            hit = np.asarray(msg.cat.categories.astype(str).str.contains(INFERRED, regex=False), bool)
            inferred = np.r_[hit, False][msg.cat.codes.to_numpy()]      # code -1 (no note): last slot
        else:
            inferred = msg.astype(str).str.contains(INFERRED, regex=False).to_numpy()
        end[inferred[comm]] = -1
    order = np.lexsort((start, rank))
    rank, op_id, start, end = rank[order], op_id[order], start[order], end[order]
    prev_end = np.r_[-1, end[:-1]].astype(np.float64)
    prev_end[np.r_[True, rank[1:] != rank[:-1]] | (prev_end < 0)] = np.nan
    gap = pd.Series(start - prev_end, index=pd.MultiIndex.from_arrays([rank, op_id]))
    gap = gap[~gap.index.duplicated(keep=False)]    # op ids reused across merged sources: no gap for those
    key = pd.MultiIndex.from_arrays([coll["rank"].to_numpy(), coll["op_id"].to_numpy()])
    gap_ns = gap.reindex(key).to_numpy().astype(np.float64)
    idx = coll["instance"].to_numpy()             # member rows sorted by instance: one segment each
    new = np.r_[True, idx[1:] != idx[:-1]] if len(idx) else np.zeros(0, bool)
    first, seg = np.flatnonzero(new), np.cumsum(new) - 1
    n = np.diff(np.r_[first, len(idx)])[seg]
    return coll.assign(gap_ns=gap_ns, gap_late_ns=_gap_lateness(gap_ns, seg, first, n))


def held_by(coll: pd.DataFrame, inst: pd.DataFrame) -> pd.DataFrame:
    """`inst` with last_rank and skew_ns taken from who held each instance up: the member latest by its own
    doing (its arrival lateness, capped by its gap lateness: `with_release`), where some member's is
    known and positive; the raw last arrival elsewhere. A rank that waited for a slow peer in one group
    and so arrived last in the next is not the one that kept that next instance waiting."""
    if "gap_late_ns" not in coll.columns or not len(coll):
        return inst
    idx = coll["instance"].to_numpy()
    new = np.r_[True, idx[1:] != idx[:-1]]
    first, seg = np.flatnonzero(new), np.cumsum(new) - 1
    held = np.minimum(coll["late_ns"].to_numpy().astype(np.float64), coll["gap_late_ns"].to_numpy())
    held = np.where(np.isfinite(held), held, -np.inf)
    order = np.lexsort((held, seg))
    top = order[np.r_[first[1:], len(idx)] - 1]          # the member with the largest held lateness
    best = held[top]
    use = np.isfinite(best) & (best > 0)
    inst = inst.copy()
    at = idx[top][use]
    inst.loc[inst.index[at], "last_rank"] = coll["rank"].to_numpy()[top][use]
    inst.loc[inst.index[at], "skew_ns"] = best[use].astype(np.int64)
    return inst


def _gap_lateness(gap: np.ndarray, seg: np.ndarray, first: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Each member's gap minus the smallest gap among the instance's other members, and never more than its
    own gap (+inf where its gap is unknown: then the arrival lateness alone counts). A rank cannot be late
    by its own doing for longer than it was out of communication: where the others' gaps are unknown, or
    negative (an op nested in another, the broadcasts inside a broadcast_object_list, starts before the
    outer one ends), its own gap bounds it (seed 20261217 #147: rank 2, posting each send as soon as its
    recv from the slow rank's side ended, read as late as the slow rank itself every step)."""
    g = np.where(np.isnan(gap), np.inf, gap)
    order = np.lexsort((g, seg))
    gs = g[order]
    lo1 = gs[first]                                         # smallest and second smallest per instance
    lo2 = gs[np.minimum(first + 1, len(gs) - 1)]
    rank_in = np.empty(len(g), np.int64)
    rank_in[order] = np.arange(len(g)) - first[seg[order]]
    ref = np.where(rank_in == 0, lo2[seg], lo1[seg])
    with np.errstate(invalid="ignore"):            # inf - inf: neither gap known
        out = g - ref
    own = np.where(np.isfinite(g), np.maximum(g, 0.0), np.inf)
    return np.where(n >= 2, np.minimum(np.where(np.isfinite(out), out, np.inf), own), np.inf)


def loop_steps(ops: pd.DataFrame, coll: pd.DataFrame, inst: pd.DataFrame
               ) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """(coll, inst) with each instance's step the iteration of the loop it was issued in, for a trace
    that marks no steps: each rank's collectives (call site, op, group) repeat one loop body
    (repetition.loop_iterations); an instance takes the iteration its lowest member rank counted.
    A slow rank is late once per iteration, not at every collective (ops posted back to back after
    its delay arrive together), so the iteration is the trial. None when no rank's calls repeat."""
    c = ops[((ops["kind"] == "collective") & (ops["collective_seq_id"] >= 0)
             & (ops["process_group"] != "")).to_numpy()]
    if not len(c) or "call_site" not in c.columns:
        return None
    c = c[["rank", "process_group", "collective_seq_id", "start_ns", "call_site", "op_name"]].sort_values(
        ["rank", "start_ns"], kind="stable")
    ranks = c["rank"].to_numpy()
    it = _iterations(c)
    if not (it >= 0).any():
        return None
    per = pd.DataFrame({"process_group": c["process_group"].astype(str).to_numpy(),
                        "collective_seq_id": c["collective_seq_id"].to_numpy(), "rank": ranks, "it": it})
    per = per[per["it"] >= 0].sort_values("rank", kind="stable").drop_duplicates(["process_group", "collective_seq_id"])
    step = inst[["process_group", "collective_seq_id"]].astype({"process_group": str}).merge(
        per[["process_group", "collective_seq_id", "it"]], how="left", on=["process_group", "collective_seq_id"]
    )["it"].fillna(-1).to_numpy(dtype=np.int64)
    return coll.assign(step=step[coll["instance"].to_numpy()]), inst.assign(step=step)


def pseudo_steps(coll: pd.DataFrame, inst: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(coll, inst) with every collective instance its own step, for a trace that marks no steps."""
    coll = coll.assign(step=coll["instance"].to_numpy().astype(np.int64))
    inst = inst.assign(step=np.arange(len(inst), dtype=np.int64))
    return coll, inst


def cadence_step_times(inst: pd.DataFrame) -> pd.Series:
    """Wall time per step from the collectives alone (a trace with no step times in its metrics): from the
    step's first arrival to the next step's (the last step: to its last end). The span of a step's own ops
    would be its collectives' span only, not the work between them."""
    x = inst[inst["step"] >= 0]
    if not len(x):
        return pd.Series(dtype="float64")
    g = x.groupby("step")
    begin, end = g["first_ns"].min().astype("float64"), g["max_end_ns"].max().astype("float64")
    nxt = begin.shift(-1)
    return nxt.fillna(end).sub(begin).clip(lower=0.0)


def arrival_effect(r: int, lateness: pd.DataFrame, counted: np.ndarray, step_ns: float) -> dict:
    """effect_ratio, z, noise, noise_from, late_ms and effect_from of rank r from its arrival lateness
    against the other ranks' over the counted steps (module docstring); {} without a peer or a step time."""
    x = lateness[lateness["step"].isin(counted)]
    piv = x.pivot_table(index="step", columns="rank", values="arrival_late_ns", aggfunc="max")
    if r not in piv.columns or not (step_ns > 0):
        return {}
    piv = piv[piv[r].notna()]
    healthy = [q for q in piv.columns if q != r]
    if not healthy or not len(piv):
        return {}

    def per_step(q: int, ref: list) -> pd.Series:
        return (piv[q] - piv[ref].median(axis=1)).dropna()

    mine = per_step(r, healthy)
    if not len(mine):
        return {}
    effect = float(mine.median())
    n = len(mine)
    if len(healthy) >= 2:
        others = {q: per_step(q, [h for h in healthy if h != q]) for q in healthy}
        pooled = np.concatenate([v.to_numpy(dtype=np.float64) for v in others.values()])
        meds = np.asarray([float(v.median()) for v in others.values() if len(v)])
        noise = max(spread_sigma(meds), spread_sigma(pooled))
        noise_from = f"spread of lateness between {len(healthy)} healthy peers"
    else:
        noise = robust_sigma(mine.to_numpy(dtype=np.float64)) if n >= 3 else float("nan")
        noise_from = f"step-to-step spread of lateness over {n} steps"
    floor = NOISE_FLOOR * step_ns
    z = effect / max(noise, floor) if np.isfinite(noise) else float("nan")
    return {"effect_ratio": 1.0 + effect / step_ns, "z": z, "noise": max(noise, floor) / step_ns if np.isfinite(noise)
            else float("nan"), "noise_from": noise_from, "late_ms": effect / 1e6, "effect_from": ARRIVAL}



P2P_GROUP = "p2p"      # the process group the pseudo-instances of p2p transfers are filed under


def with_p2p_pairs(ops: pd.DataFrame, pairs: pd.DataFrame, coll: pd.DataFrame, inst: pd.DataFrame
                   ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(coll, inst) with each matched, finished send/recv pair of a marked step added as an instance of
    two members (group P2P_GROUP, its send's op name), for the arrival tests.

    Why: a rank that is slow before a p2p transfer makes only its peer wait, in the recv; when the collectives
    around it are posted in step by both (the delay absorbed by the transfer), no collective shows a late
    arrival and the straggler is invisible. A transfer is a rendezvous of its two sides like a collective
    of two: who posted last, and by how much beyond its own gap, reads the same. Pipelines stay quiet: every
    stage's send waits on its own compute the same way, so no stage is late against its peers' median."""
    if not len(pairs) or "state" not in pairs.columns:
        return coll, inst
    m = pairs[(pairs["state"] == "matched").to_numpy()]
    ss, rs_ = m["send_step"].to_numpy(dtype=np.float64), m["recv_step"].to_numpy(dtype=np.float64)
    ok = ((m["send_status"].astype(str) == "ok") & (m["recv_status"].astype(str) == "ok")).to_numpy() \
        & (ss >= 0) & (ss == rs_)
    m = m[ok]
    if not len(m):
        return coll, inst
    n = len(m)
    rank = np.r_[m["src"].to_numpy(), m["dst"].to_numpy()].astype(np.int64)
    op_id = np.r_[m["send_op_id"].to_numpy(), m["recv_op_id"].to_numpy()].astype(np.int64)
    start = np.r_[m["send_start_ns"].to_numpy(), m["recv_start_ns"].to_numpy()].astype(np.int64)
    ends = ops.loc[(ops["kind"] == S.KIND_P2P).to_numpy(), ["rank", "op_id", "end_ns"]]
    end_of = pd.Series(ends["end_ns"].to_numpy(), index=pd.MultiIndex.from_arrays(
        [ends["rank"].to_numpy().astype(np.int64), ends["op_id"].to_numpy()]))
    end_of = end_of[~end_of.index.duplicated(keep=False)]
    end = end_of.reindex(pd.MultiIndex.from_arrays([rank, op_id])).fillna(-1).to_numpy().astype(np.int64)
    pair = np.r_[np.arange(n), np.arange(n)]
    order = np.lexsort((start, pair))               # per pair: the earlier poster first
    rank, op_id, start, end, pair = rank[order], op_id[order], start[order], end[order], pair[order]
    first, last = start[0::2], start[1::2]
    base = len(inst)
    step = ss[ok].astype(np.int64)
    add = pd.DataFrame({
        "process_group": P2P_GROUP, "collective_seq_id": m["seq"].to_numpy().astype(np.int64),
        "op_name": m["send_op_name"].astype(str).to_numpy(), "step": step, "bytes": 0,
        "arrived": 2, "first_ns": first, "last_ns": last, "last_rank": rank[1::2], "last_op_id": op_id[1::2],
        "min_end_ns": np.minimum(end[0::2], end[1::2]), "max_end_ns": np.maximum(end[0::2], end[1::2]),
        "members": 2})
    add["complete"] = add["min_end_ns"] >= 0
    add["skew_ns"] = last - first
    add["waited_ns"] = last - first
    add["op_ns"] = np.where(add["complete"], add["max_end_ns"] - add["last_ns"], -1)
    members = pd.DataFrame({"rank": rank, "step": step[pair], "op_id": op_id,
                            "late_ns": start - np.repeat(first, 2), "instance": base + pair})
    inst = pd.concat([inst, add[inst.columns]], ignore_index=True)
    coll = pd.concat([coll, members[coll.columns]], ignore_index=True)
    return coll, inst


def p2p_loop_steps(ops: pd.DataFrame, pairs: pd.DataFrame) -> pd.DataFrame | None:
    """`pairs` with each side's step the iteration of the loop its op was issued in, for a trace that marks
    no steps: each rank's calls (its sends and receives read with its collectives, in issue order) repeat
    one loop body (repetition.loop_iterations). A transfer both of whose sides fall in one iteration is then
    a rendezvous of that iteration for `with_p2p_pairs`, as in a trace with marked steps. None when no rank's
    calls repeat or there is no pair."""
    if not len(pairs) or "call_site" not in ops.columns:
        return None
    kinds = (ops["kind"] == S.KIND_P2P) | ((ops["kind"] == S.KIND_COLLECTIVE) & (ops["process_group"] != ""))
    c = ops.loc[kinds.to_numpy(), ["rank", "op_id", "call_site", "op_name", "process_group"]]
    if not len(c):
        return None
    c = c.sort_values(["rank", "op_id"], kind="stable")
    ranks = c["rank"].to_numpy().astype(np.int64)
    it = _iterations(c)
    if not (it >= 0).any():
        return None
    of = pd.Series(it, index=pd.MultiIndex.from_arrays([ranks, c["op_id"].to_numpy().astype(np.int64)]))
    of = of[~of.index.duplicated(keep="first")]

    def side(rank: str, op_id: str) -> np.ndarray:
        at = pd.MultiIndex.from_arrays([pairs[rank].to_numpy().astype(np.int64),
                                        pairs[op_id].fillna(-1).to_numpy().astype(np.int64)])
        return of.reindex(at).fillna(-1).to_numpy().astype(np.int64)
    return pairs.assign(send_step=side("src", "send_op_id"), recv_step=side("dst", "recv_op_id"))


def _iterations(c: pd.DataFrame) -> np.ndarray:
    """Per row of `c` (sorted by rank, then issue order): the loop iteration of the call in its rank's
    sequence of (call site, op, group), -1 outside the loop or where the rank's calls never repeat."""
    keys = (c["call_site"].astype(str) + "|" + c["op_name"].astype(str) + "|" + c["process_group"].astype(str)).to_numpy()
    ranks = c["rank"].to_numpy()
    it = np.full(len(c), -1, dtype=np.int64)
    bounds = np.flatnonzero(np.r_[True, ranks[1:] != ranks[:-1], True])
    for a, b in zip(bounds[:-1], bounds[1:]):
        got = loop_iterations(list(keys[a:b]))
        if got is not None:
            it[a:b] = got
    return it
