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
import pyarrow.ipc

from . import schema as S

STATUS_INFLIGHT = "inflight"

# String columns with few distinct values are loaded as categoricals: a
# 10-million-row trace stays a few hundred MB instead of several GB.
_CATEGORICAL = ("phase", "kind", "op_name", "process_group", "input_dtypes", "reduce_op", "status", "call_site", "source")


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
    returned and the tail is reported once. Columns missing from an older file
    are filled with nulls; unknown extra columns are dropped.
    """
    if not path.exists():
        return _empty(schema)
    batches: list[pa.RecordBatch] = []
    try:
        # Read into Arrow's memory pool rather than memory-mapping: then the
        # conversion to pandas can free each buffer as soon as it is copied.
        source = pa.OSFile(str(path), "r")
        reader = pa.ipc.open_stream(source)
    except (pa.ArrowInvalid, pa.ArrowIOError, OSError, ValueError) as exc:
        if path.stat().st_size == 0:
            warnings.append(f"{path}: empty file (the rank died before its first flush)")
        else:
            warnings.append(f"{path}: not a readable Arrow stream ({_short(exc)}); skipped")
        return _empty(schema)
    file_version = (reader.schema.metadata or {}).get(b"ncclscope_schema", b"").decode(errors="replace")
    if file_version and S.major(file_version) != S.major(S.SCHEMA_VERSION):
        warnings.append(f"{path}: schema version {file_version}, this reader understands {S.SCHEMA_VERSION}; skipped")
        return _empty(schema)
    while True:
        try:
            batches.append(reader.read_next_batch())
        except StopIteration:
            break
        except (pa.ArrowInvalid, pa.ArrowIOError, OSError, ValueError) as exc:
            warnings.append(f"{path}: torn batch after {len(batches)} complete ones ({_short(exc)}); kept those")
            break
    table = pa.Table.from_batches(batches, schema=reader.schema) if batches else reader.schema.empty_table()
    return conform_table(table, schema, path, warnings)


def conform_table(table: pa.Table, schema: pa.Schema, path: Path, warnings: list[str]) -> pa.Table:
    cols = []
    for fld in schema:
        if fld.name in table.column_names:
            col = table.column(fld.name)
            if col.type != fld.type:
                try:
                    col = col.cast(fld.type)
                except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                    warnings.append(f"{path}: column {fld.name} has type {col.type}, expected {fld.type}; nulled")
                    col = pa.nulls(len(table), fld.type)
        else:
            col = pa.nulls(len(table), fld.type)
        cols.append(col)
    return pa.Table.from_arrays(cols, schema=schema)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text[:200]


def _read_json(path: Path, warnings: list[str]) -> dict[str, Any]:
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(errors="replace"))
    except (OSError, ValueError) as exc:
        warnings.append(f"{path}: unreadable JSON ({_short(exc)}); ignored")
        return {}
    if not isinstance(data, dict):
        warnings.append(f"{path}: expected a JSON object, got {type(data).__name__}; ignored")
        return {}
    return data


def _int(value: Any, default: int = -1) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


def _rank_dirs(path: Path, warnings: list[str]) -> dict[int, Path]:
    found: dict[int, Path] = {}
    for entry in sorted(path.iterdir()):
        if entry.is_dir() and entry.name.startswith("rank-"):
            r = _int(entry.name[5:], -1)
            if r < 0:
                warnings.append(f"{entry}: not a rank directory name; skipped")
                continue
            found[r] = entry
    return found


def _concat_columns(tables: list[pa.Table], schema: pa.Schema) -> pa.Table:
    """Concatenate per-rank tables column by column into fresh contiguous
    buffers (strings of few values straight to dictionaries, null integers to
    -1), then drop the inputs.

    Why not `pa.concat_tables`: a table read from an IPC stream keeps each
    batch's columns in one shared buffer, and pandas' zero-copy conversion of
    any one column would pin the whole batch, strings included. Copying
    column by column lets every read buffer go, which keeps a 10-million-event
    trace near one copy in memory. Consumes (empties) `tables`.
    """
    columns = []
    for i, fld in enumerate(schema):
        chunks = [c for t in tables for c in t.column(i).chunks]
        arr = pa.concat_arrays(chunks) if chunks else pa.array([], type=fld.type)
        del chunks
        if fld.name in _CATEGORICAL and pa.types.is_string(fld.type):
            arr = arr.fill_null("").dictionary_encode() if arr.null_count else arr.dictionary_encode()
        elif pa.types.is_integer(fld.type) and arr.null_count:
            arr = arr.fill_null(-1)
        columns.append(arr)
    tables.clear()   # the caller's list is consumed: its read buffers are freed here
    return pa.Table.from_arrays(columns, names=schema.names)


def _to_pandas(table: pa.Table) -> pd.DataFrame:
    """Arrow -> pandas without the float detour: null integers become -1 in
    Arrow, low-cardinality strings become categoricals, and the Arrow buffers
    are released while converting (peak memory about one copy, not three)."""
    arrays = []
    for fld, col in zip(table.schema, table.columns):
        if fld.name in _CATEGORICAL and pa.types.is_string(fld.type):
            col = col.fill_null("").dictionary_encode()   # already dictionaries after _concat_columns: a no-op
        elif pa.types.is_integer(fld.type) and col.null_count:
            col = col.fill_null(-1)
        arrays.append(col)
    out = pa.Table.from_arrays(arrays, names=table.column_names)
    del arrays, table
    return out.to_pandas(split_blocks=True, self_destruct=True)


def _fill_ints(df: pd.DataFrame, schema: pa.Schema) -> pd.DataFrame:
    """Integer columns in their schema dtype (a no-op after `_to_pandas`)."""
    for fld in schema:
        if pa.types.is_integer(fld.type):
            want = np.dtype(fld.type.to_pandas_dtype())
            col = df[fld.name]
            if col.dtype != want:
                df[fld.name] = col.fillna(-1).astype(want) if col.isna().any() else col.astype(want)
    return df


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
    phase = events["phase"].to_numpy()
    is_begin = phase == S.PHASE_BEGIN
    is_end = phase == S.PHASE_END
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
    keep = [c for c in events.columns if c not in ("phase", "status", "message", "time_ns")]
    ops = events.iloc[begin_rows][keep].rename(columns={"t_ns": "start_ns"}).reset_index(drop=True)
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
    ops["message"] = pd.Series(events["message"].array.take(match, allow_fill=True)).fillna("")
    ops["duration_ns"] = np.where(found, end_ns - ops["start_ns"].to_numpy(), -1).astype("int64")
    r, st = ops["rank"].to_numpy(), ops["start_ns"].to_numpy()
    ordered = len(ops) < 2 or bool(np.all((r[1:] > r[:-1]) | ((r[1:] == r[:-1]) & (st[1:] >= st[:-1]))))
    if not ordered:   # clocks stepped backwards, or rows appended out of order
        ops = ops.sort_values(["rank", "start_ns", "op_id"], kind="stable").reset_index(drop=True)
    return ops


class GroupViews:
    """Each rank's view of the process groups, parsed once per distinct view.

    On a healthy job every rank records the same (byte-identical) table, so a
    1,024-rank run with a thousand groups parses one view, not a million rows.
    `table()` expands the views into the per-rank `groups` table; `majority()`
    answers "who is in group g" from the views weighted by how many ranks
    hold each, without touching the expanded table.
    """

    def __init__(self) -> None:
        self._index: dict[Any, int] = {}
        self.views: list[dict[str, list[Any]]] = []
        self.holders: list[list[int]] = []

    def add(self, rank: int, raw: Any, warnings: list[str], where: Path) -> None:
        """`raw`: the bytes of groups.json, or an already-parsed list (rank.json of older traces)."""
        key = raw if isinstance(raw, (bytes, str)) else json.dumps(raw, sort_keys=True, default=str)
        idx = self._index.get(key)
        if idx is None:
            if isinstance(raw, (bytes, str)):
                try:
                    raw = json.loads(raw)
                except ValueError as exc:
                    warnings.append(f"{where}: unreadable JSON ({_short(exc)}); this rank's group view is unknown")
                    return
            idx = self._index[key] = len(self.views)
            self.views.append(_parse_view(raw, warnings, where))
            self.holders.append([])
        self.holders[idx].append(rank)

    def add_rows(self, rows: list[dict[str, Any]]) -> None:
        """Group rows in the GROUP schema (from the foreign-format readers)."""
        by_rank: dict[int, list[dict[str, Any]]] = {}
        for row in rows:
            by_rank.setdefault(int(row["rank"]), []).append(
                {"name": row["process_group"], "kind": row["group_kind"], "ranks": list(row["ranks"]),
                 "creation_order": row["creation_order"], "backend": row["backend"]})
        for r, lst in by_rank.items():
            self.add(r, lst, [], Path("."))

    def table(self) -> pd.DataFrame:
        parts = []
        for view, holders in zip(self.views, self.holders):
            n, k = len(view["process_group"]), len(holders)
            if n == 0 or k == 0:
                continue
            cols: dict[str, Any] = {"rank": np.repeat(np.asarray(holders, dtype=np.int32), n)}
            for name in S.GROUP_COLUMNS[1:]:
                arr = np.empty(n, dtype=object)
                arr[:] = view[name]
                cols[name] = np.tile(arr, k)
            parts.append(pd.DataFrame(cols))
        if not parts:
            return pd.DataFrame(columns=S.GROUP_COLUMNS)
        out = pd.concat(parts, ignore_index=True) if len(parts) > 1 else parts[0]
        out["creation_order"] = out["creation_order"].astype("int32")
        return out.sort_values("rank", kind="stable").reset_index(drop=True)

    def majority(self) -> dict[str, list[int]]:
        votes: dict[str, dict[tuple[int, ...], int]] = {}
        for view, holders in zip(self.views, self.holders):
            for name, members in zip(view["process_group"], view["ranks"]):
                tally = votes.setdefault(name, {})
                key = tuple(members)
                tally[key] = tally.get(key, 0) + len(holders)
        return {name: list(max(tally.items(), key=lambda kv: kv[1])[0]) for name, tally in votes.items()}


def _parse_view(raw: Any, warnings: list[str], where: Path) -> dict[str, list[Any]]:
    view: dict[str, list[Any]] = {name: [] for name in S.GROUP_COLUMNS[1:]}
    if not isinstance(raw, list):
        warnings.append(f"{where}: group table is not a list; ignored")
        return view
    for g in raw:
        if isinstance(g, dict) and "name" in g:
            view["process_group"].append(str(g["name"]))
            view["group_kind"].append(str(g.get("kind", "custom")))
            members = g.get("ranks", [])
            view["ranks"].append([_int(x) for x in members if isinstance(x, (int, str))]
                                 if isinstance(members, list) else [])
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
    event_tables, metric_tables, sample_tables = [], [], []
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
            coords={str(k): _int(v) for k, v in coords.items()},
            end_status=str(end.get("status", "")), end_message=str(end.get("message", "")),
        )
        gpath = d / S.GROUPS_JSON
        if gpath.exists():
            try:
                views.add(r, gpath.read_bytes(), warnings, gpath)
            except OSError as exc:
                warnings.append(f"{gpath}: unreadable ({_short(exc)}); this rank's group view is unknown")
        elif isinstance(meta.get("groups"), list):   # traces written before groups.json
            views.add(r, meta["groups"], warnings, d / S.RANK_JSON)
        ev = read_stream(d / S.EVENTS_FILE, S.EVENTS_SCHEMA, warnings)
        if not (d / S.EVENTS_FILE).exists():
            warnings.append(f"{d / S.EVENTS_FILE}: missing (the rank wrote no events)")
        event_tables.append(force_rank(ev, r))
        metric_tables.append(force_rank(read_stream(d / S.METRICS_FILE, S.METRICS_SCHEMA, warnings), r))
        sample_tables.append(force_rank(read_stream(d / S.SAMPLES_FILE, S.SAMPLES_SCHEMA, warnings), r))
        if (d / S.STACKS_FILE).exists():
            stacks[r] = (d / S.STACKS_FILE).read_text(errors="replace")

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

    return assemble(root, run, world_size, ranks, event_tables, metric_tables, sample_tables, None,
                    stacks, warnings, group_views=views)


def assemble(
    path: Path, run: dict[str, Any], world_size: int, ranks: dict[int, RankInfo],
    event_tables: list[pa.Table], metric_tables: list[pa.Table] | None = None,
    sample_tables: list[pa.Table] | None = None, group_rows: list[dict[str, Any]] | None = None,
    stacks: dict[int, str] | None = None, warnings: list[str] | None = None,
    group_views: GroupViews | None = None,
) -> Trace:
    """Build a Trace from Arrow tables in the schema; used by `load` and by the
    foreign-format readers in `ingest/`, so every analysis sees one shape.
    The table lists are consumed (emptied) to keep peak memory near one copy."""
    def cat(tables: list[pa.Table] | None, sch: pa.Schema) -> pa.Table:
        if not tables:
            return sch.empty_table()
        return _concat_columns(tables, sch)

    events = _fill_ints(_to_pandas(cat(event_tables, S.EVENTS_SCHEMA)), S.EVENTS_SCHEMA)
    offsets = pd.Series({r: info.clock_offset_ns for r, info in ranks.items()}, dtype="int64")
    events["t_ns"] = events["time_ns"] + events["rank"].map(offsets).fillna(0).astype("int64")
    metrics = _fill_ints(_to_pandas(cat(metric_tables, S.METRICS_SCHEMA)), S.METRICS_SCHEMA)
    samples = _fill_ints(_to_pandas(cat(sample_tables, S.SAMPLES_SCHEMA)), S.SAMPLES_SCHEMA)
    if len(samples):
        samples["time_ns"] = samples["time_ns"] + samples["rank"].map(offsets).fillna(0).astype("int64")
    if len(metrics):
        metrics["time_ns"] = metrics["time_ns"] + metrics["rank"].map(offsets).fillna(0).astype("int64")
    if group_views is None:
        group_views = GroupViews()
        group_views.add_rows(group_rows or [])
    groups = group_views.table()
    return Trace(
        group_views=group_views,
        path=path, run=run, world_size=world_size, ranks=dict(sorted(ranks.items())), events=events,
        ops=build_ops(events), metrics=metrics, samples=samples, groups=groups, stacks=stacks or {},
        warnings=warnings if warnings is not None else [],
    )


def force_rank(table: pa.Table, rank: int) -> pa.Table:
    """Trust the directory, not the rows: a hostile file cannot claim another rank."""
    idx = table.schema.get_field_index("rank")
    return table.set_column(idx, "rank", pa.array(np.full(len(table), rank, dtype=np.int32)))
