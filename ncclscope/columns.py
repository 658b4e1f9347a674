"""Per-rank tables to compact columns, and the begin/end join that makes `ops`.

Split out of trace.py (the loader): this is the column engine the loader
feeds. Each rank's Arrow tables become numpy columns as soon as they are read
(strings as codes into one dictionary per column shared by all ranks), one
concatenation per column at the end, and `build_ops` joins begin and end rows
by sorted keys. Nothing here reads files.
"""
from __future__ import annotations

from dataclasses import field  # noqa: F401
from pathlib import Path  # noqa: F401
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc  # noqa: F401

from . import schema as S

STATUS_INFLIGHT = "inflight"

# String columns with few distinct values are loaded as categoricals: a
# 10-million-row trace stays a few hundred MB instead of several GB.
_CATEGORICAL = ("phase", "kind", "op_name", "process_group", "input_dtypes", "input_sizes", "reduce_op", "status", "call_site",
                "message", "source")


class _Columns:
    """Per-rank tables in, one pandas frame out, at about one compact copy of memory.

    `add` queues a rank's table; every ~256 k rows the queued ranks are
    turned into numpy columns (strings of few values become codes into one
    dictionary per column, shared by all ranks; null integers -1; other
    strings copied out of the read buffer) and their Arrow read buffers are
    freed: at 16,384 ranks the raw Arrow tables of every rank together would
    be twice the size of the frame. Batching keeps the per-field Python work
    per batch, not per rank (2,048 ranks: 21 s -> 10 s of load). `frame`
    concatenates column by column, dropping each column's pieces as it goes.
    No per-row Python work.
    """

    def __init__(self, schema: pa.Schema) -> None:
        self.schema = schema
        self.parts: dict[str, list[Any]] = {f.name: [] for f in schema}
        self.cats: dict[str, dict[str, int]] = {f.name: {} for f in schema
                                                if f.name in _CATEGORICAL and pa.types.is_string(f.type)}
        self.rows = 0
        self.pending: list[pa.Table] = []
        self.pending_ranks: list[int | None] = []
        self.pending_rows = 0

    BATCH_ROWS = 1 << 18     # ranks are converted in batches: per-field work is paid per batch, not per rank

    def add(self, table: pa.Table, rank: int | None = None) -> None:
        """Queue a table; with `rank`, every row's `rank` is that one (the loader trusts the directory, not
        the rows: `trace.force_rank`), written once per batch instead of a fresh Arrow column per file."""
        self.pending.append(table)
        self.pending_ranks.append(rank)
        self.pending_rows += table.num_rows
        if self.pending_rows >= self.BATCH_ROWS or len(self.pending) >= 512:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        pending, self.pending, self.pending_rows = self.pending, [], 0
        ranks, self.pending_ranks = self.pending_ranks, []
        forced = self.schema.get_field_index("rank") >= 0 and all(r is not None for r in ranks)
        if not forced:     # some table keeps its own ranks: force the others' here, table by table
            pending = [t if r is None or self.schema.get_field_index("rank") < 0 else _force_rank(t, r)
                       for t, r in zip(pending, ranks)]
        counts = [t.num_rows for t in pending]
        try:
            tables = [pa.concat_tables(pending) if len(pending) > 1 else pending[0]]
            rank_cols = [np.repeat(np.asarray(ranks, dtype=np.int32), counts)] if forced else [None]
        except (pa.ArrowInvalid, pa.ArrowTypeError):   # schemas differ in a detail (nullability): one by one
            tables = [conform_table(t, self.schema, Path("."), [], keep_dictionary=True) for t in pending]
            rank_cols = ([np.full(n, r, dtype=np.int32) for n, r in zip(counts, ranks)] if forced
                         else [None] * len(tables))
        del pending
        for table, rank_col in zip(tables, rank_cols):
            self._convert(table, rank_col)

    def _convert(self, table: pa.Table, rank_col: np.ndarray | None = None) -> None:
        for fld, col in zip(self.schema, table.columns):
            name = fld.name
            if rank_col is not None and name == "rank":
                self.parts[name].append(rank_col.astype(np.dtype(fld.type.to_pandas_dtype()), copy=False))
                continue
            # dictionary chunks may each have their own dictionary: _codes reads them one by one
            chunks = col.chunks if (name in self.cats or col.num_chunks <= 1) else [col.combine_chunks()]
            if name in self.cats:
                self.parts[name].append(self._codes(name, chunks))
            elif pa.types.is_integer(fld.type) or pa.types.is_floating(fld.type):
                want = np.dtype(fld.type.to_pandas_dtype())
                fill = -1 if pa.types.is_integer(fld.type) else None
                arrs = [(c.fill_null(fill) if c.null_count and fill is not None else c).to_numpy(zero_copy_only=False)
                        for c in chunks]
                self.parts[name].append(np.concatenate(arrs).astype(want, copy=False) if arrs
                                        else np.empty(0, dtype=want))
            else:   # strings of many values, lists: a fresh Arrow copy (frees the read buffer)
                arr = pa.concat_arrays(chunks) if chunks else pa.array([], type=fld.type)
                if pa.types.is_string(fld.type) and arr.null_count:
                    arr = arr.fill_null("")
                self.parts[name].append(arr)
            del chunks
        self.rows += table.num_rows

    def _codes(self, name: str, chunks: list[pa.Array]) -> np.ndarray:
        if len(chunks) > 1 and not any(pa.types.is_dictionary(c.type) for c in chunks):
            return self._codes_chunked(name, chunks)
        d = self.cats[name]
        out = []
        for c in chunks:
            if not pa.types.is_dictionary(c.type):
                c = pc.dictionary_encode(c)
                values = c.dictionary.to_pylist()
                lut = np.fromiter((d.setdefault("" if v is None else str(v), len(d)) for v in values),
                                  dtype=np.int32, count=len(values))
            else:   # already encoded: register the values it uses, in order of first use, as encoding would
                values = c.dictionary.to_pylist()
                lut = np.zeros(len(values), dtype=np.int32)
                ind = c.indices.to_numpy(zero_copy_only=False) if not c.indices.null_count else \
                    c.indices.drop_null().to_numpy(zero_copy_only=False)
                for i in pd.unique(ind).tolist():
                    v = values[i]
                    lut[i] = d.setdefault("" if v is None else str(v), len(d))
            idx = c.indices
            if idx.null_count:
                lut = np.append(lut, np.int32(d.setdefault("", len(d))))
                idx = idx.fill_null(len(values))
            out.append(lut[idx.to_numpy(zero_copy_only=False)])
        codes = np.concatenate(out) if out else np.empty(0, dtype=np.int32)
        return codes.astype(np.int16) if len(d) < 32_000 else codes

    def _codes_chunked(self, name: str, chunks: list[pa.Array]) -> np.ndarray:
        """`_codes` of many plain-string chunks (one per rank of a batch) in one hashing pass.

        Arrow's dictionary encoding of a chunked array hands every chunk the same dictionary, its values
        in order of first appearance, so the values a chunk adds are one index range; registering each
        chunk's range and then "" (for its nulls) registers the values in the order `_codes` gives them
        chunk by chunk, at one kernel call and one lookup per column instead of one per rank (45 k calls
        at 4,096 ranks)."""
        d = self.cats[name]
        enc = pc.dictionary_encode(pa.chunked_array(chunks))
        values = enc.chunk(0).dictionary.to_pylist() if enc.num_chunks else []
        idx = pa.chunked_array([c.indices for c in enc.chunks], type=pa.int32()).fill_null(-1)
        idx = idx.to_numpy()
        lut = np.empty(len(values) + 1, dtype=np.int32)       # the last slot (index -1) is a null's code
        seen, at = -1, 0
        for c in chunks:
            n = len(c)
            if n:
                top = int(idx[at:at + n].max())
                for i in range(seen + 1, top + 1):
                    v = values[i]
                    lut[i] = d.setdefault("" if v is None else str(v), len(d))
                seen = max(seen, top)
                if c.null_count:
                    lut[-1] = d.setdefault("", len(d))
            at += n
        codes = lut[idx]
        return codes.astype(np.int16) if len(d) < 32_000 else codes

    def frame(self) -> pd.DataFrame:
        self._flush()
        big = self.rows >= (1 << 22)
        cols: dict[str, Any] = {}
        for fld in self.schema:
            parts = self.parts.pop(fld.name)
            if fld.name in self.cats:
                codes = np.concatenate(parts) if parts else np.empty(0, dtype=np.int16)
                parts.clear()
                cats = list(self.cats[fld.name]) or [""]
                cols[fld.name] = pd.Categorical.from_codes(codes, categories=pd.Index(cats))
            elif pa.types.is_integer(fld.type) or pa.types.is_floating(fld.type):
                cols[fld.name] = np.concatenate(parts) if parts else np.empty(0, fld.type.to_pandas_dtype())
            else:
                cols[fld.name] = (pa.chunked_array(parts, type=fld.type) if parts
                                  else pa.array([], type=fld.type)).to_pandas()
            del parts
            if big:          # per column on a big table: its pieces' heap goes back before the next column
                _trim()
        _trim()
        return pd.DataFrame(cols, copy=False)


def _force_rank(table: pa.Table, rank: int) -> pa.Table:
    """`table` with every row's `rank` set to `rank` (trace.force_rank, which re-exports it)."""
    idx = table.schema.get_field_index("rank")
    return table.set_column(idx, "rank", pa.array(np.full(len(table), rank, dtype=np.int32)))


def conform_table(table: pa.Table, schema: pa.Schema, path: Path, warnings: list[str],
                  keep_dictionary: bool = False) -> pa.Table:
    """`table` in `schema`: columns by name (the first of a duplicated name, with
    a warning), cast where the type differs (nulled, with a warning, where the
    cast fails), missing ones null. With `keep_dictionary` (the column engine's
    own input) a dictionary-encoded column of a categorical string field stays
    encoded: `_Columns` reads its codes instead of hashing every string again."""
    cols = []
    names = table.column_names
    for fld in schema:
        idx = [i for i, name in enumerate(names) if name == fld.name]
        if idx:
            if len(idx) > 1:
                warnings.append(f"{path}: column {fld.name} appears {len(idx)} times; using the first")
            col = table.column(idx[0])
            if keep_dictionary and _encoded_string(col.type, fld):
                pass
            elif col.type != fld.type:
                try:
                    col = col.cast(fld.type)
                except (pa.ArrowException, ValueError, TypeError):
                    warnings.append(f"{path}: column {fld.name} has type {col.type}, expected {fld.type}; nulled")
                    col = pa.nulls(len(table), fld.type)
        else:
            col = pa.nulls(len(table), fld.type)
        cols.append(col)
    extra = [n for n in dict.fromkeys(names) if schema.get_field_index(n) < 0]
    if extra:     # an older file only lacks columns; unknown ones next to missing ones mean a renamed column
        missing = [f.name for f in schema if f.name not in names]
        warnings.append(f"{path}: unknown column(s) {', '.join(n[:40] for n in extra[:5])} ignored"
                        + (f"; missing {', '.join(missing[:5])} read as null" if missing else ""))
    if keep_dictionary and any(c.type != f.type for c, f in zip(cols, schema)):
        return pa.Table.from_arrays(cols, schema=pa.schema([f.with_type(c.type) for c, f in zip(cols, schema)],
                                                           metadata=schema.metadata))
    return pa.Table.from_arrays(cols, schema=schema)


def _encoded_string(typ: pa.DataType, fld: pa.Field) -> bool:
    return (fld.name in _CATEGORICAL and pa.types.is_string(fld.type) and pa.types.is_dictionary(typ)
            and pa.types.is_string(typ.value_type))


def _columns(tables: "list[pa.Table] | _Columns | None", schema: pa.Schema) -> _Columns:
    """A _Columns from a list of tables, consuming (emptying) the list as it goes."""
    if isinstance(tables, _Columns):
        return tables
    out = _Columns(schema)
    for i in range(len(tables or [])):
        t, tables[i] = tables[i], None
        out.add(conform_table(t, schema, Path("."), [], keep_dictionary=True) if t.schema != schema else t)
        del t
    if tables:
        tables.clear()
    return out


def _aligned(times: np.ndarray, ranks: np.ndarray, offsets: dict[int, int]) -> np.ndarray:
    """times + each row's rank's clock offset, by table lookup (ranks are small non-negative ints here)."""
    if not len(times):
        return times.astype(np.int64)
    lo, hi = int(ranks.min()), int(ranks.max())
    if lo >= 0 and hi < (1 << 24):
        lut = np.zeros(hi + 1, dtype=np.int64)
        for r, off in offsets.items():
            if 0 <= r <= hi:
                lut[r] = off
        return times + lut[ranks]
    return times + pd.Series(ranks).map(pd.Series(offsets, dtype="int64")).fillna(0).astype("int64").to_numpy()


def _fill_ints(df: pd.DataFrame, schema: pa.Schema) -> pd.DataFrame:
    """Integer columns in their schema dtype (a no-op after `_Columns.frame`)."""
    for fld in schema:
        if pa.types.is_integer(fld.type):
            want = np.dtype(fld.type.to_pandas_dtype())
            col = df[fld.name]
            if col.dtype != want:
                df[fld.name] = col.fillna(-1).astype(want) if col.isna().any() else col.astype(want)
    return df


def _equals(col: pd.Series, value: str) -> np.ndarray:
    """col == value as a bool array; on a categorical through its codes (no object array of 10M strings)."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        cats = col.cat.categories
        if value not in cats:
            return np.zeros(len(col), dtype=bool)
        return col.cat.codes.to_numpy() == cats.get_loc(value)
    return (col == value).to_numpy(dtype=bool)


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


def _trim() -> None:
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
    is_begin = _equals(events["phase"], S.PHASE_BEGIN)
    is_end = _equals(events["phase"], S.PHASE_END)
    key = (events["rank"].to_numpy().astype(np.int64) << 40) | (events["op_id"].to_numpy() & ((1 << 40) - 1))
    end_rows = np.flatnonzero(is_end)
    order = np.argsort(key[end_rows], kind="stable")
    ekeys = key[end_rows][order]
    last = np.r_[ekeys[1:] != ekeys[:-1], True] if len(ekeys) else np.zeros(0, dtype=bool)
    ekeys, erows = ekeys[last], end_rows[order][last]
    begin_rows = np.flatnonzero(is_begin)
    bkeys = key[begin_rows]
    if len(ekeys):
        pos = np.minimum(np.searchsorted(ekeys, bkeys), len(ekeys) - 1)
        found = ekeys[pos] == bkeys
        match = np.where(found, erows[pos], -1)
    else:
        found = np.zeros(len(bkeys), dtype=bool)
        match = np.full(len(bkeys), -1)
    # free the join's temporaries before the begin rows are copied: at 32 M rows they are ~1.5 GB
    del key, end_rows, order, ekeys, erows, bkeys, last, is_begin, is_end
    if "pos" in locals():
        del pos
    ops = ops_from_join(events, begin_rows, match, found)
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
    ops = events[keep].iloc[begin_rows].rename(columns={"t_ns": "start_ns"}).reset_index(drop=True)
    t = events["t_ns"].to_numpy()
    end_ns = np.where(found, t[np.maximum(match, 0)], -1).astype("int64")
    status = events["status"]
    if not isinstance(status.dtype, pd.CategoricalDtype):
        status = status.astype("category")
    cats = [str(c) for c in status.cat.categories]
    if STATUS_INFLIGHT not in cats:
        cats.append(STATUS_INFLIGHT)
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
