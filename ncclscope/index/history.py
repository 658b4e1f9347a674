"""The instances a vote cannot decide (a lone survivor, a 1 vs 1 tie), decided by what the same call did in the
rank's other steps (or loop iterations) and on the other groups of its kind: `find_history_deviations`, and
`merge_history`, which files those verdicts with the votes' (instances.find_deviations).

Split out of instances.py (the tables, no judgement): this is the one place a rank's own past is read as evidence
about a collective it disagrees on.
"""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from ncclscope import schema as S
from ncclscope.index.instances import (DEVIATION_COLUMNS, HISTORY_MIN_REFS, category_value, near_instances)


def find_history_deviations(coll: pd.DataFrame, inst: pd.DataFrame, dev: pd.DataFrame,
                            kinds: dict[str, str] | None = None,
                            members: dict[str, list[int]] | None = None) -> pd.DataFrame:
    """Deviations the instance vote cannot decide, decided by what the same call did elsewhere.

    The vote inside an instance needs voters. When gloo aborts an innocent
    neighbour on a size mismatch, the neighbour's last rows die with it: the
    deviant is the only member left with a record of the instance, or a
    2-member group splits 1 vs 1. Training repeats itself, so the same call
    (same rank, group, call site, n-th call from that site in the step) in the
    rank's other steps, and the same call on the other groups of the same kind
    in this step, say what the op should have been. A row deviates when all of
    those references (at least HISTORY_MIN_REFS) agree on one value and it
    differs. Sizes are compared with the rank's own history only (other groups
    of a kind, e.g. dp groups of different pipeline stages, legitimately hold
    different sizes).

    Candidates: unfinished instances only one member began, and tied instances.
    """
    cols = DEVIATION_COLUMNS
    x = _candidate_rows(coll, inst, dev)
    if x is None:
        return pd.DataFrame(columns=cols)
    pool, x = _reference_pool(coll, x, kinds or {})
    frames = [f for f in (_history_category(pool, x, cat, members) for cat in ("type", "size", "dtype"))
              if f is not None]
    if not frames:
        return pd.DataFrame(columns=cols)
    out = pd.concat(frames, ignore_index=True)
    return out[cols].sort_values(["process_group", "seq", "rank"], kind="stable").reset_index(drop=True)


def _candidate_rows(coll: pd.DataFrame, inst: pd.DataFrame, dev: pd.DataFrame) -> pd.DataFrame | None:
    """The rows of the candidate instances (lone unfinished ones, tied ones) that have a step and a call
    site; None where there are none."""
    if not len(coll) or not len(inst):
        return None
    lone = inst[(inst["n_began"] == 1) & (inst["n_notok"] > 0)][["process_group", "seq"]]
    tied = dev.loc[dev["tie"].astype(bool), ["process_group", "seq"]] if len(dev) else lone.iloc[0:0]
    cand = pd.concat([lone, tied], ignore_index=True).drop_duplicates()
    if not len(cand):
        return None
    cand = cand.assign(seq=cand["seq"].astype("int64"))
    x = near_instances(coll, cand["process_group"], cand["seq"]).merge(
        cand, left_on=["process_group", "collective_seq_id"], right_on=["process_group", "seq"])
    x = x[x["call_site"] != ""]
    return x if len(x) else None


def _reference_pool(coll: pd.DataFrame, x: pd.DataFrame, kinds: dict[str, str]) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(every call from the candidates' call sites in a step, with its group kind and `ord`: the n-th call
    from that site on that group in that step; the candidates with their own `ord` and kind)."""
    at_site = coll["call_site"].isin(x["call_site"].unique()).to_numpy()
    pool = coll[at_site].assign(run=_statement_runs(coll)[at_site])
    names = pool["process_group"].unique()
    kind_map = {n: kinds.get(n) or n.rstrip("0123456789") or n for n in names}
    pool = pool.assign(kind=pool["process_group"].map(kind_map))
    pool = pool.sort_values(["rank", "process_group", "call_site", "collective_seq_id"], kind="stable")
    # A call outside any marked step (a plain script marks none), or from a line whose every call falls in
    # one step (a loop with no optimizer step in it: the tracer's step never advances), is its own
    # iteration: the n-th call from its line on its group, numbered below -1 so it never meets a step's.
    # One statement that issues several collectives (DDP's constructor: an all_gather and broadcasts, all
    # from the user's one line; all_gather_object: an all_gather of the sizes, then one of the bytes) is one
    # call, not iterations: a run of calls from one line with no other line's call between them is one such
    # iteration, its calls in order, where the run mixes ops or the line always runs so (`_statement_lines`).
    by_site = pool.groupby(["rank", "process_group", "call_site"], sort=False)
    nth = by_site.cumcount().to_numpy()
    mixed = (pool.groupby("run", sort=False)["op_name"].transform("nunique") > 1).to_numpy()
    statement = mixed | _statement_lines(pool)
    nth_run = pool.groupby(["rank", "process_group", "call_site"], sort=False)["run"].rank(method="dense")
    nth = np.where(statement, nth_run.to_numpy(dtype=np.int64) - 1 + (1 << 40), nth)   # its own numbering
    one_step = (by_site["step"].transform("nunique") == 1).to_numpy()
    step = pool["step"].to_numpy()
    pool["step"] = np.where((step >= 0) & ~one_step, step, -2 - nth)
    pool = pool.sort_values(["rank", "process_group", "call_site", "step", "collective_seq_id"], kind="stable")
    pool["ord"] = pool.groupby(["rank", "process_group", "call_site", "step"], sort=False).cumcount()
    return pool, x.drop(columns="step").merge(pool[["rank", "op_id", "ord", "kind", "step"]], on=["rank", "op_id"])


def _statement_lines(pool: pd.DataFrame) -> np.ndarray:
    """Per row of `pool`: its line issues several calls on its group each time it runs. Every run of the line
    (`_statement_runs`) but the last, which a hang may cut short, holds more than one call on the group, and
    there are two runs or more. Read as iterations, the bytes all_gather of an all_gather_object is compared
    with the sizes ones of the other runs and called a size deviation (seed 20261220 #113: the innocent
    partner of a rank that died without a dump was named); a line whose runs are single calls but one (an
    extra call in one iteration) keeps each call its own iteration, so the extra one is still compared."""
    keys = ["rank", "process_group", "call_site"]
    if not len(pool):
        return np.zeros(0, dtype=bool)
    n = pool.groupby(keys + ["run"], sort=False, observed=True)["op_id"].transform("size")
    by_line = pool.groupby(keys, sort=False, observed=True)["run"]
    last = pool["run"] == by_line.transform("max")
    short = pool.assign(short=(n < 2) & ~last).groupby(keys, sort=False, observed=True)["short"].transform("sum")
    return ((short == 0) & (by_line.transform("nunique") >= 2)).to_numpy()


def _statement_runs(coll: pd.DataFrame) -> np.ndarray:
    """Per row of `coll` (sorted by rank, then issue order): the number of its run, a maximal stretch of one
    rank's calls from one call site with no other site's call between them."""
    if not len(coll):
        return np.zeros(0, np.int64)
    rank = coll["rank"].to_numpy()
    site = pd.factorize(coll["call_site"])[0]
    new = np.r_[True, (rank[1:] != rank[:-1]) | (site[1:] != site[:-1])]
    return np.cumsum(new)


_ROOT = re.compile(r"root (-?\d+)")


def _roots_in_own_group(eq: pd.DataFrame, members: dict[str, list[int]]) -> pd.Series:
    """A peer group's call as the candidate's group would make it: a rooted op's root (a global rank) moved
    to the member at the same position of the candidate's group (dp groups broadcast from their own first
    member: root 0 on [0, 2] is root 1 on [1, 3])."""
    def move(ref: str, src: str, dst: str) -> str:
        m = _ROOT.search(ref)
        a, b = members.get(src) or [], members.get(dst) or []
        if m is None or int(m.group(1)) not in a or len(a) != len(b):
            return ref
        return ref[:m.start(1)] + str(b[a.index(int(m.group(1)))]) + ref[m.end(1):]
    return pd.Series([move(str(r), str(s), str(d)) for r, s, d in
                      zip(eq["ref"], eq["ref_group"], eq["process_group"])], index=eq.index, dtype=object)


def _history_category(pool: pd.DataFrame, x: pd.DataFrame, cat: str,
                      members: dict[str, list[int]] | None = None) -> pd.DataFrame | None:
    """The candidates whose `cat` (type, size, dtype) differs from what all their references agree on: the
    same call in the rank's other steps, and (not for sizes) on the other groups of its kind in this step."""
    pv, pok = category_value(pool, cat)
    xv, xok = category_value(x, cat)
    p = pool.assign(ref=pv)[pok]
    xs = x.assign(value=xv)[xok]
    if not len(xs) or not len(p):
        return None
    base = xs[["process_group", "seq", "rank", "call_site", "ord", "step", "kind", "value"]]
    # what a call passed is in its begin row, however the op ended: for sizes and dtypes every other
    # step's call counts (a rank aborted early has few completed ones); which op it was, only completed
    known = p if cat != "type" else p.loc[p["status"] == S.STATUS_OK]
    hist = base.merge(known[["rank", "process_group", "call_site", "ord", "step",
                             "ref"]].rename(columns={"step": "ref_step"}),
                      on=["rank", "process_group", "call_site", "ord"])
    hist = hist[hist["ref_step"] != hist["step"]].assign(src="history", ref_group="")
    refs = [hist]
    if cat != "size":
        eq = base.merge(p[["kind", "call_site", "ord", "step", "process_group", "ref"]].rename(
            columns={"process_group": "ref_group"}), on=["kind", "call_site", "ord", "step"])
        eq = eq[eq["ref_group"] != eq["process_group"]]
        if cat == "type" and members:
            eq = eq.assign(ref=_roots_in_own_group(eq, members))
        refs.append(eq.assign(src="peers"))
    r = pd.concat(refs, ignore_index=True)
    if not len(r):
        return None
    agg = r.groupby(["process_group", "seq", "rank"], sort=False).agg(
        n=("ref", "size"), nu=("ref", "nunique"), ref=("ref", "first"), value=("value", "first"),
        n_hist=("src", lambda s: int((s == "history").sum())),
        groups=("ref_group", lambda s: sorted({g for g in s if g}))).reset_index()
    bad = agg[(agg["n"] >= HISTORY_MIN_REFS) & (agg["nu"] == 1) & (agg["ref"] != agg["value"])]
    if not len(bad):
        bad = _tie_by_own_loop(xs, agg, novel=cat == "type")
    if not len(bad):
        return None
    # In a tie, history must single out some voters, not all of them (all changing is not a mismatch).
    n_voters = xs.groupby(["process_group", "seq"]).size().rename("n_voters").reset_index()
    bad = bad.merge(n_voters, on=["process_group", "seq"])
    n_bad = bad.groupby(["process_group", "seq"])["rank"].transform("size")
    bad = bad[(n_bad < bad["n_voters"]) | (bad["n_voters"] == 1)]
    if not len(bad):
        return None
    notes = [_ref_note(int(h), list(gs)) for h, gs in zip(bad["n_hist"], bad["groups"])]
    rows = bad.merge(x[["process_group", "seq", "rank", "op_name", "op_id", "start_ns", "status", "call_site",
                        "step"]], on=["process_group", "seq", "rank"])
    return rows.assign(category=cat, majority=rows["ref"], n_majority=rows["n"], tie=False,
                       basis="history", ref_note=notes)


def _tie_by_own_loop(xs: pd.DataFrame, agg: pd.DataFrame, novel: bool) -> pd.DataFrame:
    """A tie too thin for HISTORY_MIN_REFS (a 2-rank group, a bug in the second iteration), decided where
    every voter has its own earlier calls to go by: the voters whose call differs from what their own
    earlier iterations of it did, where every other voter's call is what its own did. `novel` (op types):
    a voter calling from a line it never called from before counts as differing (the program took a
    branch, an `if rank == ...`, it never took before). Both sides changed, or neither: still a tie."""
    refs = agg[agg["nu"] == 1]
    out = []
    for (g, k), vs in xs[["process_group", "seq", "rank", "value"]].groupby(["process_group", "seq"], sort=False):
        if len(vs) < 2:
            continue
        mine = refs[(refs["process_group"] == g) & (refs["seq"] == k)]
        kept = mine[mine["ref"] == mine["value"]]
        changed = mine[mine["ref"] != mine["value"]]
        fresh = vs[~vs["rank"].isin(agg.loc[(agg["process_group"] == g) & (agg["seq"] == k), "rank"])] if novel \
            else vs.iloc[0:0]
        n_dev = len(changed) + len(fresh)
        if not n_dev or not len(kept) or n_dev + len(kept) != len(vs) or kept["value"].nunique() != 1:
            continue
        ref = kept["value"].iloc[0]
        if len(changed) and (changed["ref"] != ref).any():
            continue
        rows = [changed[["process_group", "seq", "rank", "n", "nu", "ref", "value", "n_hist", "groups"]]] \
            if len(changed) else []
        if len(fresh):
            rows.append(fresh.assign(n=0, nu=1, ref=ref, n_hist=-1, groups=[[]] * len(fresh)))
        out += rows
    cols = ["process_group", "seq", "rank", "n", "nu", "ref", "value", "n_hist", "groups"]
    return pd.concat(out, ignore_index=True)[cols] if out else agg.iloc[0:0]


def _ref_note(n_hist: int, groups: list[str]) -> str:
    if n_hist < 0:       # _tie_by_own_loop: a call from a line this rank never called from before
        return "the others' own earlier iterations (its call comes from a line it never reached before)"
    parts = []
    if n_hist:
        parts.append(f"its own other {'iterations' if n_hist > 1 else 'iteration'} of that call ({n_hist})")
    if groups:
        parts.append(f"{', '.join(groups[:2])}{f' and {len(groups) - 2} more groups' if len(groups) > 2 else ''} "
                     f"at this step")
    return " and ".join(parts)


def merge_history(dev: pd.DataFrame, hist: pd.DataFrame) -> pd.DataFrame:
    """Instance votes plus history deviations; history replaces the ties of an instance it resolves (all its
    categories: an op type decided by history explains the sizes tied beside it)."""
    if not len(hist):
        return dev
    if not len(dev):
        return hist
    resolved = hist[["process_group", "seq"]].drop_duplicates().assign(resolved=True)
    d = dev.merge(resolved, on=["process_group", "seq"], how="left")
    d = d[~(d["resolved"].fillna(False).astype(bool) & d["tie"].astype(bool))].drop(columns="resolved")
    out = pd.concat([d, hist], ignore_index=True)
    return out.sort_values(["process_group", "seq", "rank"], kind="stable").reset_index(drop=True)

