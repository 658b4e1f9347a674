"""Load a run directory into tables, tolerating whatever a dying job left behind.

A hung or killed job leaves torn Arrow streams, missing rank directories,
half-written JSON and ranks that never said goodbye. None of that may stop the
analysis: each problem becomes one line in `Trace.warnings` that says what and
where, and everything else is still loaded. Nothing in the run directory is
ever written to.

Tables (pandas, one row per record, all ranks concatenated):
- `events`  : raw begin/end/instant rows (schema.EVENTS_SCHEMA) plus `t_ns`,
              the time aligned to rank 0's clock.
- `ops`     : one row per op (begin joined with its end): `start_ns`,
              `end_ns` (-1 if the op never ended), `duration_ns`, `status`
              ("inflight" when there is no end row) and the begin row's fields.
- `metrics`, `samples`, `groups` as in the schema.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc

from . import safe_io
from . import schema as S

STATUS_INFLIGHT = "inflight"

# String columns with few distinct values are loaded as categoricals: a
# 10-million-row trace stays a few hundred MB instead of several GB.
_CATEGORICAL = ("phase", "kind", "op_name", "process_group", "input_dtypes", "input_sizes", "reduce_op", "status", "call_site",
                "message", "source")


class TraceError(Exception):
    """The input cannot be analyzed at all (not a run directory, no rank data)."""


@dataclass
class RankInfo:
    """What is known about one rank, from rank.json and run.json."""

    rank: int
    present: bool = False                  # its directory exists
    host: str = ""
    pid: int = -1
    device: str = ""
    clock_offset_ns: int = 0               # add to local time to get rank 0's time
    clock_uncertainty_ns: int = 0
    host_cpus: int = 0                     # cores the rank's process could use (0: not recorded)
    coords: dict[str, int] = field(default_factory=dict)   # tp/cp/dp/pp/ep index
    end_status: str = ""                   # rank.json "end": ok | error | "" (never ended)
    end_message: str = ""
    exitcode: int | None = None            # from run.json (launcher); None if unknown
    signal: str | None = None              # e.g. "SIGKILL" when killed by a signal
    stopped_by_launcher: bool = False      # still running when the launcher ended the job

    @property
    def state(self) -> str:
        """finished | failed | killed | stopped | unknown | missing: how the process ended.

        "stopped" means the rank was still alive (hung or waiting) when the
        launcher ended the job; "killed" means a signal ended it first."""
        if not self.present:
            return "missing"
        if self.signal and not self.stopped_by_launcher:
            return "killed"
        if self.stopped_by_launcher:
            return "failed" if self.end_status == "error" else "stopped"
        if self.exitcode is not None and self.exitcode != 0:
            return "failed"
        if self.end_status == "ok" or self.exitcode == 0:
            return "finished"
        if self.end_status == "error":
            return "failed"
        return "unknown"


@dataclass
class Trace:
    path: Path
    run: dict[str, Any]
    world_size: int
    ranks: dict[int, RankInfo]
    events: pd.DataFrame
    ops: pd.DataFrame
    metrics: pd.DataFrame
    samples: pd.DataFrame
    groups: pd.DataFrame
    stacks: dict[int, str]
    warnings: list[str]
    group_views: "GroupViews | None" = None

    @property
    def present_ranks(self) -> list[int]:
        return sorted(r for r, info in self.ranks.items() if info.present)

    @property
    def end_ns(self) -> int:
        """Latest aligned time seen anywhere in the trace (the 'now' of a post-mortem)."""
        t = int(self.events["t_ns"].max()) if len(self.events) else 0
        if len(self.samples):
            t = max(t, int(self.samples["time_ns"].max()))
        return t

    def group_members(self) -> dict[str, list[int]]:
        """Group name -> member ranks, taking the view most ranks agree on."""
        if self.group_views is not None:
            return self.group_views.majority()
        views = GroupViews()
        views.add_rows(self.groups.to_dict("records"))
        return views.majority()

    def last_heartbeat_ns(self) -> dict[int, int]:
        hb = self.events[self.events["op_name"] == S.HEARTBEAT]
        return {int(r): int(t) for r, t in hb.groupby("rank", observed=True)["t_ns"].max().items()}


def _empty(schema: pa.Schema) -> pa.Table:
    return schema.empty_table()


def read_stream(path: Path, schema: pa.Schema, warnings: list[str]) -> pa.Table:
    """Read an append-only Arrow IPC stream, keeping every complete batch.

    A writer killed mid-batch leaves a torn tail: the batches before it are
    returned and the tail is reported once. Every batch is validated in full
    (offsets, UTF-8) before it is used; a batch that fails is treated like a
    torn one, so a flipped byte costs the batches from there on, never the
    process. Only a regular file is opened (a named pipe or a device would
    block or never end). Columns missing from an older file are filled with
    nulls; unknown extra columns are dropped.
    """
    import stat

    from . import safe_io
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return _empty(schema)
    except (OSError, ValueError) as exc:
        warnings.append(f"{path}: unreadable ({_short(exc)}); skipped")
        return _empty(schema)
    if not stat.S_ISREG(st.st_mode):
        warnings.append(f"{path}: {safe_io._kind(st.st_mode)}, not a regular file; skipped")
        return _empty(schema)
    if st.st_size == 0:
        warnings.append(f"{path}: empty file (the rank died before its first flush)")
        return _empty(schema)
    batches: list[pa.RecordBatch] = []
    try:
        # Read into Arrow's memory pool rather than memory-mapping: then the
        # conversion to pandas can free each buffer as soon as it is copied.
        source = pa.OSFile(str(path), "r")
        reader = pa.ipc.open_stream(source)
        file_version = (reader.schema.metadata or {}).get(b"ncclscope_schema", b"").decode(errors="replace")
    except (pa.ArrowException, OSError, ValueError, MemoryError) as exc:
        warnings.append(f"{path}: not a readable Arrow stream ({_short(exc)}); skipped")
        return _empty(schema)
    if file_version and S.major(file_version) != S.major(S.SCHEMA_VERSION):
        warnings.append(f"{path}: schema version {file_version[:40]}, this reader understands {S.SCHEMA_VERSION}; skipped")
        return _empty(schema)
    while True:
        try:
            batch = reader.read_next_batch()
            batch.validate(full=True)
            batches.append(batch)
        except StopIteration:
            break
        except (pa.ArrowException, OSError, ValueError, MemoryError, IndexError, KeyError) as exc:
            warnings.append(f"{path}: torn batch after {len(batches)} complete ones ({_short(exc)}); kept those")
            break
    try:
        table = pa.Table.from_batches(batches, schema=reader.schema) if batches else reader.schema.empty_table()
    except (pa.ArrowException, ValueError) as exc:
        warnings.append(f"{path}: batches disagree with the stream's schema ({_short(exc)}); skipped")
        return _empty(schema)
    return conform_table(table, schema, path, warnings)


def conform_table(table: pa.Table, schema: pa.Schema, path: Path, warnings: list[str]) -> pa.Table:
    """`table` in `schema`: columns by name (the first of a duplicated name, with
    a warning), cast where the type differs (nulled, with a warning, where the
    cast fails), missing ones null."""
    cols = []
    names = table.column_names
    for fld in schema:
        idx = [i for i, name in enumerate(names) if name == fld.name]
        if idx:
            if len(idx) > 1:
                warnings.append(f"{path}: column {fld.name} appears {len(idx)} times; using the first")
            col = table.column(idx[0])
            if col.type != fld.type:
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
    return pa.Table.from_arrays(cols, schema=schema)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:200]


def _read_json(path: Path, warnings: list[str]) -> dict[str, Any]:
    """A JSON object from a regular file of bounded size, through the guarded
    parser (safe_io.loads); {} with one warning for anything else. A declared
    world size is bounded by the rank directories on disk (`_bound_world`)."""
    from . import safe_io
    try:
        os.stat(path)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        pass       # read_bytes words the error
    try:
        data = safe_io.read_json(path)
    except safe_io.InputError as exc:
        warnings.append(f"{exc}; ignored")
        return {}
    if not isinstance(data, dict):
        warnings.append(f"{path}: expected a JSON object, got {type(data).__name__}; ignored")
        return {}
    if path.name in (S.RUN_JSON, S.RANK_JSON) and "world_size" in data:
        _bound_world(data, path.parent if path.name == S.RUN_JSON else path.parent.parent, path, warnings)
    return data


_DIRS_CACHE: dict[str, tuple[int, dict[int, Path]]] = {}


def _rank_dirs_cached(root: Path) -> dict[int, Path]:
    """_rank_dirs(root), listed once per directory state (its mtime) instead of once per rank.json:
    every rank.json of a 16,384-rank run asks, and 16,384 listings of 16,384 entries took minutes."""
    try:
        stamp = os.stat(root).st_mtime_ns
    except (OSError, ValueError):
        return _rank_dirs(root, [])
    hit = _DIRS_CACHE.get(str(root))
    if hit is None or hit[0] != stamp:
        _DIRS_CACHE.clear()          # one run at a time
        hit = _DIRS_CACHE[str(root)] = (stamp, _rank_dirs(root, []))
    return hit[1]


def _bound_world(data: dict[str, Any], root: Path, where: Path, warnings: list[str]) -> None:
    """Replace a declared world_size no rank directory layout supports (2**31
    next to four directories) by the highest rank on disk + 1, with a warning."""
    from . import safe_io
    declared = _int(data.get("world_size"), 0)
    if declared <= 4096:
        return
    ranks = _rank_dirs_cached(root)
    highest = max(ranks) if ranks else 0
    cap = safe_io.plausible_world(declared, len(ranks), highest)
    if declared > cap:
        warnings.append(f"{where}: says world_size {declared}, but {len(ranks)} rank directories are on disk "
                        f"(highest rank {highest}); using {highest + 1}")
        data["world_size"] = highest + 1


def _int(value: Any, default: int = -1) -> int:
    """An int from input, bounded to |x| <= 2**53 (no field of a trace needs more:
    a bigger rank, pid, offset or count is junk), else `default`."""
    from .safe_io import to_int
    return to_int(value, default, -(2**53), 2**53)


def _rank_dirs(path: Path, warnings: list[str]) -> dict[int, Path]:
    """rank -> its directory, for every rank-N directory with a plausible N: a
    30-digit name or a stray rank-1000000000 next to four real directories is
    skipped with a warning instead of making a world of a billion ranks."""
    from .safe_io import MAX_RANK
    found: dict[int, Path] = {}
    try:
        entries = sorted(path.iterdir())
    except OSError as exc:
        warnings.append(f"{path}: cannot list ({_short(exc)})")
        return found
    for entry in entries:
        if entry.name.startswith("rank-") and entry.is_dir():
            name = entry.name[5:]
            r = _int(name, -1) if name.isdigit() and len(name) <= 12 else -1
            if r < 0 or r > MAX_RANK:
                warnings.append(f"{entry}: not a rank directory name; skipped")
                continue
            found[r] = entry
    limit = max(8 * len(found), 4096)
    stray = [r for r in found if r >= limit]
    for r in sorted(stray):
        warnings.append(f"{found[r]}: rank {r} is far beyond the {len(found)} rank directories here; skipped")
        del found[r]
    return found


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
        self.pending_rows = 0

    BATCH_ROWS = 1 << 18     # ranks are converted in batches: per-field work is paid per batch, not per rank

    def add(self, table: pa.Table) -> None:
        self.pending.append(table)
        self.pending_rows += table.num_rows
        if self.pending_rows >= self.BATCH_ROWS or len(self.pending) >= 512:
            self._flush()

    def _flush(self) -> None:
        if not self.pending:
            return
        pending, self.pending, self.pending_rows = self.pending, [], 0
        try:
            tables = [pa.concat_tables(pending) if len(pending) > 1 else pending[0]]
        except (pa.ArrowInvalid, pa.ArrowTypeError):   # schemas differ in a detail (nullability): one by one
            tables = [conform_table(t, self.schema, Path("."), []) for t in pending]
        del pending
        for table in tables:
            self._convert(table)

    def _convert(self, table: pa.Table) -> None:
        for fld, col in zip(self.schema, table.columns):
            chunks = [col.combine_chunks()] if col.num_chunks > 1 else col.chunks
            name = fld.name
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
        d = self.cats[name]
        out = []
        for c in chunks:
            if not pa.types.is_dictionary(c.type):
                c = pc.dictionary_encode(c)
            values = c.dictionary.to_pylist()
            lut = np.fromiter((d.setdefault("" if v is None else str(v), len(d)) for v in values),
                              dtype=np.int32, count=len(values))
            idx = c.indices
            if idx.null_count:
                lut = np.append(lut, np.int32(d.setdefault("", len(d))))
                idx = idx.fill_null(len(values))
            out.append(lut[idx.to_numpy(zero_copy_only=False)])
        codes = np.concatenate(out) if out else np.empty(0, dtype=np.int32)
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


def _columns(tables: "list[pa.Table] | _Columns | None", schema: pa.Schema) -> _Columns:
    """A _Columns from a list of tables, consuming (emptying) the list as it goes."""
    if isinstance(tables, _Columns):
        return tables
    out = _Columns(schema)
    for i in range(len(tables or [])):
        t, tables[i] = tables[i], None
        out.add(conform_table(t, schema, Path("."), []) if t.schema != schema else t)
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
    r, st = ops["rank"].to_numpy(), ops["start_ns"].to_numpy()
    ordered = len(ops) < 2 or bool(np.all((r[1:] > r[:-1]) | ((r[1:] == r[:-1]) & (st[1:] >= st[:-1]))))
    if not ordered:   # clocks stepped backwards, or rows appended out of order
        ops = ops.sort_values(["rank", "start_ns", "op_id"], kind="stable").reset_index(drop=True)
    return ops


# Rows of `Trace.groups` a contested group may cost before its majority view falls back to its members' votes.
GROUP_ROW_BUDGET = 2_000_000
_MAX_RANGE = 1 << 24      # a hostile {"range": [0, 10**18, 1]} must not allocate the universe


class GroupViews:
    """Each rank's view of the process groups, kept as distinct views, never ranks x groups.

    Two on-disk shapes feed it (docs/trace-format.md):
    - a full view per rank (groups.json as a JSON list, or `groups` inside
      rank.json in older traces): parsed once per distinct byte string;
    - groups.json as an object (format 2): the rank's own groups plus the
      fingerprint of its whole plan; the whole plan travels in the files of
      rank 0 and of the lowest rank of every other fingerprint. A rank whose
      fingerprint has a plan holds that plan's view (after checking that its
      own groups agree with it); a rank whose plan was not found holds a
      partial view of just its own groups, and a warning says so.

    `majority()` answers "who is in group g" by weighting each distinct view
    by its holders. `table()` is the `groups` table the analyses vote over:
    each rank's rows for the groups it belongs to (one representative row
    for a group none of a view's holders is in), plus, for a group some
    views disagree on, every holder's row, so the vote there counts every
    rank as it did when every rank wrote everything (within
    GROUP_ROW_BUDGET rows; past it the majority view votes through its
    members). A healthy 16,384-rank run is 5 rows per rank, not 20,545.
    """

    def __init__(self) -> None:
        self._index: dict[Any, int] = {}
        self._views: list[dict[str, list[Any]]] = []
        self._holders: list[list[int]] = []
        self._plans: dict[str, int] = {}                 # fingerprint -> index of its full view
        self._pending: list[tuple[int, str, list[Any], Path]] = []   # (rank, fingerprint, own groups, where)
        self._warnings: list[str] | None = None
        self.fingerprints: dict[int, str] = {}           # rank -> fingerprint of its plan (format 2 only)

    # ---- input ---------------------------------------------------------------
    def add(self, rank: int, raw: Any, warnings: list[str], where: Path) -> None:
        """`raw`: the bytes of groups.json, or an already-parsed list (rank.json of older traces) or object."""
        if self._warnings is None:
            self._warnings = warnings
        if isinstance(raw, (bytes, str)):
            head = raw.lstrip()[:1]
            if head in (b"{", "{"):
                try:
                    obj = safe_io.loads(raw, where)
                except ValueError as exc:
                    warnings.append(f"{where}: unreadable JSON ({_short(exc)}); this rank's group view is unknown")
                    return
                self._add_own(rank, obj, warnings, where)
                return
        elif isinstance(raw, dict):
            self._add_own(rank, raw, warnings, where)
            return
        key = raw if isinstance(raw, (bytes, str)) else json.dumps(raw, sort_keys=True, default=str)
        idx = self._index.get(key)
        if idx is None:
            if isinstance(raw, (bytes, str)):
                try:
                    raw = safe_io.loads(raw, where)
                except ValueError as exc:
                    warnings.append(f"{where}: unreadable JSON ({_short(exc)}); this rank's group view is unknown")
                    return
            idx = self._index[key] = len(self._views)
            self._views.append(_parse_view(raw, warnings, where))
            self._holders.append([])
        self._holders[idx].append(rank)

    def _add_own(self, rank: int, obj: Any, warnings: list[str], where: Path) -> None:
        """groups.json format 2: {fingerprint, groups (own), plan (whole, on some ranks)}."""
        if not isinstance(obj, dict):
            warnings.append(f"{where}: group table is not a list or an object; ignored")
            return
        fp = str(obj.get("fingerprint", ""))[:64]
        own = obj.get("groups")
        if not isinstance(own, list):
            warnings.append(f"{where}: no list of own groups; this rank's group view is unknown")
            own = []
        plan = obj.get("plan")
        if isinstance(plan, list):
            view = _parse_view(plan, warnings, where)
            known = self._plans.get(fp)
            if known is None:
                self._plans[fp] = len(self._views)
                self._views.append(view)
                self._holders.append([])
            elif not _same_view(self._views[known], view):
                warnings.append(f"{where}: a plan with fingerprint {fp} that differs from another rank's plan "
                                f"with the same fingerprint; this rank keeps its own")
                self._views.append(view)
                self._holders.append([rank])
                self.fingerprints[rank] = fp
                return
        self.fingerprints[rank] = fp
        self._pending.append((rank, fp, own, where))

    def add_rows(self, rows: list[dict[str, Any]]) -> None:
        """Group rows in the GROUP schema (from the foreign-format readers)."""
        by_rank: dict[int, list[dict[str, Any]]] = {}
        for row in rows:
            by_rank.setdefault(int(row["rank"]), []).append(
                {"name": row["process_group"], "kind": row["group_kind"], "ranks": list(row["ranks"]),
                 "creation_order": row["creation_order"], "backend": row["backend"]})
        for r, lst in by_rank.items():
            self.add(r, lst, [], Path("."))

    def resolve(self, warnings: list[str] | None = None) -> None:
        """Attach every format-2 rank to its plan's view (or to a view of its own groups)."""
        if not self._pending:
            return
        warnings = warnings if warnings is not None else (self._warnings if self._warnings is not None else [])
        pending, self._pending = self._pending, []
        lookups: dict[int, dict[str, tuple[str, Any, int]]] = {}
        orphans: dict[str, list[int]] = {}
        disagree: list[int] = []
        for rank, fp, own, where in sorted(pending, key=lambda p: p[0]):
            idx = self._plans.get(fp)
            if idx is not None:
                look = lookups.get(idx)
                if look is None:
                    v = self._views[idx]
                    look = lookups[idx] = {n: (k, _members_key(m), o) for n, k, m, o in zip(
                        v["process_group"], v["group_kind"], v["ranks"], v["creation_order"])}
                if _own_agrees(own, look):
                    self._holders[idx].append(rank)
                    continue
                disagree.append(rank)
            else:
                orphans.setdefault(fp, []).append(rank)
            self._views.append(_parse_view(own, warnings, where))
            self._holders.append([rank])
        for fp, rs in orphans.items():
            warnings.append(f"group plan {fp or '(no fingerprint)'} of {_ranks_text(rs)} is in no loaded "
                            f"groups.json (rank 0 or the plan's lowest rank is missing); only their own groups "
                            f"are known")
        if disagree:
            warnings.append(f"{_ranks_text(disagree)}: own groups disagree with the plan of the same fingerprint; "
                            f"kept as their own views")

    # ---- views -----------------------------------------------------------------
    @property
    def views(self) -> list[dict[str, list[Any]]]:
        self.resolve()
        return self._views

    @property
    def holders(self) -> list[list[int]]:
        self.resolve()
        return self._holders

    def table(self) -> pd.DataFrame:
        """The `groups` table (one row per (rank, group) vote; see the class docstring)."""
        views, holders = self.views, self.holders
        live = [i for i, (v, h) in enumerate(zip(views, holders)) if h and len(v["process_group"])]
        if not live:
            return pd.DataFrame(columns=S.GROUP_COLUMNS)
        main = max(live, key=lambda i: (len(holders[i]), -i))
        contested = _contested(views, live, main)
        cost = {i: len(holders[i]) * sum(n in contested for n in views[i]["process_group"]) for i in live} \
            if contested else {i: 0 for i in live}
        others = sum(c for i, c in cost.items() if i != main)
        full_main = cost[main] + others <= GROUP_ROW_BUDGET
        full_others = others <= GROUP_ROW_BUDGET
        parts = []
        main_names = frozenset(views[main]["process_group"])
        for i in live:
            full = full_main if i == main else full_others
            # a group no holder of this view is in gets one representative row, from the majority view
            # (old traces' views differ in backend strings only: one per rank, and must not cost ranks x groups)
            parts.append(_view_rows(views[i], np.asarray(sorted(holders[i]), dtype=np.int64),
                                    contested if full else frozenset(), None if i == main else main_names))
        rank = np.concatenate([p[0] for p in parts])
        order = np.lexsort((np.concatenate([p[1] for p in parts]), rank))
        cols: dict[str, Any] = {"rank": rank[order].astype(np.int32)}
        for name in S.GROUP_COLUMNS[1:]:
            col = np.concatenate([p[2][name] for p in parts])
            cols[name] = col[order]
        out = pd.DataFrame(cols)
        out["creation_order"] = out["creation_order"].astype("int32")
        return out

    def majority(self) -> dict[str, list[int]]:
        votes: dict[str, dict[tuple[int, ...], int]] = {}
        for view, holders in zip(self.views, self.holders):
            if not holders:
                continue
            for name, members in zip(view["process_group"], view["ranks"]):
                tally = votes.setdefault(name, {})
                key = tuple(members)
                tally[key] = tally.get(key, 0) + len(holders)
        return {name: list(max(tally.items(), key=lambda kv: kv[1])[0]) for name, tally in votes.items()}


def _ranks_text(rs: list[int]) -> str:
    shown = ",".join(map(str, rs[:8])) + (f",... ({len(rs)} ranks)" if len(rs) > 8 else "")
    return f"rank{'s' if len(rs) > 1 else ''} {shown}"


def _members_key(m: Any) -> Any:
    """A comparable key of a member list: ("r", start, stop, step) for a progression, else a tuple."""
    if isinstance(m, dict):
        rng = m.get("range")
        if isinstance(rng, list) and len(rng) == 3 and all(isinstance(x, int) for x in rng) and rng[2] > 0:
            r = range(*rng)
            if len(r) >= 3:
                return ("r", r.start, r.start + len(r) * r.step, r.step)
            return tuple(r)
        return ("bad",)
    if not isinstance(m, (list, tuple, range)):
        return ("bad",)
    if len(m) >= 3:
        step = m[1] - m[0] if isinstance(m[0], int) and isinstance(m[1], int) else 0
        if step > 0 and list(m) == list(range(m[0], m[-1] + 1, step)):
            return ("r", m[0], m[-1] + step, step)
    return tuple(m)


def _own_agrees(own: list[Any], look: dict[str, tuple[str, Any, int]]) -> bool:
    """Each of a rank's own groups has the same kind, members and creation order in the plan."""
    for g in own:
        if not isinstance(g, dict):
            return False
        ref = look.get(str(g.get("name")))
        if ref is None or ref[0] != str(g.get("kind", "custom")) or ref[2] != _int(g.get("creation_order")):
            return False
        if ref[1] != _members_key(g.get("ranks", [])):
            return False
    return True


def _same_view(a: dict[str, list[Any]], b: dict[str, list[Any]]) -> bool:
    return all(a[k] == b[k] for k in S.GROUP_COLUMNS[1:])


def _contested(views: list[dict[str, list[Any]]], live: list[int], main: int) -> frozenset[str]:
    """Names of groups on which some view disagrees with the majority view (kind, members or order)."""
    if len(live) == 1:
        return frozenset()
    mv = views[main]
    ref = {n: (k, m, o) for n, k, m, o in zip(mv["process_group"], mv["group_kind"], mv["ranks"],
                                               mv["creation_order"])}
    out = set()
    for i in live:
        if i == main:
            continue
        v = views[i]
        for n, k, m, o in zip(v["process_group"], v["group_kind"], v["ranks"], v["creation_order"]):
            r = ref.get(n)
            if r is not None and (r[0] != k or r[2] != o or (r[1] is not m and r[1] != m)):
                out.add(n)
    return frozenset(out)


def _view_rows(view: dict[str, list[Any]], holders: np.ndarray, full: frozenset[str],
               covered: frozenset[str] | None = None) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """(rank, group index, columns) of one view's rows: members' votes, one representative for a
    group none of the holders is in (unless it is in `covered`), every holder's vote on the groups in `full`."""
    names = view["process_group"]
    n = len(names)
    lens = np.fromiter((len(m) for m in view["ranks"]), dtype=np.int64, count=n)
    flat = np.fromiter((x for m in view["ranks"] for x in m), dtype=np.int64, count=int(lens.sum()))
    gi = np.repeat(np.arange(n, dtype=np.int64), lens)
    is_full = np.fromiter((nm in full for nm in names), dtype=bool, count=n) if full else np.zeros(n, dtype=bool)
    sel = ~is_full[gi] & np.isin(flat, holders)
    r_mem, g_mem = flat[sel], gi[sel]
    voted = np.zeros(n, dtype=bool)
    voted[g_mem] = True
    need = ~voted & ~is_full
    if covered:
        need &= ~np.fromiter((nm in covered for nm in names), dtype=bool, count=n)
    rep = np.flatnonzero(need)
    full_idx = np.flatnonzero(is_full)
    rank = np.concatenate([r_mem, np.full(len(rep), holders[0], dtype=np.int64),
                           np.repeat(holders, len(full_idx))])
    g = np.concatenate([g_mem, rep, np.tile(full_idx, len(holders))])
    cols = {}
    for name in S.GROUP_COLUMNS[1:]:
        arr = np.empty(n, dtype=object)
        arr[:] = view[name]          # one shared object per group: view_keys dedups member lists by identity
        cols[name] = arr[g]
    return rank, g, cols


def _decode_members(members: Any) -> list[int]:
    if isinstance(members, dict):
        rng = members.get("range")
        if isinstance(rng, list) and len(rng) == 3 and all(isinstance(x, int) for x in rng) and rng[2] > 0:
            r = range(*rng)
            if len(r) <= _MAX_RANGE:
                return list(r)
        return []
    if isinstance(members, list):
        return [_int(x) for x in members if isinstance(x, (int, str))]
    return []


def _parse_view(raw: Any, warnings: list[str], where: Path) -> dict[str, list[Any]]:
    view: dict[str, list[Any]] = {name: [] for name in S.GROUP_COLUMNS[1:]}
    if not isinstance(raw, list):
        warnings.append(f"{where}: group table is not a list; ignored")
        return view
    for g in raw:
        if isinstance(g, dict) and "name" in g:
            view["process_group"].append(str(g["name"]))
            view["group_kind"].append(str(g.get("kind", "custom")))
            view["ranks"].append(_decode_members(g.get("ranks", [])))
            view["creation_order"].append(_int(g.get("creation_order")))
            view["backend"].append(str(g.get("backend", "")))
    return view


def load(path: str | os.PathLike[str]) -> Trace:
    """Load a run directory. Raises TraceError only when nothing can be analyzed."""
    root = Path(path)
    if not root.exists():
        raise TraceError(f"{root}: no such directory")
    if not root.is_dir():
        raise TraceError(f"{root}: not a directory (expected a run directory with rank-NNNNN/ inside)")
    warnings: list[str] = []
    run = _read_json(root / S.RUN_JSON, warnings)
    dirs = _rank_dirs(root, warnings)
    if not dirs:
        raise TraceError(f"{root}: no rank-NNNNN directories (is this a run directory?)")

    ranks: dict[int, RankInfo] = {}
    # each rank's tables become compact columns as soon as they are read (its read buffers go at once)
    event_tables, metric_tables, sample_tables = (_Columns(S.EVENTS_SCHEMA), _Columns(S.METRICS_SCHEMA),
                                                  _Columns(S.SAMPLES_SCHEMA))
    views = GroupViews()
    stacks: dict[int, str] = {}
    world_size = _int(run.get("world_size"), 0)
    for r, d in dirs.items():
        meta = _read_json(d / S.RANK_JSON, warnings)
        if meta and _int(meta.get("rank"), r) != r:
            warnings.append(f"{d / S.RANK_JSON}: says rank {meta.get('rank')} but lives in {d.name}; using {r}")
        world_size = max(world_size, _int(meta.get("world_size"), 0))
        end = meta.get("end") if isinstance(meta.get("end"), dict) else {}
        coords = meta.get("coords") if isinstance(meta.get("coords"), dict) else {}
        ranks[r] = RankInfo(
            rank=r, present=True, host=str(meta.get("host", "")), pid=_int(meta.get("pid")),
            device=str(meta.get("device", "")),
            clock_offset_ns=_int(meta.get("clock_offset_ns"), 0),
            clock_uncertainty_ns=_int(meta.get("clock_uncertainty_ns"), 0),
            host_cpus=max(_int(meta.get("host_cpus"), 0), 0),
            coords={str(k): _int(v) for k, v in coords.items()},
            end_status=str(end.get("status", "")), end_message=str(end.get("message", "")),
        )
        gpath = d / S.GROUPS_JSON
        if gpath.exists():
            try:
                views.add(r, safe_io.read_bytes(gpath, safe_io.JSON_LIMIT), warnings, gpath)
            except (OSError, ValueError) as exc:     # safe_io.InputError: not a regular file, too big
                warnings.append(f"{gpath}: unreadable ({_short(exc)}); this rank's group view is unknown")
        elif isinstance(meta.get("groups"), list):   # traces written before groups.json
            views.add(r, meta["groups"], warnings, d / S.RANK_JSON)
        ev = read_stream(d / S.EVENTS_FILE, S.EVENTS_SCHEMA, warnings)
        from .usertrace.fr_merge import merge_rank; ev = merge_rank(d, ev, warnings)  # noqa: E702  (ncclscope run: Flight Recorder-only ops)
        if not (d / S.EVENTS_FILE).exists():
            warnings.append(f"{d / S.EVENTS_FILE}: missing (the rank wrote no events)")
        event_tables.add(force_rank(ev, r))
        del ev
        metric_tables.add(force_rank(read_stream(d / S.METRICS_FILE, S.METRICS_SCHEMA, warnings), r))
        sample_tables.add(force_rank(read_stream(d / S.SAMPLES_FILE, S.SAMPLES_SCHEMA, warnings), r))
        if (d / S.STACKS_FILE).exists():
            try:
                stacks[r] = safe_io.read_text(d / S.STACKS_FILE)
            except (OSError, ValueError) as exc:
                warnings.append(f"{d / S.STACKS_FILE}: unreadable ({_short(exc)}); no stacks for rank {r}")

    exits = run.get("ranks") if isinstance(run.get("ranks"), dict) else {}
    world_size = max(world_size, max(dirs) + 1)
    for r in range(world_size):
        if r not in ranks:
            ranks[r] = RankInfo(rank=r, present=False)
            warnings.append(f"{root}: rank {r} has no directory {S.rank_dir_name(r)}; analyzing the other ranks")
        ex = exits.get(str(r)) if isinstance(exits, dict) else None
        if isinstance(ex, dict):
            code = ex.get("exitcode")
            ranks[r].exitcode = code if isinstance(code, int) else None
            sig = ex.get("signal")
            ranks[r].signal = str(sig) if sig else None
            ranks[r].stopped_by_launcher = bool(ex.get("stopped_by_launcher", False))

    views.resolve(warnings)
    return assemble(root, run, world_size, ranks, event_tables, metric_tables, sample_tables, None,
                    stacks, warnings, group_views=views)


def assemble(
    path: Path, run: dict[str, Any], world_size: int, ranks: dict[int, RankInfo],
    event_tables: "list[pa.Table] | _Columns", metric_tables: "list[pa.Table] | _Columns | None" = None,
    sample_tables: "list[pa.Table] | _Columns | None" = None, group_rows: list[dict[str, Any]] | None = None,
    stacks: dict[int, str] | None = None, warnings: list[str] | None = None,
    group_views: GroupViews | None = None,
) -> Trace:
    """Build a Trace from Arrow tables in the schema; used by `load` and by the
    foreign-format readers in `ingest/`, so every analysis sees one shape.
    The table lists are consumed (emptied) to keep peak memory near one copy."""
    events = _fill_ints(_columns(event_tables, S.EVENTS_SCHEMA).frame(), S.EVENTS_SCHEMA)
    offsets = {r: int(info.clock_offset_ns) for r, info in ranks.items()}
    events["t_ns"] = _aligned(events["time_ns"].to_numpy(), events["rank"].to_numpy(), offsets)
    metrics = _fill_ints(_columns(metric_tables, S.METRICS_SCHEMA).frame(), S.METRICS_SCHEMA)
    samples = _fill_ints(_columns(sample_tables, S.SAMPLES_SCHEMA).frame(), S.SAMPLES_SCHEMA)
    if len(samples):
        samples["time_ns"] = _aligned(samples["time_ns"].to_numpy(), samples["rank"].to_numpy(), offsets)
    if len(metrics):
        metrics["time_ns"] = _aligned(metrics["time_ns"].to_numpy(), metrics["rank"].to_numpy(), offsets)
    if group_views is None:
        group_views = GroupViews()
        group_views.add_rows(group_rows or [])
    groups = group_views.table()
    ops = build_ops(events)
    _trim()
    return Trace(
        group_views=group_views,
        path=path, run=run, world_size=world_size, ranks=dict(sorted(ranks.items())), events=events,
        ops=ops, metrics=metrics, samples=samples, groups=groups, stacks=stacks or {},
        warnings=warnings if warnings is not None else [],
    )


def force_rank(table: pa.Table, rank: int) -> pa.Table:
    """Trust the directory, not the rows: a hostile file cannot claim another rank."""
    idx = table.schema.get_field_index("rank")
    return table.set_column(idx, "rank", pa.array(np.full(len(table), rank, dtype=np.int32)))
