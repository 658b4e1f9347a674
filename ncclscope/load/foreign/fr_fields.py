"""Which fields of a Flight Recorder entry the reader takes, and how it takes them: `fields` transposes a
dump's entry dicts into one tuple per field with C-level passes (one itemgetter call per entry), falling
back to a tolerant per-entry path for anything torch would not write. `fr_entries.Entries` codes the
result into columns."""
from __future__ import annotations

import operator
from itertools import repeat
from typing import Any

__all__ = ["KEYS", "OPTIONAL", "ALL_KEYS", "fields"]

# p2p_seq_id keys a coalesced p2p block (the p2p sequence itself is recounted); a dump without it takes the
# tolerant path, as it always did
KEYS = ("record_id", "process_group", "collective_seq_id", "p2p_seq_id", "profiling_name", "input_sizes",
        "input_dtypes", "state", "time_created_ns", "time_discovered_started_ns", "time_discovered_completed_ns",
        "timeout_ms", "is_p2p", "thread_id")
# fields a 2.x dump may lack (outputs came with 2.2, thread_name with 2.9; a JSON dump has no frames; pg_id,
# the recording process's own number of the group): read where present, None where not, without sending the
# whole dump down the tolerant path
OPTIONAL = ("frames", "output_sizes", "output_dtypes", "thread_name", "pg_id")
ALL_KEYS = KEYS + OPTIONAL
_GET_ALL = operator.itemgetter(*ALL_KEYS)


def fields(entries: list[Any], fast: bool = True) -> dict[str, Any]:
    """ALL_KEYS -> the values of that field, one per entry. `fast`: one C call per entry and
    one transpose when every entry is a dict with every key (format 2.10 as torch writes
    it; a JSON dump, or an older 2.x one, without some OPTIONAL keys: one C pass per optional key);
    else, or when that fails, the tolerant path: non-dict entries skipped, a missing
    key None, `seq_id` where an older format has no `collective_seq_id`."""
    if fast:
        for keys in (ALL_KEYS, KEYS):
            try:
                cols = list(zip(*map(_own_keys_getter(entries, keys), entries)))
            except (KeyError, TypeError, IndexError):
                continue
            if not cols:
                return {k: () for k in ALL_KEYS}
            out = dict(zip(keys, cols))
            for k in ALL_KEYS[len(keys):]:                    # C-level: dict.get over the entries
                out[k] = list(map(dict.get, entries, repeat(k)))
            return out
    rows = [e for e in entries if isinstance(e, dict)]
    out = {k: [e.get(k) for e in rows] for k in ALL_KEYS}
    seq = out["collective_seq_id"]
    for i, e in enumerate(rows):
        if seq[i] is None:
            seq[i] = e.get("seq_id")
    return out


def _own_keys_getter(entries: list[Any], keys: tuple[str, ...] = ALL_KEYS) -> operator.itemgetter:
    """An itemgetter of `keys` with the first entry's own key objects. A dump's entries share their key strings
    (the pickle memo, json's key memo), so each lookup then matches by identity, without comparing the
    text of a key that is equal but another object (~5% of reading the entries)."""
    first = entries[0] if entries else None
    if type(first) is not dict:
        return _GET_ALL if keys is ALL_KEYS else operator.itemgetter(*keys)
    own = {k: k for k in first if type(k) is str}
    return operator.itemgetter(*[own.get(k, k) for k in keys])
