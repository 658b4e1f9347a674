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

Significance (what makes a `straggler` a warning). Ranks that share cores
(8 ranks on 2 here) take turns being late by scheduler noise; a finding that
changes the exit code must stand out of the run's own noise on all of:

- last arrivals, across steps and collectives: a training step counts as
  "led" when the rank was last at the collectives that hold most of the
  step's waiting (skew-weighted: a collective posted right after another,
  with no compute between, is a coin flip that says nothing; by count when
  no collective has a skew); the number of led steps k of n, against
  Binomial(n, p0) with p0 the skew-weighted mean of 1/members over its
  collectives (every member equally likely last): one-sided tail
  P(X >= k) <= ALPHA (0.01), and k >= MIN_STEP_FRAC (2/3) of n. Steps, not
  collectives, are the trials: a rank descheduled once is late at every
  collective of that step, so collectives of one step are not independent.
  Power: with two-member groups no outcome of n steps is rarer than 2^-n
  (six steps: 1/64 > ALPHA). Where even the most extreme outcome cannot reach
  ALPHA, the rank must show that outcome (last in every step, at least
  MIN_STEPS_ALL = 4, and that record itself at most ALPHA_STRONG: two ranks
  need 5 steps) and its compute effect must reach POWER_Z = 2 * MIN_Z,
  whatever its effect (straggler_stats: a strong effect stands in for a
  weaker record, p <= ALPHA_STRONG, only where a record could reach ALPHA);
- effect size: per counted step (the first step is left out when there are
  three or more: it carries warm-up), a rank's log compute minus the median
  of its healthy peers' (same pipeline position, the candidate excluded) in
  that step; its effect is the median over the steps (a single step in which
  a healthy peer was descheduled for seconds does not move it). The
  candidate's effect (this, or its total compute over the steps against the
  peers' totals, whichever stands out more: each is blind in a case the
  other sees) must be at least log MIN_RATIO (1.25x) and at least
  MIN_Z (3) standard deviations above the healthy peers' effects:
  z = effect / max(sigma, NOISE_FLOOR = 0.10), sigma = the spread of the
  healthy peers' effects (two or more): the larger of 1.4826 * MAD and
  1.2533 * mean absolute deviation from the median (a handful of peers makes
  the MAD alone blind to one slow peer),
  and, for the per-step median, at least the standard error of a median of
  that many steps given the healthy peers' per-step spread pooled; or, with
  a single peer, the larger of the standard error of the median of the
  per-step log ratio (step-to-step consistency) and the same standard error
  from the spread between the ranks of the other pipeline positions (one
  peer cannot show how far two healthy ranks of this run drift apart; the
  other positions' ranks can);
- what-if saving: at least MIN_SAVING_FRAC (5%) of run time and 1 ms per step.

A candidate for the tests passes the saving floor and was last at half its
collectives or caused MIN_CAUSED_SHARE (half) of all the waiting (with
several collectives a step, ZeRO-2's, only the one after the compute shows a
slow rank last). A candidate that passes the floors but not the
tests is reported at `info` severity with its numbers (it does not change
the exit code); `ranks` holds p_last, steps_led, effect_ratio, noise, z. The tests
themselves are `straggler_stats.py`.

Without compute spans (a user's script under `ncclscope run`: collectives
only, on gloo with inferred ends) the effect size and the what-if saving come
from the arrival skew itself, per step (per instance when no step is marked):
`straggler_arrival.py` states that rule; the last-arrival test and the floors
are the ones above.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ncclscope.findings import Evidence, Finding
from ncclscope.load.trace import Trace
from ncclscope.index.views import index_of, release_heap
from ncclscope.index.labels import rank_label
from ncclscope.perf.straggler_arrival import (arrival_effect, arrival_lateness, cadence_step_times, loop_steps,
                                              held_by, p2p_loop_steps, pseudo_steps, with_p2p_pairs, with_release,
                                              P2P_GROUP)
from ncclscope.perf.straggler_stats import ARRIVAL, shortfall_text, significance, stats_text

MS = 1e6
MIN_SAVING_FRAC = 0.05   # what-if saving floor, fraction of run time
MIN_SAVING_STEP_NS = 1e6 # and per step
MIN_CAUSED_SHARE = 0.5   # or this share of all the waiting ranks caused, for a candidate (then the tests decide)


@dataclass
class StragglerResult:
    instances: pd.DataFrame = field(default_factory=pd.DataFrame)
    rank_step: pd.DataFrame = field(default_factory=pd.DataFrame)
    ranks: pd.DataFrame = field(default_factory=pd.DataFrame)
    findings: list[Finding] = field(default_factory=list)


def group_table(trace: Trace) -> pd.DataFrame:
    """One row per process group: name, kind, size, members (the majority view).

    Membership comes from the trace's index (analysis/index.py), which votes
    over the distinct group views (one per distinct groups.json, not one per
    rank) once per trace, for the hang analyses and these alike. Read-only."""
    return index_of(trace).group_table


MEMBER_COLUMNS = ("rank", "op_id", "op_name", "process_group", "collective_seq_id", "step", "bytes", "start_ns",
                  "end_ns")


def collective_instances(trace: Trace, member_columns: tuple[str, ...] = MEMBER_COLUMNS
                         ) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(member rows with lateness, one row per instance). Shared with comm_stats.

    Expected size comes from the group table (majority view); an instance
    with fewer arrivals than members is incomplete (a hang, not a straggler).
    Rows are sorted by (group, seq, arrival) once and every per-instance
    value is a numpy segment reduction over that order. The member rows carry
    `member_columns` (a subset of MEMBER_COLUMNS) plus late_ns and instance:
    a caller that needs three of them does not hold all nine for 2 M rows."""
    ops = trace.ops
    mask = ((ops["kind"] == "collective") & (ops["collective_seq_id"] >= 0) & (ops["process_group"] != "")).to_numpy()
    cols = [c for c in MEMBER_COLUMNS if c in member_columns]
    if not mask.any():
        return ops.loc[mask, cols], pd.DataFrame()
    # rows picked and ordered on numpy columns, then each column taken once in that order (no frame copy
    # of the 2 M collective rows before the sort and another after it)
    rows = np.flatnonzero(mask)
    del mask
    pg_code = ops["process_group"].cat.codes.to_numpy()[rows].astype(np.int64)
    seq = ops["collective_seq_id"].to_numpy()[rows]
    start = ops["start_ns"].to_numpy()[rows]
    order = np.lexsort((start, seq, pg_code))
    rows = rows[order]
    pg_code, seq, start = pg_code[order], seq[order], start[order]
    del order

    def col(c: str, at: np.ndarray = rows) -> object:
        return ops[c].array.take(at) if isinstance(ops[c].dtype, pd.CategoricalDtype) else ops[c].to_numpy()[at]

    end = col("end_ns")
    new = np.ones(len(rows), dtype=bool)
    new[1:] = (pg_code[1:] != pg_code[:-1]) | (seq[1:] != seq[:-1])
    first = np.flatnonzero(new)
    last = np.r_[first[1:], len(rows)] - 1
    arrived = last - first + 1
    inst_id = np.cumsum(new) - 1
    del new
    end_for_min = np.where(end < 0, -1, end)
    sizes = group_table(trace).set_index("process_group")["size"]
    names = ops["process_group"].cat.categories.astype(str)
    pg_names = names[pg_code[first]]
    del pg_code
    expected = pd.Series(pg_names).map(sizes).fillna(0).to_numpy(dtype=np.int64)
    inst = pd.DataFrame({
        "process_group": pg_names, "collective_seq_id": seq[first],
        "op_name": pd.Series(col("op_name", rows[first])).to_numpy().astype(str),
        "step": np.maximum.reduceat(col("step"), first),
        "bytes": np.maximum.reduceat(col("bytes"), first),
        "arrived": arrived, "first_ns": start[first], "last_ns": start[last],
        "last_rank": col("rank", rows[last]).astype(np.int64), "last_op_id": col("op_id", rows[last]),
        "min_end_ns": np.minimum.reduceat(end_for_min, first), "max_end_ns": np.maximum.reduceat(end, first),
        "members": np.maximum(expected, arrived),
    }, copy=False)                      # fresh arrays: no stacked copy
    del end_for_min, end, seq
    inst["complete"] = (inst["arrived"] == inst["members"]) & (inst["min_end_ns"] >= 0)
    inst["skew_ns"] = inst["last_ns"] - inst["first_ns"]
    inst["waited_ns"] = inst["arrived"] * inst["last_ns"] - np.add.reduceat(start, first)
    inst["op_ns"] = np.where(inst["complete"], inst["max_end_ns"] - inst["last_ns"], -1)
    coll = pd.DataFrame({c: col(c) for c in cols}, copy=False)
    del rows
    coll["late_ns"] = start - start[first][inst_id]
    coll["instance"] = inst_id
    return coll, inst


def _peer_key(trace: Trace, ranks: np.ndarray) -> np.ndarray:
    pp = {r: info.coords.get("pp", 0) for r, info in trace.ranks.items()}
    return np.array([pp.get(int(r), 0) for r in ranks], dtype="int64")


def analyze_stragglers(trace: Trace, min_saving_frac: float = MIN_SAVING_FRAC, min_last_frac: float = 0.5) -> StragglerResult:
    """The tables and `straggler` findings of the module docstring."""
    res = StragglerResult()
    coll, inst = collective_instances(trace, ("rank", "step", "op_id"))   # the member columns read here
    cstep = _compute_per_step(trace)
    if not len(inst) and not len(cstep):
        return res
    # no compute spans (a user's script under `ncclscope run`): the effect size is the arrival skew itself
    # (one step number on every op is no step marking: a script whose loop never calls an optimizer)
    by_arrival = not len(cstep)
    steps_marked = bool(len(inst)) and inst.loc[inst["step"] >= 0, "step"].nunique() >= 2
    pairs = None                          # transfers that may have absorbed a slow rank's delay (with_p2p_pairs)
    if by_arrival and not steps_marked:
        looped = loop_steps(trace.ops, coll, inst)
        coll, inst = looped or pseudo_steps(coll, inst)
        if looped is not None:            # each side in the loop iteration it was issued in
            pairs = p2p_loop_steps(trace.ops, index_of(trace).p2p_pairs)
    elif by_arrival:
        pairs = index_of(trace).p2p_pairs
    if pairs is not None:
        coll, inst = with_p2p_pairs(trace.ops, pairs, coll, inst)
    if by_arrival:
        coll = with_release(trace.ops, coll)
        inst = held_by(coll, inst)
    res.instances = inst
    done = inst[inst["complete"]] if len(inst) else inst
    rs, n_last, n_in = _rank_step(coll, inst, done, cstep)
    lateness = arrival_lateness(coll, inst) if by_arrival else None
    if lateness is not None:
        rs = rs.merge(lateness, on=["rank", "step"], how="left")
        rs["saving_ns"] = rs["arrival_caused_ns"].fillna(0.0)
    res.rank_step = rs.sort_values(["rank", "step"]).reset_index(drop=True)
    step_time = step_times(trace)
    if by_arrival and not (steps_marked and len(trace.metrics) and trace.metrics["step_time_s"].notna().any()):
        step_time = cadence_step_times(inst)     # the span of a step's ops is only its collectives' here
    res.ranks = _per_rank(rs, n_last, n_in, step_time)
    n_steps = max(1, len(step_time))
    counted = _counted_steps(rs["step"].dropna().unique())
    release_heap(trace)     # the member-row temporaries above, before _last_by_step makes its own
    led = _last_by_step(coll, inst) if len(coll) and len(done) else pd.DataFrame()
    cand = _candidates(res.ranks, min_saving_frac, min_last_frac, n_steps)
    step_ns = float(step_time[step_time.index.isin(counted)].median()) if len(step_time) else float("nan")
    stats = {int(row["rank"]): significance(
        int(row["rank"]), led, cstep, counted,
        None if lateness is None else arrival_effect(int(row["rank"]), lateness, counted, step_ns))
        for _, row in cand.iterrows()}
    for col in ("p_last", "steps_led", "steps_seen", "effect_ratio", "noise", "z"):
        res.ranks[col] = res.ranks["rank"].map({r: st[col] for r, st in stats.items()}).astype("float64")
    sig = {r for r, st in stats.items() if st["significant"]}
    res.ranks["significant"] = res.ranks["rank"].isin(sig)
    p2p_in = len(inst) > 0 and bool((inst["process_group"] == P2P_GROUP).any())
    what = "collectives and p2p transfers" if p2p_in else "collectives"
    for _, row in cand.iterrows():
        found = _straggler_finding(trace, row, stats[int(row["rank"])], done, n_steps, what)
        if found is not None:
            res.findings.append(found)
    return res


def _compute_per_step(trace: Trace) -> pd.DataFrame:
    """Per (rank, step): compute time and, against the peers at its pipeline position, their median
    (the others' median: with two peers, simply the other one), the ratio and the excess over it."""
    ops = trace.ops
    cm = ((ops["kind"] == "compute") & (ops["end_ns"] >= 0) & (ops["step"] >= 0)).to_numpy()
    comp = ops.loc[cm, ["rank", "step", "duration_ns"]]
    cstep = comp.groupby(["rank", "step"])["duration_ns"].sum().rename("compute_ns").reset_index()
    if len(cstep):
        cstep["peer"] = _peer_key(trace, cstep["rank"].to_numpy())
        g = cstep.groupby(["peer", "step"])["compute_ns"]
        n, total = g.transform("size"), g.transform("sum")
        cstep["peer_median_ns"] = np.where(n == 2, total - cstep["compute_ns"],
                                           np.where(n >= 3, g.transform("median"), np.nan))
        cstep["compute_ratio"] = cstep["compute_ns"] / cstep["peer_median_ns"].where(cstep["peer_median_ns"] > 0)
        cstep["excess_ns"] = (cstep["compute_ns"] - cstep["peer_median_ns"]).clip(lower=0)
    return cstep


def _rank_step(coll: pd.DataFrame, inst: pd.DataFrame, done: pd.DataFrame, cstep: pd.DataFrame
               ) -> tuple[pd.DataFrame, pd.Series, pd.Series]:
    """(per (rank, step): lateness, skew caused as last arriver, compute and its peers' median, what-if
    saving; per rank: times last; per rank: complete training collectives it was in)."""
    empty = pd.DataFrame({"rank": pd.Series(dtype="int64"), "step": pd.Series(dtype="int64")})
    late_df, caused_df = empty.assign(late_ns=0.0), empty.assign(caused_ns=0.0)
    n_last = n_in = pd.Series(dtype="int64")
    if len(coll) and len(done):
        # members of complete instances in training steps: three columns, not a copy of the member rows
        sel = inst["complete"].to_numpy()[coll["instance"].to_numpy()] & (coll["step"].to_numpy() >= 0)
        rank, step = coll["rank"].to_numpy()[sel], coll["step"].to_numpy()[sel]
        codes, late_df = _rank_step_codes(rank, step)
        late_df["late_ns"] = _group_sum(codes, coll["late_ns"].to_numpy()[sel])
        del sel, codes, step
        caused_df = (done[done["step"] >= 0].groupby(["last_rank", "step"], as_index=False)["skew_ns"].sum()
                     .rename(columns={"last_rank": "rank", "skew_ns": "caused_ns"}))
        # set-up and tear-down collectives (step -1) are not training: leave them out of the counts
        n_last = done[done["step"] >= 0].groupby("last_rank").size()
        n_in = pd.Series(rank, copy=False).groupby(rank).size()
        del rank
    rs = late_df.merge(caused_df, on=["rank", "step"], how="outer")
    cols = ["compute_ns", "peer_median_ns", "compute_ratio", "excess_ns"]
    base = cstep[["rank", "step"] + cols] if len(cstep) else empty.assign(**{c: np.nan for c in cols})
    rs = rs.merge(base, on=["rank", "step"], how="outer")
    rs[["late_ns", "caused_ns"]] = rs[["late_ns", "caused_ns"]].fillna(0)
    rs["saving_ns"] = np.minimum(rs["caused_ns"], rs["excess_ns"].fillna(0))
    return rs, n_last, n_in


def _per_rank(rs: pd.DataFrame, n_last: pd.Series, n_in: pd.Series, step_time: pd.Series) -> pd.DataFrame:
    """Per rank: steps, lateness, skew caused, saving (and its share of the run time), median compute
    ratio, times last, collectives, last_frac; sorted by saving."""
    per = rs.groupby("rank").agg(steps=("step", "nunique"), late_ns=("late_ns", "sum"), caused_ns=("caused_ns", "sum"),
                                 saving_ns=("saving_ns", "sum"), compute_ratio=("compute_ratio", "median"))
    per["times_last"] = n_last.reindex(per.index).fillna(0).astype("int64")
    per["collectives"] = n_in.reindex(per.index).fillna(0).astype("int64")
    per["last_frac"] = per["times_last"] / per["collectives"].where(per["collectives"] > 0)
    total_step = float(step_time.sum()) if len(step_time) else float(rs.groupby("step")["compute_ns"].max().sum())
    per["saving_frac"] = per["saving_ns"] / total_step if total_step > 0 else np.nan
    return per.reset_index().sort_values("saving_ns", ascending=False).reset_index(drop=True)


def _candidates(ranks: pd.DataFrame, min_saving_frac: float, min_last_frac: float, n_steps: int) -> pd.DataFrame:
    """The ranks the significance tests decide on (at most 8): past the saving floors, and last at most of
    their collectives or the cause of most of the run's waiting. Arrival counts weigh every collective
    alike, and where a step has several (ZeRO-2: reduce-scatter after the compute, then a norm all-reduce
    and the parameter all-gather) only the one after the compute shows the slow rank."""
    def share_of(col: str) -> pd.Series:
        v = ranks[col].clip(lower=0)
        return v / float(v.sum()) if float(v.sum()) > 0 else v * 0.0
    # the waiting a rank caused, or the saving it alone would give (without compute spans: what its own
    # lateness cost, lateness it passed on to ranks that waited for it not counted)
    share = np.maximum(share_of("caused_ns"), share_of("saving_ns"))
    return ranks[(ranks["saving_frac"] >= min_saving_frac)
                 & ((ranks["last_frac"] >= min_last_frac) | (share >= MIN_CAUSED_SHARE))
                 & (ranks["saving_ns"] >= MIN_SAVING_STEP_NS * n_steps)].head(8)


def _straggler_finding(trace: Trace, row: pd.Series, st: dict, done: pd.DataFrame, n_steps: int,
                       what: str = "collectives") -> Finding | None:
    """The `straggler` finding of one candidate (`row` of the per-rank table, `st` its tests): a warning
    when significant, else `info` with what it lacks. None without an instance it was last at. `what`: the
    rendezvous counted (collectives, and p2p transfers where with_p2p_pairs added them)."""
    r = int(row["rank"])
    mine = done[done["last_rank"] == r].sort_values("skew_ns", ascending=False).head(5)
    ev = [Evidence(rank=r, note=f"arrived {x['skew_ns'] / MS:.1f} ms after the first of {int(x['members'])} "
                                 f"(step {int(x['step'])})",
                   op_name=str(x["op_name"]), process_group=str(x["process_group"]),
                   seq=int(x["collective_seq_id"]), op_id=int(x["last_op_id"]), time_ns=int(x["last_ns"]))
          for _, x in mine.iterrows()]
    if not ev:
        return None
    ratio = row["compute_ratio"]
    rtext = f", compute {ratio:.1f}x its peers' median" if np.isfinite(ratio) else ""
    if st.get("effect_from") == ARRIVAL:
        rtext = f" by a median {st['late_ms']:.1f} ms a step"
    saving = (f"at the median speed each step would be {row['saving_ns'] / n_steps / MS:.1f} ms shorter "
              f"({row['saving_frac']:.0%} of run time)")
    test = stats_text(st)
    if st["significant"]:
        sev = "warning"
        title = (f"{rank_label(trace, [r])} is a straggler: last to arrive at {row['last_frac']:.0%} of its "
                 f"{what}{rtext}; {saving} ({test})")
    else:
        sev = "info"
        title = (f"{rank_label(trace, [r])} was last to arrive at {row['last_frac']:.0%} of its {what}"
                 f"{rtext}, but that is within this run's noise ({test}; {shortfall_text(st)})")
    return Finding(
        "straggler", sev, title,
        [r], ev, {"rank": r, "saving_ns": float(row["saving_ns"]), "saving_frac": float(row["saving_frac"]),
                  "saving_per_step_ns": float(row["saving_ns"]) / n_steps,
                  "compute_ratio": float(ratio) if np.isfinite(ratio) else None,
                  "last_frac": float(row["last_frac"]), "significant": bool(st["significant"]),
                  **{k: (None if isinstance(v, float) and not np.isfinite(v) else v)
                     for k, v in st.items() if k != "significant"}})


def _counted_steps(steps: np.ndarray) -> np.ndarray:
    """Training steps used for the effect size: all but the first when there are three or more (warm-up)."""
    steps = np.sort(np.asarray([s for s in steps if s >= 0], dtype=np.int64))
    return steps[1:] if len(steps) >= 3 else steps


def _last_by_step(coll: pd.DataFrame, inst: pd.DataFrame) -> pd.DataFrame:
    """Per (rank, step): complete training collectives it was in (n), last at (k), sum of 1/members (p0_sum).

    Sorted by (rank, step). One value column is summed at a time over one dense group code (the pandas
    group sums, in row order within a group, as one `groupby(["rank", "step"]).agg` of all six would):
    at 10 M events a frame of the 2 M member rows with every value column was the analysis' peak."""
    idx = coll["instance"].to_numpy()
    members = inst["members"].to_numpy()
    ok = inst["complete"].to_numpy()[idx] & (coll["step"].to_numpy() >= 0) & (members[idx] >= 2)
    idx = idx[ok]
    rank, step = coll["rank"].to_numpy()[ok], coll["step"].to_numpy()[ok]
    del ok
    codes, out = _rank_step_codes(rank, step)
    last = (inst["last_rank"].to_numpy()[idx] == rank).astype(np.int64)
    del rank, step
    out["n"] = np.bincount(codes, minlength=len(out)).astype(np.int64)
    out["k"] = _group_sum(codes, last)
    p0 = 1.0 / members[idx]
    out["p0_sum"] = _group_sum(codes, p0)
    skew = inst["skew_ns"].to_numpy()[idx].astype(np.float64)
    del idx
    out["w"] = _group_sum(codes, skew)
    out["wk"] = _group_sum(codes, skew * last)
    out["wp0_sum"] = _group_sum(codes, skew * p0)
    return out


def _rank_step_codes(rank: np.ndarray, step: np.ndarray) -> tuple[np.ndarray, pd.DataFrame]:
    """(dense group code per row, one row per (rank, step) group in sorted order with those two columns):
    the grouping of `groupby(["rank", "step"], sort=True)`, computed once for several sums. Steps are >= 0."""
    # (rank, step) as one int64 in lexicographic order (step >= 0 and below 2**32 here)
    codes, keys = pd.factorize(rank.astype(np.int64) * (1 << 32) + step.astype(np.int64), sort=True)
    return codes, pd.DataFrame({"rank": (keys >> 32).astype(rank.dtype), "step": (keys & 0xFFFFFFFF).astype(step.dtype)})


def _group_sum(codes: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per dense code 0..n-1 (every code present) the pandas group sum of `values` (compensated for floats)."""
    return pd.Series(values, copy=False).groupby(codes, sort=True).sum().to_numpy()


def step_times(trace: Trace) -> pd.Series:
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
