"""Resident memory of a big Flight Recorder trace: what the loader does so that a 1,024-rank job's dumps
(2 M entries, 4 M event rows) load and analyse in about 1 GB.

What it does changes no value any analysis reads (the trace after it is value for value the one
`assemble` built).
(Fixing glibc's mmap threshold so that freed column temporaries left the resident set is gone: every
mapped block was fresh pages to fault in, 1.01 M page faults against 0.31 M at 1,024 ranks, ~1.5-3 s
of CPU, for 30-60 MiB of peak; the heap now reuses the freed temporaries. Sharing the ops columns with
the begin rows is no longer done here: every trace's loader does it, `columns.Columns.frame(lead=...)`.)

- `share_equal_columns`: a dump records no steps, microbatches, stages or chunks and no clock offsets,
  so `step`, `microbatch`, `stage` and `chunk` are one array of -1 four times over (`t_ns` is
  `time_ns` already: `trace.assemble` shares them when no rank has a clock offset). pandas'
  copy-on-write lets the columns share one buffer (a write to one copies it first): ~70 MB at 4 M
  event rows and 2 M ops.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import numpy as np
import pandas as pd

from ncclscope.load.heap import copy_on_write

if TYPE_CHECKING:
    from ncclscope.load.trace import Trace

__all__ = ["share_equal_columns", "slim_tables"]

_PER_STEP = ("step", "microbatch", "stage", "chunk")


def slim_tables(trace: "Trace") -> "Trace":
    """The trace with its equal columns sharing buffers (module docstring); the same values. Nothing
    is shared where pandas does not copy on write."""
    if not copy_on_write():
        return trace
    share_equal_columns(trace.events, (_PER_STEP,))                        # no steps, microbatches, ...
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

