"""Collective alignment: do the members of each group agree on instance #k?

Sequence alignment is per process group: `collective_seq_id` k on rank a and k
on rank b of the same group are the same collective instance (gloo and NCCL
pair them by that per-group counter, whatever the ranks think they called).
For every instance we compare what the members issued, in Flight Recorder's
categories:

- type  (op name, with the reduce op): all_reduce on three ranks, broadcast on
  one -> the job hangs (gloo) or silently mixes data;
- size  (input shapes; not for ops whose sizes legitimately differ per rank);
- dtype;
- state (some members began #k, others never did: a *missing participant*,
  which is who the others wait on).

Flight Recorder's analyzer stops at the first mismatch and blames whichever
rank it compared first. Here the deviant is the minority of a majority vote
(ties are called ambiguous, never silently blamed), every group is checked,
and we keep going past the first mismatch, bounded per group, because a
second, independent mismatch is exactly what a person would otherwise miss.

Two things real drills taught (tests/test_drills_e2e.py):
- gloo aborts an innocent neighbour on a size mismatch and the neighbour's
  last rows die with it, and 2-member groups split 1 vs 1: such instances
  are decided by *history* (`find_history_deviations`: the same call in the
  rank's other steps and on the other groups of its kind in this step);
- a rank that skips a collective does not hang there: its next one pairs
  with the others' skipped one (one instance off) and the job hangs later,
  elsewhere. `step_census_deviations` finds the step where a member issued
  fewer (or more) ops on a group from one call site than the others.

All of it is vectorised: instances are keyed by one int64 (group code, seq),
a min/max pass finds the few mismatched instances, and only those are voted on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import pyarrow as pa

from .. import schema as S
from ..findings import Evidence, Finding
from .groups import (fmt_ranks, group_kinds, group_label, majority_vote, member_table, membership, rank_label,
                     seconds)

if TYPE_CHECKING:
    from ..trace import Trace

DEVIATION_COLUMNS = ["process_group", "seq", "category", "rank", "value", "majority", "n_voters", "n_majority",
                     "tie", "op_name", "op_id", "start_ns", "status", "call_site", "step", "basis", "ref_note"]
HISTORY_MIN_REFS = 2     # references (own other steps, peer groups) a history verdict needs

# Ops whose input sizes may legitimately differ between ranks.
SIZE_EXEMPT = frozenset({
    "all_to_all", "all_to_all_single", "alltoall", "alltoall_base", "alltoallv", "scatter", "gather",
    "all_gather_v", "reduce_scatter_v", "barrier", "monitored_barrier", "all_gather_object",
    "gather_object", "scatter_object_list", "broadcast_object_list",
})
CATEGORY_LABEL = {"type": "op type", "size": "input sizes", "dtype": "dtype"}

COLL_COLUMNS = ["rank", "op_id", "process_group", "collective_seq_id", "op_name", "input_sizes", "input_dtypes",
                "reduce_op", "status", "start_ns", "end_ns", "call_site", "step", "microbatch", "stage"]


def plain_str(s: pd.Series) -> pd.Series:
    """A string column as plain strings ("" for nulls).

    Categoricals are decoded through Arrow's dictionary cast: ~10x faster than
    pandas' own decode on millions of rows.
    """
    if isinstance(s.dtype, pd.CategoricalDtype):
        codes = s.cat.codes.to_numpy()
        cats = pa.array([str(c) for c in s.cat.categories], type=pa.string())
        arr = pa.DictionaryArray.from_arrays(pa.array(codes, mask=codes < 0), cats).cast(pa.string())
        return pd.Series(arr.fill_null(""), index=s.index, dtype="str")
    return s.astype("str").fillna("")


def _take_str(s: pd.Series, mask: np.ndarray) -> np.ndarray:
    """The few rows of a (possibly Arrow-backed) string column under a boolean mask, as a numpy array:
    select first, convert after (converting a 2-million-row column to pick 100 names costs 0.2 s)."""
    return s.iloc[np.flatnonzero(mask)].to_numpy()


STR_COLUMNS = ("process_group", "op_name", "input_dtypes", "reduce_op", "status", "call_site", "input_sizes")


def collective_ops(ops: pd.DataFrame) -> pd.DataFrame:
    """The collective ops, sorted by (rank, start), with plain string columns, int64 rank/seq and
    `gid`, an int code of the group for fast grouping on millions of rows."""
    kind = ops["kind"]
    mask = (kind == S.KIND_COLLECTIVE).to_numpy() & (ops["collective_seq_id"].to_numpy() >= 0)
    sub = ops.loc[mask, COLL_COLUMNS]
    out = pd.DataFrame({c: plain_str(sub[c]) if c in STR_COLUMNS else sub[c] for c in COLL_COLUMNS})
    out["rank"] = out["rank"].astype("int64")
    out = out[out["process_group"] != ""].reset_index(drop=True)
    out["gid"] = pd.factorize(out["process_group"])[0].astype(np.int64)
    return out


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
    df = pd.DataFrame({"key": key, "ok": ok.astype(np.int64), "start": coll["start_ns"].to_numpy()})
    agg = df.groupby("key", sort=True).agg(n_began=("ok", "size"), n_ok=("ok", "sum"),
                                            first_start_ns=("start", "min"), last_start_ns=("start", "max"))
    first = ~pd.Series(key).duplicated().to_numpy()
    names = pd.DataFrame({"key": key[first], "process_group": _take_str(coll["process_group"], first),
                          "seq": coll["collective_seq_id"].to_numpy()[first]}).set_index("key")
    agg = agg.join(names)
    agg["n_notok"] = agg["n_began"] - agg["n_ok"]
    return agg.reset_index(drop=True)[["process_group", "seq", "n_began", "n_ok", "n_notok", "first_start_ns",
                                       "last_start_ns"]]


# --------------------------------------------------------------------------
# type / size / dtype mismatches
# --------------------------------------------------------------------------
def _type_value(df: pd.DataFrame) -> pd.Series:
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
            val = _type_value(sub)
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
        return _type_value(df).astype(object), np.ones(len(df), dtype=bool)
    if cat == "size":
        ok = (df["input_sizes"] != "").to_numpy() & ~df["op_name"].isin(SIZE_EXEMPT).to_numpy()
        return df["input_sizes"].str.replace(" ", "", regex=False).astype(object), ok
    return df["input_dtypes"].astype(object), (df["input_dtypes"] != "").to_numpy()


def find_history_deviations(coll: pd.DataFrame, inst: pd.DataFrame, dev: pd.DataFrame,
                            kinds: dict[str, str] | None = None) -> pd.DataFrame:
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
    if not len(coll) or not len(inst):
        return pd.DataFrame(columns=cols)
    lone = inst[(inst["n_began"] == 1) & (inst["n_notok"] > 0)][["process_group", "seq"]]
    tied = dev.loc[dev["tie"].astype(bool), ["process_group", "seq"]] if len(dev) else lone.iloc[0:0]
    cand = pd.concat([lone, tied], ignore_index=True).drop_duplicates()
    if not len(cand):
        return pd.DataFrame(columns=cols)
    cand = cand.assign(seq=cand["seq"].astype("int64"))
    x = coll.merge(cand, left_on=["process_group", "collective_seq_id"], right_on=["process_group", "seq"])
    x = x[(x["step"] >= 0) & (x["call_site"] != "")]
    if not len(x):
        return pd.DataFrame(columns=cols)
    kinds = kinds or {}
    pool = coll[coll["call_site"].isin(x["call_site"].unique()).to_numpy() & (coll["step"] >= 0).to_numpy()]
    names = pool["process_group"].unique()
    kind_map = {n: kinds.get(n) or n.rstrip("0123456789") or n for n in names}
    pool = pool.assign(kind=pool["process_group"].map(kind_map))
    pool = pool.sort_values(["rank", "process_group", "call_site", "step", "collective_seq_id"], kind="stable")
    pool["ord"] = pool.groupby(["rank", "process_group", "call_site", "step"], sort=False).cumcount()
    x = x.merge(pool[["rank", "op_id", "ord", "kind"]], on=["rank", "op_id"])
    frames = []
    for cat in ("type", "size", "dtype"):
        pv, pok = _category_value(pool, cat)
        xv, xok = _category_value(x, cat)
        p = pool.assign(ref=pv)[pok]
        xs = x.assign(value=xv)[xok]
        if not len(xs) or not len(p):
            continue
        base = xs[["process_group", "seq", "rank", "call_site", "ord", "step", "kind", "value"]]
        hist = base.merge(p.loc[p["status"] == S.STATUS_OK, ["rank", "process_group", "call_site", "ord", "step",
                                                             "ref"]].rename(columns={"step": "ref_step"}),
                          on=["rank", "process_group", "call_site", "ord"])
        hist = hist[hist["ref_step"] != hist["step"]].assign(src="history", ref_group="")
        refs = [hist]
        if cat != "size":
            eq = base.merge(p[["kind", "call_site", "ord", "step", "process_group", "ref"]].rename(
                columns={"process_group": "ref_group"}), on=["kind", "call_site", "ord", "step"])
            refs.append(eq[eq["ref_group"] != eq["process_group"]].assign(src="peers"))
        r = pd.concat(refs, ignore_index=True)
        if not len(r):
            continue
        agg = r.groupby(["process_group", "seq", "rank"], sort=False).agg(
            n=("ref", "size"), nu=("ref", "nunique"), ref=("ref", "first"), value=("value", "first"),
            n_hist=("src", lambda s: int((s == "history").sum())),
            groups=("ref_group", lambda s: sorted({g for g in s if g}))).reset_index()
        bad = agg[(agg["n"] >= HISTORY_MIN_REFS) & (agg["nu"] == 1) & (agg["ref"] != agg["value"])]
        if not len(bad):
            continue
        # In a tie, history must single out some voters, not all of them (all changing is not a mismatch).
        n_voters = xs.groupby(["process_group", "seq"]).size().rename("n_voters").reset_index()
        bad = bad.merge(n_voters, on=["process_group", "seq"])
        n_bad = bad.groupby(["process_group", "seq"])["rank"].transform("size")
        bad = bad[(n_bad < bad["n_voters"]) | (bad["n_voters"] == 1)]
        if not len(bad):
            continue
        notes = [_ref_note(int(h), list(gs)) for h, gs in zip(bad["n_hist"], bad["groups"])]
        rows = bad.merge(x[["process_group", "seq", "rank", "op_name", "op_id", "start_ns", "status", "call_site",
                            "step"]], on=["process_group", "seq", "rank"])
        frames.append(rows.assign(category=cat, majority=rows["ref"], n_majority=rows["n"], tie=False,
                                  basis="history", ref_note=notes))
    if not frames:
        return pd.DataFrame(columns=cols)
    out = pd.concat(frames, ignore_index=True)
    return out[cols].sort_values(["process_group", "seq", "rank"], kind="stable").reset_index(drop=True)


def _ref_note(n_hist: int, groups: list[str]) -> str:
    parts = []
    if n_hist:
        parts.append(f"its own other {'steps' if n_hist > 1 else 'step'} ({n_hist})")
    if groups:
        parts.append(f"{', '.join(groups[:2])}{f' and {len(groups) - 2} more groups' if len(groups) > 2 else ''} "
                     f"at this step")
    return " and ".join(parts)


def merge_history(dev: pd.DataFrame, hist: pd.DataFrame) -> pd.DataFrame:
    """Instance votes plus history deviations; history replaces a tie it resolves."""
    if not len(hist):
        return dev
    if not len(dev):
        return hist
    resolved = hist[["process_group", "seq", "category"]].drop_duplicates().assign(resolved=True)
    d = dev.merge(resolved, on=["process_group", "seq", "category"], how="left")
    d = d[~(d["resolved"].fillna(False).astype(bool) & d["tie"].astype(bool))].drop(columns="resolved")
    out = pd.concat([d, hist], ignore_index=True)
    return out.sort_values(["process_group", "seq", "rank"], kind="stable").reset_index(drop=True)


def _mismatch_findings(trace: Trace, coll: pd.DataFrame, dev: pd.DataFrame, members: dict[str, list[int]],
                       max_per_group: int) -> list[Finding]:
    """One finding per (group, deviant rank): its first deviating instance plus how many later ones."""
    findings: list[Finding] = []
    if not len(dev):
        return findings
    end = trace.end_ns
    firsts = dev.groupby(["process_group", "rank"], sort=False)["seq"].agg(first="min", n="nunique").reset_index()
    for g, gsub in firsts.sort_values(["process_group", "first", "rank"]).groupby("process_group", sort=True):
        # Ranks whose first deviation is the same instance share one finding (a tie names several).
        per_inst = list(gsub.groupby("first", sort=True))
        for i, (k, isub) in enumerate(per_inst):
            if i >= max_per_group:
                rest = per_inst[i:]
                findings.append(_summary_finding(str(g), rest, dev, members))
                break
            findings.append(_instance_finding(trace, coll, dev, str(g), int(k), isub, members, end))
    return findings


def _instance_finding(trace: Trace, coll: pd.DataFrame, dev: pd.DataFrame, g: str, k: int, isub: pd.DataFrame,
                      members: dict[str, list[int]], end_ns: int) -> Finding:
    ranks = sorted(int(r) for r in isub["rank"])
    later = int(isub["n"].max()) - 1
    rows = dev[(dev["process_group"] == g) & (dev["seq"] == k)]
    rows = rows[rows["rank"].isin(ranks)]
    inst = coll[(coll["process_group"] == g) & (coll["collective_seq_id"] == k)].sort_values("rank")
    tie = bool(rows["tie"].any())
    named = ranks[:1] if tie else ranks
    parts, cats = [], []
    history = False
    for cat, csub in rows.groupby("category", sort=False):
        maj = csub["majority"].iloc[0]
        value = csub["value"].iloc[0]
        cats.append(str(cat))
        if (csub["basis"] == "history").all():
            history = True
            parts.append(_describe(str(cat), value, maj, 0, str(csub["ref_note"].iloc[0])))
        else:
            agree = _holders(inst, str(cat), maj)
            parts.append(_describe(str(cat), value, maj, len(agree), rank_label(trace, agree)))
    ops = inst[~inst["rank"].isin(ranks)]["op_name"] if len(inst) > len(ranks) else inst["op_name"]
    op = str(ops.mode().iloc[0]) if len(ops) else "collective"
    glabel = group_label(g, members.get(g))
    title = f"{rank_label(trace, named)} deviates in {op} #{k} on {glabel}: " + "; ".join(parts)
    absent = sorted(set(members.get(g, [])) - set(int(r) for r in inst["rank"]))
    if absent and history:
        how = _end_states(trace, absent)
        title += f"; {rank_label(trace, absent)} left no record of #{k}" + (f" ({how})" if how else "")
    if tie:
        n_maj = int(rows["n_majority"].iloc[0])
        title = (f"ambiguous ({n_maj} vs {n_maj} tie), naming the lowest rank {named[0]}: "
                 f"{op} #{k} on {glabel}: " + "; ".join(parts))
    if later > 0:
        title += f" (and in {later} later instance{'s' if later > 1 else ''})"
    notok = inst[inst["status"] != S.STATUS_OK]
    if len(notok):
        title += f"; {rank_label(trace, notok['rank'])} blocked in it for {seconds(end_ns - int(notok['start_ns'].min()))}"
    ev = []
    for r in inst.itertuples(index=False):
        is_dev = int(r.rank) in set(int(x) for x in rows["rank"])
        note = ("deviant: " if is_dev else "majority: ") + _summary(r) + f"; {r.status}"
        ev.append(Evidence(rank=int(r.rank), note=note, op_name=str(r.op_name), process_group=g, seq=k,
                           op_id=int(r.op_id), time_ns=int(r.start_ns)))
    ev.sort(key=lambda e: (not e.note.startswith("deviant"), e.rank))
    return Finding(kind="collective_mismatch", severity="error", title=title, ranks=named, evidence=ev[:24],
                   data={"process_group": g, "seq": k, "instance": [g, k], "categories": cats,
                         "ambiguous": tie, "deviant_ranks": sorted(int(x) for x in rows["rank"].unique()),
                         "later_instances": later, "unfinished": bool(len(notok)),
                         "basis": "history" if history else "instance", "absent_ranks": absent})


def _end_states(trace: Trace, ranks: list[int]) -> str:
    """"killed by SIGABRT" / "failed" for ranks whose records end early: why their rows may be lost."""
    out = []
    for r in ranks[:4]:
        info = trace.ranks.get(r)
        if info is None:
            continue
        who = f"rank {r} " if len(ranks) > 1 else ""
        if info.state == "killed":
            out.append(f"{who}killed by {info.signal}")
        elif info.state in ("failed", "missing"):
            out.append(f"{who}{info.state}")
    return ", ".join(out)


def _holders(inst: pd.DataFrame, cat: str, value: object) -> list[int]:
    if cat == "type":
        vals = _type_value(inst)
    elif cat == "size":
        vals = inst["input_sizes"].str.replace(" ", "", regex=False)
    else:
        vals = inst["input_dtypes"]
    return [int(r) for r in inst.loc[vals.to_numpy() == value, "rank"]]


def _describe(cat: str, value: object, majority: object, n_agree: int, agree: str) -> str:
    verb, verb2 = {"type": ("called", "called"), "size": ("passed sizes", "passed"),
                   "dtype": ("used dtype", "used")}[cat]
    return f"{verb} {value} where {agree} {verb2} {majority}"


def _summary(r: object) -> str:
    red = f"({r.reduce_op})" if getattr(r, "reduce_op", "") else ""
    return f"{r.op_name}{red} sizes {r.input_sizes} {r.input_dtypes}".strip()


def _summary_finding(g: str, rest: list[tuple[int, pd.DataFrame]], dev: pd.DataFrame,
                     members: dict[str, list[int]]) -> Finding:
    seqs = [int(k) for k, _ in rest]
    ranks = sorted({int(r) for _, s in rest for r in s["rank"]})
    k0 = seqs[0]
    first = dev[(dev["process_group"] == g) & (dev["seq"] == k0)].iloc[0]
    ev = [Evidence(rank=int(first["rank"]), note=f"first of {len(seqs)} further deviations on {g}",
                   op_name=str(first["op_name"]), process_group=g, seq=k0, op_id=int(first["op_id"]),
                   time_ns=int(first["start_ns"]))]
    return Finding(kind="collective_mismatch", severity="warning",
                   title=f"{len(seqs)} more mismatched instance{'s' if len(seqs) > 1 else ''} on "
                         f"{group_label(g, members.get(g))} not listed (first #{k0}; ranks {','.join(map(str, ranks[:16]))})",
                   ranks=ranks, evidence=ev, data={"process_group": g, "seqs": seqs[:1000], "summary": True})


# --------------------------------------------------------------------------
# sequence shifts: a skipped or extra collective earlier in the run
# --------------------------------------------------------------------------
CENSUS_COLUMNS = ["process_group", "step", "call_site", "rank", "count", "expected", "direction", "basis",
                  "op_name", "ref_seq", "ref_ranks", "n_members"]


def passed_steps(coll: pd.DataFrame) -> pd.Series:
    """rank -> the highest training step it certainly finished: the one before its last step, or its
    last step when it went on to post-training ops (a step -1 op after its last training op)."""
    if not len(coll):
        return pd.Series(dtype="int64")
    df = pd.DataFrame({"rank": coll["rank"].to_numpy(np.int64), "step": coll["step"].to_numpy(np.int64),
                       "start": coll["start_ns"].to_numpy(np.int64)})
    pos = df[df["step"] >= 0]
    if not len(pos):
        return pd.Series(dtype="int64")
    mx = pos.groupby("rank")["step"].max()
    last_train = pos.groupby("rank")["start"].max()
    after = df[df["step"] < 0].groupby("rank")["start"].max().reindex(mx.index)
    finished = (after > last_train).fillna(False).astype(np.int64)
    return (mx - 1 + finished).astype(np.int64)


def step_census_deviations(coll: pd.DataFrame, members: dict[str, list[int]],
                           groups: list[str] | None = None) -> pd.DataFrame:
    """Members of a group that issued fewer (skipped) or more (extra) collectives on it from one
    call site in one training step than the group's other members.

    gloo and NCCL pair collectives by per-group sequence number, so a rank that
    skips one all_reduce does not hang there: its next all_reduce pairs with
    the others' skipped one, and the job hangs later, one instance off, often
    in a 2-member group where "3 of 4 members entered" cannot point at anyone.
    The step each op was issued in still can: per (group, step, call site),
    every member that finished the step must have issued the same number of
    ops. The odd member is found by majority; in a tie (two members), by
    regularity: the member whose count at that step differs from its own
    count at that call site in its other steps.
    """
    empty = pd.DataFrame(columns=CENSUS_COLUMNS)
    if not len(coll):
        return empty
    want = set(members) if groups is None else set(groups) & set(members)
    # Select on the int group codes first: the collective table may hold millions of rows.
    gid = coll["gid"].to_numpy() if "gid" in coll else pd.factorize(coll["process_group"])[0]
    first = ~pd.Series(gid).duplicated().to_numpy()
    codes = [int(k) for k, n in zip(gid[first], _take_str(coll["process_group"], first)) if n in want]
    mask = np.isin(gid, codes) & (coll["step"].to_numpy() >= 0)
    c = coll.loc[mask, ["rank", "op_id", "process_group", "collective_seq_id", "op_name", "call_site", "step"]]
    c = c[(c["call_site"] != "").to_numpy()]
    if not len(c):
        return empty
    cell = ["process_group", "step", "call_site"]
    cnt = c.groupby(cell + ["rank"], sort=False).agg(
        count=("op_id", "size"), first_seq=("collective_seq_id", "min"), op_name=("op_name", "first")).reset_index()
    cells = cnt[cell].drop_duplicates()
    mt = member_table({g: members[g] for g in cells["process_group"].unique()}).rename(columns={"member": "rank"})
    full = cells.merge(mt, on="process_group")
    passed = passed_steps(coll)
    full = full[full["rank"].map(passed).fillna(-1).to_numpy() >= full["step"].to_numpy()]
    full = full.merge(cnt, on=cell + ["rank"], how="left")
    full["count"] = full["count"].fillna(0).astype(np.int64)
    spread = full.groupby(cell, sort=False)["count"].agg(["min", "max", "size"])
    bad = spread[(spread["min"] != spread["max"]) & (spread["size"] >= 2)].reset_index()[cell]
    if not len(bad):
        return empty
    f = full.merge(bad, on=cell)
    dev = majority_vote(f, cell, "count")
    frames = []
    strict = dev[~dev["tie"].astype(bool)]
    if len(strict):
        frames.append(strict.assign(expected=strict["majority"].astype(np.int64), basis="majority"))
    tied = dev.loc[dev["tie"].astype(bool), cell].drop_duplicates()
    if len(tied):
        t = f.merge(tied, on=cell)
        hist = full.merge(t[["process_group", "call_site", "rank"]].drop_duplicates(),
                          on=["process_group", "call_site", "rank"])
        h = hist.groupby(["process_group", "call_site", "rank", "count"]).size().rename("n").reset_index()
        tt = t[cell + ["rank", "count"]].merge(h.rename(columns={"count": "usual"}),
                                              on=["process_group", "call_site", "rank"])
        tt["n"] = tt["n"] - (tt["usual"] == tt["count"]).astype(np.int64)     # its other steps only
        tt = tt[tt["n"] > 0]
        top = tt.groupby(cell + ["rank"])["n"].transform("max")
        best = tt[tt["n"] == top]
        best = best[best.groupby(cell + ["rank"])["usual"].transform("size") == 1]
        t2 = t.merge(best[cell + ["rank", "usual"]], on=cell + ["rank"])
        odd = t2[t2["count"] != t2["usual"]]
        n_odd = odd.groupby(cell).size().rename("n_odd")
        n_all = t.groupby(cell).size().rename("n_all")
        n_known = t2.groupby(cell).size().rename("n_known")
        ok = pd.concat([n_odd, n_all, n_known], axis=1).fillna(0)
        ok = ok[(ok["n_odd"] >= 1) & (ok["n_odd"] < ok["n_all"]) & (ok["n_known"] == ok["n_all"])]
        reg = odd.merge(ok.reset_index()[cell], on=cell)
        if len(reg):
            frames.append(reg.assign(expected=reg["usual"].astype(np.int64), basis="regularity"))
    if not frames:
        return empty
    out = pd.concat(frames, ignore_index=True)
    out["direction"] = np.where(out["count"] < out["expected"], "skipped", "extra")
    # What the others issued there: their first seq and op name, and who they are.
    devs = out[cell + ["rank"]].assign(is_dev=True)
    others = f.merge(devs, on=cell + ["rank"], how="left")
    others = others[others["is_dev"].isna() & others["first_seq"].notna()]
    ref = others.groupby(cell, sort=False).agg(
        ref_seq=("first_seq", "min"), ref_op=("op_name", "first"),
        ref_ranks=("rank", lambda r: sorted(int(x) for x in r))).reset_index()
    out = out.drop(columns=["op_name"]).merge(f[cell + ["rank", "op_name"]], on=cell + ["rank"], how="left")
    out = out.merge(ref, on=cell, how="left")
    out["op_name"] = out["ref_op"].where(out["ref_op"].notna(), out["op_name"]).fillna("collective")
    out["ref_seq"] = out["ref_seq"].fillna(-1).astype(np.int64)
    out["ref_ranks"] = out["ref_ranks"].map(lambda v: v if isinstance(v, list) else [])
    out["n_members"] = out["process_group"].map(lambda g: len(members.get(g, [])))
    return out[CENSUS_COLUMNS].sort_values(["step", "process_group", "rank"], kind="stable").reset_index(drop=True)


# --------------------------------------------------------------------------
# state: missing participants
# --------------------------------------------------------------------------
def max_seq_table(coll: pd.DataFrame) -> pd.DataFrame:
    """(process_group, rank) -> highest collective_seq_id begun."""
    if not len(coll):
        return pd.DataFrame(columns=["process_group", "rank", "max_seq"])
    _, gid = _keys(coll)
    rank = coll["rank"].to_numpy(dtype=np.int64)
    key = gid * (int(rank.max()) + 1) + rank
    mx = pd.Series(coll["collective_seq_id"].to_numpy(dtype=np.int64)).groupby(key, sort=False).max()
    first = ~pd.Series(key).duplicated().to_numpy()
    names = pd.Series(_take_str(coll["process_group"], first), index=key[first])
    return pd.DataFrame({"process_group": pd.Series(names.loc[mx.index].to_numpy(), dtype="str"),
                         "rank": (mx.index.to_numpy() % (int(rank.max()) + 1)).astype(np.int64),
                         "max_seq": mx.to_numpy()})


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


def _missing_findings(trace: Trace, coll: pd.DataFrame, missing: pd.DataFrame, members: dict[str, list[int]],
                      max_per_group: int, max_total: int = 12) -> list[Finding]:
    """One warning per unfinished instance with absent members (bounded per group and overall)."""
    findings: list[Finding] = []
    if not len(missing):
        return findings
    end = trace.end_ns
    want = missing[["process_group", "seq"]].drop_duplicates()
    want = want[want.groupby("process_group").cumcount() < max_per_group]
    n_all = len(want)
    want = want.merge(missing.groupby(["process_group", "seq"])["first_start_ns"].min().reset_index(),
                      on=["process_group", "seq"]).sort_values(["first_start_ns", "process_group"]).head(max_total)
    began = coll.merge(want, left_on=["process_group", "collective_seq_id"], right_on=["process_group", "seq"])
    for (g, k), sub in missing.merge(want, on=["process_group", "seq"]).groupby(["process_group", "seq"], sort=True):
        g, k = str(g), int(k)
        absent = sorted(int(r) for r in sub["rank"])
        b = began[(began["process_group"] == g) & (began["seq"] == k)].sort_values("rank")
        op = str(b["op_name"].mode().iloc[0]) if len(b) else "collective"
        waiting = b[b["status"] != S.STATUS_OK]
        since = seconds(end - int(waiting["start_ns"].min())) if len(waiting) else "?"
        if len(sub) == 1:
            m = int(sub["max_seq"].iloc[0])
            stops = f"its last was #{m}" if m > 0 else f"it posted none on {g}"
        else:
            stops = "last: " + ", ".join(f"rank {int(r.rank)} " + (f"#{int(r.max_seq)}" if r.max_seq > 0 else "none")
                                         for r in sub.head(6).itertuples(index=False))
        title = (f"{rank_label(trace, absent)} never posted {op} #{k} on {group_label(g, members.get(g))} "
                 f"({stops}); {rank_label(trace, b['rank'])} began it")
        if len(waiting) == len(b):
            title += f" and {'is' if len(b) == 1 else 'are'} waiting since {since}"
        elif len(waiting):
            title += f"; {len(waiting)} still waiting since {since}"
        ev = [Evidence(rank=int(r.rank), note=f"never began #{k} (highest #{int(r.max_seq)} on {g})",
                       op_name=op, process_group=g, seq=k) for r in sub.head(16).itertuples(index=False)]
        ev += [Evidence(rank=int(r.rank), note=f"began #{k}: {r.status}", op_name=str(r.op_name),
                        process_group=g, seq=k, op_id=int(r.op_id), time_ns=int(r.start_ns))
               for r in b.head(16).itertuples(index=False)]
        findings.append(Finding(kind="collective_mismatch", severity="warning", title=title, ranks=absent,
                                evidence=ev, data={"process_group": g, "seq": k, "instance": [g, k],
                                                   "categories": ["state"], "missing_participant": True,
                                                   "waiting_ranks": [int(r) for r in waiting["rank"]]}))
    if n_all > len(want):
        rest = missing.merge(want[["process_group", "seq"]], how="left", indicator=True)
        rest = rest[rest["_merge"] == "left_only"]
        first = rest.iloc[0]
        findings.append(Finding(
            kind="collective_mismatch", severity="warning",
            title=f"{n_all - len(want)} more unfinished instances with absent members not listed "
                  f"(on {rest['process_group'].nunique()} groups; absent ranks {fmt_ranks(rest['rank'])})",
            ranks=sorted(int(r) for r in rest["rank"].unique())[:64],
            evidence=[Evidence(rank=int(first["rank"]), note=f"never began #{int(first['seq'])}",
                               process_group=str(first["process_group"]), seq=int(first["seq"]))],
            data={"categories": ["state"], "missing_participant": True, "summary": True}))
    return findings


# --------------------------------------------------------------------------
@dataclass
class CollectiveReport:
    findings: list[Finding] = field(default_factory=list)
    instances: pd.DataFrame = field(default_factory=pd.DataFrame)   # per (group, seq) counts
    deviations: pd.DataFrame = field(default_factory=pd.DataFrame)  # per (group, seq, category, deviant rank)
    missing: pd.DataFrame = field(default_factory=pd.DataFrame)     # per (group, seq, absent rank)


def analyze_collectives(trace: Trace, coll: pd.DataFrame | None = None,
                        members: dict[str, list[int]] | None = None, max_per_group: int = 5,
                        max_seq: pd.DataFrame | None = None) -> CollectiveReport:
    """Type/size/dtype mismatches (error) and missing participants (warning), every group, bounded."""
    if coll is None:
        coll = collective_ops(trace.ops)
    if members is None:
        members = membership(trace, coll)
    inst = instance_table(coll)
    dev = find_deviations(coll)
    dev = merge_history(dev, find_history_deviations(coll, inst, dev, group_kinds(trace)))
    missing = missing_participants(coll, members, inst, max_seq)
    findings = _mismatch_findings(trace, coll, dev, members, max_per_group)
    findings += _missing_findings(trace, coll, missing, members, max_per_group)
    return CollectiveReport(findings=findings, instances=inst, deviations=dev, missing=missing)
