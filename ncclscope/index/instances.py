"""Collective instances and their deviations: the tables the collective, group and wait-for questions read.

Sequence alignment is per process group: `collective_seq_id` k on rank a and k
on rank b of the same group are the same collective instance (gloo and NCCL
pair them by that per-group counter, whatever the ranks think they called).
This module builds, without judging anything:

- `collective_ops`        the collective rows (some strings as sorted categoricals), an int group code;
- `instance_table`        one row per (group, seq): how many began / finished it;
- `max_seq_table`         (group, rank) -> the highest seq it began;
- `missing_participants`  members that never began an unfinished instance others began;
- `find_deviations`       type / size / dtype disagreements inside an instance, by
                          majority vote (ties flagged, never silently blamed);
- `find_history_deviations` the instances a vote cannot decide (a lone survivor,
                          a 1 vs 1 tie), decided by what the same call did in the
                          rank's other steps and on the other groups of its kind.

All of it is vectorised: instances are keyed by one int64 (group code, seq),
a min/max pass finds the few mismatched instances, and only those are voted on.
`TraceIndex` (index.py) builds each table once per trace; the questions read them there.
"""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from ncclscope import schema as S
from ncclscope.index.labels import majority_vote, plain_str, sorted_categorical, take_str

DEVIATION_COLUMNS = ["process_group", "seq", "category", "rank", "value", "majority", "n_voters", "n_majority",
                     "tie", "op_name", "op_id", "start_ns", "status", "call_site", "step", "basis", "ref_note"]


HISTORY_MIN_REFS = 2     # references (own other steps, peer groups) a history verdict needs


# Ops whose input sizes may legitimately differ between ranks. The object collectives whose list every
# member sizes alike (broadcast_object_list, all_gather_object, scatter_object_list) are compared: the
# tracer records the list's length as their size (an older trace records none, "[]" on every rank).
SIZE_EXEMPT = frozenset({
    "all_to_all", "all_to_all_single", "alltoall", "alltoall_base", "alltoallv", "scatter", "gather",
    "all_gather_v", "reduce_scatter_v", "barrier", "monitored_barrier", "gather_object",
})


CATEGORY_LABEL = {"type": "op type", "size": "input sizes", "dtype": "dtype"}


COLL_COLUMNS = ["rank", "op_id", "process_group", "collective_seq_id", "op_name", "input_sizes", "input_dtypes",
                "reduce_op", "status", "start_ns", "end_ns", "call_site", "step", "microbatch", "stage"]


STR_COLUMNS = ("process_group", "op_name", "input_dtypes", "reduce_op", "status", "call_site", "input_sizes")
# the string columns kept as sorted categoricals (the others as plain strings)
CAT_COLUMNS = ("input_dtypes", "reduce_op", "status", "input_sizes", "call_site", "op_name")


def _str_column(s: pd.Series, name: str) -> pd.Series | pd.Categorical:
    return sorted_categorical(s) if name in CAT_COLUMNS else plain_str(s).reset_index(drop=True)


def collective_ops(ops: pd.DataFrame) -> pd.DataFrame:
    """The collective ops, sorted by (rank, start), int64 rank/seq and `gid`, an int code of the group for
    fast grouping on millions of rows. String columns have "" for nulls; those in CAT_COLUMNS are
    categoricals of the values present, in sorted order (labels.sorted_categorical): compared with a
    string, sorted or grouped they act as the plain strings did, at a fraction of the memory (an int8
    code a row instead of an Arrow string)."""
    kind = ops["kind"]
    mask = (kind == S.KIND_COLLECTIVE).to_numpy() & (ops["collective_seq_id"].to_numpy() >= 0)
    pg = ops["process_group"]
    if isinstance(pg.dtype, pd.CategoricalDtype):
        # rows without a group go before anything is copied; the group code comes from the category codes
        # (numbered in order of first appearance, as factorizing the decoded strings numbers them)
        codes = pg.cat.codes.to_numpy()
        named = np.asarray([str(c) != "" for c in pg.cat.categories] + [False])   # code -1 (null) -> ""
        mask = mask & named[codes]
        rows = np.flatnonzero(mask)
        gid = pd.factorize(codes[rows])[0].astype(np.int64)
        out = pd.DataFrame({c: _str_column(ops[c].iloc[rows], c) if c in STR_COLUMNS
                            else ops[c].to_numpy()[rows] for c in COLL_COLUMNS}, copy=False)   # fresh columns
        out["rank"] = out["rank"].astype("int64")
        out["gid"] = gid
        return out
    sub = ops.loc[mask, COLL_COLUMNS]
    sub = sub[plain_str(sub["process_group"]).to_numpy() != ""]
    out = pd.DataFrame({c: _str_column(sub[c], c) if c in STR_COLUMNS else sub[c].to_numpy()
                        for c in COLL_COLUMNS})
    out["rank"] = out["rank"].astype("int64")
    out["gid"] = pd.factorize(out["process_group"])[0].astype(np.int64)
    return out


def near_instances(coll: pd.DataFrame, groups, seqs) -> pd.DataFrame:
    """The rows of `coll` on one of `groups` with one of `seqs`: a superset of some instances' rows, picked by
    a mask, so that the merge that pairs them with the instances works on those rows, not on all 2 M."""
    mask = coll["process_group"].isin(pd.unique(np.asarray(groups, dtype=object))).to_numpy()
    seqs = np.asarray(seqs)
    if np.issubdtype(seqs.dtype, np.integer):        # anything else (floats after a merge): groups alone
        mask = mask & coll["collective_seq_id"].isin(pd.unique(seqs)).to_numpy()
    return coll[mask]


def _keys(coll: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """One int64 per (group, seq) instance; returns (key, group code)."""
    gid = coll["gid"].to_numpy() if "gid" in coll else pd.factorize(coll["process_group"])[0].astype(np.int64)
    seq = coll["collective_seq_id"].to_numpy(dtype=np.int64)
    return gid * (int(seq.max()) + 1 if len(seq) else 1) + seq, gid


def instance_table(coll: pd.DataFrame) -> pd.DataFrame:
    """One row per (process_group, seq): how many began it, finished ok, did not; first/last start."""
    if not len(coll):
        return pd.DataFrame(columns=["process_group", "seq", "n_began", "n_ok", "n_notok", "first_start_ns",
                                     "last_start_ns"])
    key, _ = _keys(coll)
    ok = (coll["status"] == S.STATUS_OK).to_numpy()
    df = pd.DataFrame({"key": key, "ok": ok.astype(np.int64), "start": coll["start_ns"].to_numpy()},
                      copy=False)      # read only (grouped): no stacked copy of 2 M rows
    agg = df.groupby("key", sort=True).agg(n_began=("ok", "size"), n_ok=("ok", "sum"),
                                            first_start_ns=("start", "min"), last_start_ns=("start", "max"))
    first = ~pd.Series(key).duplicated().to_numpy()
    names = pd.DataFrame({"key": key[first], "process_group": take_str(coll["process_group"], first),
                          "seq": coll["collective_seq_id"].to_numpy()[first]}).set_index("key")
    agg = agg.join(names)
    agg["n_notok"] = agg["n_began"] - agg["n_ok"]
    return agg.reset_index(drop=True)[["process_group", "seq", "n_began", "n_ok", "n_notok", "first_start_ns",
                                       "last_start_ns"]]


def max_seq_table(coll: pd.DataFrame) -> pd.DataFrame:
    """(process_group, rank) -> highest collective_seq_id begun."""
    if not len(coll):
        return pd.DataFrame(columns=["process_group", "rank", "max_seq"])
    _, gid = _keys(coll)
    rank = coll["rank"].to_numpy(dtype=np.int64)
    key = gid * (int(rank.max()) + 1) + rank
    mx = pd.Series(coll["collective_seq_id"].to_numpy(dtype=np.int64)).groupby(key, sort=False).max()
    first = ~pd.Series(key).duplicated().to_numpy()
    names = pd.Series(take_str(coll["process_group"], first), index=key[first])
    return pd.DataFrame({"process_group": pd.Series(names.loc[mx.index].to_numpy(), dtype="str"),
                         "rank": (mx.index.to_numpy() % (int(rank.max()) + 1)).astype(np.int64),
                         "max_seq": mx.to_numpy()})


def member_table(members: dict[str, list[int]]) -> pd.DataFrame:
    """Long form of `membership`: columns process_group (str), member (int64), n_members."""
    names = [n for n, rs in members.items() for _ in rs]
    ranks = [int(r) for rs in members.values() for r in rs]
    sizes = [len(rs) for rs in members.values() for _ in rs]
    return pd.DataFrame({"process_group": pd.Series(names, dtype="str"),
                         "member": np.asarray(ranks, dtype=np.int64),
                         "n_members": np.asarray(sizes, dtype=np.int64)})


def missing_participants(coll: pd.DataFrame, members: dict[str, list[int]],
                         instances: pd.DataFrame | None = None, max_seq: pd.DataFrame | None = None) -> pd.DataFrame:
    """Members that never began an unfinished instance others began: who those others wait on.

    For member b of g with highest begun seq m_b, the missing instance is the
    first k > m_b on g that some member began and did not finish ok. (An
    instance every participant finished cannot have lacked b: b's rows were
    lost, which is not a hang.) Columns: process_group, seq, rank, max_seq,
    n_began, n_members, first_start_ns.
    """
    cols = ["process_group", "seq", "rank", "max_seq", "n_began", "n_members", "first_start_ns"]
    if not len(coll):
        return pd.DataFrame(columns=cols)
    inst = instance_table(coll) if instances is None else instances
    notok = inst[inst["n_notok"] > 0][["process_group", "seq", "n_began", "first_start_ns"]]
    if not len(notok):
        return pd.DataFrame(columns=cols)
    mt = member_table(members).rename(columns={"member": "rank"})
    mt = mt[mt["process_group"].isin(notok["process_group"].unique())]
    mt = mt.merge(max_seq_table(coll) if max_seq is None else max_seq, on=["process_group", "rank"], how="left")
    mt["max_seq"] = mt["max_seq"].fillna(0).astype("int64")
    mt["probe"] = mt["max_seq"] + 1
    left = mt.sort_values("probe", kind="stable")
    right = notok.assign(seq=notok["seq"].astype("int64")).sort_values("seq", kind="stable")
    m = pd.merge_asof(left, right, left_on="probe", right_on="seq", by="process_group", direction="forward")
    m = m[m["seq"].notna()]
    m = m.assign(seq=m["seq"].astype("int64"), n_began=m["n_began"].astype("int64"),
                 first_start_ns=m["first_start_ns"].astype("int64"))
    return m[cols].sort_values(["process_group", "seq", "rank"]).reset_index(drop=True)


# --------------------------------------------------------------------------
# type / size / dtype deviations
# --------------------------------------------------------------------------
def type_value(df: pd.DataFrame) -> pd.Series:
    red = df["reduce_op"].astype(str)
    return df["op_name"].astype(str) + np.where(red != "", "(" + red + ")", "")


def find_deviations(coll: pd.DataFrame) -> pd.DataFrame:
    """One row per (instance, category, deviant rank), with the majority value and vote counts.

    A cheap min/max pass over integer codes finds the instances where members
    disagree at all; only those rows are decoded and voted on.
    """
    cols = DEVIATION_COLUMNS
    if not len(coll):
        return pd.DataFrame(columns=cols)
    key, _ = _keys(coll)
    tcode = pd.factorize(coll["op_name"])[0].astype(np.float64) * 1e4 + pd.factorize(coll["reduce_op"])[0]
    size_ok = (coll["input_sizes"] != "").to_numpy() & ~coll["op_name"].isin(SIZE_EXEMPT).to_numpy()
    raw, uniq = pd.factorize(coll["input_sizes"])          # normalise the few distinct shapes only
    norm = pd.factorize(pd.Series(uniq, dtype="str").str.replace(" ", "", regex=False))[0]
    scode = np.where(size_ok, norm[raw] if len(norm) else raw, np.nan)
    dtype_ok = (coll["input_dtypes"] != "").to_numpy()
    dcode = np.where(dtype_ok, pd.factorize(coll["input_dtypes"])[0], np.nan)
    df = pd.DataFrame({"key": key, "t": tcode, "s": scode, "d": dcode})
    agg = df.groupby("key", sort=False).agg(["min", "max"])
    bad = np.zeros(len(agg), dtype=bool)
    for c in ("t", "s", "d"):
        bad |= (agg[(c, "min")] != agg[(c, "max")]).to_numpy() & agg[(c, "min")].notna().to_numpy()
    bad_keys = agg.index[bad]
    if not len(bad_keys):
        return pd.DataFrame(columns=cols)
    sub = coll[np.isin(key, bad_keys.to_numpy())].rename(columns={"collective_seq_id": "seq"})
    frames = []
    keys = ["process_group", "seq"]
    for cat in ("type", "size", "dtype"):
        if cat == "type":
            val = type_value(sub)
            voters = sub
        elif cat == "size":
            ok = (sub["input_sizes"] != "") & ~sub["op_name"].isin(SIZE_EXEMPT)
            voters, val = sub[ok], sub.loc[ok, "input_sizes"].str.replace(" ", "", regex=False)
        else:
            ok = sub["input_dtypes"] != ""
            voters, val = sub[ok], sub.loc[ok, "input_dtypes"]
        v = voters.assign(value=val.astype(object))
        dev = majority_vote(v, keys, "value")
        if len(dev):
            frames.append(dev.assign(category=cat))
    if not frames:
        return pd.DataFrame(columns=cols)
    out = pd.concat(frames, ignore_index=True).assign(basis="instance", ref_note="")
    return out[cols].sort_values(["process_group", "seq", "rank"], kind="stable").reset_index(drop=True)


def _category_value(df: pd.DataFrame, cat: str) -> tuple[pd.Series, np.ndarray]:
    """(value, comparable) of one category for each row: type, size (spaces removed) or dtype."""
    if cat == "type":
        return type_value(df).astype(object), np.ones(len(df), dtype=bool)
    if cat == "size":
        ok = (df["input_sizes"] != "").to_numpy() & ~df["op_name"].isin(SIZE_EXEMPT).to_numpy()
        return df["input_sizes"].str.replace(" ", "", regex=False).astype(object), ok
    return df["input_dtypes"].astype(object), (df["input_dtypes"] != "").to_numpy()


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
    # One statement that issues several different collectives (DDP's constructor: an all_gather and
    # broadcasts, all from the user's one line) is one call, not iterations: a run of calls from one line with
    # no other line's call between them, of more than one op, is one such iteration, its calls in order.
    by_site = pool.groupby(["rank", "process_group", "call_site"], sort=False)
    nth = by_site.cumcount().to_numpy()
    mixed = (pool.groupby("run", sort=False)["op_name"].transform("nunique") > 1).to_numpy()
    nth_run = pool.groupby(["rank", "process_group", "call_site"], sort=False)["run"].rank(method="dense")
    nth = np.where(mixed, nth_run.to_numpy(dtype=np.int64) - 1 + (1 << 40), nth)   # its own numbering
    one_step = (by_site["step"].transform("nunique") == 1).to_numpy()
    step = pool["step"].to_numpy()
    pool["step"] = np.where((step >= 0) & ~one_step, step, -2 - nth)
    pool = pool.sort_values(["rank", "process_group", "call_site", "step", "collective_seq_id"], kind="stable")
    pool["ord"] = pool.groupby(["rank", "process_group", "call_site", "step"], sort=False).cumcount()
    return pool, x.drop(columns="step").merge(pool[["rank", "op_id", "ord", "kind", "step"]], on=["rank", "op_id"])


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
    pv, pok = _category_value(pool, cat)
    xv, xok = _category_value(x, cat)
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

