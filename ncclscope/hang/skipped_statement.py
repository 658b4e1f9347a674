"""A tie decided by a statement one member skipped (asked by history_ties.resolve_by_history).

Two members of a group disagree at the same instance #k (a 1 vs 1 type/size vote) and each call is what its
own call site always issued, so neither call's history singles one out; and where only one iteration came
before, no rank's sequence on the group has repeated enough to predict its next call (loop_order.predicted_
next). What still tells them apart is the order of the loop's statements. A rank that skips a statement (its
all_reduce went to another group, or behind an `if`) reaches the statement after it with that one's count
ahead of the skipped one's, although in every earlier iteration of its own the skipped statement came between
two calls of the one it now stands in. Its partner, which issued the skipped statement there, shows its loop
is still calling it. The partner, at the skipped statement itself, broke nothing.

Per member: its calls on the group up to #k as statements (op, call site), in order. It is flagged when some
statement t was called exactly once between each two consecutive calls of its current statement s in its own
record, and once before the first, but not since the last (t's count is one behind s's), while another member
at the same instance has called t at least as often as s has now been called: t is a statement of the loop,
not a set-up call before it (a set-up call the partner made once says nothing, and both would be flagged).
A tie is decided when exactly one member is flagged.
"""
from __future__ import annotations

from collections import Counter

import pandas as pd


def _statements(on_g: pd.DataFrame, rank: int) -> list[tuple[str, str]]:
    """The rank's calls in `on_g` (its group's, up to #k) as (op, call site), in sequence order."""
    mine = on_g[(on_g["rank"] == rank).to_numpy()].sort_values("collective_seq_id", kind="stable")
    return list(zip(mine["op_name"].astype(str), mine["call_site"].astype(str)))


def _skipped(calls: list[tuple[str, str]], counts: Counter, peer_counts: list[Counter]
             ) -> tuple[tuple[str, str], int] | None:
    """(the statement the last call skipped, how many earlier iterations placed it there), or None.
    `counts`: the calls' own Counter."""
    if not calls:
        return None
    s = calls[-1]
    at_s = [i for i, c in enumerate(calls) if c == s]
    n_s = len(at_s)
    if n_s < 2:
        return None
    for t, n_t in counts.items():
        if t == s or n_t != n_s - 1 or not any(pc[t] >= n_s for pc in peer_counts):
            continue
        at_t = [i for i, c in enumerate(calls) if c == t]
        bounds = [-1, *at_s]                       # t once before s's first call, once between each two
        if all(bounds[i] < at_t[i] < bounds[i + 1] for i in range(n_s - 1)):
            return t, n_s - 1
    return None


def skipped_statement(coll: pd.DataFrame, rows: pd.DataFrame, group: str) -> tuple[int, str, str, int] | None:
    """Of the members' calls `rows` (one instance of `group`, each member once), the one rank that skipped a
    statement of its loop to make its call (module docstring): (rank, the skipped op, its call site, the
    earlier iterations that placed it there). None unless exactly one member is flagged."""
    if len(rows) < 2 or rows["rank"].duplicated().any():
        return None
    k = int(rows["collective_seq_id"].max())
    on_g = coll[(coll["process_group"] == group).to_numpy() & (coll["collective_seq_id"] <= k).to_numpy()]
    calls = {int(r): _statements(on_g, int(r)) for r in rows["rank"]}
    counts = {r: Counter(c) for r, c in calls.items()}
    flagged = []
    for r, mine in calls.items():
        got = _skipped(mine, counts[r], [c for q, c in counts.items() if q != r])
        if got is not None:
            flagged.append((r, *got[0], got[1]))
    return flagged[0] if len(flagged) == 1 else None
