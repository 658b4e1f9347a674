"""Collective alignment: do the members of each group agree on instance #k?

For every collective instance (aligned per group by `collective_seq_id`, see
instances.py) we compare what the members issued, in Flight Recorder's
categories:

- type  (op name, with the reduce op): all_reduce on three ranks, broadcast on
  one -> the job hangs (gloo) or silently mixes data;
- size  (input shapes; not for ops whose sizes legitimately differ per rank);
- split (all_to_all_single: a member's sends against what its peers expect, a2a.py);
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
  are decided by *history* (`instances.find_history_deviations`);
- a rank that skips a collective does not hang there: its next one pairs
  with the others' skipped one and the job hangs later, elsewhere
  (`census.step_census_deviations`, asked by the wait-for graph).

This module words the findings; the tables come from the index.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import pandas as pd

from ncclscope import schema as S
from ncclscope.findings import Cause, CauseBasis, Evidence, Finding, InstanceRef, WaitSummary
from ncclscope.hang.a2a import split_deviations
from ncclscope.hang.abort_ties import larger_side
from ncclscope.index.views import IndexLike, TraceIndex, as_index
from ncclscope.index.history import find_history_deviations, merge_history
from ncclscope.index.instances import find_deviations, near_instances, type_value
from ncclscope.index.labels import fmt_ranks, rank_label
from ncclscope.index.source_loops import cwds_of, left_loop_note, recent_sites
from ncclscope.hang.wording import since as since_text

if TYPE_CHECKING:
    from ncclscope.load.trace import Trace

# The JSON order of a mismatch's `data` (its cause's claims among them), as earlier releases wrote it;
# `died_inside` is added by diagnose when dead ranks died inside the instance.
MISMATCH_LAYOUT = ("process_group", "seq", "categories", "ambiguous", "deviant_ranks", "later_instances",
                   "unfinished", "basis", "absent_ranks", "call_site", "died_inside")


@dataclass
class CollectiveReport:
    findings: list[Finding] = field(default_factory=list)
    instances: pd.DataFrame = field(default_factory=pd.DataFrame)   # per (group, seq) counts
    deviations: pd.DataFrame = field(default_factory=pd.DataFrame)  # per (group, seq, category, deviant rank)
    missing: pd.DataFrame = field(default_factory=pd.DataFrame)     # per (group, seq, absent rank)



def analyze_collectives(source: IndexLike, max_per_group: int = 5) -> CollectiveReport:
    """Type/size/dtype mismatches (error) and missing participants (warning), every group, bounded."""
    ix = as_index(source)
    coll, inst = ix.coll, ix.instances
    dev = find_deviations(coll)
    dev = merge_history(dev, find_history_deviations(coll, inst, dev, ix.kinds, ix.members))
    splits = split_deviations(ix)
    if len(splits):
        dev = pd.concat([dev, splits], ignore_index=True) if len(dev) else splits
    findings = _mismatch_findings(ix, dev, max_per_group)
    findings += _missing_findings(ix, max_per_group)
    return CollectiveReport(findings=findings, instances=inst, deviations=dev, missing=ix.missing)


def _mismatch_findings(ix: TraceIndex, dev: pd.DataFrame, max_per_group: int) -> list[Finding]:
    """One finding per (group, deviant rank): its first deviating instance plus how many later ones."""
    findings: list[Finding] = []
    if not len(dev):
        return findings
    firsts = dev.groupby(["process_group", "rank"], sort=False)["seq"].agg(first="min", n="nunique").reset_index()
    for g, gsub in firsts.sort_values(["process_group", "first", "rank"]).groupby("process_group", sort=True):
        # Ranks whose first deviation is the same instance share one finding (a tie names several).
        per_inst = list(gsub.groupby("first", sort=True))
        for i, (k, isub) in enumerate(per_inst):
            if i >= max_per_group:
                rest = per_inst[i:]
                findings.append(_summary_finding(ix, str(g), rest, dev))
                break
            findings.append(_instance_finding(ix, dev, str(g), int(k), isub))
    return findings


def _deviant_site(inst: pd.DataFrame, ranks: list[int], common: bool = False) -> str:
    """The call site the (first) deviant rank issued the instance from (`common`: the one most of
    `ranks` issued it from), "" when not recorded."""
    mine = inst[inst["rank"].isin(ranks)]["call_site"].astype(str) if "call_site" in inst.columns else pd.Series([], dtype=str)
    mine = mine[mine != ""]
    if not len(mine):
        return ""
    return str(mine.mode().iloc[0]) if common else str(mine.iloc[0])


def _instance_finding(ix: TraceIndex, dev: pd.DataFrame, g: str, k: int, isub: pd.DataFrame) -> Finding:
    trace, coll, members, end_ns = ix.trace, ix.coll, ix.members, ix.end_ns
    ranks = sorted(int(r) for r in isub["rank"])
    later = int(isub["n"].max()) - 1
    rows = dev[(dev["process_group"] == g) & (dev["seq"] == k)]
    rows = rows[rows["rank"].isin(ranks)]
    inst = coll[(coll["process_group"] == g) & (coll["collective_seq_id"] == k)].sort_values("rank")
    tie = bool(rows["tie"].any())
    named = ranks[:1] if tie else ranks
    absent = sorted(set(members.get(g, [])) - set(int(r) for r in inst["rank"]))
    # a 1 vs 1 tie whose other member gloo aborted: the survivor that posted more bytes (abort_ties.py)
    aborted_by = larger_side(trace, inst, absent, [str(c) for c in rows["category"].unique()], g) if tie else None
    flip = aborted_by is not None and aborted_by not in ranks
    if aborted_by is not None:
        named, tie = [aborted_by], False
    dev_ranks = set(named) if aborted_by is not None else set(int(x) for x in rows["rank"])
    parts, cats = [], []
    history = False
    for cat, csub in rows.groupby("category", sort=False):
        maj = csub["majority"].iloc[0]
        value = csub["value"].iloc[0]
        cats.append(str(cat))
        if flip:                         # worded from the named survivor's side
            value, maj = maj, value
        if cat == "split":               # a2a.py words it: what it sends against what its peers expect
            parts.append(str(value))
        elif (csub["basis"] == "history").all():
            history = True
            parts.append(_describe(str(cat), value, maj, 0, str(csub["ref_note"].iloc[0])))
        else:
            agree = _holders(inst, str(cat), maj)
            parts.append(_describe(str(cat), value, maj, len(agree), rank_label(trace, agree)))
    ops = inst[~inst["rank"].isin(ranks)]["op_name"] if len(inst) > len(ranks) else inst["op_name"]
    op = str(ops.mode().iloc[0]) if len(ops) else "collective"
    glabel = ix.label(g)
    title = f"{rank_label(trace, named)} deviates in {op} #{k} on {glabel}: " + "; ".join(parts)
    site = _deviant_site(inst, named)
    theirs = _deviant_site(inst, sorted(set(int(r) for r in inst["rank"]) - dev_ranks), common=True)
    if site:                         # the user's line to look at, and the peers' where it differs
        before = recent_sites(trace, named[0]) if len(named) == 1 and theirs and theirs != site else None
        title += (f" ({'its' if len(named) == 1 else 'their'} call at {site}"
                  + (f"; the others' at {theirs}{left_loop_note(cwds_of(trace), theirs, [site], before)}"
                     if theirs and theirs != site else "") + ")")
    if aborted_by is not None:
        dead = _end_states(trace, absent)
        title += (f"; a 1 vs 1 tie among the survivors, decided by {rank_label(trace, absent)}"
                  f"{f' ({dead})' if dead else ''}: gloo aborts a member that receives more bytes than it "
                  f"posted, so the dead one agreed with the smaller side")
    if absent and history:
        how = _end_states(trace, absent)
        title += f"; {rank_label(trace, absent)} left no record of #{k}" + (f" ({how})" if how else "")
    if tie:
        n_maj = int(rows["n_majority"].iloc[0])
        why = str(rows["ref_note"].iloc[0]) if (rows["category"] == "split").all() else ""
        title = (f"ambiguous ({why or f'{n_maj} vs {n_maj} tie'}), naming the lowest rank {named[0]}: "
                 f"{op} #{k} on {glabel}: " + "; ".join(parts))
    if later > 0:
        title += f" (and in {later} later instance{'s' if later > 1 else ''})"
    notok = inst[inst["status"] != S.STATUS_OK]
    if len(notok):
        title += (f"; {rank_label(trace, notok['rank'])} blocked in it"
                  + since_text(end_ns, notok['start_ns'].min(), " for "))
    ev = []
    for r in inst.itertuples(index=False):
        is_dev = int(r.rank) in dev_ranks
        note = ("deviant: " if is_dev else "majority: ") + _summary(r) + f"; {r.status}"
        ev.append(Evidence(rank=int(r.rank), note=note, op_name=str(r.op_name), process_group=g, seq=k,
                           op_id=int(r.op_id), time_ns=int(r.start_ns)))
    ev.sort(key=lambda e: (not e.note.startswith("deviant"), e.rank))
    nxt = _next_instances(coll, inst) if absent else ()
    return Finding(kind="collective_mismatch", severity="error", title=title, ranks=named, evidence=ev[:24],
                   instance=InstanceRef(g, k),
                   data={"process_group": g, "seq": k, "categories": cats, "call_site": site},
                   cause=Cause(basis=CauseBasis.HISTORY if history else CauseBasis.ABORT if aborted_by is not None
                               else CauseBasis.INSTANCE, ambiguous=tie, deviant_ranks=tuple(sorted(dev_ranks)),
                               absent_ranks=tuple(absent), unfinished=bool(len(notok)), later_instances=later,
                               next_instances=nxt or None),
                   layout=MISMATCH_LAYOUT)


def _next_instances(coll: pd.DataFrame, inst: pd.DataFrame) -> tuple[tuple[str, int], ...]:
    """The collective instances the members that recorded `inst` issued right after it, each in its own
    order (`coll` is sorted by rank, start): where a member that left no record of it is waited on next."""
    pos = coll.index.get_indexer(inst.index) + 1
    pos = pos[(pos > 0) & (pos < len(coll))]
    if not len(pos):
        return ()
    after = coll.iloc[pos]
    same = after["rank"].to_numpy() == coll["rank"].to_numpy()[pos - 1]
    return tuple(sorted({(str(g), int(k)) for g, k in zip(after["process_group"].to_numpy()[same],
                                                           after["collective_seq_id"].to_numpy()[same])}))


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
        vals = type_value(inst)
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


def _summary_finding(ix: TraceIndex, g: str, rest: list[tuple[int, pd.DataFrame]], dev: pd.DataFrame) -> Finding:
    seqs = [int(k) for k, _ in rest]
    ranks = sorted({int(r) for _, s in rest for r in s["rank"]})
    k0 = seqs[0]
    first = dev[(dev["process_group"] == g) & (dev["seq"] == k0)].iloc[0]
    ev = [Evidence(rank=int(first["rank"]), note=f"first of {len(seqs)} further deviations on {g}",
                   op_name=str(first["op_name"]), process_group=g, seq=k0, op_id=int(first["op_id"]),
                   time_ns=int(first["start_ns"]))]
    return Finding(kind="collective_mismatch", severity="warning",
                   title=f"{len(seqs)} more mismatched instance{'s' if len(seqs) > 1 else ''} on "
                         f"{ix.label(g)} not listed (first #{k0}; ranks {','.join(map(str, ranks[:16]))})",
                   ranks=ranks, evidence=ev, data={"process_group": g, "seqs": seqs[:1000]},
                   cause=Cause(summary=True))


def _missing_findings(ix: TraceIndex, max_per_group: int, max_total: int = 12) -> list[Finding]:
    """One warning per unfinished instance with absent members (bounded per group and overall)."""
    findings: list[Finding] = []
    missing = ix.missing
    if not len(missing):
        return findings
    trace, coll, end = ix.trace, ix.coll, ix.end_ns
    want = missing[["process_group", "seq"]].drop_duplicates()
    want = want[want.groupby("process_group").cumcount() < max_per_group]
    n_all = len(want)
    want = want.merge(missing.groupby(["process_group", "seq"])["first_start_ns"].min().reset_index(),
                      on=["process_group", "seq"]).sort_values(["first_start_ns", "process_group"]).head(max_total)
    began = near_instances(coll, want["process_group"], want["seq"]).merge(
        want, left_on=["process_group", "collective_seq_id"], right_on=["process_group", "seq"])
    for (g, k), sub in missing.merge(want, on=["process_group", "seq"]).groupby(["process_group", "seq"], sort=True):
        g, k = str(g), int(k)
        absent = sorted(int(r) for r in sub["rank"])
        b = began[(began["process_group"] == g) & (began["seq"] == k)].sort_values("rank")
        op = str(b["op_name"].mode().iloc[0]) if len(b) else "collective"
        waiting = b[b["status"] != S.STATUS_OK]
        since = since_text(end, waiting["start_ns"].min()) if len(waiting) else ""      # "" where no time
        if len(sub) == 1:
            m = int(sub["max_seq"].iloc[0])
            stops = f"its last was #{m}" if m > 0 else f"it posted none on {g}"
        else:
            stops = "last: " + ", ".join(f"rank {int(r.rank)} " + (f"#{int(r.max_seq)}" if r.max_seq > 0 else "none")
                                         for r in sub.head(6).itertuples(index=False))
        title = (f"{rank_label(trace, absent)} never posted {op} #{k} on {ix.label(g)} "
                 f"({stops}); {rank_label(trace, b['rank'])} began it")
        if len(waiting) == len(b):
            title += f" and {'is' if len(b) == 1 else 'are'} waiting{since}"
        elif len(waiting):
            title += f"; {len(waiting)} still waiting{since}"
        ev = [Evidence(rank=int(r.rank), note=f"never began #{k} (highest #{int(r.max_seq)} on {g})",
                       op_name=op, process_group=g, seq=k) for r in sub.head(16).itertuples(index=False)]
        ev += [Evidence(rank=int(r.rank), note=f"began #{k}: {r.status}", op_name=str(r.op_name),
                        process_group=g, seq=k, op_id=int(r.op_id), time_ns=int(r.start_ns))
               for r in b.head(16).itertuples(index=False)]
        findings.append(Finding(kind="collective_mismatch", severity="warning", title=title, ranks=absent,
                                evidence=ev, instance=InstanceRef(g, k),
                                wait=WaitSummary(waiting_ranks=tuple(int(r) for r in waiting["rank"])),
                                data={"process_group": g, "seq": k, "categories": ["state"],
                                      "missing_participant": True}))
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
            data={"categories": ["state"], "missing_participant": True}, cause=Cause(summary=True)))
    return findings

