"""Hang roots from the wait-for graph: one finding per place the waiting chains end.

When a job hangs, most ranks sit in some collective or recv and each of them
timed out or was killed; the one that matters is usually *not* blocked where
the others are. The graph (waitgraph.py) says where every chain of waits
ends; this module names that end:

- a cycle                          -> `deadlock`, or `hang` when a rank on the
                                      cycle deviated first: it skipped (or added)
                                      a collective in an earlier step, so its
                                      later ones on that group paired one
                                      instance off (step census, census.py), or
                                      it skipped an instance a strict majority of
                                      its group entered and went on to a
                                      collective on another group;
- a dead rank                      -> `dead_rank`;
- a live rank in no comm op        -> `stuck_in_compute` (inflight compute span,
                                      or heartbeats to the end), else `hang`
                                      (several that stopped at one point: one
                                      `hang` naming them all, same_stop.py);
- ranks blocked in an op that every counterpart posted -> `hang` (stalled op:
  a mismatch or the transport; `diagnose` names the deviant when the
  collective analysis finds one).

Chains are followed across groups and p2p (a waits on b in dp, b on c via
p2p, c is dead: the root is c). Roots come most waiters first, a rank that
left its loop before the idle ranks that may wait on it, and a rank that died
of its own timeout after every root that is not a death (`timeouts_last`). Rank states come from the index
(rank_states.py), sentences from wording.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from ncclscope import schema as S
from ncclscope.findings import Evidence, Finding, WaitSummary
from ncclscope.hang.census import step_census_deviations
from ncclscope.hang.loop_departures import (cycle_leavers, finished_by_leavers, left_loop_finding, left_loop_text,
                                           site_of)
from ncclscope.index.views import IndexLike, as_index
from ncclscope.index.labels import fmt_ranks, rank_label, seconds
from ncclscope.hang.lone_posters import lone_posters
from ncclscope.hang.loop_order import loop_leavers, loop_passers, looped, not_reached, p2p_passers
from ncclscope.index.wait_edges import WaitEdges
from ncclscope.index.waitgraph import WaitGraph, wait_graph
from ncclscope.hang.same_stop import same_stop, same_stop_finding
from ncclscope.hang.stalled import stalled_findings
from ncclscope.hang.wording import (MAX_EVIDENCE, WaitContext, at_site, edge_desc, last_op_evidence,
                                    last_stack_place, op_desc, op_evidence, payload, since, sort_key,
                                    timed_out_ranks, waiter_evidence, waiting_summary, wanted_desc)

MAX_ROOTS_PER_ROLE = 4           # more chain ends of one kind are reported as one finding
MAX_HOPS = 4                     # cycle hops spelled out in a deadlock title


@dataclass
class WaitReport:
    findings: list[Finding] = field(default_factory=list)
    waits: WaitEdges = field(default_factory=WaitEdges)           # waiter -> target, with the op (on demand)
    blocking: pd.DataFrame = field(default_factory=pd.DataFrame)  # each rank's blocking ops
    ranks: pd.DataFrame = field(default_factory=pd.DataFrame)     # per-rank role: dead/blocked/computing/...
    cycles: list[list[int]] = field(default_factory=list)

    @property
    def edges(self) -> pd.DataFrame:
        """Every edge as one table (a 16,384-rank world barrier: 4.1 M rows), built on first use."""
        return self.waits.frame


def analyze_waits(source: IndexLike) -> WaitReport:
    """Build the wait-for graph of a trace (or its index) and turn each root cause into one finding."""
    ix = as_index(source)
    graph = wait_graph(ix)
    ctx = WaitContext(ix, graph.edges)
    findings, cycles = _classify(ctx, graph)
    return WaitReport(findings=findings, waits=graph.edges, blocking=ix.blocking, ranks=ix.rank_states.reset_index(),
                      cycles=cycles)


def _classify(ctx: WaitContext, graph: WaitGraph) -> tuple[list[Finding], list[list[int]]]:
    comps, comp_of, waiters_of = graph.comps, graph.comp_of, graph.waiters_of
    findings: list[tuple[tuple, Finding]] = []
    unknown: list[tuple[tuple, Finding]] = []     # idle chain ends: after any rank that left its loop
    departed: list[tuple[tuple, Finding]] = []    # cycles rooted at a rank that left its loop
    cycles: list[list[int]] = []
    stalled: list[int] = []
    endpoints: dict[str, list[tuple[int, set[int]]]] = {}
    for c, ws in waiters_of.items():
        comp = comps[c]
        if len(comp) > 1:
            cycle = graph.cycle(c)
            cycles.append(cycle)
            kf = _cycle_finding(ctx, comp, cycle, ws)
            (departed if kf[1].kind == "hang" else findings).append(kf)
            continue
        r = comp[0]
        role = ctx.st.at[r, "role"] if r in ctx.st.index else "dead"
        if role == "blocked":
            stalled.append(r)
        elif ws:
            endpoints.setdefault(role, []).append((r, ws))
    for item in list(endpoints.get("finished", [])):
        left = finished_by_leavers(ctx, *item)
        if left is not None:
            endpoints["finished"].remove(item)
            departed.append(left)
    lone = lone_posters(ctx, endpoints.get("finished", []))
    if lone is not None:      # most of a group finished; the few waiting in one call more are the root
        endpoints["finished"] = [it for it in endpoints["finished"] if it[0] not in lone[2]]
        findings.append(lone[:2])
    for role, items in endpoints.items():
        if not items:
            continue
        if len(items) > MAX_ROOTS_PER_ROLE:   # a node failure kills 8 ranks at once: one finding, not 8
            (unknown if role == "idle" else findings).append(_endpoint_group_finding(ctx, items, role))
            continue
        for point, same in (same_stop(ctx, items) if role == "idle" else [(None, [it]) for it in items]):
            kf = (_endpoint_finding(ctx, same[0][0], role, same[0][1]) if len(same) == 1
                  else same_stop_finding(ctx, same, point))
            (unknown if role == "idle" else findings).append(kf)
    findings += stalled_findings(ctx, stalled, comps, comp_of, waiters_of)
    # A rank in no op whose state nothing says (a dump's rank blocked in a send/recv gloo does not record
    # looks just like this) may be waiting on a rank that left its loop; the departure is the first
    # deviation and comes before it. Otherwise every root keeps its place (most waiters, earliest first).
    if departed:
        findings += departed
        findings.sort(key=lambda kf: kf[0])
        ids = {id(kf) for kf in departed}
        last = max(i for i, kf in enumerate(findings) if id(kf) in ids)
        unknown.sort(key=lambda kf: kf[0])
        ordered = findings[:last + 1] + unknown + findings[last + 1:]
    else:
        ordered = sorted(findings + unknown, key=lambda kf: kf[0])
    out = timeouts_last(ctx, [f for _, f in ordered])
    named = {r for f in out for r in f.ranks}
    quiet = _unwaited_dead(ctx, named)
    return out + ([quiet] if quiet else []), cycles


def timeouts_last(ctx: WaitContext, roots: list[Finding]) -> list[Finding]:
    """The roots with deaths by timeout after every root that is not a death, the order otherwise kept.

    A rank whose process ended on its own timeout ("Timed out waiting 12000ms for recv") waited that long
    for something that never came: its death is a consequence of whatever it waited on, however many
    ranks then wait on it, and it came a timeout after the wait began. A rank that stopped on its own
    (never posted an op, left its loop, sits in compute) is where waiting began (seed 20261218 #2: rank 5
    skipped a broadcast_object_list at step 2; rank 4 went on, timed out in the next step's all_reduce and
    died, and four ranks then waited on the dead rank: DEAD RANK on rank 4, the skip second)."""
    if all(f.kind == "dead_rank" for f in roots):
        return roots
    late = timed_out_ranks(ctx.st)
    return sorted(roots, key=lambda f: f.kind == "dead_rank" and bool(f.ranks) and set(f.ranks) <= late)


def _unwaited_dead(ctx: WaitContext, named: set[int]) -> Finding | None:
    """Ranks that died (killed, failed, missing) with nobody waiting on them: context, a warning."""
    st = ctx.st
    quiet = st[st["dead"] & st["state"].isin(["killed", "failed", "missing"]) & ~st.index.isin(list(named))]
    if not len(quiet):
        return None
    ranks = [int(r) for r in quiet.index]
    ev = [last_op_evidence(ctx, int(r), str(row.dead_reason)) for r, row in quiet.head(MAX_EVIDENCE).iterrows()]
    them = "it" if len(ranks) == 1 else "them"
    title = f"{rank_label(ctx.trace, ranks)} ended with no rank waiting on {them}: {ev[0].note}"
    if len(ranks) > 1:
        title += " (first of them)"
    return Finding(kind="dead_rank", severity="warning", title=title, ranks=ranks, evidence=ev,
                   data={"root_ranks": ranks, "unwaited": True}, wait=WaitSummary())


def _cycle_sites(ctx: WaitContext, steps: list) -> str:
    """Where the cycle's blocked calls were made: "pipeline.py:20" when they share one call site, "a.py:1
    (rank 0), b.py:2 (rank 1)" for up to MAX_HOPS distinct ones; "" when the trace records none."""
    b = ctx.blocking
    if "call_site" not in b.columns:
        return ""
    by_id = {(int(r.rank), int(r.op_id)): str(r.call_site) for r in b.itertuples(index=False)}
    got = [(int(a), by_id.get((int(a), int(e["op_id"])), "")) for a, _, e in steps]
    got = [(a, site) for a, site in got if site]
    if not got:
        return ""
    if len({site for _, site in got}) == 1:
        return got[0][1]
    return ", ".join(f"{site} (rank {a})" for a, site in got[:MAX_HOPS])


def _cycle_finding(ctx: WaitContext, comp: list[int], cycle: list[int], waiters: set[int]) -> tuple[tuple, Finding]:
    inside = ctx.edges.select(waiters=comp, targets=comp)
    outside = set(waiters) - set(comp)
    shift = _shift_suspects(ctx, comp, inside)
    if shift is not None:
        return _shift_finding(ctx, comp, cycle, waiters | set(comp), shift)
    skip = _skip_suspects(ctx, inside)
    if skip is not None:
        return _skip_finding(ctx, comp, cycle, waiters | set(comp), skip)
    leavers = cycle_leavers(ctx.coll, ctx.ix.p2p, ctx.blocking, comp)
    if leavers:
        return left_loop_finding(ctx, comp, cycle, waiters | set(comp), leavers)
    skip = _skip_suspects(ctx, inside, p2p=True)
    if skip is not None:
        return _skip_finding(ctx, comp, cycle, waiters | set(comp), skip)
    steps = []
    for a, b in zip(cycle, cycle[1:] + cycle[:1]):
        e = inside[(inside["waiter"] == a) & (inside["target"] == b)].iloc[0]
        steps.append((a, b, e))
    if all(e["via"] == S.KIND_P2P for _, _, e in steps) and len({str(e["op_name"]) for _, _, e in steps}) == 1:
        op = str(steps[0][2]["op_name"])
        seqs = sorted({int(e["seq"]) for _, _, e in steps})
        prep = "from" if op.endswith("recv") else "to"
        both = "both" if len(cycle) == 2 else "all"
        title = (f"{rank_label(ctx.trace, cycle)} {both} blocked in {op} {prep} each other "
                 f"(p2p seq {','.join(map(str, seqs))})")
        sites = _cycle_sites(ctx, steps)
        if sites:
            title += f" at {sites}"
    else:
        hops = "; ".join(f"rank {a} in {edge_desc(ctx, e)} waits on rank {b}" for a, b, e in steps[:MAX_HOPS])
        if len(steps) > MAX_HOPS:
            hops += f"; ... {len(steps) - MAX_HOPS} more hops back to rank {cycle[0]}"
        title = f"{rank_label(ctx.trace, comp)} wait on each other in a cycle: {hops}"
    summary, start, direct = waiting_summary(ctx, outside, comp) if outside else ("", -1, [])
    b = ctx.blocking[ctx.blocking["rank"].isin(comp)]
    start_all = int(b["start_ns"].min()) if len(b) else start
    title += since(ctx.end, start_all, "; blocked for ")
    if summary:
        title += f"; {summary}"
    ev = [Evidence(rank=int(a), note=f"{e['status']}, waits on rank {b} ({e['reason']})"
                                     f"{since(ctx.end, e['start_ns'])}",
                   op_name=str(e["op_name"]), process_group=str(e["process_group"]), seq=int(e["seq"]),
                   op_id=int(e["op_id"]), time_ns=int(e["start_ns"]), peer=int(e["peer"]))
          for a, b, e in steps[:MAX_EVIDENCE]]
    ev += waiter_evidence(ctx, outside, direct, comp)
    pl = payload(ctx, comp, outside, direct, start_all, summary, cycle=cycle)
    return sort_key(waiters | set(comp), start_all), Finding(
        kind="deadlock", severity="error", title=title, ranks=sorted(comp), evidence=ev, **pl)


def _skip_suspects(ctx: WaitContext, inside: pd.DataFrame, p2p: bool = False) -> pd.DataFrame | None:
    """Cycle edges into a rank that skipped an instance a strict majority entered, and went on elsewhere
    (with `p2p`: also to a send/recv its own loop issues after that instance, loop_order.p2p_passers)."""
    e0 = inside[(inside["via"] == S.KIND_COLLECTIVE) & (inside["reason"] == "not begun")]
    e = e0[2 * e0["n_began"] > e0["n_members"]]
    if not len(e0):
        return None
    b = ctx.blocking
    bc = b[b["kind"] == S.KIND_COLLECTIVE][["rank", "process_group"]]
    elsewhere = e.merge(bc.rename(columns={"rank": "target", "process_group": "target_group"}), on="target")
    elsewhere = elsewhere[elsewhere["target_group"] != elsewhere["process_group"]].drop(columns="target_group")
    elsewhere = pd.concat([elsewhere, loop_leavers(ctx, e0[2 * e0["n_began"] <= e0["n_members"]])],
                          ignore_index=True)
    # Or the target went on to a later training step (blocked in a p2p op of the next step, say, under
    # context parallelism): it skipped the instance, whatever it is blocked in now.
    wstep = b[["rank", "op_id", "step"]].rename(columns={"rank": "waiter", "step": "waiter_step"})
    tstep = b[b["step"] >= 0].groupby("rank")["step"].min().rename("target_step")
    # (No majority needed here: in a 2-member group 1 of 2 began it, and the target's later step says who left.)
    later = e0.merge(wstep, on=["waiter", "op_id"]).merge(tstep, left_on="target", right_index=True)
    later = later[(later["waiter_step"] >= 0) & (later["target_step"] > later["waiter_step"])]
    elsewhere = pd.concat([elsewhere, later[list(e0.columns)], loop_passers(ctx, e0)] + ([p2p_passers(ctx, e)] if p2p else []),
                          ignore_index=True).drop_duplicates(
        ["waiter", "target", "process_group", "seq"])
    # the first deviation, not the majority: a target that has not reached the instance in its own loop
    # (it waits in an op its loop issues before this one) did not skip it, whatever the others began
    elsewhere = elsewhere[~not_reached(ctx, elsewhere)]
    if not len(elsewhere):
        return None
    first = elsewhere.sort_values("start_ns").iloc[0]
    same = elsewhere[(elsewhere["process_group"] == first["process_group"]) & (elsewhere["seq"] == first["seq"])]
    return same


def _shift_suspects(ctx: WaitContext, comp: list[int], inside: pd.DataFrame) -> pd.DataFrame | None:
    """Cycle members that skipped (or added) a collective in an earlier step: the cycle is the
    consequence of the sequence shift, and the first of them deviated first."""
    groups = set(inside.loc[inside["via"] == S.KIND_COLLECTIVE, "process_group"].astype(str))
    b = ctx.blocking[ctx.blocking["rank"].isin(comp) & (ctx.blocking["kind"] == S.KIND_COLLECTIVE)]
    groups |= set(b["process_group"].astype(str))
    if not groups:
        return None
    cen = step_census_deviations(ctx.coll, ctx.members, sorted(groups))
    cen = cen[cen["rank"].isin(comp)]
    if not len(cen):
        return None
    first = cen.iloc[0]
    return cen[(cen["process_group"] == first["process_group"]) & (cen["step"] == first["step"])
               & (cen["call_site"] == first["call_site"])]


def _shift_finding(ctx: WaitContext, comp: list[int], cycle: list[int], involved: set[int],
                   shift: pd.DataFrame) -> tuple[tuple, Finding]:
    roots = sorted(int(r) for r in shift["rank"].unique())
    e = shift.iloc[0]
    g, step, site, op = str(e["process_group"]), int(e["step"]), str(e["call_site"]), str(e["op_name"])
    glabel = ctx.ix.label(g)
    waiters = set(involved) - set(roots)
    rb = ctx.blocking[ctx.blocking["rank"].isin(roots)]
    went = ", ".join(op_desc(ctx, r) for r in rb.drop_duplicates("rank").head(2).itertuples(index=False))
    summary, start, direct = waiting_summary(ctx, waiters, roots)
    ref = list(e["ref_ranks"])
    seq = (f"#{int(e['ref_seq'])} for rank{'s' if len(ref) > 1 else ''} {fmt_ranks(ref)}"
           if int(e["ref_seq"]) >= 0 and ref else "")
    n = abs(int(e["count"]) - int(e["expected"]))
    off = "one instance" if n == 1 else f"{n} instances"
    if e["direction"] == "skipped":
        what = f"skipped {op} on {glabel} at step {step} ({site}" + (f", {seq})" if seq else ")")
    else:
        what = f"issued an extra {op} on {glabel} at step {step} ({site})"
    coll = ctx.coll
    later = coll[coll["rank"].isin(roots).to_numpy() & (coll["process_group"] == g).to_numpy()
                 & (coll["step"].to_numpy() > step)]
    if len(later) or e["direction"] != "skipped":
        title = f"{rank_label(ctx.trace, roots)} {what}: its later {op}s on {g} paired {off} off"
        title += f", and it went on to {went}" if went else ""
    else:               # nothing later on g to pair off: it left the group's call out and went elsewhere
        title = f"{rank_label(ctx.trace, roots)} {what}" + (f" and went on to {went}" if went else "")
    if summary:
        title += f"; {summary}"
    # The instance the cycle is blocked on in g (where the shift surfaced), for supporting findings.
    on_g = ctx.edges.select(waiters=involved, group=g)
    blocked_k = int(on_g["seq"].min()) if len(on_g) else int(e["ref_seq"])
    ev = []
    for r in shift.itertuples(index=False):
        ref = "the other members" if r.basis == "majority" else "its other steps"
        ev.append(Evidence(rank=int(r.rank), note=f"{r.direction}: issued {int(r.count)} {op} from {site} on {g} at "
                                                  f"step {step}; {ref} issued {int(r.expected)}",
                           op_name=op, process_group=g, seq=int(r.ref_seq)))
    ev += [op_evidence(r, f"{r.status}: blocked here{since(ctx.end, r.start_ns)}")
           for r in rb.itertuples(index=False)]
    ev += waiter_evidence(ctx, waiters, direct, roots)
    pl = payload(ctx, roots, waiters, direct, start, summary, cycle=cycle, skipped=[g, int(e["ref_seq"])],
                 shift={"process_group": g, "step": step, "call_site": site, "direction": str(e["direction"]),
                        "count": int(e["count"]), "expected": int(e["expected"]), "basis": str(e["basis"])},
                 instance=[g, blocked_k], process_group=g, seq=blocked_k)
    return sort_key(involved, start), Finding(kind="hang", severity="error", title=title, ranks=roots,
                                               evidence=ev[:MAX_EVIDENCE * 2], **pl)


def _skip_finding(ctx: WaitContext, comp: list[int], cycle: list[int], involved: set[int],
                  skip: pd.DataFrame) -> tuple[tuple, Finding]:
    roots = sorted(int(t) for t in skip["target"].unique())
    e = skip.iloc[0]
    g, k = str(e["process_group"]), int(e["seq"])
    waiters = set(involved) - set(roots)
    rb = ctx.blocking[ctx.blocking["rank"].isin(roots)]
    went = ", ".join(op_desc(ctx, r) + at_site(r) for r in rb.drop_duplicates("rank").head(2).itertuples(index=False))
    summary, start, direct = waiting_summary(ctx, waiters, roots)
    title = (f"{rank_label(ctx.trace, roots)} never posted {e['op_name']} #{k} on {ctx.ix.label(g)} "
             f"({int(e['n_began'])} of {int(e['n_members'])} members did"
             f"{'; every earlier iteration of its loop did' if looped(e) else ''}) and went on to {went}")
    posted = ctx.coll[(ctx.coll["process_group"] == g).to_numpy() & (ctx.coll["collective_seq_id"] == k).to_numpy()]
    if len(posted) and "call_site" in posted.columns:
        title += left_loop_text(ctx, str(posted["call_site"].astype(str).mode().iloc[0]),
                                [str(s) for s in rb["call_site"]] if "call_site" in rb.columns else [],
                                roots[0] if len(roots) == 1 else None)
    if summary:
        title += f"; {summary}"
    ev = [op_evidence(r, f"{r.status}: blocked here instead of {g} #{k}{since(ctx.end, r.start_ns, ', since ')}")
          for r in rb.itertuples(index=False)]
    ev += waiter_evidence(ctx, waiters, direct, roots)
    pl = payload(ctx, roots, waiters, direct, start, summary, cycle=cycle, skipped=[g, k],
                 instance=[g, k], process_group=g, seq=k)
    return sort_key(involved, start), Finding(kind="hang", severity="error", title=title, ranks=roots,
                                               evidence=ev, **pl)


def _endpoint_finding(ctx: WaitContext, r: int, role: str, waiters: set[int]) -> tuple[tuple, Finding]:
    """A chain ends at a rank that waits on nobody: dead, computing, finished or idle."""
    row = ctx.st.loc[r]
    summary, start, direct = waiting_summary(ctx, waiters, [r])
    who = rank_label(ctx.trace, [r])
    t0 = ctx.ix.start_ns
    into = ctx.edges.select(targets=[r])
    wanted = wanted_desc(ctx, into.iloc[0]) if len(into) else "its next op"
    ev: list[Evidence] = []
    last = last_op_evidence(ctx, r)
    if role == "dead":
        kind, title = "dead_rank", f"{who} {str(row.dead_reason)}"
        if row.last_op:
            ev.append(last)
        if not pd.isna(row.last_hb_ns):
            ev.append(Evidence(rank=r, note=f"last heartbeat at {seconds(int(row.last_hb_ns) - t0)}",
                               op_name=S.HEARTBEAT, time_ns=int(row.last_hb_ns)))
        if not ev:
            ev.append(Evidence(rank=r, note=str(row.dead_reason)))
    elif role == "computing":
        kind = "stuck_in_compute"
        if row.computing_op:
            step = f" (step {int(row.computing_step)})" if row.computing_step >= 0 else ""
            title = (f"{who} has been in {row.computing_op}{since(ctx.end, row.computing_start_ns, ' for ')}"
                     f"{step} and never posted {wanted}")
            ev.append(Evidence(rank=r, note=f"inflight since {seconds(int(row.computing_start_ns) - t0)}",
                               op_name=str(row.computing_op), time_ns=int(row.computing_start_ns)))
        else:
            title = (f"{who} is alive (heartbeats to the end) but in no communication op and never posted "
                     f"{wanted}; its last op was {row.last_op or 'none'}")
            # where it was: the latest stack dump since that op (a timeout's or the final SIGTERM's)
            _, place, where = last_stack_place(ctx.trace, r, int(row.last_op_start_ns), int(ctx.end), t0)
            if where is not None:
                title += f"; its {place}"
                ev.append(where)
            ev.append(last)
    else:
        kind = "hang"
        if role == "finished":
            site = site_of(ctx, int(into.iloc[0]["waiter"]), int(into.iloc[0]["op_id"])) if len(into) else ""
            title = f"{who} finished (exit 0) without posting {wanted}" + left_loop_text(ctx, site, None, r)
        else:
            title = (f"{who} never posted {wanted} and is in no communication op "
                     f"(state {row.state}; last op {row.last_op or 'none'} {row.last_op_status})")
        ev.append(last)
    if summary:
        title += f"; {summary}"
    ev += waiter_evidence(ctx, waiters, direct, [r])
    pl = payload(ctx, [r], waiters, direct, start, summary, rank_role=role)
    alive = [int(x) for x in (row.last_event_ns, row.last_hb_ns) if not pd.isna(x) and int(x) >= 0]
    key = sort_key(waiters, start, max(alive) if role == "dead" and alive else 2**62)
    return key, Finding(kind=kind, severity="error", title=title, ranks=[r], evidence=ev, **pl)


def _endpoint_group_finding(ctx: WaitContext, items: list[tuple[int, set[int]]], role: str) -> tuple[tuple, Finding]:
    """Many chain ends of one kind (e.g. all ranks of a lost node) as one finding."""
    items = sorted(items)
    roots = [r for r, _ in items]
    waiters = set().union(*(ws for _, ws in items)) - set(roots)
    _, first = _endpoint_finding(ctx, items[0][0], role, items[0][1])
    summary, start, direct = waiting_summary(ctx, waiters, roots)
    what = {"dead": "are dead", "computing": "are stuck in compute",
            "finished": "finished without posting what others wait for"}.get(role, "are in no communication op")
    lead = first.title.split("; ")[0]
    title = f"{rank_label(ctx.trace, roots)} {what} (first: {lead})" + (f"; {summary}" if summary else "")
    ev = [e for e in first.evidence if e.rank == roots[0]]
    ev += [last_op_evidence(ctx, r, str(ctx.st.at[r, "dead_reason"]) if role == "dead" else None)
           for r in roots[1:MAX_EVIDENCE]]
    ev += waiter_evidence(ctx, waiters, direct, roots)
    kind = {"dead": "dead_rank", "computing": "stuck_in_compute"}.get(role, "hang")
    pl = payload(ctx, roots, waiters, direct, start, summary, rank_role=role)
    return sort_key(waiters | set(roots), start), Finding(kind=kind, severity="error", title=title, ranks=roots,
                                                           evidence=ev[:MAX_EVIDENCE * 2], **pl)
