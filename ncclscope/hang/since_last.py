"""Has a blocked rank reached an instance its own loop cannot place? Its peers' calls since the instance
before it say (`since_last_says`, asked by loop_order.not_reached; split out of loop_order.py).

A rank's own history places an instance only where its loop issued that call before; a one-off call (DDP's
bucket-order broadcast of the second iteration, a barrier after a loop on other groups) is placed by the
ranks that did post it: what they called between the group's previous instance and this one, and how often.
"""
from __future__ import annotations

from typing import Any

import pandas as pd

from ncclscope import schema as S
from ncclscope.hang.wording import WaitContext


def since_last_says(ctx: WaitContext, e: Any, memo: dict | None = None) -> bool | None:
    """Has target `e.target` not yet reached the instance `g #k` (e.process_group, e.seq), by the calls the
    instance's posters made since the instance before it? For a call the target's loop never issued before
    (DDP's bucket-order broadcast of the second iteration, a one-off barrier), its own history cannot
    place it (`loop_says` None); its peers can. The target posted g #k-1 and is blocked in one collective
    from some statement (op and call site). When most of the posters of g #k issued that statement (each
    on its own group for it) between their g #k-1 and g #k at least as many times as the target has since
    its g #k-1 (the blocked call included), the statement comes before g #k, and a target still in it has
    simply not got there: False. (Most, not all: the rank that left the statement out is often a poster.
    At least as many, not just once: a statement that also runs after g #k, an inner loop, would have the
    target past it.) Counted from g #k-1, not from the start, so dumps whose ring buffers begin at
    different calls are read alike; for the group's first instance (no g #k-1: a barrier after a loop on
    other groups) from the start of each record, where every record begins with the group's (`_from_start`).
    None where the posters say nothing, or where the target posted anything after that collective (an
    async call left open, DDP's all_reduce, while it waits in a later send: seed 20261218 #2).
    `memo` holds what does not depend on the target (an instance's spans, a statement's calls, the groups
    whose records begin alike) across the targets `not_reached` asks about: a world barrier may have
    hundreds."""
    memo = {} if memo is None else memo
    b = ctx.blocking
    mine = b[(b["rank"] == e.target).to_numpy()]
    tb = mine[(mine["kind"] == S.KIND_COLLECTIVE).to_numpy()]
    k = int(e.seq)
    if len(tb) != 1 or k < 1 or (mine["start_ns"] > int(tb["start_ns"].iloc[0])).any():
        return None          # blocked in a send/recv posted after it: it went on (an async call left open)
    site, op = str(tb["call_site"].iloc[0]), str(tb["op_name"].iloc[0])
    if not site:
        return None
    coll, target = ctx.coll, int(e.target)
    g = str(e.process_group)
    span = _memo(memo, ("span", g, k), lambda: _instance_spans(coll, e.process_group, k))
    if k not in span.columns:
        return None
    if k == 1:      # the group's first instance: counted from the start of each record (`_from_start`)
        lo_target = -1
    elif k - 1 not in span.columns or pd.isna(span[k - 1].get(target)):
        return None
    else:
        lo_target = span[k - 1][target]
    calls = _memo(memo, ("calls", op, site), lambda: _statement_calls(coll, op, site))
    # per poster of g #k (a rank that posted g #k-1 too): its calls of the statement in between
    posted = _memo(memo, ("posted", g, k, op, site), lambda: _calls_between(span, k, calls))
    n = posted.drop(target, errors="ignore")
    if not len(n):
        return None
    own = calls[(calls["rank"] == target).to_numpy()]
    if k == 1:
        theirs = _memo(memo, ("groups", g, k, op, site),
                       lambda: set(calls.loc[calls["rank"].isin(posted.index).to_numpy(), "process_group"]))
        groups = set(own["process_group"]) | theirs
        if not groups or not groups <= _memo(memo, ("aligned",), lambda: _from_start(coll)):
            return None
    n_target = int((own["start_ns"] > lo_target).sum())          # the target's since its g #k-1
    return False if n_target > 0 and 2 * int((n >= n_target).sum()) > len(n) else None


def _memo(memo: dict, key: tuple, make: Any) -> Any:
    if key not in memo:
        memo[key] = make()
    return memo[key]


def _instance_spans(coll: pd.DataFrame, group: Any, k: int) -> pd.DataFrame:
    """Per rank (index) and seq (columns k-1, k): the start of its call of `group` #seq."""
    on_g = coll[(coll["process_group"] == group).to_numpy() & coll["collective_seq_id"].isin([k - 1, k]).to_numpy()]
    return on_g.pivot_table(index="rank", columns="collective_seq_id", values="start_ns", aggfunc="min")


def _statement_calls(coll: pd.DataFrame, op: str, site: str) -> pd.DataFrame:
    """Every rank's calls of one statement (op and call site): rank, start, group (as text)."""
    y = coll.loc[(coll["op_name"].astype(str) == op).to_numpy() & (coll["call_site"].astype(str) == site).to_numpy(),
                 ["rank", "start_ns", "process_group"]]
    return y.assign(process_group=y["process_group"].astype(str))


def _calls_between(span: pd.DataFrame, k: int, calls: pd.DataFrame) -> pd.Series:
    """Per rank that posted g #k (and g #k-1, for k > 1): its `calls` after its g #k-1 and before its g #k."""
    hi = span[k]
    lo = span[k - 1] if k > 1 else pd.Series(-1, index=span.index, dtype="int64")
    posters = hi.index[(hi.notna() & lo.notna()).to_numpy()]
    y = calls[calls["rank"].isin(posters).to_numpy()]
    r, start = y["rank"], y["start_ns"]
    inside = (start > r.map(lo)) & (start < r.map(hi))
    return inside.groupby(r).sum().reindex(posters, fill_value=0)


def _from_start(coll: pd.DataFrame) -> set[str]:
    """The groups whose record begins at the same call on every rank that has one (a run trace; dumps whose
    ring buffers kept each group from its first call): counting a statement's calls on them since the start
    of each record, as `since_last_says` does for a group's first instance (a barrier after a loop on other
    groups: seed 20261229 #18), counts them all."""
    first = coll.groupby(["process_group", "rank"], observed=True)["collective_seq_id"].min()
    n = first.groupby(level=0, observed=True).nunique()
    return set(n.index[(n == 1).to_numpy()].astype(str))
