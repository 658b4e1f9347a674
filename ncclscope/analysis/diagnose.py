"""One verdict for a hung (or healthy) job: who everyone waits on, and why.

    from ncclscope.trace import load
    from ncclscope.analysis.diagnose import diagnose
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
   innocent neighbour crashed on the mismatch or everybody timed out);
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

from ..findings import SEVERITIES, Explains, Finding, Role
from .compose import OK_VERDICT, hang_verdict
from .collectives import analyze_collectives
from .groups import analyze_groups
from .index import index_of
from .p2p import analyze_p2p
from .stacks import stack_for
from .waitfor import analyze_waits

if TYPE_CHECKING:
    from ..trace import Trace

ROOT_KINDS = ("deadlock", "hang", "dead_rank", "stuck_in_compute")
PROMOTABLE = ("wrong_group", "collective_mismatch")
_ROLE_ORDER = {"headline": 0, "independent": 1, "supporting": 2}
MAX_EVIDENCE = 60


@dataclass
class Diagnosis:
    verdict: str
    findings: list[Finding]
    tables: dict[str, pd.DataFrame] = field(default_factory=dict)

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
    findings = combine(trace, roots, cr.findings + pr.findings + gr.findings + context)
    tables = {"wait_edges": wr.edges, "blocking_ops": wr.blocking, "rank_states": wr.ranks,
              "collective_instances": cr.instances, "collective_deviations": cr.deviations,
              "missing_participants": cr.missing, "p2p_pairs": pr.pairs, "p2p_unmatched": pr.unmatched,
              "group_view_deviations": gr.view_deviations}
    return Diagnosis(verdict=hang_verdict(findings), findings=findings, tables=tables)


# --------------------------------------------------------------------------
def _instance(f: Finding) -> tuple[str, int] | None:
    return (f.instance.group, f.instance.seq) if f.instance is not None else None


def _blocked_at(f: Finding) -> set[tuple[str, int]]:
    return {(i.group, i.seq) for i in f.instances}


def _involved(f: Finding) -> set[int]:
    return f.involved_ranks


def explains(cause: Finding, root: Finding) -> bool:
    """Does a wrong_group / type-size-dtype mismatch account for this wait-for root?"""
    if cause.kind not in PROMOTABLE or cause.severity != "error" or cause.data.get("summary"):
        return False
    inst = _instance(cause)
    if inst is None:
        return False
    g, k = inst
    blocked_at = _blocked_at(root)
    if cause.kind == "wrong_group":
        return inst in blocked_at or bool(set(cause.ranks) & set(root.ranks))
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


def _promote(trace: Trace, cause: Finding, root: Finding) -> Finding:
    title = cause.title
    summary = root.wait.text if root.wait is not None else ""
    if root.kind == "dead_rank" and not set(root.ranks) <= set(cause.ranks):
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
        causes = sorted((c for c in pending if explains(c, root)),
                        key=lambda c: (PROMOTABLE.index(c.kind), min(e.time_ns for e in c.evidence)))
        if causes:
            pending.remove(causes[0])
            head = _as_headline(trace, _promote(trace, causes[0], root))
            promoted.append((causes[0], head))
            out.append(head)
            if root.kind == "dead_rank" and not set(root.ranks) <= set(causes[0].ranks):
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
