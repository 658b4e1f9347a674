"""The analyzer process's heap: what keeps its resident set near the tables it holds.

`no_hugepages` and `trim` are process-wide and idempotent; callers are the loader (`trace.assemble`, the
Flight Recorder builder) and the index (`index.views`), each where big temporaries have just been
freed. `copy_on_write` says whether frames may share column buffers (the ops columns as views of the
begin rows, a dump's equal columns).
"""
from __future__ import annotations

from typing import Any

import pandas as pd

__all__ = ["copy_on_write", "no_hugepages", "trim"]


def no_hugepages() -> None:
    """Stop numpy asking for transparent huge pages on its big arrays (`madvise(MADV_HUGEPAGE)`, numpy's
    default on Linux): the analyzer makes one fresh array of tens of MB per column and per temporary, and
    on a host whose memory is fragmented each huge-page fault can stall in the kernel's compaction.
    Measured on the 4,096-rank benchmark (10.4 M events, 2-core box): the column concatenation 2.0 -> 0.9 s
    CPU and the begin/end join 1.7-2.3 -> 1.0-1.2 s; the peak resident set did not move. Process-wide and
    idempotent; a numpy without the switch is left as it is."""
    try:
        from numpy._core.multiarray import _set_madvise_hugepage
    except ImportError:
        try:
            from numpy.core.multiarray import _set_madvise_hugepage   # numpy < 2
        except ImportError:
            return
    try:
        _set_madvise_hugepage(False)
    except (TypeError, ValueError, RuntimeError):
        pass


def trim() -> None:
    """Give freed heap memory back to the OS (glibc keeps small freed blocks otherwise, and peak RSS
    would count the per-rank pieces a second time). A no-op elsewhere."""
    global _LIBC
    if _LIBC is None:
        try:
            import ctypes
            _LIBC = ctypes.CDLL("libc.so.6")
            _LIBC.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC.malloc_trim(0)


_LIBC: Any = None


def copy_on_write() -> bool:
    """Whether pandas copies a shared buffer before a write (always from pandas 3; an option before):
    without it a write to one column would show in every column or frame sharing its buffer."""
    if int(pd.__version__.split(".")[0]) >= 3:
        return True
    try:
        return bool(pd.options.mode.copy_on_write)
    except (AttributeError, KeyError):
        return False
