"""Resident memory of a big Flight Recorder trace: what the loader does so that a 1,024-rank job's dumps
(2 M entries, 4 M event rows) load and analyse in about 1 GB.

Two things, neither of which changes a value any analysis reads (the trace after them is
value for value the one `assemble` built; ~230 MB of the tables at 1,024 ranks x 2,000 entries).
(A third, fixing glibc's mmap threshold so that freed column temporaries left the resident set, is
gone: every mapped block was fresh pages to fault in, 1.01 M page faults against 0.31 M at 1,024
ranks, ~1.5-3 s of CPU, for 30-60 MiB of peak; the heap now reuses the freed temporaries.)

- `share_equal_columns`: a dump records no steps, microbatches, stages or chunks and no clock offsets,
  so `step`, `microbatch`, `stage` and `chunk` are one array of -1 four times over, and `t_ns` a copy
  of `time_ns`. pandas' copy-on-write lets the columns share one buffer (a write to one copies it
  first), which at 4 M event rows and 2 M ops is ~100 MB of the ~600 MB the tables hold.
- `share_begin_rows`: the loader writes every begin row first, in the order `build_ops` keeps its ops
  (rank, then entry order), so an op's rank, op_id, sequence ids, peer, tag, bytes, timeout and start
  are the first rows of the event columns again; the numeric ops columns that equal them become views
  of those rows (another ~130 MB at 2 M ops). Checked column by column, value for value.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import numpy as np
import pandas as pd

if TYPE_CHECKING:
    from ..trace import Trace

__all__ = ["share_equal_columns", "share_begin_rows", "slim_tables"]

_PER_STEP = ("step", "microbatch", "stage", "chunk")
_FROM_BEGIN = tuple((c, c) for c in ("rank", "op_id", "collective_seq_id", "p2p_seq_id", "peer", "tag", "bytes",
                                     "timeout_ms") + _PER_STEP) + (("start_ns", "t_ns"),)   # numeric columns


def _copy_on_write() -> bool:
    """Whether pandas copies a shared buffer before a write (always from pandas 3; an option before):
    without it a write to one column would show in the columns sharing its buffer."""
    if int(pd.__version__.split(".")[0]) >= 3:
        return True
    try:
        return bool(pd.options.mode.copy_on_write)
    except (AttributeError, KeyError):
        return False


def slim_tables(trace: "Trace") -> "Trace":
    """The trace with its equal columns sharing buffers (module docstring); the same values. Nothing
    is shared where pandas does not copy on write."""
    if not _copy_on_write():
        return trace
    share_equal_columns(trace.events, (_PER_STEP, ("time_ns", "t_ns")))     # no steps, no clock offsets
    share_begin_rows(trace.events, trace.ops, _FROM_BEGIN)                 # the begin rows are written first
    share_equal_columns(trace.ops, (_PER_STEP,))
    return trace


def share_equal_columns(df: pd.DataFrame, groups: Iterable[tuple[str, ...]]) -> int:
    """Within each group of column names, point every column whose values and dtype equal the group's
    first column's at that column's buffer. Returns the bytes no longer held twice. A column that
    differs (or is absent) keeps its own buffer: the frame reads exactly as before."""
    saved = 0
    for names in groups:
        names = tuple(n for n in names if n in df.columns)
        if len(names) < 2:
            continue
        first = df[names[0]]
        base = first.to_numpy()
        for name in names[1:]:
            col = df[name]
            if col.dtype != first.dtype or not isinstance(col.dtype, np.dtype):
                continue
            arr = col.to_numpy()
            if np.shares_memory(arr, base) or not np.array_equal(arr, base):
                continue
            saved += arr.nbytes
            df[name] = first
    return saved


def _same(a: pd.Series, b: pd.Series) -> bool:
    """Equal numeric dtype and equal values (other columns are small codes: not worth sharing)."""
    if a.dtype != b.dtype or len(a) != len(b):
        return False
    if not isinstance(a.dtype, np.dtype) or a.dtype.kind not in "biuf":
        return False
    return bool(np.array_equal(a.to_numpy(), b.to_numpy()))


def share_begin_rows(events: pd.DataFrame, ops: pd.DataFrame, pairs: Iterable[tuple[str, str]]) -> int:
    """Make each ops column of `pairs` (ops column, events column) that equals the first len(ops) rows
    of its events column a view of them; returns the bytes no longer held twice. Nothing happens unless
    the events' first len(ops) rows are the ops' begin rows in the ops' order (same rank and op_id row
    for row)."""
    n = len(ops)
    if not n or len(events) < n or not isinstance(events.index, pd.RangeIndex) \
            or not isinstance(ops.index, pd.RangeIndex) or events.index.start != 0 or ops.index.start != 0:
        return 0
    head = events.iloc[:n]
    if not (_same(ops["rank"], head["rank"].reset_index(drop=True))
            and _same(ops["op_id"], head["op_id"].reset_index(drop=True))):
        return 0
    saved = 0
    for op_col, ev_col in pairs:
        if op_col not in ops.columns or ev_col not in events.columns:
            continue
        view = events[ev_col].iloc[:n]
        if _same(ops[op_col], view.reset_index(drop=True)):
            saved += int(ops[op_col].memory_usage(index=False, deep=False))
            ops[op_col] = view.rename(op_col)
    return saved
