"""`TraceError`: the input cannot be analyzed at all (not a run directory, no rank data, not a dump).

A leaf module (it imports nothing of ncclscope), so that the loader
(`trace.py`), its Flight Recorder merge step (`load/fr_merge.py`) and the
dump readers (`fr_read.py`, `safe_pickle.py`) can all raise it without
importing each other: `trace.load -> fr_merge -> fr_read` and
`load.foreign.detect -> load.trace` are one-way chains, not a cycle. `ncclscope.load.trace`
re-exports it; `from ncclscope.load.trace import TraceError` is the same class.
"""
from __future__ import annotations


class TraceError(Exception):
    """The input cannot be analyzed at all (not a run directory, no rank data)."""
