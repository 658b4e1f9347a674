"""Per-rank tables to compact columns.

Split out of trace.py (the loader): this is the column engine the loader
feeds. Each rank's Arrow tables become numpy columns as soon as they are read
(strings as codes into one dictionary per column shared by all ranks), one
concatenation per column at the end; `opsjoin.build_ops` then joins begin and
end rows. Nothing here reads files.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from ncclscope.load.heap import trim

# String columns with few distinct values are loaded as categoricals: a
# 10-million-row trace stays a few hundred MB instead of several GB.
_CATEGORICAL = ("phase", "kind", "op_name", "process_group", "input_dtypes", "input_sizes", "reduce_op", "status", "call_site",
                "message", "source")


class Columns:
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
            self.flush()

    def flush(self) -> None:
        """Convert the queued tables now (`add` does so every BATCH_ROWS rows; `frame` at the end). Public
        for the live follower (tui/follow_tables.LiveTable), which reads `parts` right after each poll."""
        if not self.pending:
            return
        pending, self.pending, self.pending_rows = self.pending, [], 0
        ranks, self.pending_ranks = self.pending_ranks, []
        has_rank = self.schema.get_field_index("rank") >= 0
        forced = has_rank and all(r is not None for r in ranks)
        if not forced:     # some table keeps its own ranks: force the others' here, table by table
            pending = [self._filled(t) for t in pending]
            pending = [t if r is None or not has_rank else force_rank(t, r) for t, r in zip(pending, ranks)]
        counts = [t.num_rows for t in pending]
        rank_all = np.repeat(np.asarray(ranks, dtype=np.int32), counts) if forced else None
        pending = self._runs(pending)      # tables missing the same columns: filled once per run
        try:
            tables = [pa.concat_tables(pending) if len(pending) > 1 else pending[0]]
            rank_cols = [rank_all]
        except (pa.ArrowInvalid, pa.ArrowTypeError):   # schemas differ in a detail (nullability): one by one
            tables = [conform_table(t, self.schema, Path("."), [], keep_dictionary=True) for t in pending]
            ends = np.cumsum([t.num_rows for t in tables])
            rank_cols = ([rank_all[e - t.num_rows:e] for e, t in zip(ends, tables)] if forced
                         else [None] * len(tables))
        del pending
        for table, rank_col in zip(tables, rank_cols):
            self._convert(table, rank_col)

    def _filled(self, table: pa.Table) -> pa.Table:
        """`table` in the schema when it only lacks columns (the loader leaves those to this engine)."""
        if table.schema.equals(self.schema) or not missing_only(table.schema, self.schema):
            return table
        return conform_table(table, self.schema, Path("."), [], keep_dictionary=True)

    def _runs(self, tables: list[pa.Table]) -> list[pa.Table]:
        """Consecutive tables of one schema that only lacks columns (`missing_only`: every rank's metrics of
        an older writer) become one table in the schema: one fill per run, not one per file (16,384 ranks:
        4 s). Other tables are passed on as they are; rows keep their order."""
        if all(t.schema.equals(self.schema) for t in tables):
            return tables
        out: list[pa.Table] = []
        i = 0
        while i < len(tables):
            t = tables[i]
            j = i + 1
            if not t.schema.equals(self.schema) and missing_only(t.schema, self.schema):
                while j < len(tables) and tables[j].schema.equals(t.schema):
                    j += 1
                run = pa.concat_tables(tables[i:j]) if j - i > 1 else t
                out.append(conform_table(run, self.schema, Path("."), [], keep_dictionary=True))
            else:
                out.append(t)
            i = j
        return out

    def _convert(self, table: pa.Table, rank_col: np.ndarray | None = None) -> None:
        for fld, col in zip(self.schema, table.columns):
            name = fld.name
            if rank_col is not None and name == "rank":
                self.parts[name].append(rank_col.astype(np.dtype(fld.type.to_pandas_dtype()), copy=False))
                continue
            # combine_chunks, not ChunkedArray.to_numpy: the latter's fresh numpy heap cost more page faults
            # and ~200 MB more peak at 4,096 ranks (measured); this keeps the parts in Arrow's pool
            numeric = pa.types.is_integer(fld.type) or pa.types.is_floating(fld.type)
            # dictionary chunks may each have their own dictionary: _codes reads them one by one
            chunks = col.chunks if (name in self.cats or col.num_chunks <= 1) else [col.combine_chunks()]
            if name in self.cats:
                self.parts[name].append(self._codes(name, chunks))
            elif numeric:
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
        col = pa.concat_arrays(chunks)       # one copy of small strings; then one encode, indices without a copy
        enc = pc.dictionary_encode(col)
        values = enc.dictionary.to_pylist()
        idx = enc.indices
        idx = (idx.fill_null(-1) if idx.null_count else idx).to_numpy(zero_copy_only=False)
        lut = np.empty(len(values) + 1, dtype=np.int32)       # the last slot (index -1) is a null's code
        # chunk by chunk, the values come in dictionary order, and "" after the values of the first chunk
        # that has a null: register in that order, in one pass (no loop over the 16,384 chunks)
        head = len(values)
        if col.null_count:
            first_null = int(np.argmax(idx < 0))
            ends = np.cumsum([len(c) for c in chunks])
            end = int(ends[int(np.searchsorted(ends, first_null, side="right"))])
            head = int(idx[:end].max()) + 1
        for i in range(head):
            v = values[i]
            lut[i] = d.setdefault("" if v is None else str(v), len(d))
        if col.null_count:
            lut[-1] = d.setdefault("", len(d))
        for i in range(head, len(values)):
            v = values[i]
            lut[i] = d.setdefault("" if v is None else str(v), len(d))
        return (lut.astype(np.int16) if len(d) < 32_000 else lut)[idx]     # one gather, in the final width

    def frame(self, lead: tuple[str, str] | None = None) -> pd.DataFrame:
        """The frame, column by column. With `lead` (a categorical column and one of its values: the events'
        ("phase", "begin")), the rows holding that value come first, then the others, each part in its own
        order: `opsjoin.build_ops` then finds the begin rows as the frame's first rows and makes the ops
        columns views of them, not a second copy (1,024 ranks, 10 M events: ~330 MB of peak). One gather
        per column, which the ops frame no longer makes; a frame already in that order (Flight Recorder
        dumps write their begin rows first) is concatenated as it is."""
        self.flush()
        big = self.rows >= (1 << 22)
        order = self._lead_order(*lead) if lead else None
        cols: dict[str, Any] = {}
        for fld in self.schema:
            parts = self.parts.pop(fld.name)
            if fld.name in self.cats:
                codes = _joined(parts, order, np.int16)
                parts.clear()
                cats = list(self.cats[fld.name]) or [""]
                # codes are this engine's own (every one < len(cats)): no validating pass over 32 M of them
                cols[fld.name] = pd.Categorical.from_codes(codes, categories=pd.Index(cats), validate=False)
            elif pa.types.is_integer(fld.type) or pa.types.is_floating(fld.type):
                cols[fld.name] = _joined(parts, order, fld.type.to_pandas_dtype())
            else:
                if order is not None and parts:
                    parts = [order.take(parts)]
                cols[fld.name] = (pa.chunked_array(parts, type=fld.type) if parts
                                  else pa.array([], type=fld.type)).to_pandas()
            del parts
            if big:          # per column on a big table: its pieces' heap goes back before the next column
                trim()
        trim()
        return pd.DataFrame(cols, copy=False)

    def _lead_order(self, name: str, value: str) -> "_Order | None":
        """Per piece, the positions of its rows holding `value` in column `name` and of the others; None
        where the rows are in that order already (no such row, only such rows, or they lead)."""
        code = self.cats.get(name, {}).get(value)
        if code is None or not self.parts[name]:
            return None
        hits = [p == code for p in self.parts[name]]
        whole = np.concatenate(hits)
        n = int(np.count_nonzero(whole))
        if n == 0 or n == len(whole) or bool(whole[:n].all()):
            return None
        del whole
        # int64 positions: numpy's gather with int32 ones converts them first (10 M rows: 104 vs 27 ms)
        return _Order(n, [(np.flatnonzero(h), np.flatnonzero(~h)) for h in hits])


class _Order:
    """Where `Columns.frame(lead=...)` puts each piece's rows: the leading ones in [0, n), the others after."""

    def __init__(self, n: int, pieces: list[tuple[np.ndarray, np.ndarray]]) -> None:
        self.n, self.pieces = n, pieces

    def take(self, parts: list[Any]) -> Any:
        """The pieces in this order: one gather per piece straight into the output (no concatenation)."""
        if isinstance(parts[0], np.ndarray):
            out = np.empty(sum(len(p) for p in parts), dtype=np.result_type(*parts))
            a, b = 0, self.n
            for p, (lead, rest) in zip(parts, self.pieces):     # positions in range by construction:
                np.take(p, lead, out=out[a:a + len(lead)], mode="clip")     # "clip" skips numpy's buffered
                np.take(p, rest, out=out[b:b + len(rest)], mode="clip")     # bounds check (half the time)
                a, b = a + len(lead), b + len(rest)
            return out
        return pa.concat_arrays([p.take(pa.array(lead)) for p, (lead, _) in zip(parts, self.pieces)]
                                + [p.take(pa.array(rest)) for p, (_, rest) in zip(parts, self.pieces)])


def _joined(parts: list[np.ndarray], order: _Order | None, empty_dtype: Any) -> np.ndarray:
    """The pieces as one array, in `order` where one is given."""
    if not parts:
        return np.empty(0, dtype=empty_dtype)
    if order is not None:
        return order.take(parts)
    return np.concatenate(parts) if len(parts) > 1 else parts[0]


def force_rank(table: pa.Table, rank: int) -> pa.Table:
    """`table` with every row's `rank` set to `rank` (trace.force_rank, which re-exports it)."""
    idx = table.schema.get_field_index("rank")
    return table.set_column(idx, "rank", pa.array(np.full(len(table), rank, dtype=np.int32)))


def conform_table(table: pa.Table, schema: pa.Schema, path: Path, warnings: list[str],
                  keep_dictionary: bool = False) -> pa.Table:
    """`table` in `schema`: columns by name (the first of a duplicated name, with
    a warning), cast where the type differs (nulled, with a warning, where the
    cast fails), missing ones null. With `keep_dictionary` (the column engine's
    own input) a dictionary-encoded column of a categorical string field stays
    encoded: `Columns` reads its codes instead of hashing every string again."""
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


# file schema -> whether conforming it to the target schema only adds null columns (no warning, no cast)
_MISSING_ONLY: list[tuple[pa.Schema, pa.Schema, bool]] = []    # (file schema, target schema, answer), recent first


def missing_only(have: pa.Schema, want: pa.Schema) -> bool:
    """True when `conform_table(t, want)` of a table in schema `have` only fills missing columns with
    nulls: no duplicated, unknown or differently typed column, so it says nothing and can be done once
    for a whole batch of such tables (`Columns` does) instead of once per file. Remembered for the few
    schemas a run has, compared with `Schema.equals` (hashing a schema costs more than the check)."""
    for h, w, hit in _MISSING_ONLY:
        if w is want and h.equals(have):
            return hit
    names = have.names
    hit = len(set(names)) == len(names) and all(
        want.get_field_index(n) >= 0 and want.field(n).type == have.field(n).type for n in names)
    _MISSING_ONLY.insert(0, (have, want, hit))
    del _MISSING_ONLY[8:]
    return hit


def _encoded_string(typ: pa.DataType, fld: pa.Field) -> bool:
    return (fld.name in _CATEGORICAL and pa.types.is_string(fld.type) and pa.types.is_dictionary(typ)
            and pa.types.is_string(typ.value_type))


def as_columns(tables: "list[pa.Table] | Columns | None", schema: pa.Schema) -> Columns:
    """A Columns from a list of tables, consuming (emptying) the list as it goes."""
    if isinstance(tables, Columns):
        return tables
    out = Columns(schema)
    for i in range(len(tables or [])):
        t, tables[i] = tables[i], None
        out.add(conform_table(t, schema, Path("."), [], keep_dictionary=True) if t.schema != schema else t)
        del t
    if tables:
        tables.clear()
    return out


def aligned_times(times: np.ndarray, ranks: np.ndarray, offsets: dict[int, int]) -> np.ndarray:
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


def fill_ints(df: pd.DataFrame, schema: pa.Schema) -> pd.DataFrame:
    """Integer columns in their schema dtype (a no-op after `Columns.frame`)."""
    for fld in schema:
        if pa.types.is_integer(fld.type):
            want = np.dtype(fld.type.to_pandas_dtype())
            col = df[fld.name]
            if col.dtype != want:
                df[fld.name] = col.fillna(-1).astype(want) if col.isna().any() else col.astype(want)
    return df


def column_equals(col: pd.Series, value: str) -> np.ndarray:
    """col == value as a bool array; on a categorical through its codes (no object array of 10M strings)."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        cats = col.cat.categories
        if value not in cats:
            return np.zeros(len(col), dtype=bool)
        return col.cat.codes.to_numpy() == cats.get_loc(value)
    return (col == value).to_numpy(dtype=bool)
