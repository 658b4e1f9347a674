"""Idle ranks that stopped at one point: one root, not the lowest of them.

A rank in no communication op that never posted what its peers wait in is a
chain end of the wait-for graph (waitfor.py). When several such ranks never
posted the same op and their last op is the same, nothing recorded orders them:
a Flight Recorder dump of gloo records no send/recv, so a pair deadlocked in
send/recv looks exactly like two ranks that stopped together after their last
collective. Naming the lowest would be a guess; the finding names them all and
says so.
"""
from __future__ import annotations

from ncclscope.findings import Evidence, Finding
from ncclscope.hang.wording import (MAX_EVIDENCE, WaitContext, payload, sort_key, waiter_evidence, waiting_summary,
                                    wanted_desc)
from ncclscope.index.labels import rank_label


def stop_point(ctx: WaitContext, r: int) -> tuple[str, str, str]:
    """Where an idle rank stopped, as far as the evidence says: what it never posted and its last op."""
    into = ctx.edges.select(targets=[r])
    row = ctx.st.loc[r]
    return (wanted_desc(ctx, into.iloc[0]) if len(into) else "", str(row.last_op), str(row.last_op_status))


def same_stop(ctx: WaitContext, items: list[tuple[int, set[int]]]) -> list[list[tuple[int, set[int]]]]:
    """Idle chain ends split by where they stopped. Ranks in no communication op that never posted
    the same op and whose last op is the same stopped at one point of the program: nothing in the
    evidence orders them (a Flight Recorder dump of gloo records no p2p op, so a pair deadlocked
    in send/recv looks exactly like this), so naming the lowest of them would be a guess."""
    by: dict[tuple[str, str, str], list[tuple[int, set[int]]]] = {}
    for it in items:
        by.setdefault(stop_point(ctx, it[0]), []).append(it)
    return list(by.values())


def same_stop_finding(ctx: WaitContext, items: list[tuple[int, set[int]]]) -> tuple[tuple, Finding]:
    """Several idle ranks that stopped at the same point: one `hang` naming all of them."""
    items = sorted(items)
    roots = [r for r, _ in items]
    waiters = set().union(*(ws for _, ws in items)) - set(roots)
    wanted, last_op, status = stop_point(ctx, roots[0])
    summary, start, direct = waiting_summary(ctx, waiters, roots)
    title = (f"{rank_label(ctx.trace, roots)} never posted {wanted or 'their next op'} and are in no "
             f"communication op (state {ctx.st.at[roots[0], 'state']}; last op {last_op or 'none'} {status}): "
             f"they stopped at the same point, and nothing recorded says which of them stopped first")
    if summary:
        title += f"; {summary}"
    ev = [Evidence(rank=r, note=f"last op: {ctx.st.at[r, 'last_op']} ({ctx.st.at[r, 'last_op_status'] or 'n/a'})",
                   op_name=str(ctx.st.at[r, "last_op"]), time_ns=int(ctx.st.at[r, "last_op_start_ns"]))
          for r in roots[:MAX_EVIDENCE]]
    ev += waiter_evidence(ctx, waiters, direct, roots)
    pl = payload(ctx, roots, waiters, direct, start, summary, rank_role="idle", ambiguous=True)
    return sort_key(waiters | set(roots), start), Finding(kind="hang", severity="error", title=title, ranks=roots,
                                                           evidence=ev[:MAX_EVIDENCE * 2], **pl)
