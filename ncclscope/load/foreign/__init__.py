"""Readers for traces other tools wrote (Flight Recorder dumps, profiler traces).

Every reader ends in `ncclscope.load.trace.assemble`, so the analyses see one shape
whatever the source. Entry point: `load_any(path)` (see `detect.py`).

Modules: `detect` (what is this input, by content), `vocab` (the names both
readers share), `fr_read` / `fr_entries` / `fr_fixups` / `flight_recorder` /
`fr_groups` (Flight Recorder dumps: reading, entries to columns, the gloo and
ring-buffer fix-ups, building the Trace, its group table),
`prof_read` / `prof_rows` / `profiler` (profiler traces likewise),
`safe_pickle` (the restricted unpickler). Every file is read through
`ncclscope.load.safe_io`. Import order is one way: detect -> readers -> vocab.
"""
from __future__ import annotations

from typing import Any

from ncclscope.load.foreign.vocab import (P2P_OPS, GroupNamer, coded, dtype_itemsize, events_table, group_kind, normalize_dtype,
                    normalize_op, parse_ranks)

__all__ = ["load_any", "normalize_dtype", "dtype_itemsize", "normalize_op", "group_kind", "GroupNamer",
           "events_table", "coded", "parse_ranks", "P2P_OPS"]


def load_any(path: Any, engine: Any = None, world_size: int | None = None, ops_only: bool = False) -> Any:
    """Load a run directory, a Flight Recorder dump directory or a profiler trace directory (`engine`: on
    its workers, ncclscope.engine; `world_size`: the job's ranks, for Flight Recorder dumps)."""
    from ncclscope.load.foreign.detect import load_any as _load_any
    return _load_any(path, engine=engine, world_size=world_size, ops_only=ops_only)
