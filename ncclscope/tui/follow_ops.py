"""The begin/end join of a followed run, extended from the appended rows only (`--follow`).

`opsjoin.build_ops` joins every begin row with its end row on each call
(a sort of every end row's key). Here each rank keeps its own join: an op's
begin and end rows are matched by (rank, op_id) within the rank, never across
ranks. A poll looks at the rank's new rows and its still-open ops only:

- new end rows go into the rank's end table (sorted keys; of several end rows
  for one op the last written wins, as in `build_ops`);
- an open op whose key a new end row carries is closed: it is *changed*;
- a new begin row looks its key up in the end table (an end row may come first);
- an op already closed (settled) is never re-joined, except when a later end
  row names its key again (the last-written rule; rare, found by key lookup).

Each op keeps its rank and its begin row's index in the rank's rows (`brow`)
and its end row's (`erow`, -1: in flight). The ops frame is then taken from the
poll's events frame by those row numbers, column for column as `build_ops`
makes it (that construction is mirrored in `ops_frame`: `build_ops` fuses it
with the full join, so it cannot be called for the take alone). Each op's
identity across polls is `uid = rank << 40 | its index among the rank's ops`;
`changed` lists the uids of the ops added or changed by the last `update`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ncclscope import schema as S
from ncclscope.load.opsjoin import ops_from_join

MASK = (1 << 40) - 1           # build_ops' key: rank << 40 | op_id & MASK; within one rank: op_id & MASK
UID_SHIFT = 40


def _empty(dtype: str = "int64") -> np.ndarray:
    return np.empty(0, dtype=dtype)


@dataclass
class _RankJoin:
    brow: np.ndarray = field(default_factory=_empty)    # begin row of each op (row index in the rank)
    okey: np.ndarray = field(default_factory=_empty)    # its key (op_id & MASK)
    erow: np.ndarray = field(default_factory=_empty)    # its end row, -1 while in flight
    open: np.ndarray = field(default_factory=_empty)    # indices of the ops still in flight
    ekeys: np.ndarray = field(default_factory=_empty)   # every end row's key, sorted, one per key ...
    erows: np.ndarray = field(default_factory=_empty)   # ... and the last end row written for it
    last_t: int = np.iinfo(np.int64).min                # local start of the last op: ordered while non-decreasing
    ordered: bool = True


class LiveOps:
    """Per-rank begin/end joins; `update` with each rank's new rows, `ops_frame` for the poll's trace."""

    def __init__(self) -> None:
        self.ranks: dict[int, _RankJoin] = {}
        self.changed: np.ndarray = _empty()     # uids of ops new or changed in the last update(s)
        self._changed: list[np.ndarray] = []

    def reset(self, rank: int) -> None:
        self.ranks.pop(rank, None)

    @property
    def ordered(self) -> bool:
        """Every rank's ops start in row order: `build_ops` then keeps that order (no sort)."""
        return all(j.ordered for j in self.ranks.values())

    def begin_poll(self) -> None:
        self._changed = []

    def end_poll(self) -> None:
        self.changed = np.sort(np.concatenate(self._changed)) if self._changed else _empty()

    def update(self, rank: int, first_row: int, phase: np.ndarray, op_id: np.ndarray, time_ns: np.ndarray,
               begin_code: int, end_code: int) -> None:
        """Join rank `rank`'s new rows (row `first_row` on; phase as codes, begin/end as given)."""
        j = self.ranks.setdefault(rank, _RankJoin())
        key = op_id.astype(np.int64) & MASK
        n_old = len(j.brow)
        touched: list[np.ndarray] = []
        is_end = phase == end_code
        if is_end.any():
            nk, nr = key[is_end], first_row + np.flatnonzero(is_end)
            order = np.argsort(nk, kind="stable")
            nk, nr = nk[order], nr[order]
            last = np.r_[nk[1:] != nk[:-1], True]             # several end rows for one op: the last one
            nk, nr = nk[last], nr[last]
            pos = np.searchsorted(j.ekeys, nk)
            hit = pos < len(j.ekeys)
            hit[hit] = j.ekeys[pos[hit]] == nk[hit]
            if hit.any():                                     # a later end row for a key seen before
                j.erows[pos[hit]] = nr[hit]
                again = np.flatnonzero(np.isin(j.okey, nk[hit]))
                if len(again):
                    j.erow[again] = j.erows[np.searchsorted(j.ekeys, j.okey[again])]
                    touched.append(again)
            new = ~hit
            j.ekeys = np.insert(j.ekeys, pos[new], nk[new])
            j.erows = np.insert(j.erows, pos[new], nr[new])
            if len(j.open):                                   # open ops the new end rows close
                op = j.open
                p = np.minimum(np.searchsorted(nk, j.okey[op]), len(nk) - 1)
                closes = nk[p] == j.okey[op]
                if closes.any():
                    j.erow[op[closes]] = nr[p[closes]]
                    touched.append(op[closes])
        is_begin = phase == begin_code
        if is_begin.any():
            bk, br = key[is_begin], first_row + np.flatnonzero(is_begin)
            if len(j.ekeys):
                p = np.minimum(np.searchsorted(j.ekeys, bk), len(j.ekeys) - 1)
                er = np.where(j.ekeys[p] == bk, j.erows[p], -1)
            else:
                er = np.full(len(bk), -1, dtype=np.int64)
            t = time_ns[is_begin]
            if j.ordered and (t[0] < j.last_t or (len(t) > 1 and bool(np.any(t[1:] < t[:-1])))):
                j.ordered = False
            j.last_t = max(j.last_t, int(t[-1]))
            j.brow = np.concatenate([j.brow, br.astype(np.int64)])
            j.okey = np.concatenate([j.okey, bk])
            j.erow = np.concatenate([j.erow, er.astype(np.int64)])
            touched.append(np.arange(n_old, len(j.brow), dtype=np.int64))
        if touched:
            idx = np.unique(np.concatenate(touched))
            self._changed.append((np.int64(rank) << UID_SHIFT) | idx)
        j.open = np.flatnonzero(j.erow < 0)

    def ops_frame(self, events: pd.DataFrame, bases: dict[int, int]) -> tuple[pd.DataFrame, np.ndarray]:
        """(ops, uid of each ops row): the ops frame `build_ops(events)` gives, from the joins kept here.

        `bases`: each rank's first row in `events` (ranks in order)."""
        ranks = [r for r in bases if r in self.ranks]
        begin_rows = np.concatenate([bases[r] + self.ranks[r].brow for r in ranks]) if ranks else _empty()
        match = np.concatenate([np.where(self.ranks[r].erow >= 0, bases[r] + self.ranks[r].erow, -1)
                                for r in ranks]) if ranks else _empty()
        uid = np.concatenate([(np.int64(r) << UID_SHIFT) | np.arange(len(self.ranks[r].brow), dtype=np.int64)
                              for r in ranks]) if ranks else _empty()
        found = match >= 0
        ops = ops_from_join(events, begin_rows, match, found)   # the frame build_ops makes from a join
        if not self.ordered:   # clocks stepped backwards, or rows appended out of order: build_ops sorts
            order = np.lexsort((ops["op_id"].to_numpy(), ops["start_ns"].to_numpy(), ops["rank"].to_numpy()))
            ops = ops.iloc[order].reset_index(drop=True)
            uid = uid[order]
        return ops, uid


def phase_codes(cats: dict[str, int]) -> tuple[int, int]:
    """The begin and end codes of the `phase` column in the follower's converter (-2: not seen yet)."""
    return cats.get(S.PHASE_BEGIN, -2), cats.get(S.PHASE_END, -2)
