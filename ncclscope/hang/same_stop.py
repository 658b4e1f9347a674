"""Idle ranks that stopped at one point: one finding that says so.

A rank in no communication op that never posted what its peers wait in is a
chain end of the wait-for graph (waitfor.py). When several such ranks never
posted the same op and their last op is the same, nothing recorded orders them:
a Flight Recorder dump of gloo records no send/recv, so a pair deadlocked in
send/recv, or a sender to the wrong peer and the rank it left waiting, looks
exactly like ranks that stopped together after their last collective. One
`hang` says so and lists them all; its root is the lowest of them, and the
sentence says that this is a convention, not evidence.

One thing in a Flight Recorder dump does order them: its file time. Where some
of the tied ranks were dumped right after their last op, before every other
tied rank's dump, and the others sat idle before theirs (index/dump_gaps.py), while
a waiter went on to post what none of them did, the ones dumped first ended
at a point the program goes on from: they left it before its end (their loop
ran out, or they returned early), and the idle ones waited on them in
something the dumps do not record. Those are named (`ended_first`; seed
20261219 #282: rank 1's data ran out after three steps, ranks 0 and 2 failed
in their ring send/recv with it a second later, rank 3 waited in the next
iteration's all_gather). Without a waiter nobody is known to have gone past
that point, and the split is `dump_idle.ended_early`'s to read.

Why the lowest, measured: on the first run of seed 20261209 (random programs,
gloo dumps), 38 verdicts were of this shape; naming all of them as the root was
right 16 times (every swap_order pair, no wrong-peer sender with its victim),
naming the lowest 22 times (a ring sends from r to r + 1, so a sender to the
wrong peer is usually below the rank it left waiting).
"""
from __future__ import annotations

import pandas as pd

from ncclscope.findings import Finding
from ncclscope.hang.wording import (MAX_EVIDENCE, WaitContext, duration, last_op_evidence, payload, sort_key,
                                    waiter_evidence, waiting_summary, wanted_desc)
from ncclscope.index.labels import rank_label

StopPoint = tuple[str, str, str]       # what the rank never posted, its last op, that op's status


def stop_point(ctx: WaitContext, r: int) -> StopPoint:
    """Where an idle rank stopped, as far as the evidence says: what it never posted and its last op."""
    into = ctx.edges.select(targets=[r])
    row = ctx.st.loc[r]
    return (wanted_desc(ctx, into.iloc[0]) if len(into) else "", str(row.last_op), str(row.last_op_status))


def same_stop(ctx: WaitContext, items: list[tuple[int, set[int]]]
              ) -> list[tuple[StopPoint, list[tuple[int, set[int]]]]]:
    """Idle chain ends split by where they stopped. Ranks in no communication op that never posted
    the same op and whose last op is the same stopped at one point of the program: nothing in the
    evidence orders them (a Flight Recorder dump of gloo records no p2p op, so a pair deadlocked
    in send/recv looks exactly like this)."""
    by: dict[StopPoint, list[tuple[int, set[int]]]] = {}
    for it in items:
        by.setdefault(stop_point(ctx, it[0]), []).append(it)
    return list(by.items())


def same_stop_finding(ctx: WaitContext, items: list[tuple[int, set[int]]], point: StopPoint
                      ) -> tuple[tuple, Finding]:
    """Several idle ranks that stopped at `point`: one `hang`, the lowest as its root, all named."""
    items = sorted(items)
    stopped = [r for r, _ in items]
    roots = stopped[:1]
    waiters = set().union(*(ws for _, ws in items)) - set(stopped)
    wanted, last_op, status = point
    summary, start, direct = waiting_summary(ctx, waiters, stopped)
    rest = stopped[1:]
    title = (f"{rank_label(ctx.trace, roots)} never posted {wanted or 'its next op'} and is in no "
             f"communication op (state {ctx.st.at[roots[0], 'state']}; last op {last_op or 'none'} {status}); "
             f"{rank_label(ctx.trace, rest)} stopped at the same point and nothing recorded says which of them "
             f"stopped first (the lowest rank is named)")
    order = ended_first(ctx, stopped, waiters)
    if order is not None:
        roots, rest, idle = order
        sat = idle.loc[rest, "gap"]
        lo, hi = duration(int(sat.min())), duration(int(sat.max()))
        one = len(roots) == 1
        title = (f"{rank_label(ctx.trace, roots)} ended right after its last op ({last_op or 'none'}) without "
                 f"posting {wanted or 'its next op'} ({'its' if one else 'their'} Flight Recorder dump"
                 f"{' was' if one else 's were'} written then), while {rank_label(ctx.trace, rest)} stopped at "
                 f"the same point and sat {lo if lo == hi else f'{lo} to {hi}'} outside any collective before "
                 f"being dumped: the program goes on from there (the waiting ranks posted it), so "
                 f"{'it' if one else 'they'} left it before its end")
    if summary:
        title += f"; {summary}"
    ev = [last_op_evidence(ctx, r) for r in stopped[:MAX_EVIDENCE]]
    ev += waiter_evidence(ctx, waiters, direct, stopped)
    pl = payload(ctx, roots, waiters | set(rest), direct, start, summary, rank_role="idle",
                 ambiguous=order is None, same_stop=stopped)
    return sort_key(waiters, start), Finding(kind="hang", severity="error", title=title, ranks=roots,
                                                           evidence=ev[:MAX_EVIDENCE * 2], **pl)


def ended_first(ctx: WaitContext, stopped: list[int], waiters: set[int]
                ) -> tuple[list[int], list[int], pd.DataFrame] | None:
    """(ended, idle, the dump idleness table) where the dumps' file times order ranks that stopped at one
    point (module docstring): some were dumped right after their last op and before every idle one, and a
    waiter went on past that point. None otherwise (no waiter, no dump times, no such split)."""
    if not waiters:
        return None
    idle = ctx.ix.dump_gaps
    if idle is None or not set(stopped) <= set(idle.index):
        return None
    sub = idle.loc[stopped]
    ended = sorted(int(r) for r in sub.index[~sub["idle"]])
    sat = sorted(int(r) for r in sub.index[sub["idle"]])
    if not ended or not sat or int(sub.loc[ended, "dumped"].max()) >= int(sub.loc[sat, "dumped"].min()):
        return None
    return ended, sat, idle
