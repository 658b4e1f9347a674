"""The begin/end join that makes `Trace.ops` from the events frame.

Split out of columns.py (the column engine that builds the events frame). Nothing here reads files.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ncclscope import schema as S
from ncclscope.load.columns import column_equals
from ncclscope.load.heap import copy_on_write

STATUS_INFLIGHT = "inflight"     # an op's status in `Trace.ops` when it has no end row (the evidence of a hang)
# what the join adds to an event column's categories in the ops: the status of an op with no end row, and the
# message of an op with no end row (the empty one)
_JOIN_ADDS = {"status": STATUS_INFLIGHT, "message": ""}


def ops_categories(column: str, event_categories: list[str]) -> list[str]:
    """The categories of an ops column, given those of the event column it comes from (the engine's driver
    builds the ops of chunks joined on workers with these: engine/ops_chunks.py)."""
    cats = list(event_categories) or [""]
    extra = _JOIN_ADDS.get(column)
    return cats + [extra] if extra is not None and extra not in cats else cats


def build_ops(events: pd.DataFrame) -> pd.DataFrame:
    """Join each begin row with its end row: one row per op, vectorised.

    Ops with no end row get status "inflight" and end_ns -1: on a dead or hung
    job they are the evidence. An end row whose begin row is missing (a torn
    first batch) has nothing to join to and is left out of `ops` (it stays in
    `events`). When an op has several end rows, the last one written wins.

    The join is a sorted-key lookup (rank << 40 | op_id) rather than a pandas
    merge: on a 10-million-row trace it is several times faster and makes no
    intermediate copy of the begin rows.
    """
    is_begin = column_equals(events["phase"], S.PHASE_BEGIN)
    is_end = column_equals(events["phase"], S.PHASE_END)
    key = (events["rank"].to_numpy().astype(np.int64) << 40) | (events["op_id"].to_numpy() & ((1 << 40) - 1))
    end_rows = np.flatnonzero(is_end)
    ekeys = key[end_rows]
    begin_rows = np.flatnonzero(is_begin)
    bkeys = key[begin_rows]
    direct = _direct_join(len(key), ekeys, end_rows, bkeys)
    if direct is not None:
        found, match = direct
        del key, end_rows, ekeys, bkeys, is_begin, is_end, direct
        return _finish(ops_from_join(events, begin_rows, match, found))
    if len(ekeys) > 1 and not bool(np.all(ekeys[1:] >= ekeys[:-1])):   # in key order already: no sort
        order = np.argsort(ekeys, kind="stable")
        ekeys, end_rows = ekeys[order], end_rows[order]
        del order
    last = np.r_[ekeys[1:] != ekeys[:-1], True] if len(ekeys) else np.zeros(0, dtype=bool)
    ekeys, erows = ekeys[last], end_rows[last]
    if len(ekeys):
        pos = np.minimum(np.searchsorted(ekeys, bkeys), len(ekeys) - 1)
        found = ekeys[pos] == bkeys
        match = np.where(found, erows[pos], -1)
    else:
        found = np.zeros(len(bkeys), dtype=bool)
        match = np.full(len(bkeys), -1)
    # free the join's temporaries before the begin rows are copied: at 32 M rows they are ~1.5 GB
    del key, end_rows, ekeys, erows, bkeys, last, is_begin, is_end
    if "pos" in locals():
        del pos
    return _finish(ops_from_join(events, begin_rows, match, found))


def marks_of(events: pd.DataFrame) -> pd.DataFrame:
    """The rows of `events` that are neither a begin nor an end row (`Trace.marks`), index 0..n-1."""
    if not len(events):
        return events.iloc[0:0].reset_index(drop=True)
    op_row = column_equals(events["phase"], S.PHASE_BEGIN) | column_equals(events["phase"], S.PHASE_END)
    return events[~op_row].reset_index(drop=True)


def _direct_join(n_rows: int, ekeys: np.ndarray, end_rows: np.ndarray,
                 bkeys: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """(found, match) of `build_ops`' join by direct addressing, or None where it does not apply.

    The tracer numbers each rank's ops 0, 1, 2, ...: rank x (largest op id + 1) slots are then about
    one per row, and a slot table (end row of each (rank, op id), -1 for none) answers every begin row
    in one gather instead of a sort and a binary search each (16 M begin rows: 1.3 s for the search).
    Applies when the table stays within two slots per row; anything else (Flight Recorder rows' op ids
    from 2**32, negative ranks, sparse ids) takes the sorted-key path. `n_rows`: the events' rows."""
    if not len(ekeys) or not len(bkeys):
        return None
    mask = (1 << 40) - 1
    low = int(min(ekeys.min(), bkeys.min()))
    if low < 0:                                                  # a negative rank
        return None
    base = (low >> 40) << 40          # the lowest rank's slots first (an engine's chunk starts at any rank)
    ranks = (int(max(ekeys.max(), bkeys.max())) - base) >> 40
    width = max(int((ekeys & mask).max()), int((bkeys & mask).max())) + 1
    if (ranks + 1) * width > max(2 * n_rows, 1 << 16):
        return None
    if base:
        ekeys, bkeys = ekeys - base, bkeys - base
    table = np.full((ranks + 1) * width, -1, dtype=np.int32 if n_rows < 2**31 else np.int64)
    # an op with several end rows: the last one written (the highest row) wins, as in the sorted join
    np.maximum.at(table, (ekeys >> 40) * width + (ekeys & mask), end_rows.astype(table.dtype, copy=False))
    match = table[(bkeys >> 40) * width + (bkeys & mask)].astype(np.int64)
    del table
    return match >= 0, match


def _finish(ops: pd.DataFrame) -> pd.DataFrame:
    """`ops` in (rank, start) order: already so unless clocks stepped back or rows came out of order."""
    r, st = ops["rank"].to_numpy(), ops["start_ns"].to_numpy()
    ordered = len(ops) < 2 or bool(np.all((r[1:] > r[:-1]) | ((r[1:] == r[:-1]) & (st[1:] >= st[:-1]))))
    if not ordered:   # clocks stepped backwards, or rows appended out of order
        ops = ops.sort_values(["rank", "start_ns", "op_id"], kind="stable").reset_index(drop=True)
    return ops


def ops_from_join(events: pd.DataFrame, begin_rows: np.ndarray, match: np.ndarray,
                  found: np.ndarray) -> pd.DataFrame:
    """The ops frame from a begin/end join: `begin_rows` (row of each op's begin in `events`), `match` (its
    end row, -1 for none) and `found` (match >= 0); rows in `begin_rows` order. Shared by `build_ops` and
    the `--follow` reader's incremental join (tui/follow_ops.py)."""
    keep = [c for c in events.columns if c not in ("phase", "status", "message", "time_ns")]
    head = _leading(begin_rows) if copy_on_write() else 0   # the begin rows lead: columns are views

    def column(c: str) -> Any:
        return _view(events[c], head) if head else _take(events[c], begin_rows)

    ops = pd.DataFrame({("start_ns" if c == "t_ns" else c): column(c) for c in keep}, copy=False)
    t = events["t_ns"].to_numpy()
    end_ns = np.where(found, t[np.maximum(match, 0)], -1).astype("int64")
    status = events["status"]
    if not isinstance(status.dtype, pd.CategoricalDtype):
        status = status.astype("category")
    cats = ops_categories("status", [str(c) for c in status.cat.categories])
    codes = status.cat.codes.to_numpy()[np.maximum(match, 0)].astype(np.int32)
    codes = np.where(found, codes, cats.index(STATUS_INFLIGHT))
    ops["end_ns"] = end_ns
    ops["status"] = pd.Categorical.from_codes(codes, categories=cats)
    msg = pd.Series(events["message"].array.take(match, allow_fill=True))
    if isinstance(msg.dtype, pd.CategoricalDtype) and "" not in msg.cat.categories:
        msg = msg.cat.add_categories([""])
    ops["message"] = msg.fillna("")
    ops["duration_ns"] = np.where(found, end_ns - ops["start_ns"].to_numpy(), -1).astype("int64")
    return ops


def _leading(rows: np.ndarray) -> int:
    """len(rows) when `rows` are the frame's first rows in order (0, 1, ..., n-1: the loader puts them first), else 0.
    `rows` come from flatnonzero (strictly increasing), so the last one being n-1 says it."""
    n = len(rows)
    if not n or int(rows[-1]) != n - 1 or int(rows[0]) != 0:
        return 0
    return n if n < 3 or bool(np.all(rows[1:] > rows[:-1])) else 0


def _view(col: pd.Series, n: int) -> pd.Series:
    """The first n values of a column, sharing its buffer (a categorical's codes too): pandas' copy-on-write
    copies either side before a write, so neither frame can change the other."""
    return col.iloc[:n].reset_index(drop=True)


def _take(col: pd.Series, rows: np.ndarray) -> Any:
    """`col.iloc[rows]`'s values (same dtype, categories and order) by a plain numpy gather: pandas' take
    of the 16 M begin rows of a 32 M-row trace, column by column, cost 3.4 s of the load."""
    dtype = col.dtype
    if isinstance(dtype, pd.CategoricalDtype):
        return pd.Categorical.from_codes(col.cat.codes.to_numpy()[rows], dtype=dtype, validate=False)
    if isinstance(dtype, np.dtype) and dtype.kind in "iufb":
        return col.to_numpy()[rows]
    return col.array.take(rows)
