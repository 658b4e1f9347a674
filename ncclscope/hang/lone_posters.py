"""Ranks that posted a call the rest of their group never made, and waited in it while the rest finished.

A wait-for chain that ends at ranks which finished (exit 0) reads as "they finished without posting the
call": the finishers are the chain's ends, so they were named. When most of the group finished cleanly
after the same last call, and a minority posted one call more and waits in it, the minority is what
differs: it issued more calls than its program's other ranks (an accumulation count, a loop bound or an
`if` of its own). A rank that skipped a call and finished early is the other way round, a minority of
finishers against waiters, and stays a chain end (`waitfor._endpoint_finding`). Only ranks known to have
finished count: a rank whose state nothing says (a dump's rank idle in a send/recv gloo does not record)
may be stuck anywhere, and waiting on it proves nothing."""
from __future__ import annotations

import pandas as pd

from ncclscope import schema as S
from ncclscope.findings import Cause, CauseBasis, Finding
from ncclscope.hang.wording import (WaitContext, at_site, op_desc, op_evidence, payload, since, sort_key,
                                   waiter_evidence, waiting_summary)
from ncclscope.index.labels import rank_label


def lone_posters(ctx: WaitContext, finished: list[tuple[int, set[int]]]) -> tuple[tuple, Finding, set[int]] | None:
    """(sort key, finding, the finished ranks it accounts for) when the ranks waiting on finished ranks are
    a strict minority of one group, in one instance #k of it, and every other member finished with #k-1 its
    last call on that group; else None."""
    done = {int(r) for r, _ in finished}
    e = ctx.edges.select(targets=sorted(done))
    if not len(e) or (e["via"] != S.KIND_COLLECTIVE).any():
        return None
    inst = e.drop_duplicates(["process_group", "seq"])
    if len(inst) != 1:
        return None
    g, k = str(inst["process_group"].iloc[0]), int(inst["seq"].iloc[0])
    members = [int(m) for m in ctx.members.get(g) or []]
    coll = ctx.coll
    on_g = coll[(coll["process_group"] == g).to_numpy()]
    posters = sorted({int(r) for r in on_g.loc[on_g["collective_seq_id"] == k, "rank"]})
    absent = sorted(set(members) - set(posters))
    if not posters or not absent or not set(absent) <= done or 2 * len(posters) >= len(members):
        return None
    last = on_g[on_g["rank"].isin(absent).to_numpy()].groupby("rank")["collective_seq_id"].max()
    if len(last) != len(absent) or not (last == k - 1).all():
        return None
    return _finding(ctx, g, k, posters, absent, finished)


def _finding(ctx: WaitContext, g: str, k: int, posters: list[int], absent: list[int],
             finished: list[tuple[int, set[int]]]) -> tuple[tuple, Finding, set[int]]:
    b = ctx.blocking
    rb = b[b["rank"].isin(posters).to_numpy() & (b["kind"] == S.KIND_COLLECTIVE).to_numpy()
           & (b["process_group"] == g).to_numpy()]
    row = next(rb.itertuples(index=False), None)
    what = op_desc(ctx, row) if row is not None else f"#{k} on {g}"
    n = len(absent)
    title = (f"{rank_label(ctx.trace, posters)} posted {what}{at_site(row) if row is not None else ''}, a call "
             f"the other {n} member{'s' if n > 1 else ''} never made: {rank_label(ctx.trace, absent)} finished "
             f"(exit 0) with #{k - 1} {'their' if n > 1 else 'its'} last call on {g}")
    site = str(getattr(row, "call_site", "") or "") if row is not None else ""
    if site:
        title += _count_note(ctx.coll, site, posters, absent)
    # ranks waiting on the posters (further down the chain), and the posters' own waits
    waiters = set().union(*(ws for r, ws in finished if r in absent)) - set(posters)
    summary, start, direct = waiting_summary(ctx, waiters, posters)
    if summary:
        title += f"; {summary}"
    ev = [op_evidence(r, f"{r.status}: the only call of its group at #{k}{since(ctx.end, r.start_ns, ', since ')}")
          for r in rb.itertuples(index=False)]
    ev += waiter_evidence(ctx, waiters, direct, posters)
    start = int(rb["start_ns"].min()) if len(rb) else start
    cause = Cause(basis=CauseBasis.INSTANCE, deviant_ranks=tuple(posters), absent_ranks=tuple(absent),
                  unfinished=True)
    pl = payload(ctx, posters, waiters, direct, start, summary, instance=(g, k), process_group=g, seq=k)
    f = Finding(kind="hang", severity="error", title=title, ranks=posters, evidence=ev, cause=cause, **pl)
    return sort_key(set(absent) | waiters, start), f, set(absent)


def _count_note(coll: pd.DataFrame, site: str, posters: list[int], absent: list[int]) -> str:
    """" (N calls from that line where each of the others made M)" when the counts say so plainly."""
    at = coll[(coll["call_site"].astype(str) == site).to_numpy()]
    n = at.groupby("rank").size()
    mine = {int(n.get(r, 0)) for r in posters}
    theirs = {int(n.get(r, 0)) for r in absent}
    if len(mine) != 1 or len(theirs) != 1:
        return ""
    m, t = mine.pop(), theirs.pop()
    return f" ({m} calls from that line where each of the others made {t})" if m > t else ""
