"""A cycle member that left its own loop: the first deviation inside what looks like a deadlock.

Every rank runs the same program, and a training loop posts the same calls (op, group, peer, call site)
every iteration. In a cycle of waits the graph alone cannot say who started it: two ranks of a blocking
exchange both sending, a send to the wrong peer and that peer's own wait. Their sequences can. A member
whose own sequence stops repeating exactly at the op it is blocked in (its loop posts another op there:
the other direction of the exchange, another peer, another group) departed from its program; a member
whose sequence repeats to its blocked op is where its loop put it. The departed members are the root,
and everything else in the cycle is consequence.

Each rank's collective and p2p rows are read in the order the rank issued them (op_id), so dumps and
traces without step numbers are read the same; the period and phase come from
`repetition.virtual_steps`. A sequence that never repeated MIN_REPEATS times before (a hang in the
first iterations) proves nothing, and neither does a cycle in which every member departed.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from ncclscope import schema as S
from ncclscope.findings import Cause, CauseBasis, Departure, Finding
from ncclscope.hang.wording import (MAX_EVIDENCE, WaitContext, op_evidence, payload, since, sort_key, waiter_evidence,
                                   waiting_summary)
from ncclscope.index.labels import rank_label
from ncclscope.index.source_loops import cwds_of, left_loop_note, recent_sites
from ncclscope.index.repetition import MAX_PERIOD, repeats_to_end, virtual_steps

MAX_MEMBERS = 16            # cycle members whose sequences are read


@dataclass(frozen=True)
class LoopBreak:
    """Rank `rank` is blocked in the call its loop breaks at: it posted `op` (to/from `peer`, on `group`,
    from `site`) where the loop's previous iteration posted `expected_op` / `expected_peer` /
    `expected_group` from `expected_site`; `iteration` counts the loop's iterations before the break."""

    rank: int
    op_id: int
    op: str
    peer: int
    group: str
    site: str
    expected_op: str
    expected_peer: int
    expected_group: str
    expected_site: str
    iteration: int
    exact: bool = True               # the break is the blocked call itself


def comm_sequence(coll: pd.DataFrame, p2p: pd.DataFrame, rank: int) -> pd.DataFrame:
    """The rank's collective and p2p calls in issue order: op_id, op_name, process_group, peer, call_site."""
    cols = ["op_id", "op_name", "process_group", "peer", "call_site", "start_ns"]
    c = coll[(coll["rank"] == rank).to_numpy()].assign(peer=-1)[cols]
    p = p2p[(p2p["rank"] == rank).to_numpy()][cols]
    out = pd.concat([c.astype({"op_name": str, "process_group": str, "call_site": str}),
                     p.astype({"op_name": str, "process_group": str, "call_site": str})], ignore_index=True)
    # by start, then op_id: rows merged from the rank's own Flight Recorder (DDP's, broadcast_object_list's
    # inner broadcast) are numbered after every traced row, not where the rank issued them
    return out.sort_values(["start_ns", "op_id"], kind="stable").reset_index(drop=True)


def _tokens(seq: pd.DataFrame) -> list[str]:
    return [f"{o}\x1f{g}\x1f{p}\x1f{s}" for o, g, p, s in zip(seq["op_name"], seq["process_group"],
                                                             seq["peer"].to_numpy(np.int64), seq["call_site"])]


def loop_break(seq: pd.DataFrame, rank: int, blocked: set[int]) -> LoopBreak | None:
    """Where the rank's loop breaks, when that is an op it is blocked in (`blocked`: their op ids; an isend
    and an irecv posted together are both in flight), or a call of the same iteration before it (a call
    that went where its loop never sends it, then the block); else None. `exact` in the second case is
    False: `cycle_leavers` then asks more of the other members."""
    if not len(seq):
        return None
    ops, groups = seq["op_name"].to_numpy(), seq["process_group"].to_numpy()
    peers, sites = seq["peer"].to_numpy(np.int64), seq["call_site"].to_numpy()
    rep = virtual_steps(_tokens(seq))
    if rep is None:
        return None
    steps, brk = rep
    period = int(np.count_nonzero(steps[:brk] == steps[brk] - 1))
    at = np.flatnonzero(seq["op_id"].isin(list(blocked)).to_numpy())
    if not period or not len(at) or not (brk in at or (brk < at[0] and at[0] - brk < period)):
        return None
    j = brk - period
    return LoopBreak(rank=rank, op_id=int(seq["op_id"].iloc[brk]), op=str(ops[brk]), peer=int(peers[brk]),
                     group=str(groups[brk]), site=str(sites[brk]), expected_op=str(ops[j]),
                     expected_peer=int(peers[j]), expected_group=str(groups[j]), expected_site=str(sites[j]),
                     iteration=int(steps[brk]), exact=brk in at)


def cycle_leavers(coll: pd.DataFrame, p2p: pd.DataFrame, blocking: pd.DataFrame,
                  comp: list[int]) -> list[LoopBreak]:
    """The members of a wait-for cycle whose own loop breaks at the call they are blocked in (or earlier in
    that iteration), when some but not all are; a break before the blocked call counts only where every
    other member keeps its loop to its blocked call. Else nothing: the sequences cannot single anyone out."""
    members = sorted(int(r) for r in comp)[:MAX_MEMBERS]
    b = blocking[blocking["rank"].isin(members).to_numpy()
                 & blocking["kind"].isin([S.KIND_COLLECTIVE, S.KIND_P2P]).to_numpy()]
    blocked = b.groupby("rank")["op_id"].agg(lambda x: {int(v) for v in x}).to_dict()
    seqs = {r: comm_sequence(coll, p2p, r) for r in members if r in blocked}
    leavers = [d for r, seq in seqs.items() if (d := loop_break(seq, r, blocked[r])) is not None]
    if not leavers:
        return _early_leavers(seqs, blocked, members)
    if len(leavers) >= len(members):
        return []
    if not all(d.exact for d in leavers):
        left = {d.rank for d in leavers}
        if not all(r in seqs and repeats_to_end(_tokens(seqs[r])) for r in members if r not in left):
            return []
    return leavers


def waiter_leavers(coll: pd.DataFrame, p2p: pd.DataFrame, blocking: pd.DataFrame, waiters: list[int],
                   target_seq: pd.DataFrame) -> list[LoopBreak]:
    """Waiters on a rank that finished whose own loop breaks exactly at the op they wait in, when the
    finished rank's sequence repeats its loop to its end: it ran its program out, and they asked it for
    a call their loop never makes (a send to the wrong peer in the last iteration). A finished rank that
    left its loop early (its data ran out) does not repeat to its end; then nothing is returned."""
    if not repeats_to_end(_tokens(target_seq)):
        return []
    b = blocking[blocking["rank"].isin(waiters[:MAX_MEMBERS]).to_numpy()
                 & blocking["kind"].isin([S.KIND_COLLECTIVE, S.KIND_P2P]).to_numpy()]
    blocked = b.groupby("rank")["op_id"].agg(lambda x: {int(v) for v in x}).to_dict()
    out = []
    for r, ids in blocked.items():
        d = loop_break(comm_sequence(coll, p2p, int(r)), int(r), ids)
        if d is not None and d.exact:
            out.append(d)
    return out


def _early_leavers(seqs: dict[int, pd.DataFrame], blocked: dict[int, set[int]], members: list[int]) -> list[LoopBreak]:
    """A cycle formed in the loop's second iteration: one earlier iteration is all the history there is.

    With one iteration almost any tail fits some period of its own, so every member is read with the
    same loop shape (every rank runs the same program): a setup prefix `o` and a period `p`, iteration 0
    = calls [o, o + p), the rest its partial second iteration. A member is kept when its partial
    iteration repeats iteration 0; a leaver's repeats it up to its first blocked op and differs there.
    Of the shapes that split the members into both (no member breaking anywhere else), the one under
    which the most calls repeat is the loop; a tie between shapes naming other leavers names nobody."""
    toks = {r: _tokens(seq) for r, seq in seqs.items()}
    at = {r: np.flatnonzero(seq["op_id"].isin(list(blocked[r])).to_numpy()) for r, seq in seqs.items()}
    if len(toks) < len(members) or any(not len(a) for a in at.values()):
        return []
    shape = _best_shape(toks, at)
    if shape is None:
        return []
    left, p, o = shape
    # Ranks of one program may loop with periods of their own (a branch on the rank adds calls): a member
    # whose blocked call, with the call before it, is a pair its own sequence already made is where its
    # own loop put it, whatever shape the others fit
    left = frozenset(r for r in left if not _made_before(toks[r], _first_bad(toks[r], o, p)))
    if not left or len(left) >= len(members):
        return []
    out = []
    for r in sorted(left):
        seq, i = seqs[r], _first_bad(toks[r], o, p)
        j = i - p
        out.append(LoopBreak(rank=r, op_id=int(seq["op_id"].iloc[i]), op=str(seq["op_name"].iloc[i]),
                             peer=int(seq["peer"].iloc[i]), group=str(seq["process_group"].iloc[i]),
                             site=str(seq["call_site"].iloc[i]), expected_op=str(seq["op_name"].iloc[j]),
                             expected_peer=int(seq["peer"].iloc[j]),
                             expected_group=str(seq["process_group"].iloc[j]),
                             expected_site=str(seq["call_site"].iloc[j]), iteration=(i - o) // p))
    return out


def _first_bad(t: list[str], o: int, p: int) -> int:
    """The first call of `t` past iteration 0 of loop shape (o, p) that differs from the call p before it."""
    return next(k for k in range(o + p, len(t)) if t[k] != t[k - p])


def _made_before(t: list[str], i: int) -> bool:
    """Whether the calls t[i - 1], t[i] follow each other earlier in `t` (t[i] alone where it is first)."""
    return any(t[k] == t[i] and (i == 0 or (k > 0 and t[k - 1] == t[i - 1])) for k in range(i))


def _best_shape(toks: dict[int, list[str]], at: dict[int, np.ndarray]) -> tuple[frozenset[int], int, int] | None:
    """(leavers, p, o): of the loop shapes (setup prefix o, period p) that split the members into leavers
    and kept ones, the one under which the most calls repeat (the smallest p, then o, among equals); None
    when there is none, or when the shapes with the most repeats name different leavers.

    Under shape (o, p) a member's first bad call is the first k >= o + p with t[k] != t[k - p]: none, it is
    kept (its n - o - p calls past iteration 0 repeat); at one of its blocked ops (an earlier one may be a
    stale async row: a Flight Recorder entry never marked done), it left (first_bad - o - p repeat); else
    the shape does not fit. For one p every o is read at once from the next mismatch at or after each
    position, so the search is O(MAX_PERIOD x calls) (it was a scan per shape: a live poll of a
    10-minute pipeline job spent minutes here on a transient cycle)."""
    ranks = list(toks)
    codes: dict[str, int] = {}
    seqs = [np.fromiter((codes.setdefault(x, len(codes)) for x in toks[r]), np.int64, len(toks[r])) for r in ranks]
    shortest = min(len(t) for t in seqs)
    best_rep, found = -1, set()
    for p in range(1, min(MAX_PERIOD, shortest) + 1):
        n_o = shortest - p                       # o in [0, shortest - p): every member has o + p < n
        if n_o <= 0:
            continue
        o = np.arange(n_o, dtype=np.int64)
        ok = np.ones(n_o, dtype=bool)
        any_left, any_kept = np.zeros(n_o, dtype=bool), np.zeros(n_o, dtype=bool)
        rep = np.zeros(n_o, dtype=np.int64)
        mask = np.zeros(n_o, dtype=np.int64)
        for bit, (r, t) in enumerate(zip(ranks, seqs)):
            n = len(t)
            pos = np.arange(p, n, dtype=np.int64)
            bad_at = np.where(t[p:] != t[:-p], pos, n)
            next_bad = np.minimum.accumulate(bad_at[::-1])[::-1]       # next mismatch at or after p + i
            fb = next_bad[o]                                          # position o + p is index o
            kept = fb == n
            left = ~kept & np.isin(fb, at[r])
            ok &= kept | left
            any_left |= left
            any_kept |= kept
            rep += np.where(kept, n - o - p, fb - o - p)
            mask |= left.astype(np.int64) << bit
        ok &= any_left & any_kept
        if not ok.any():
            continue
        top = int(rep[ok].max())
        if top < best_rep:
            continue
        if top > best_rep:
            best_rep, found = top, set()
        sel = ok & (rep == top)
        found |= {(int(m), p, int(oo)) for m, oo in zip(mask[sel], o[sel])}
    if not found or len({m for m, _, _ in found}) != 1:
        return None
    m, p, o0 = min(found, key=lambda x: (x[1], x[2]))
    return frozenset(r for bit, r in enumerate(ranks) if m >> bit & 1), p, o0


def call_text(op: str, peer: int, group: str) -> str:
    """`send to rank 0`, `recv from rank 2`, `all_reduce on dp0`: a call as the sentences name it."""
    if peer >= 0:
        return f"{op} {'from' if op.endswith('recv') else 'to'} rank {peer}"
    return f"{op} on {group}"


def left_loop_finding(ctx: WaitContext, comp: list[int], cycle: list[int], involved: set[int],
                      leavers: list[LoopBreak]) -> tuple[tuple, Finding]:
    """A `hang` rooted at the cycle members that left their loops; the others wait on them."""
    roots = sorted(d.rank for d in leavers)
    d = leavers[0]
    waiters = set(involved) - set(roots)
    summary, start, direct = waiting_summary(ctx, waiters, roots)
    went = call_text(d.op, d.peer, d.group)
    loop = call_text(d.expected_op, d.expected_peer, d.expected_group)
    verb = "posted" if d.exact else "called"
    title = (f"{rank_label(ctx.trace, roots)} left {'its loop' if len(roots) == 1 else 'their loops'} in "
             f"iteration {d.iteration + 1}: {verb} {went}" + (f" at {d.site}" if d.site else "")
             + f" where every earlier iteration {verb} {loop}"
             + (f" ({d.expected_site})" if d.expected_site not in ("", d.site) else ""))
    if summary:
        title += f"; {summary}"
    rb = ctx.blocking[ctx.blocking["rank"].isin(roots)]
    here = "left its loop here" if d.exact else "blocked here after leaving its loop"
    ev = [op_evidence(r, f"{r.status}: {here}{since(ctx.end, r.start_ns, ', since ')}")
          for r in rb.itertuples(index=False)]
    ev += waiter_evidence(ctx, waiters, direct, roots)
    dep = Departure(step=-1, call_site=d.expected_site, went_site=d.site, went_op=d.op, position=d.iteration,
                    basis=CauseBasis.LOOP)
    pl = payload(ctx, roots, waiters, direct, start, summary, cycle=cycle)
    return sort_key(involved, start), Finding(kind="hang", severity="error", title=title, ranks=roots,
                                               evidence=ev[:MAX_EVIDENCE * 2],
                                               cause=Cause(basis=CauseBasis.LOOP, departure=dep), **pl)


def finished_by_leavers(ctx: WaitContext, r: int, ws: set[int]) -> tuple[tuple, Finding] | None:
    """Ranks wait on `r`, which finished its loop; the ones whose own loop broke at the op they wait in
    (`waiter_leavers`) are the root, not the rank that ran its program out."""
    direct = sorted(int(w) for w in ctx.edges.select(targets=[r])["waiter"].unique())
    leavers = waiter_leavers(ctx.coll, ctx.ix.p2p, ctx.blocking, direct, comm_sequence(ctx.coll, ctx.ix.p2p, r))
    if not leavers or len(leavers) >= len(direct) + 1:
        return None
    return left_loop_finding(ctx, [r], [], set(ws), leavers)


def left_loop_text(ctx: WaitContext, waiter_site: str, root_sites: list[str] | None = None,
                   root: int | None = None) -> str:
    """" (the others post it at S, in the loop at L; it left that loop early)" for a root whose peers
    still loop: it finished (`root_sites` None) or is blocked at lines outside that loop (its data ran
    out, a loop bound of its own). Only the others' site where the loop is not known or not left.
    `root`: the rank that left, whose recent call sites say which loop of a nest it left."""
    if not waiter_site:
        return ""
    history = recent_sites(ctx.trace, root) if root is not None else None
    return (f" (the others post it at {waiter_site}"
            f"{left_loop_note(cwds_of(ctx.trace), waiter_site, root_sites, history)})")


def site_of(ctx: WaitContext, rank: int, op_id: int) -> str:
    """The call site of one of a rank's ops, "" when not recorded."""
    ops = ctx.trace.ops
    row = ops[(ops["rank"].to_numpy() == rank) & (ops["op_id"].to_numpy() == op_id)]
    return str(row["call_site"].iloc[0]) if len(row) and "call_site" in row.columns else ""
