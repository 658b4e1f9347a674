"""One verdict for a hung (or healthy) job: who everyone waits on, and why.

    from ncclscope.load.trace import load
    from ncclscope.verdict.diagnose import diagnose
    d = diagnose(load("run-20250101-120000"))
    print(d.verdict)          # HANG: rank 5 (pp 1, dp 1) never posted all_reduce #17 on dp1[1,3,5,7]; ...
    for f in d.findings: ...  # headline first, then what supports it

The modules each answer one question (collective alignment, p2p matching,
group views, the wait-for graph). A single root cause shows up in several of
them: a rank that used the wrong group is a missing participant in one group,
a skip-suspect in the wait-for graph and a `wrong_group` in the group check.
People need one headline per root cause, so this module:

1. takes each wait-for root (deadlock / hang / dead_rank / stuck_in_compute);
2. promotes a more specific cause when one explains it (`wrong_group`, or a
   type/size/dtype `collective_mismatch` at the instance the waiters are
   blocked in or before it: that is the first rank to deviate, even when an
   innocent neighbour crashed on the mismatch or everybody timed out; a
   `schedule_deviation` of a rank in a deadlock (schedule_check.py); a skip
   that a death, a tie or a hang followed (`skips_before_death`); a
   `wrong_group` before the death of a member of the group it went to or was
   meant for, alive at the wrong call (groups.with_partner_deaths: gloo pairs
   the wrong call with that member's own and aborts it); an `unmatched_p2p`
   whose absent side left its own routine there (p2p.with_departure: in step
   s-1 it posted the counterpart at this point, in step s it went elsewhere),
   over the deadlock or hang between the two). The first deviation is the
   root cause: the death or deadlock it led to stays listed as supporting;
3. files the collective / p2p / group findings about the same ranks or
   instance under it as supporting (`role == Role.SUPPORTING`,
   `supports` = the headline's title);
4. sorts most severe first (headlines before independent findings before
   supporting ones) and writes the verdict from the first headline.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import pandas as pd

from ncclscope import schema as S
from ncclscope.findings import SEVERITIES, Evidence, Explains, Finding, InstanceRef, Role
from ncclscope.verdict.headline import OK_VERDICT, hang_verdict  # noqa: F401  (OK_VERDICT re-exported)
from ncclscope.hang.census import deviations_before_death, sequence_skips
from ncclscope.index.instances import DEVIATION_COLUMNS, find_history_deviations
from ncclscope.hang.collectives import analyze_collectives
from ncclscope.hang.group_checks import analyze_groups
from ncclscope.index.views import TraceIndex, index_of
from ncclscope.index.labels import rank_label
from ncclscope.hang.late_arrival import find_late_arrivals
from ncclscope.hang.nonmember import find_nonmember_calls
from ncclscope.hang.p2p import analyze_p2p
from ncclscope.hang.schedule_check import analyze_schedule
from ncclscope.hang.p2p_tags import tag_deviations
from ncclscope.hang.p2p_sizes import size_deviations
from ncclscope.index.stack_excerpts import stack_for
from ncclscope.hang.stopped import fr_roots
from ncclscope.hang.waitfor import analyze_waits

if TYPE_CHECKING:
    from ncclscope.load.trace import Trace
    from ncclscope.index.wait_edges import WaitEdges

ROOT_KINDS = ("deadlock", "hang", "dead_rank", "stuck_in_compute")
PROMOTABLE = ("wrong_group", "collective_mismatch", "schedule_deviation", "hang", "unmatched_p2p",
              "stuck_in_compute")   # the last only as a late arrival (late_arrival.py)
DEPARTURE_EXPLAINS = ("deadlock", "hang")
SCHEDULE_EXPLAINS = ("deadlock", "hang", "dead_rank")
_ROLE_ORDER = {"headline": 0, "independent": 1, "supporting": 2}
MAX_EVIDENCE = 60


@dataclass
class Diagnosis:
    verdict: str
    findings: list[Finding]
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)
    waits: "WaitEdges | None" = None      # the wait-for edges, expanded on demand (`.select`, `.frame`)

    @property
    def ok(self) -> bool:
        return self.verdict.startswith("OK")

    @property
    def headline(self) -> Finding | None:
        return next((f for f in self.findings if f.role == Role.HEADLINE), None)

    def to_json(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "findings": [f.to_json() for f in self.findings]}


def diagnose(trace: Trace, max_per_group: int = 5) -> Diagnosis:
    """Run every hang analysis on `trace` and reduce it to headline findings and a verdict.

    Each question reads the trace's index (built once, see index.py), never its own copy of the tables."""
    ix = index_of(trace)
    cr = analyze_collectives(ix, max_per_group=max_per_group)
    pr = analyze_p2p(ix)
    gr = analyze_groups(ix)
    wr = analyze_waits(ix)
    roots = [f for f in wr.findings if f.severity == "error"]
    context = [f for f in wr.findings if f.severity != "error"]
    sched = analyze_schedule(ix)
    before = (skips_before_death(ix, roots) + mismatches_before_death(ix, roots) + find_late_arrivals(ix)
              + find_nonmember_calls(ix))
    causes = (_with_deaths_inside(ix, cr.findings) + sched + before + tag_deviations(ix, pr.findings)
              + size_deviations(ix) + pr.findings + gr.findings + context)
    findings = combine(trace, *fr_roots(ix, roots, causes))
    tables = {"blocking_ops": wr.blocking, "rank_states": wr.ranks,
              "collective_instances": cr.instances, "collective_deviations": cr.deviations,
              "missing_participants": cr.missing, "p2p_pairs": pr.pairs, "p2p_unmatched": pr.unmatched,
              "group_view_deviations": gr.view_deviations}
    return Diagnosis(verdict=hang_verdict(findings), findings=findings, tables=tables, waits=wr.waits)


# --------------------------------------------------------------------------
def _instance(f: Finding) -> tuple[str, int] | None:
    return (f.instance.group, f.instance.seq) if f.instance is not None else None


def _blocked_at(f: Finding) -> set[tuple[str, int]]:
    return {(i.group, i.seq) for i in f.instances}


def _involved(f: Finding) -> set[int]:
    return f.involved_ranks


def skips_before_death(ix: TraceIndex, roots: list[Finding]) -> list[Finding]:
    """The first deviation behind the wait-for roots, when it is a skip:

    - a rank in a root whose call sites in its last step jump ahead of its own previous step's order at
      an instance the others posted from the skipped site (census.sequence_skips), whatever the root;
    - for each dead rank the graph ends at, the skip it made before dying, if its record (census, stack
      dump, last compute span) shows one (census.deviations_before_death).
    The death (gloo's SIGABRT on the paired-off collective, an allocation failure from garbage counts),
    the tie or the hang is its consequence; `combine` promotes the skip over it."""
    dead = sorted({int(r) for f in roots if f.kind == "dead_rank" for r in f.ranks})
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
        out.append(Finding(kind="hang", severity="error", title=title, ranks=[int(d.rank)], evidence=ev,
                           instance=InstanceRef(g, k) if k >= 0 else None,
                           involved=sorted({int(d.rank)} | set(refs)),
                           data={"before_death": True, "basis": str(d.basis), "call_site": site,
                                 "step": int(d.step), "skipped": [g, k], "went_site": str(d.went_site)}))
    return out


def _with_deaths_inside(ix: TraceIndex, findings: list[Finding]) -> list[Finding]:
    """Mark each mismatch with the dead ranks that died inside its instance (their begin row for it never
    got an end): gloo aborts the members of a size mismatch in the op itself, so those deaths are the
    mismatch's doing (`explains`), the deviant's own death included."""
    mism = [f for f in findings if f.kind == "collective_mismatch" and f.instance is not None]
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
        out.append(replace(f, data={**f.data, "died_inside": sorted(ranks)}) if ranks else f)
    return out


def mismatches_before_death(ix: TraceIndex, roots: list[Finding]) -> list[Finding]:
    """A dead rank's partner whose lone record of an instance differs from its own history there.

    gloo SIGABRTs the partner of a size mismatch and its rows die with it: the instance is left with one
    record, which may even have completed. The survivor whose call differs from every earlier call it made
    from that site (instances.find_history_deviations) deviated first; the death is the consequence."""
    dead = sorted({int(r) for f in roots if f.kind == "dead_rank" for r in f.ranks})
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
    dev = find_history_deviations(pool, lone, pd.DataFrame(columns=DEVIATION_COLUMNS), ix.kinds)
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
        out.append(Finding(kind="collective_mismatch", severity="error", title=title, ranks=ranks, evidence=ev,
                           instance=InstanceRef(g, k),
                           data={"process_group": g, "seq": k, "categories": sorted(set(sub["category"])),
                                 "deviant_ranks": ranks, "absent_ranks": absent, "basis": "history", "call_site": site,
                                 "before_death": True, "later_instances": 0, "unfinished": False,
                                 "ambiguous": False}))
    return out


def explains(cause: Finding, root: Finding) -> bool:
    """Does a wrong_group / type-size-dtype mismatch / schedule deviation / skip before a death / skipped
    p2p account for this wait-for root?"""
    if cause.kind not in PROMOTABLE or cause.severity != "error" or cause.data.get("summary"):
        return False
    if cause.kind == "stuck_in_compute":   # a late arrival: the peer's timeout and what followed are its doing
        return (cause.data.get("basis") == "late-arrival" and root.kind in ROOT_KINDS
                and bool(set(cause.involved) & root.involved_ranks))
    if cause.kind == "schedule_deviation":
        return root.kind in SCHEDULE_EXPLAINS and bool(set(cause.ranks) & root.involved_ranks)
    if cause.kind == "collective_mismatch" and cause.data.get("before_death"):
        return root.kind == "dead_rank" and bool(set(root.ranks) & set(cause.data.get("absent_ranks", [])))
    if cause.kind == "collective_mismatch" and root.kind == "dead_rank" and set(root.ranks) & set(
            cause.data.get("died_inside", ())):
        return True
    if cause.kind == "unmatched_p2p":   # the absent side skipped it (p2p.with_departure) or changed its tag
        return ((bool(cause.data.get("departure")) or bool(cause.data.get("tag_deviant")))
                and root.kind in DEPARTURE_EXPLAINS
                and {int(cause.data["poster"]), int(cause.data["absent"])} <= root.involved_ranks)
    if cause.kind == "hang":
        if not cause.data.get("before_death"):
            return False
        if cause.data.get("basis") == "sequence":       # the skip is in the rank's own record: any root it is in
            return bool(set(cause.ranks) & root.involved_ranks)
        return root.kind == "dead_rank" and bool(set(cause.ranks) & set(root.ranks))
    if cause.kind == "collective_mismatch" and cause.data.get("p2p_pair"):   # a send/recv size change
        return bool(set(cause.data["p2p_pair"]) & root.involved_ranks)
    inst = _instance(cause)
    if inst is None:
        return False
    g, k = inst
    blocked_at = _blocked_at(root)
    if cause.kind == "wrong_group":
        # the waiters are in the instance it skipped, or in the one its wrong call made on the other group;
        # or the root is the death of a member of either group, alive at the wrong call (gloo paired the
        # wrong call with that member's own and aborted it: groups.with_partner_deaths)
        if set(cause.ranks) & set(root.ranks):
            return True
        if root.kind == "dead_rank":     # a death it caused, not one that was there before it
            return bool(set(root.ranks) & set(cause.data.get("partner_deaths", ())))
        made = (str(cause.data.get("wrong_group", "")), int(cause.data.get("wrong_seq", -1)))
        return inst in blocked_at or made in blocked_at
    if inst in blocked_at:
        return True
    # An earlier instance on the same group counts only if it never finished or the deviation
    # persisted (a shifted sequence); a mismatch that completed long ago is a separate finding.
    persists = bool(cause.data.get("unfinished")) or int(cause.data.get("later_instances", 0)) > 0
    later = any(a == g and b >= k for a, b in blocked_at)
    return later and persists and bool(set(cause.data.get("deviant_ranks", cause.ranks)) & _involved(root))


def supports(f: Finding, head: Finding, root: Finding | None) -> bool:
    """Is `f` another view of the same root cause (same root ranks or the same blocked instance)?"""
    roots = set(head.ranks) | (set(root.ranks) if root else set())
    if set(f.ranks) & roots:
        return True
    inst = _instance(f)
    blocked_at = _blocked_at(root or head)
    if inst is not None and inst in blocked_at:
        return True
    if f.kind == "unmatched_p2p":
        inv = _involved(root or head)
        return f.data.get("poster") in inv and f.data.get("absent") in inv
    return False


def _cause_order(c: Finding) -> tuple:
    """Most specific cause first; a tied (ambiguous) vote comes after a skip that names the rank."""
    rank = PROMOTABLE.index(c.kind)
    if c.kind == "collective_mismatch" and c.data.get("ambiguous"):
        rank = len(PROMOTABLE)
    return (rank, min(e.time_ns for e in c.evidence))


def _skip_first(causes: list[Finding]) -> list[Finding]:
    """A mismatch is the shifted pairing of a skip when the same rank skipped a call on the same group at or
    before that instance (census.sequence_skips: its #k came from a later call site than its peers' #k). Its
    op then met the peers' next op, so sizes or types disagree; the skip is the first deviation."""
    if not causes or causes[0].kind != "collective_mismatch":
        return causes
    head = causes[0]
    deviant, inst = set(head.data.get("deviant_ranks", head.ranks)), _instance(head)
    for c in causes[1:]:
        ci = _instance(c)
        if (c.kind == "hang" and c.data.get("basis") == "sequence" and set(c.ranks) & deviant
                and ci is not None and inst is not None and ci[0] == inst[0] and ci[1] <= inst[1]):
            return [c] + [x for x in causes if x is not c]
    return causes


def _consequence(cause: Finding) -> bool:
    """Causes whose root stays listed as their consequence (supporting): a schedule deviation's deadlock,
    a skip's death."""
    return (cause.kind == "schedule_deviation" or bool(cause.data.get("before_death"))
            or bool(cause.data.get("departure")) or cause.data.get("basis") == "late-arrival")


def _promote(trace: Trace, cause: Finding, root: Finding) -> Finding:
    title = cause.title
    summary = root.wait.text if root.wait is not None else ""
    if (root.kind == "dead_rank" and (not set(root.ranks) <= set(cause.ranks) or _consequence(cause))) or (
            root.kind == "deadlock" and cause.data.get("departure")):
        title += f"; then {root.title}"
    elif summary and "waiting" not in title and "blocked" not in title:
        title += f"; {summary}"
    seen = {(e.rank, e.op_id, e.note) for e in cause.evidence}
    evidence = list(cause.evidence) + [e for e in root.evidence if (e.rank, e.op_id, e.note) not in seen]
    data = dict(cause.data)
    if "p2p" in root.data:
        data["p2p"] = root.data["p2p"]
    return replace(cause, title=title, evidence=evidence[:MAX_EVIDENCE], data=data,
                   wait=root.wait if root.wait is not None else cause.wait,
                   instances=list(root.instances) or list(cause.instances),
                   involved=list(root.involved) or list(cause.involved),
                   explains=Explains(str(root.kind), root.title, tuple(root.ranks)),
                   stack=stack_for(trace, cause.ranks) or cause.stack)


def _as_headline(trace: Trace, f: Finding) -> Finding:
    """Mark `f` as a headline and attach its root ranks' stacks when the analysis did not."""
    f = _with_role(f, Role.HEADLINE)
    if not f.stack:
        f.stack = stack_for(trace, f.ranks)
    return f


def _with_role(f: Finding, role: Role, supports_title: str = "") -> Finding:
    return replace(f, role=role, supports=supports_title or f.supports)


def combine(trace: Trace, roots: list[Finding], others: list[Finding]) -> list[Finding]:
    """One headline per root cause, the rest attached as supporting or left independent."""
    pending = list(others)
    promoted: list[tuple[Finding, Finding]] = []   # (cause, its headline)
    out: list[Finding] = []
    for root in roots:
        earlier = next((h for c, h in promoted if explains(c, root)), None)
        if earlier is not None:          # the same deviation explains this root too
            out.append(_with_role(root, Role.SUPPORTING, earlier.title))
            continue
        causes = _skip_first(sorted((c for c in pending if explains(c, root)), key=_cause_order))
        if causes:
            pending.remove(causes[0])
            head = _as_headline(trace, _promote(trace, causes[0], root))
            promoted.append((causes[0], head))
            out.append(head)
            if (root.kind == "dead_rank" and not set(root.ranks) <= set(causes[0].ranks)) or _consequence(causes[0]):
                out.append(_with_role(root, Role.SUPPORTING, head.title))
        else:
            head = _as_headline(trace, root)
            out.append(head)
        for f in [f for f in pending if supports(f, head, root)]:
            pending.remove(f)
            out.append(_with_role(f, Role.SUPPORTING, head.title))
    out += [_with_role(f, Role.INDEPENDENT) for f in pending]
    if not any(f.role == Role.HEADLINE for f in out):
        errors = [i for i, f in enumerate(out) if f.severity == "error"]
        if errors:
            out[errors[0]] = _as_headline(trace, out[errors[0]])
    return sorted(out, key=lambda f: (SEVERITIES.index(f.severity), _ROLE_ORDER[f.role.value]))
