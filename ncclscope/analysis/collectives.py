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
from .groups import fmt_ranks, group_label, majority_vote, member_table, membership, rank_label, seconds

if TYPE_CHECKING:
    from ..trace import Trace

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
    names = pd.DataFrame({"key": key[first], "process_group": coll["process_group"].to_numpy()[first],
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
    cols = ["process_group", "seq", "category", "rank", "value", "majority", "n_voters", "n_majority", "tie",
            "op_name", "op_id", "start_ns", "status", "call_site", "step"]
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
    out = pd.concat(frames, ignore_index=True)
    return out[cols].sort_values(["process_group", "seq", "rank"], kind="stable").reset_index(drop=True)


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
    for cat, csub in rows.groupby("category", sort=False):
        maj = csub["majority"].iloc[0]
        value = csub["value"].iloc[0]
        cats.append(str(cat))
        agree = _holders(inst, str(cat), maj)
        parts.append(_describe(str(cat), value, maj, len(agree), rank_label(trace, agree)))
    op = str(inst["op_name"].mode().iloc[0]) if len(inst) else "collective"
    glabel = group_label(g, members.get(g))
    title = f"{rank_label(trace, named)} deviates in {op} #{k} on {glabel}: " + "; ".join(parts)
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
                         "later_instances": later, "unfinished": bool(len(notok))})


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
    names = pd.Series(coll["process_group"].to_numpy()[first], index=key[first])
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
    missing = missing_participants(coll, members, inst, max_seq)
    findings = _mismatch_findings(trace, coll, dev, members, max_per_group)
    findings += _missing_findings(trace, coll, missing, members, max_per_group)
    return CollectiveReport(findings=findings, instances=inst, deviations=dev, missing=missing)
