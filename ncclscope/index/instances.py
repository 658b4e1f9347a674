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
(`history.py` decides the instances a vote cannot decide, from the same call's history.)

All of it is vectorised: instances are keyed by one int64 (group code, seq),
a min/max pass finds the few mismatched instances, and only those are voted on.
`TraceIndex` (index.py) builds each table once per trace; the questions read them there.
"""
from __future__ import annotations

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


def category_value(df: pd.DataFrame, cat: str) -> tuple[pd.Series, np.ndarray]:
    """(value, comparable) of one category for each row: type, size (spaces removed) or dtype."""
    if cat == "type":
        return type_value(df).astype(object), np.ones(len(df), dtype=bool)
    if cat == "size":
        ok = (df["input_sizes"] != "").to_numpy() & ~df["op_name"].isin(SIZE_EXEMPT).to_numpy()
        return df["input_sizes"].str.replace(" ", "", regex=False).astype(object), ok
    return df["input_dtypes"].astype(object), (df["input_dtypes"] != "").to_numpy()
