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

1. takes each wait-for root (deadlock / hang / dead_rank / stuck_in_compute), a death without a Flight
   Recorder dump first where it came before the idle ranks that may wait on it (death_first.py);
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
from typing import TYPE_CHECKING, Any, Callable

import pandas as pd

from ncclscope.findings import SEVERITIES, CauseBasis, Explains, Finding, FindingKind, Role, Severity
from ncclscope.verdict.headline import hang_verdict
from ncclscope.hang.barrier_report import barrier_reports
from ncclscope.hang.before_death import mismatches_before_death, skips_before_death, with_deaths_inside
from ncclscope.hang.collectives import analyze_collectives
from ncclscope.hang.death_first import death_first
from ncclscope.hang.group_checks import analyze_groups
from ncclscope.index.views import index_of, release_heap
from ncclscope.hang.late_arrival import find_late_arrivals
from ncclscope.hang.nonmember import find_nonmember_calls
from ncclscope.hang.p2p import analyze_p2p
from ncclscope.hang.schedule_check import analyze_schedule
from ncclscope.hang.shape_rules import shape_deviations
from ncclscope.hang.p2p_tags import tag_deviations
from ncclscope.hang.p2p_sizes import size_deviations
from ncclscope.index.stack_excerpts import stack_for
from ncclscope.hang.stopped import fr_roots
from ncclscope.hang.waitfor import analyze_waits
from ncclscope.verdict.cite import cite_sources

if TYPE_CHECKING:
    from ncclscope.load.trace import Trace
    from ncclscope.index.wait_edges import WaitEdges

K = FindingKind
ROOT_KINDS = frozenset({K.DEADLOCK, K.HANG, K.DEAD_RANK, K.STUCK_IN_COMPUTE})   # the wait-for graph's roots
# The kinds that may explain a root, most specific first (this order ranks the candidates: _cause_order).
PROMOTABLE = (K.WRONG_GROUP, K.COLLECTIVE_MISMATCH, K.SCHEDULE_DEVIATION, K.HANG, K.UNMATCHED_P2P,
              K.STUCK_IN_COMPUTE)   # the last only as a late arrival (late_arrival.py)
DEPARTURE_EXPLAINS = frozenset({K.DEADLOCK, K.HANG})
SCHEDULE_EXPLAINS = frozenset({K.DEADLOCK, K.HANG, K.DEAD_RANK})
_ROLE_ORDER = {Role.HEADLINE: 0, Role.INDEPENDENT: 1, Role.SUPPORTING: 2}
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

    Each question reads the trace's index (built once, see index.py), never its own copy of the tables.
    The schedule check reads the ops alone: it goes first, before the index's per-op views exist, and each
    big question's freed working copies go back to the OS before the next (`release_heap`): at 16,384 ranks
    the peak of the whole diagnosis was the schedule check's on top of every view (docs/scale.md)."""
    ix = index_of(trace)
    sched = _released(trace, analyze_schedule(ix))
    cr = _released(trace, analyze_collectives(ix, max_per_group=max_per_group))
    pr = _released(trace, analyze_p2p(ix))
    gr = _released(trace, analyze_groups(ix))
    wr = _released(trace, analyze_waits(ix))
    roots = [f for f in wr.findings if f.severity == Severity.ERROR]
    context = [f for f in wr.findings if f.severity != Severity.ERROR]
    roots, context = death_first(ix, roots, context)
    before = (skips_before_death(ix, roots) + mismatches_before_death(ix, roots) + find_late_arrivals(ix)
              + find_nonmember_calls(ix) + barrier_reports(ix))
    sized = size_deviations(ix)
    causes = (shape_deviations(ix, sized) + with_deaths_inside(ix, cr.findings) + sched + before
              + tag_deviations(ix, pr.findings) + sized + pr.findings + gr.findings + context)
    findings = cite_sources(trace, combine(trace, *fr_roots(ix, roots, causes)))   # a second source's words
    tables = {"blocking_ops": wr.blocking, "rank_states": wr.ranks,
              "collective_instances": cr.instances, "collective_deviations": cr.deviations,
              "missing_participants": cr.missing, "p2p_pairs": pr.pairs, "p2p_unmatched": pr.unmatched,
              "group_view_deviations": gr.view_deviations}
    return Diagnosis(verdict=hang_verdict(findings), findings=findings, tables=tables, waits=wr.waits)


def _released(trace: Trace, result: Any) -> Any:
    """`result`, once the heap its question freed is given back (a no-op below index.views.BIG_OPS ops)."""
    release_heap(trace)
    return result


# --------------------------------------------------------------------------
def _instance(f: Finding) -> tuple[str, int] | None:
    return (f.instance.group, f.instance.seq) if f.instance is not None else None


def _blocked_at(f: Finding) -> set[tuple[str, int]]:
    return {(i.group, i.seq) for i in f.instances}


def explains(cause: Finding, root: Finding) -> bool:
    """Does a wrong_group / type-size-dtype mismatch / schedule deviation / skip before a death / skipped
    p2p / late arrival account for this wait-for root? One rule per kind (`EXPLAINS`)."""
    if cause.kind not in EXPLAINS or cause.severity != Severity.ERROR or cause.cause.summary:
        return False
    return EXPLAINS[cause.kind](cause, root)


def _late_arrival_explains(cause: Finding, root: Finding) -> bool:
    """A late arrival: the peer's timeout and what followed are its doing."""
    return (cause.cause.basis == CauseBasis.LATE_ARRIVAL and root.kind in ROOT_KINDS
            and bool(set(cause.involved) & root.involved_ranks))


def _schedule_explains(cause: Finding, root: Finding) -> bool:
    return root.kind in SCHEDULE_EXPLAINS and bool(set(cause.ranks) & root.involved_ranks)


def _mismatch_explains(cause: Finding, root: Finding) -> bool:
    """A type/size/dtype mismatch: at the instance the waiters are blocked in (or an earlier one on that
    group it persisted from), a lone record before its partner's death, a death inside it, a p2p pair."""
    c = cause.cause
    if c.before_death:
        return root.kind == K.DEAD_RANK and bool(set(root.ranks) & set(c.absent_ranks or ()))
    if root.kind == K.DEAD_RANK and set(root.ranks) & set(c.died_inside or ()):
        return True
    inst = _instance(cause)
    if (root.kind == K.DEAD_RANK and inst is not None and set(root.ranks) & set(c.absent_ranks or ())
            and ({(inst[0], inst[1] + 1), *(c.next_instances or ())} & _blocked_at(root))):
        # the dead rank left no record of the mismatched instance and the survivors wait in what they issued
        # right after it (the group's next instance, or their next op on another group): it stopped inside
        # the mismatch or right after it, as gloo's abort on a size mismatch does (seed 20261213 #381: rank
        # 1 broadcast 1007 elements to the others' 1000, rank 3 died without a dump; seed 20261219 #7: the
        # same, the survivors then in a barrier on the world group)
        return True
    if c.p2p_pair:                               # a send/recv size change
        return bool(set(c.p2p_pair) & root.involved_ranks)
    if inst is None:
        return False
    g, k = inst
    blocked_at = _blocked_at(root)
    if inst in blocked_at:
        return True
    # An earlier instance on the same group counts only if it never finished or the deviation
    # persisted (a shifted sequence); a mismatch that completed long ago is a separate finding.
    persists = bool(c.unfinished) or (c.later_instances or 0) > 0
    later = any(a == g and b >= k for a, b in blocked_at)
    deviant = c.deviant_ranks if c.deviant_ranks is not None else cause.ranks
    return later and persists and bool(set(deviant) & root.involved_ranks)


def _p2p_explains(cause: Finding, root: Finding) -> bool:
    """The absent side skipped it (p2p.with_departure) or changed its tag (p2p_tags.py). Not a hang of
    the absent rank itself where, after its departure, it skipped a collective before the counterpart
    (`Departure.skipped_first`): that collective is the first op it failed to post, and the hang that
    names it the first deviation (seed 20261217 #67: a rank that left its loop early never posted the
    loop's all_reduce, then its send; the hang on the all_reduce comes first)."""
    c = cause.cause
    if (c.departure is not None and c.departure.skipped_first and root.kind == K.HANG
            and list(root.ranks) == [int(c.absent)]):
        return False
    return ((c.departure is not None or c.tag_deviant) and root.kind in DEPARTURE_EXPLAINS
            and {int(c.poster), int(c.absent)} <= root.involved_ranks)


def _skip_explains(cause: Finding, root: Finding) -> bool:
    """A skip before a death: in the rank's own record (sequence) any root it is in, else its death."""
    c = cause.cause
    if not c.before_death:
        return False
    if c.basis == CauseBasis.BARRIER:              # the reporter's death and whoever waited on the reporter
        return bool(set(cause.involved) & root.involved_ranks)
    if c.basis == CauseBasis.SEQUENCE:
        return bool(set(cause.ranks) & root.involved_ranks)
    return root.kind == K.DEAD_RANK and bool(set(cause.ranks) & set(root.ranks))


def _wrong_group_explains(cause: Finding, root: Finding) -> bool:
    """The waiters are in the instance it skipped, or in the one its wrong call made on the other group;
    or the root is the death of a member of either group, alive at the wrong call (gloo paired the
    wrong call with that member's own and aborted it: group_checks.with_partner_deaths)."""
    inst = _instance(cause)
    if inst is None:
        return False
    if set(cause.ranks) & set(root.ranks):
        return True
    c = cause.cause
    if root.kind == K.DEAD_RANK:     # a death it caused, not one that was there before it
        return bool(set(root.ranks) & set(c.partner_deaths or ()))
    blocked_at = _blocked_at(root)
    made = (c.wrong.group, c.wrong.seq if c.wrong.seq is not None else -1) if c.wrong is not None else ("", -1)
    return inst in blocked_at or made in blocked_at


EXPLAINS: dict[FindingKind, Callable[[Finding, Finding], bool]] = {
    K.WRONG_GROUP: _wrong_group_explains,
    K.COLLECTIVE_MISMATCH: _mismatch_explains,
    K.SCHEDULE_DEVIATION: _schedule_explains,
    K.HANG: _skip_explains,
    K.UNMATCHED_P2P: _p2p_explains,
    K.STUCK_IN_COMPUTE: _late_arrival_explains,
}
assert set(EXPLAINS) == set(PROMOTABLE)


def supports(f: Finding, head: Finding, root: Finding | None) -> bool:
    """Is `f` another view of the same root cause (same root ranks or the same blocked instance)?"""
    roots = set(head.ranks) | (set(root.ranks) if root else set())
    if set(f.ranks) & roots:
        return True
    inst = _instance(f)
    blocked_at = _blocked_at(root or head)
    if inst is not None and inst in blocked_at:
        return True
    if f.kind == K.UNMATCHED_P2P:
        inv = (root or head).involved_ranks
        return f.cause.poster in inv and f.cause.absent in inv
    return False


def _cause_order(c: Finding) -> tuple:
    """Most specific cause first; a tied (ambiguous) vote comes after a skip that names the rank."""
    rank = PROMOTABLE.index(c.kind)
    if c.kind == K.COLLECTIVE_MISMATCH and c.cause.ambiguous:
        rank = len(PROMOTABLE)
    return (rank, min(e.time_ns for e in c.evidence))


def _skip_first(causes: list[Finding]) -> list[Finding]:
    """A mismatch is the shifted pairing of a skip when the same rank skipped a call on the same group at or
    before that instance (skips.sequence_skips: its #k came from a later call site than its peers' #k). Its
    op then met the peers' next op, so sizes or types disagree; the skip is the first deviation."""
    if not causes or causes[0].kind != K.COLLECTIVE_MISMATCH:
        return causes
    head = causes[0]
    deviant = set(head.cause.deviant_ranks if head.cause.deviant_ranks is not None else head.ranks)
    inst = _instance(head)
    for c in causes[1:]:
        ci = _instance(c)
        if (c.kind == K.HANG and c.cause.basis == CauseBasis.SEQUENCE and set(c.ranks) & deviant
                and ci is not None and inst is not None and ci[0] == inst[0] and ci[1] <= inst[1]):
            return [c] + [x for x in causes if x is not c]
    return causes


def _consequence(cause: Finding) -> bool:
    """Causes whose root stays listed as their consequence (supporting): a schedule deviation's deadlock,
    a skip's death, a departure's deadlock, a late arrival's timeout."""
    c = cause.cause
    return (cause.kind == K.SCHEDULE_DEVIATION or c.before_death or c.departure is not None
            or c.basis == CauseBasis.LATE_ARRIVAL)


def _promote(trace: Trace, cause: Finding, root: Finding) -> Finding:
    title = cause.title
    summary = root.wait.text if root.wait is not None else ""
    if (root.kind == K.DEAD_RANK and (not set(root.ranks) <= set(cause.ranks) or _consequence(cause))) or (
            root.kind == K.DEADLOCK and cause.cause.departure is not None):
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


def _tie_breakers(others: list[Finding]) -> dict[int, Finding]:
    """id(wrong_group) -> the tied mismatch it breaks: a 1-vs-1 (or any tied) type/size/dtype vote at the
    very instance a party to it made on a group its own call site never used. The calls disagree because
    one of them is on the wrong group; the rank whose call it was deviated (seed 20261218 #185, dumps: rank
    3 all-reduced on the world group at its loop's line where it always used its pp group, and met rank 0's
    all_reduce after its loop: MISMATCH, a tie naming the lowest rank 0). The wrong_group then explains
    what the mismatch explains."""
    out: dict[int, Finding] = {}
    for m in others:
        if m.kind != K.COLLECTIVE_MISMATCH or not m.cause.ambiguous or m.instance is None:
            continue
        inst = (m.instance.group, m.instance.seq)
        tied = {int(e.rank) for e in m.evidence if (e.process_group, e.seq) == inst}
        for w in others:
            c = w.cause
            if (w.kind == K.WRONG_GROUP and w.severity == Severity.ERROR and c.wrong is not None
                    and (c.wrong.group, c.wrong.seq) == inst and w.ranks and set(w.ranks) <= tied):
                out[id(w)] = m
    return out


def combine(trace: Trace, roots: list[Finding], others: list[Finding]) -> list[Finding]:
    """One headline per root cause, the rest attached as supporting or left independent."""
    pending = list(others)
    stand_in = _tie_breakers(others)
    promoted: list[tuple[Finding, Finding]] = []   # (cause, its headline)
    out: list[Finding] = []
    for root in roots:
        earlier = next((h for c, h in promoted if explains(c, root)), None)
        if earlier is not None:          # the same deviation explains this root too
            out.append(_with_role(root, Role.SUPPORTING, earlier.title))
            continue
        causes = _skip_first(sorted((c for c in pending if explains(c, root)
                                     or (id(c) in stand_in and explains(stand_in[id(c)], root))), key=_cause_order))
        if causes:
            pending.remove(causes[0])
            head = _as_headline(trace, _promote(trace, causes[0], root))
            promoted.append((causes[0], head))
            out.append(head)
            if (root.kind == K.DEAD_RANK and not set(root.ranks) <= set(causes[0].ranks)) or _consequence(causes[0]):
                out.append(_with_role(root, Role.SUPPORTING, head.title))
        else:
            head = _as_headline(trace, root)
            out.append(head)
        for f in [f for f in pending if supports(f, head, root)]:
            pending.remove(f)
            out.append(_with_role(f, Role.SUPPORTING, head.title))
    out += [_with_role(f, Role.INDEPENDENT) for f in pending]
    if not any(f.role == Role.HEADLINE for f in out):
        errors = [i for i, f in enumerate(out) if f.severity == Severity.ERROR]
        if errors:
            out[errors[0]] = _as_headline(trace, out[errors[0]])
    return sorted(out, key=lambda f: (SEVERITIES.index(f.severity), _ROLE_ORDER[f.role]))
