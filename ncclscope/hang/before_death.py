"""The first deviation behind a death or a hang, when the wait-for graph alone cannot see it.

    from ncclscope.hang.before_death import skips_before_death
    skips = skips_before_death(index_of(trace), roots)     # roots: the wait-for graph's error findings

gloo SIGABRTs the partner of a mismatched collective and its last rows die with it; a rank that skipped
a call pairs its next one with the others' skipped one. The death, the tie or the hang that follows is
the consequence; these findings name the deviation before it, each with its `Cause` (`before_death`,
the ranks that died inside a mismatched instance) so that `verdict.diagnose` promotes it over the root:

- `skips_before_death`: a skip in a root rank's own record (skips.sequence_skips) or before a dead
  rank's death (skips.deviations_before_death);
- `with_deaths_inside`: each mismatch marked with the dead ranks that died inside its instance;
- `mismatches_before_death`: a dead rank's partner whose lone record differs from its own history.
"""
from __future__ import annotations

from dataclasses import replace

import pandas as pd

from ncclscope import schema as S
from ncclscope.findings import Cause, CauseBasis, Evidence, Finding, FindingKind, InstanceRef, Severity
from ncclscope.hang.skips import deviations_before_death, sequence_skips
from ncclscope.index.history import find_history_deviations
from ncclscope.index.instances import DEVIATION_COLUMNS
from ncclscope.index.labels import rank_label
from ncclscope.index.views import TraceIndex

K = FindingKind
# The JSON order of the findings this module words (their causes' claims among `data`), as earlier releases
# wrote it: a skip before a death, a lone record that deviates from its rank's history.
SKIP_LAYOUT = ("before_death", "basis", "call_site", "step", "skipped", "went_site")
LONE_LAYOUT = ("process_group", "seq", "categories", "deviant_ranks", "absent_ranks", "basis", "call_site",
               "before_death", "later_instances", "unfinished", "ambiguous")


def skips_before_death(ix: TraceIndex, roots: list[Finding]) -> list[Finding]:
    """The first deviation behind the wait-for roots, when it is a skip:

    - a rank in a root whose call sites in its last step jump ahead of its own previous step's order at
      an instance the others posted from the skipped site (skips.sequence_skips), whatever the root;
    - for each dead rank the graph ends at, the skip it made before dying, if its record (census, stack
      dump, last compute span) shows one (skips.deviations_before_death).
    The death (gloo's SIGABRT on the paired-off collective, an allocation failure from garbage counts),
    the tie or the hang is its consequence; `combine` promotes the skip over it."""
    dead = sorted({int(r) for f in roots if f.kind == K.DEAD_RANK for r in f.ranks})
    involved = sorted({int(r) for f in roots for r in f.involved_ranks})
    if not involved:
        return []
    seq = sequence_skips(ix, involved)
    dev = deviations_before_death(ix, [r for r in dead if r not in set(seq["rank"])]) if dead else seq.iloc[0:0]
    dev = pd.concat([seq, dev], ignore_index=True) if len(dev) else seq
    out = []
    trace = ix.trace
    for d in dev.itertuples(index=False):
        g, k, site = str(d.process_group), int(d.seq), str(d.call_site)
        refs = [int(x) for x in d.ref_ranks]
        who = rank_label(trace, [int(d.rank)])
        at = f" at step {int(d.step)}" if int(d.step) >= 0 else ""   # -1: a loop without step numbers
        if d.basis == "stack-ahead":      # it ran ahead, but which earlier call it left out is not recorded
            title = (f"{who} skipped a collective on {ix.label(g)}{at}: at #{k}, where "
                     f"{rank_label(trace, refs)} called {d.op_name} ({site}), {d.note}")
        else:
            title = (f"{who} skipped {d.op_name} on {ix.label(g)}{at} "
                     f"({site}" + (f", #{k} for {rank_label(trace, refs)})" if k >= 0 and refs else ")")
                     + f": {d.note}")
        if d.went_site:
            title += f"; it paired with the others' {d.op_name}" + (f" #{k}" if k >= 0 else "")
        ev = [Evidence(rank=int(d.rank), note=f"skipped {d.op_name} from {site}{at} ({d.basis}): "
                                              f"{d.note}", op_name=str(d.op_name), process_group=g, seq=k)]
        coll = ix.coll
        began = coll[(coll["process_group"] == g) & (coll["collective_seq_id"] == k)].head(8)
        ev += [Evidence(rank=int(r.rank), note=f"posted #{k} from {r.call_site}: {r.status}", op_name=str(r.op_name),
                        process_group=g, seq=k, op_id=int(r.op_id), time_ns=int(r.start_ns))
               for r in began.itertuples(index=False)]
        out.append(Finding(kind=K.HANG, severity=Severity.ERROR, title=title, ranks=[int(d.rank)], evidence=ev,
                           instance=InstanceRef(g, k) if k >= 0 else None,
                           involved=sorted({int(d.rank)} | set(refs)),
                           data={"call_site": site, "step": int(d.step), "skipped": [g, k],
                                 "went_site": str(d.went_site)},
                           cause=Cause(basis=CauseBasis(str(d.basis)), before_death=True), layout=SKIP_LAYOUT))
    return out


def with_deaths_inside(ix: TraceIndex, findings: list[Finding]) -> list[Finding]:
    """Mark each mismatch with the dead ranks that died inside its instance (their begin row for it never
    got an end): gloo aborts the members of a size mismatch in the op itself, so those deaths are the
    mismatch's doing (`explains`), the deviant's own death included."""
    mism = [f for f in findings if f.kind == K.COLLECTIVE_MISMATCH and f.instance is not None]
    if not mism:
        return findings
    dead = {r for r, info in ix.trace.ranks.items() if info.died}
    if not dead:
        return findings
    coll = ix.coll
    open_rows = coll[(coll["status"].astype(str) == "inflight").to_numpy() & coll["rank"].isin(dead).to_numpy()]
    inside: dict[tuple[str, int], list[int]] = {}
    for r in open_rows[["process_group", "collective_seq_id", "rank"]].itertuples(index=False):
        inside.setdefault((str(r.process_group), int(r.collective_seq_id)), []).append(int(r.rank))
    ids, out = {id(m) for m in mism}, []
    for f in findings:
        ranks = inside.get((f.instance.group, f.instance.seq)) if id(f) in ids else None
        out.append(replace(f, cause=replace(f.cause, died_inside=tuple(sorted(ranks)))) if ranks else f)
    return out


def mismatches_before_death(ix: TraceIndex, roots: list[Finding]) -> list[Finding]:
    """A dead rank's partner whose lone record of an instance differs from its own history there.

    gloo SIGABRTs the partner of a size mismatch and its rows die with it: the instance is left with one
    record, which may even have completed. The survivor whose call differs from every earlier call it made
    from that site (instances.find_history_deviations) deviated first; the death is the consequence."""
    dead = sorted({int(r) for f in roots if f.kind == K.DEAD_RANK for r in f.ranks})
    if not dead:
        return []
    inst, coll, trace = ix.instances, ix.coll, ix.trace
    groups = [g for g, ms in ix.members.items() if len(ms) > 1 and set(ms) & set(dead)]
    lone = inst[(inst["n_began"] == 1) & inst["process_group"].isin(groups)]
    if not len(lone):
        return []
    lone = lone.assign(n_notok=lone["n_notok"].clip(lower=1))      # a candidate whatever its status
    # References: every call the rank made from those sites, whatever its status. What a call passed does not
    # depend on how it ended, and after the partner's death the rank's later calls there all fail.
    sites = coll.merge(lone[["process_group", "seq"]], left_on=["process_group", "collective_seq_id"],
                       right_on=["process_group", "seq"])["call_site"].unique()
    pool = coll[coll["call_site"].isin(sites).to_numpy()]
    pool = pool.assign(status=S.STATUS_OK)
    dev = find_history_deviations(pool, lone, pd.DataFrame(columns=DEVIATION_COLUMNS), ix.kinds,
                                  ix.members)
    if len(dev) and "status" in dev.columns:     # the candidates' own status, as recorded
        dev = dev.drop(columns="status").merge(coll[["rank", "op_id", "status"]], on=["rank", "op_id"], how="left")
    dev = dev[~dev["rank"].isin(dead)] if len(dev) else dev
    out = []
    for (g, k), sub in (dev.groupby(["process_group", "seq"], sort=True) if len(dev) else []):
        g, k = str(g), int(k)
        ranks = sorted(int(r) for r in sub["rank"].unique())
        absent = sorted(set(ix.members.get(g, [])) - set(ranks))
        parts = [f"{'passed sizes' if c == 'size' else 'used dtype' if c == 'dtype' else 'called'} {v} where "
                 f"{note or 'its own other calls there'} {'passed' if c == 'size' else 'used' if c == 'dtype' else 'called'}"
                 f" {m}" for c, v, m, note in zip(sub["category"], sub["value"], sub["majority"], sub["ref_note"])]
        op = str(sub["op_name"].iloc[0])
        site = str(sub["call_site"].iloc[0])
        title = (f"{rank_label(trace, ranks)} deviates in {op} #{k} on {ix.label(g)}"
                 + (f" at {site}" if site else "") + ": " + "; ".join(parts)
                 + f"; {rank_label(trace, absent)} left no record of #{k}")
        ev = [Evidence(rank=int(r.rank), note=f"deviant: {r.category} {r.value} vs {r.majority}; {r.status}",
                       op_name=str(r.op_name), process_group=g, seq=k, op_id=int(r.op_id), time_ns=int(r.start_ns))
              for r in sub.itertuples(index=False)]
        out.append(Finding(kind=K.COLLECTIVE_MISMATCH, severity=Severity.ERROR, title=title, ranks=ranks, evidence=ev,
                           instance=InstanceRef(g, k),
                           data={"process_group": g, "seq": k, "categories": sorted(set(sub["category"])),
                                 "call_site": site},
                           cause=Cause(basis=CauseBasis.HISTORY, before_death=True, deviant_ranks=tuple(ranks),
                                       absent_ranks=tuple(absent), later_instances=0, unfinished=False,
                                       ambiguous=False),
                           layout=LONE_LAYOUT))
    return out
