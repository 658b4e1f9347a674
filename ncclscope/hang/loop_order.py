"""Which rank left its own loop: the tie-break for a hang in a two-member group.

A training loop issues the same collectives, on the same groups, from the
same call sites, every iteration. When a rank adds a call behind an `if` (an
all_reduce of its loss for logging on rank 1 only) or issues the calls of one
iteration in another order, its sequence of (op, group, call site) stops
repeating at that call, while its peers' sequences keep repeating. In a
group of two, "1 of 2 members began #k" cannot say who left: the member that
began it and waits, or the one that is blocked elsewhere. The sequences can:
the rank whose own repetition breaks at the op it is blocked in, where its loop
would have issued the op the waiter waits in, deviated; the waiter did what
it does every iteration.

Each rank's collectives are read in the order the rank issued them (op_id),
so dumps without timestamps are read the same; the period and phase come from
`repetition.virtual_steps`. A sequence that never repeats MIN_REPEATS times
(a hang in the first iteration) proves nothing either way.

Two lighter readings of the same idea: a rank blocked in send/recv is read
with its p2p calls among its collectives (`p2p_passers`: it went past the
collective the others entered to a later statement of its loop), and a 1 vs
1 type/size tie is decided by what each member's own calls on the group issue
after the same context (`predicted_next`, `sequence_deviant`): one earlier
iteration is enough there, because it only chooses between two calls that
already disagree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from ncclscope import schema as S
from ncclscope.index.repetition import repeats_to_end, virtual_steps
from ncclscope.hang.wording import WaitContext
from ncclscope.hang.since_last import since_last_says

MAX_LOOP_CHECKS = 16             # tied edges whose ranks' loops are read
MIN_CONTEXT = 2                  # calls of context before a rank's own sequence predicts its next call
MAX_CONTEXT = 64                 # context read back at most
MAX_SEQUENCE = 4096              # a rank's latest calls on a group read for that prediction


@dataclass(frozen=True)
class Departure:
    """Where a rank's loop broke: its call number `index` (op `op_id`) is not the one its loop issues there,
    `expected_op` on `expected_group` from `expected_site`."""
    rank: int
    index: int
    op_id: int
    expected_group: str
    expected_site: str
    expected_op: str


def rank_sequence(coll: pd.DataFrame, rank: int, p2p: pd.DataFrame | None = None) -> pd.DataFrame:
    """The rank's collectives in issue order (op_id), with its send/recv calls among them when `p2p` is given."""
    cols = ["op_id", "op_name", "process_group", "call_site"]
    c = coll[(coll["rank"] == rank).to_numpy()][cols]
    if p2p is not None and len(p2p):
        c = pd.concat([c, p2p[(p2p["rank"] == rank).to_numpy()][cols]], ignore_index=True)
    return c.sort_values("op_id", kind="stable")


def _token(op: object, group: object, site: object) -> str:
    return f"{op}\x1f{group}\x1f{site}"


def _tokens(seq: pd.DataFrame) -> list[str]:
    return [_token(o, g, s) for o, g, s in zip(seq["op_name"].astype(str), seq["process_group"].astype(str),
                                               seq["call_site"].astype(str))]


def departure(coll: pd.DataFrame, rank: int) -> Departure | None:
    """The rank's first call that breaks its repetition, or None when it never repeats or never breaks."""
    seq = rank_sequence(coll, rank)
    toks = _tokens(seq)
    rep = virtual_steps(toks)
    if rep is None:
        return None
    steps, brk = rep
    # The period: the offset back to the previous call of the same virtual step position.
    same = np.flatnonzero(steps[:brk] == steps[brk] - 1)
    period = len(same) if len(same) else 0
    if not period:
        return None
    op, group, site = toks[brk - period].split("\x1f")
    return Departure(rank=rank, index=brk, op_id=int(seq["op_id"].iloc[brk]), expected_group=group,
                     expected_site=site, expected_op=op)


def keeps_loop(coll: pd.DataFrame, rank: int) -> bool:
    """Does the rank's whole sequence, to its last call, repeat one loop body at least MIN_REPEATS times?"""
    return repeats_to_end(_tokens(rank_sequence(coll, rank)))


def left_loop_at(coll: pd.DataFrame, target: int, blocked_op_id: int, group: str) -> Departure | None:
    """The target's departure when it is exactly its blocked op, issued where its loop issues an op on `group`."""
    d = departure(coll, target)
    if d is None or d.op_id != blocked_op_id or d.expected_group != group:
        return None
    return d


def passed_in_loop(seq: pd.DataFrame, blocked_op_id: int, op: str, group: str, site: str) -> bool | None:
    """Did the rank go past (op on group from site) to reach the op it is blocked in?

    True: in its own loop the call comes before the blocked one, and this iteration it is missing (it
    skipped it: a departure). False: the call follows the blocked one, the rank simply has not reached it
    yet (it waits earlier in its own loop: not a skip, whatever a majority of the group did). None: the
    rank's history cannot say (the blocked call never ran before, or the call is in neither period).

    `seq` is the rank's collectives in issue order (op_id). The blocked call's previous occurrence Yp and
    the one before it Ypp bound one period of its loop, whatever the loop looks like: the call occurring
    between Yp and the blocked op means it follows the blocked call in the loop (not reached); occurring only
    between Ypp and Yp means it precedes it and was left out this time (passed).

    An occurrence is a visit of the statement: a run of back-to-back identical calls is one (the two
    broadcasts of one `broadcast_object_list`, an inner loop's all_reduce per parameter), so its two calls
    are not read as two passes of the loop (seed 20261222 #26: the rank was blocked in the first broadcast of
    a `broadcast_object_list` whose previous visit made two)."""
    ops = seq["op_name"].astype(str).to_numpy()
    groups = seq["process_group"].astype(str).to_numpy()
    sites = seq["call_site"].astype(str).to_numpy()
    ids = seq["op_id"].to_numpy()
    at = np.flatnonzero(ids == blocked_op_id)
    if not len(at):
        return None
    iy = int(at[0])
    same_y = np.flatnonzero((ops[:iy] == ops[iy]) & (groups[:iy] == groups[iy]) & (sites[:iy] == sites[iy]))
    start = iy                         # the blocked call's own visit begins here
    while len(same_y) and int(same_y[-1]) == start - 1:
        start, same_y = start - 1, same_y[:-1]
    if not len(same_y):
        return None
    visits = np.split(same_y, np.flatnonzero(np.diff(same_y) != 1) + 1)
    prev_first, prev_last = int(visits[-1][0]), int(visits[-1][-1])
    before_last = int(visits[-2][-1]) if len(visits) > 1 else -1
    is_x = (ops == op) & (groups == group)
    if site:
        is_x &= sites == site
    if is_x[prev_last + 1:start].any():
        return False
    if is_x[before_last + 1:prev_first].any():
        return True
    return None


def looped(edge: pd.Series) -> bool:
    """Was this edge kept by `loop_leavers` (its `loop` column; NaN on rows from other rules)?"""
    v = edge.get("loop")
    return isinstance(v, (bool, np.bool_)) and bool(v)


def loop_leavers(ctx: WaitContext, tied: pd.DataFrame) -> pd.DataFrame:
    """Edges with no majority (1 of 2 began) into a target blocked in a collective on another group that
    left its own loop there (loop_order.py): it issued that op where its loop issues the one the waiter,
    which keeps its loop, waits in. At most MAX_LOOP_CHECKS edges are read (one pass over their ranks' rows)."""
    b = ctx.blocking
    bc = b[b["kind"] == S.KIND_COLLECTIVE][["rank", "process_group", "op_id"]]
    cand = tied.merge(bc.rename(columns={"rank": "target", "process_group": "target_group", "op_id": "target_op"}),
                      on="target")
    cand = cand[cand["target_group"] != cand["process_group"]]
    cand = cand.drop_duplicates(["waiter", "target", "process_group"]).head(MAX_LOOP_CHECKS)
    if not len(cand):
        return tied.iloc[0:0]
    n_blocked = bc.groupby("rank").size().to_dict()          # a target blocked in one collective, not several
    ranks = set(cand["waiter"].astype(int)) | set(cand["target"].astype(int))
    coll = ctx.coll
    sub = coll[coll["rank"].isin(sorted(ranks)).to_numpy()]
    keep = [i for i, e in enumerate(cand.itertuples(index=False))
            if n_blocked.get(int(e.target), 0) == 1 and keeps_loop(sub, int(e.waiter))
            and left_loop_at(sub, int(e.target), int(e.target_op), str(e.process_group)) is not None]
    return cand.iloc[keep].drop(columns=["target_group", "target_op"]).assign(loop=True)


def loop_says(ctx: WaitContext, e: Any) -> bool | None:
    """Did target `e.target` pass the instance (e.process_group #e.seq) that `e.waiter` waits in, by its own loop?
    (loop_order.passed_in_loop; the call site is the waiter's for that instance.)"""
    b = ctx.blocking
    mine = b[(b["rank"] == e.target).to_numpy()]
    tb = mine[(mine["kind"] == S.KIND_COLLECTIVE).to_numpy()]
    wb = b[(b["rank"] == e.waiter).to_numpy() & (b["op_id"] == e.op_id).to_numpy()]
    site = str(wb["call_site"].iloc[0]) if len(wb) else ""
    coll = ctx.coll
    if len(tb) == 1:
        return passed_in_loop(rank_sequence(coll, int(e.target)), int(tb["op_id"].iloc[0]), str(e.op_name),
                              str(e.process_group), site)
    if len(tb) or not len(mine):
        return None
    # blocked in send/recv only: its loop is read with its p2p calls in it, from its first blocked one
    return passed_in_loop(rank_sequence(coll, int(e.target), ctx.ix.p2p), int(mine["op_id"].min()),
                          str(e.op_name), str(e.process_group), site)


def not_reached(ctx: WaitContext, edges: pd.DataFrame) -> np.ndarray:
    """Per edge: the target has not reached the instance in its own loop (`loop_says` is False), or, where
    its own loop cannot say, by its peers' calls since the instance before it (`since_last_says` is False).
    Asked once per instance and target, not per waiter: a world barrier has thousands of waiters on one
    absent rank."""
    if not len(edges):
        return np.zeros(0, dtype=bool)
    key = ["target", "process_group", "seq"]
    first = edges.drop_duplicates(key)
    said, memo = {}, {}
    for e in first.itertuples(index=False):
        own = loop_says(ctx, e)
        said[(e.target, e.process_group, e.seq)] = own is False or (own is None
                                                                   and since_last_says(ctx, e, memo) is False)
    return np.fromiter((said[k] for k in zip(edges["target"], edges["process_group"], edges["seq"])),
                       dtype=bool, count=len(edges))


def p2p_passers(ctx: WaitContext, e: pd.DataFrame) -> pd.DataFrame:
    """Edges with a majority into a target blocked in send/recv only, whose own loop (its p2p calls read
    with its collectives) put this instance before the call it is blocked in: it went past the collective
    the others entered to a later statement of its loop. At most MAX_LOOP_CHECKS edges are read."""
    b = ctx.blocking
    p2p_only = set(b.loc[b["kind"] != S.KIND_COLLECTIVE, "rank"]) - set(b.loc[b["kind"] == S.KIND_COLLECTIVE, "rank"])
    cand = e[e["target"].isin(p2p_only)].drop_duplicates(["target", "process_group", "seq"]).head(MAX_LOOP_CHECKS)
    keep = [i for i, x in enumerate(cand.itertuples(index=False)) if loop_says(ctx, x) is True]
    if not keep:
        return e.iloc[0:0]
    said = {(int(cand["target"].iloc[i]), str(cand["process_group"].iloc[i]), int(cand["seq"].iloc[i])) for i in keep}
    return e[[(int(t), str(g), int(k)) in said for t, g, k in zip(e["target"], e["process_group"], e["seq"])]]


def loop_passers(ctx: WaitContext, e0: pd.DataFrame) -> pd.DataFrame:
    """Edges with no majority (1 of 2 began) into a target blocked in a collective on another group whose own
    loop put this instance before the op it is blocked in (it went past it), while the waiter did not go
    past anything to be where it is. At most MAX_LOOP_CHECKS edges are read."""
    tied = e0[2 * e0["n_began"] <= e0["n_members"]].drop_duplicates(["waiter", "target", "process_group"])
    tied = tied.head(MAX_LOOP_CHECKS)
    if not len(tied):
        return e0.iloc[0:0]
    passed = {i for i, e in enumerate(tied.itertuples(index=False)) if loop_says(ctx, e) is True}
    if not passed:
        return e0.iloc[0:0]
    passers = {int(tied["target"].iloc[i]) for i in passed}
    # a waiter that itself passed an instance another cycle member waits in is a deviant too: then the
    # loops cannot single out one rank, and the rule says nothing
    keep = [i for i in passed if int(tied["waiter"].iloc[i]) not in passers]
    return tied.iloc[keep]


def predicted_next(tokens: list[str]) -> tuple[str, int] | None:
    """What the rank's own sequence says comes after `tokens`: the token that followed every earlier
    occurrence of the longest suffix (read up to MAX_CONTEXT) that occurred before, and how many earlier
    occurrences say so. None when no such suffix occurred or they disagree.

    An occurrence counts when it matches at least MIN_CONTEXT calls, or every call before it: a match that
    runs back to the start of the record is as long as the evidence goes (the record began with the loop,
    whose second pass repeats its first from its first call on). One earlier iteration suffices, which
    `virtual_steps` cannot use: it needs MIN_REPEATS periods to find one."""
    n = len(tokens)
    if n <= MIN_CONTEXT:
        return None
    last = tokens[-1]
    lengths: dict[int, int] = {}                  # earlier end position -> how far it matches the suffix
    for j in range(n - 1):
        if tokens[j] != last:
            continue
        m = 1
        while m < MAX_CONTEXT and m <= j and tokens[j - m] == tokens[n - 1 - m]:
            m += 1
        if m >= MIN_CONTEXT or m == j + 1:
            lengths[j] = m
    if not lengths:
        return None
    best = max(lengths.values())
    nxt = {tokens[j + 1] for j, m in lengths.items() if m == best}
    if len(nxt) != 1:
        return None
    said = next(iter(nxt))
    return said, sum(1 for j in lengths if tokens[j + 1] == said)


def sequence_deviant(coll: pd.DataFrame, rows: pd.DataFrame, group: str,
                     alone: bool = False) -> tuple[int, str, str, int] | None:
    """Of the members' calls `rows` (one instance of `group`), the one rank whose call is not what its own
    earlier calls on the group predict there (predicted_next) while every other member's call is:
    (rank, the predicted op, its call site, how many earlier occurrences say so). None otherwise. A single
    call where `alone` (the other members left no record at all: history_ties._lone_records)."""
    if len(rows) < (1 if alone else 2):
        return None
    off, fit, said = [], 0, ([], "")         # said: the deviant's own tokens and the call they predicted
    for row in rows.itertuples(index=False):
        mine = coll[(coll["rank"] == row.rank).to_numpy() & (coll["process_group"] == group).to_numpy()
                    & (coll["collective_seq_id"] < row.collective_seq_id).to_numpy()]
        mine = mine.sort_values("collective_seq_id", kind="stable")
        if len(mine) > MAX_SEQUENCE:
            mine = mine.iloc[-MAX_SEQUENCE:]
        tokens = _tokens(mine)
        pred = predicted_next(tokens)
        if pred is None:
            return None
        if pred[0] == _token(row.op_name, row.process_group, row.call_site):
            fit += 1
        else:
            op, _, site = pred[0].split("\x1f")
            off.append((int(row.rank), op, site, pred[1]))
            said = (tokens, pred[0])
    if len(off) != 1 or fit != len(rows) - 1:
        return None
    if alone:
        row = next(rows.itertuples(index=False))
        # A call from a line the rank never called from before, with its partner's record gone, is the
        # loop's normal end (the first call after the loop) as much as a departure from it: nothing left
        # tells them apart (seed 20261213 #365: rank 1's barrier after its 4th and last iteration; rank 0
        # had raised in that iteration's compute, its dump lost).
        earlier = coll[(coll["rank"] == row.rank).to_numpy() & (coll["op_id"] < row.op_id).to_numpy()]
        if str(row.call_site) not in set(earlier["call_site"].astype(str)) or _course_elsewhere(coll, row, group):
            return None
        if run_extrapolated(*said):
            return None
    return off[0]


def run_extrapolated(tokens: list[str], predicted: str) -> bool:
    """Does the prediction only say that a run of one call goes on? Its trailing run of identical calls
    (an inner loop: one all_reduce per parameter) predicts one more of the same, but no earlier run of that
    call was longer, so nothing the rank did before says how long the run is: the call after it may be the
    loop's next statement as well as a departure (seed 20261214 #313: a barrier, then four per-parameter
    all_reduces, then the next iteration's barrier, the partner's record lost)."""
    if not tokens or tokens[-1] != predicted:
        return False
    last, n = predicted, len(tokens)
    trail = n - next((i + 1 for i in range(n - 1, -1, -1) if tokens[i] != last), 0)
    longest, cur = 0, 0
    for t in tokens[:n - trail]:
        cur = cur + 1 if t == last else 0
        longest = max(longest, cur)
    return longest <= trail


def _course_elsewhere(coll: pd.DataFrame, row: Any, group: str) -> bool:
    """Did another rank make this very call (op, call site) at this point of its own sequence on one of its
    groups, after the same calls? Then the call is the program's course, whatever the rank's own earlier
    calls predicted: an inner loop's run of identical calls predicts one more of them, and the call after
    the run breaks it in every rank (seed 20261213 #322: four per-parameter all_reduces then one more from
    another line, in each tensor-parallel group alike; the partner of one group had died)."""
    k = int(row.collective_seq_id)
    lo = max(k - MAX_CONTEXT, 0)

    def window(sub: pd.DataFrame) -> list[tuple[int, str, str]]:
        sub = sub[(sub["collective_seq_id"] > lo).to_numpy() & (sub["collective_seq_id"] <= k).to_numpy()]
        sub = sub.sort_values("collective_seq_id", kind="stable")
        return list(zip(sub["collective_seq_id"].astype(int), sub["op_name"].astype(str), sub["call_site"].astype(str)))

    mine = window(coll[(coll["rank"] == row.rank).to_numpy() & (coll["process_group"] == group).to_numpy()])
    same = coll[(coll["rank"] != row.rank).to_numpy() & (coll["collective_seq_id"] == k).to_numpy()
                & (coll["op_name"].astype(str) == str(row.op_name)).to_numpy()
                & (coll["call_site"].astype(str) == str(row.call_site)).to_numpy()]
    for (r, g), _ in same.groupby(["rank", "process_group"], sort=True, observed=True):
        if window(coll[(coll["rank"] == r).to_numpy() & (coll["process_group"] == g).to_numpy()]) == mine:
            return True
    return False
