"""One table of a followed run (events, metrics or samples), extended batch by batch (`--follow`).

`trace.assemble` turns every rank's whole table into compact columns on each
call (`columns.Columns`: strings become codes into one dictionary per
column). Here only the appended rows are converted, by one `Columns` kept for
the whole follow, so a string keeps the code it was first given; each rank
keeps its converted chunks, and a poll's frame is one concatenation per column
in rank order, as `assemble` builds it.

Category order. A full build numbers the values of a string column in the
order they first appear in the rank-ordered concatenation (value by value
within an Arrow chunk, i.e. a record batch; a chunk's nulls read as "" after
its values). Appends break that order (rank 0's new value may be one rank 3
showed two polls ago), so each rank records, per code, where the value first
appears in it (row 2i; a null of the batch ending at row j: 2j+1), and the
frame's categories are the codes sorted by (rank, that position): the order
a full build gives, with no string hashed twice. The frame itself is made by
`Columns.frame` (fed the remapped codes), so dtypes are its own.

Uses `columns.Columns` and its `flush`/`parts`/`cats`/`rows` on purpose: the
conversion and the frame are exactly the loader's, nothing is copied.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from ncclscope.load.columns import Columns

_ABSENT = np.iinfo(np.int64).max
_RANK_SHIFT = 42                      # position keys: rank index << 42 | position in the rank (2 * row + null bit)


@dataclass
class _RankCols:
    rows: int = 0
    chunks: dict[str, list[Any]] = field(default_factory=dict)    # column -> converted chunks (codes for strings)
    first: dict[str, np.ndarray] = field(default_factory=dict)    # string column -> first position per code


class LiveTable:
    """Per-rank converted rows of one schema; `append` the new rows, `frame` the whole table."""

    def __init__(self, schema: pa.Schema) -> None:
        self.schema = schema
        self.conv = Columns(schema)          # kept for the whole follow: codes never change
        self.cat_names = list(self.conv.cats)
        self.ranks: dict[int, _RankCols] = {}

    def reset(self, rank: int) -> None:
        """Forget a rank (its file was recreated): its rows are appended again from the start."""
        self.ranks.pop(rank, None)

    def rows(self, rank: int) -> int:
        rc = self.ranks.get(rank)
        return rc.rows if rc is not None else 0

    def append(self, deltas: dict[int, list[tuple[pa.Table, list[int]]]]) -> dict[int, tuple[int, dict[str, Any]]]:
        """Convert each rank's new tables (in the schema; with their record-batch lengths) and keep them.

        Returns rank -> (first new row in the rank, the new rows' converted columns)."""
        order = [r for r in sorted(deltas) if any(t.num_rows for t, _ in deltas[r])]
        if not order:
            return {}
        spans, tables = [], []
        for r in order:
            n = sum(t.num_rows for t, _ in deltas[r])
            spans.append(n)
            tables += [t for t, _ in deltas[r] if t.num_rows]
        # one table, one chunk per column: the converter's per-chunk work is paid once per poll, not per batch
        # (which values get which code does not matter here: the frame's order comes from _positions)
        self.conv.add(pa.concat_tables(tables).combine_chunks() if len(tables) > 1 else tables[0])
        self.conv.flush()
        converted: dict[str, Any] = {}
        for name, parts in self.conv.parts.items():
            if name in self.conv.cats:
                converted[name] = np.concatenate([p.astype(np.int32, copy=False) for p in parts])
            elif parts and isinstance(parts[0], np.ndarray):
                converted[name] = np.concatenate(parts)
            else:
                converted[name] = pa.concat_arrays(parts)
            parts.clear()
        self.conv.rows = 0
        out: dict[int, tuple[int, dict[str, Any]]] = {}
        rcs = [self.ranks.setdefault(r, _RankCols(chunks={f.name: [] for f in self.schema})) for r in order]
        self._positions(rcs, spans, converted, [deltas[r] for r in order])
        at = 0
        for r, rc, n in zip(order, rcs, spans):
            mine = {name: col[at:at + n] for name, col in converted.items()}
            for name, col in mine.items():
                rc.chunks[name].append(col)
                if len(rc.chunks[name]) > 16:          # bounded chunk count on a long follow
                    rc.chunks[name] = [_concat(rc.chunks[name])]
            out[r] = (rc.rows, mine)
            rc.rows += n
            at += n
        return out

    def _positions(self, rcs: list[_RankCols], spans: list[int], converted: dict[str, Any],
                   tables: list[list[tuple[pa.Table, list[int]]]]) -> None:
        """Record, per rank and code, the first position of its value in the rank (module docstring):
        one sort per column over all the new rows, not one per rank."""
        slot = np.repeat(np.arange(len(rcs), dtype=np.int64), spans)
        starts = np.repeat(np.asarray([rc.rows for rc in rcs], dtype=np.int64) - np.cumsum([0] + spans[:-1]), spans)
        row = np.arange(len(slot), dtype=np.int64) + starts              # row number within its rank
        flat = [(t, lengths) for per_rank in tables for t, lengths in per_rank if t.num_rows]
        for name in self.cat_names:
            codes = converted[name].astype(np.int64)
            pos = 2 * row
            if any(t.column(name).null_count for t, _ in flat):           # a null reads as "" after its batch
                isnull = np.concatenate([t.column(name).is_null().to_numpy(zero_copy_only=False) for t, _ in flat])
                lens = [b for _, lengths in flat for b in lengths]
                last = np.repeat(np.cumsum(lens) - 1, lens)                 # last row of each batch (all new rows)
                pos = np.where(isnull, 2 * (last + starts) + 1, pos)
            ncodes = len(self.conv.cats[name])
            key = slot * ncodes + codes
            order = np.lexsort((pos, key))
            k = key[order]
            head = np.r_[True, k[1:] != k[:-1]] if len(k) else np.zeros(0, dtype=bool)
            k, p = k[head], pos[order][head]
            s_of, c_of = k // ncodes, k % ncodes
            bounds = np.searchsorted(s_of, np.arange(len(rcs) + 1))
            for i, rc in enumerate(rcs):
                a, b = bounds[i], bounds[i + 1]
                if a == b:
                    continue
                first = rc.first.get(name)
                if first is None or len(first) < ncodes:
                    grown = np.full(ncodes, _ABSENT, dtype=np.int64)
                    if first is not None:
                        grown[:len(first)] = first
                    first = rc.first[name] = grown
                idx = c_of[a:b]
                first[idx] = np.minimum(first[idx], p[a:b])

    def frame(self, ranks: list[int]) -> pd.DataFrame:
        """The whole table over `ranks` (sorted), as `assemble` builds it from the same rows."""
        ranks = [r for r in ranks if r in self.ranks and self.ranks[r].rows]
        out = Columns(self.schema)
        for name in out.parts:
            pieces = [c for r in ranks for c in self.ranks[r].chunks[name]]
            if name in out.cats:                       # codes in this poll's category order; frame() concatenates
                lut, cats = self._order(name, ranks)
                out.parts[name] = [lut[p] for p in pieces]
                out.cats[name] = {c: i for i, c in enumerate(cats)}
            else:
                out.parts[name] = pieces
        out.rows = sum(self.ranks[r].rows for r in ranks)
        return out.frame()

    def _order(self, name: str, ranks: list[int]) -> tuple[np.ndarray, list[str]]:
        """(registration code -> frame code, the frame's categories in first-appearance order)."""
        values = list(self.conv.cats[name])
        key = np.full(len(values), _ABSENT, dtype=np.int64)
        for i, r in enumerate(ranks):
            first = self.ranks[r].first.get(name)
            if first is None:
                continue
            k = np.where(first < _ABSENT, (np.int64(i) << _RANK_SHIFT) + first, _ABSENT)
            key[:len(k)] = np.minimum(key[:len(k)], k)
        used = np.flatnonzero(key < _ABSENT)
        used = used[np.argsort(key[used], kind="stable")]
        lut = np.full(len(values), -1, dtype=np.int32)
        lut[used] = np.arange(len(used), dtype=np.int32)
        return lut, [values[i] for i in used]


def _concat(parts: list[Any]) -> Any:
    return np.concatenate(parts) if isinstance(parts[0], np.ndarray) else pa.concat_arrays(parts)
