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
        out: dict[str, list[int]] = {}
        if not len(self.groups):
            return out
        views = self.groups.assign(key=self.groups["ranks"].map(lambda r: tuple(int(x) for x in r)))
        for name, sub in views.groupby("process_group", observed=True):
            out[str(name)] = list(sub["key"].value_counts().index[0])
        return out

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
        source = pa.memory_map(str(path), "r")
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
    return _conform(table, schema, path, warnings)


def _conform(table: pa.Table, schema: pa.Schema, path: Path, warnings: list[str]) -> pa.Table:
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


def _to_pandas(table: pa.Table) -> pd.DataFrame:
    arrays = []
    for name, col in zip(table.column_names, table.columns):
        if name in _CATEGORICAL and pa.types.is_string(col.type):
            col = col.fill_null("").dictionary_encode()
        arrays.append(col)
    return pa.Table.from_arrays(arrays, names=table.column_names).to_pandas()


def _fill_ints(df: pd.DataFrame, schema: pa.Schema) -> pd.DataFrame:
    for fld in schema:
        if pa.types.is_integer(fld.type) and df[fld.name].isna().any():
            df[fld.name] = df[fld.name].fillna(-1)
        if pa.types.is_integer(fld.type):
            df[fld.name] = df[fld.name].astype(fld.type.to_pandas_dtype())
    return df


def build_ops(events: pd.DataFrame) -> pd.DataFrame:
    """Join each begin row with its end row: one row per op, vectorised.

    Ops with no end row get status "inflight" and end_ns -1: on a dead or hung
    job they are the evidence. An end row without a begin (torn begin) is kept
    with start_ns equal to its end.
    """
    begins = events[events["phase"] == S.PHASE_BEGIN]
    ends = events[events["phase"] == S.PHASE_END][["rank", "op_id", "t_ns", "status", "message"]]
    ends = ends.drop_duplicates(["rank", "op_id"], keep="last")
    ops = begins.drop(columns=["phase", "status", "message", "time_ns"]).rename(columns={"t_ns": "start_ns"})
    ops = ops.merge(ends.rename(columns={"t_ns": "end_ns"}), on=["rank", "op_id"], how="left")
    ended = ops["end_ns"].notna()
    ops["end_ns"] = ops["end_ns"].fillna(-1).astype("int64")
    status = ops["status"].astype(object).where(ended, STATUS_INFLIGHT)
    ops["status"] = pd.Categorical(status)
    ops["message"] = ops["message"].astype(object).where(ended, "")
    ops["duration_ns"] = np.where(ended, ops["end_ns"] - ops["start_ns"], -1).astype("int64")
    return ops.sort_values(["rank", "start_ns", "op_id"], kind="stable").reset_index(drop=True)


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
    event_tables, metric_tables, sample_tables, group_rows = [], [], [], []
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
        for g in meta.get("groups", []) if isinstance(meta.get("groups"), list) else []:
            if isinstance(g, dict) and "name" in g:
                group_rows.append({
                    "rank": r, "process_group": str(g["name"]), "group_kind": str(g.get("kind", "custom")),
                    "ranks": [_int(x) for x in g.get("ranks", []) if isinstance(x, (int, str))],
                    "creation_order": _int(g.get("creation_order")), "backend": str(g.get("backend", "")),
                })
        ev = read_stream(d / S.EVENTS_FILE, S.EVENTS_SCHEMA, warnings)
        if not (d / S.EVENTS_FILE).exists():
            warnings.append(f"{d / S.EVENTS_FILE}: missing (the rank wrote no events)")
        event_tables.append(_force_rank(ev, r))
        metric_tables.append(_force_rank(read_stream(d / S.METRICS_FILE, S.METRICS_SCHEMA, warnings), r))
        sample_tables.append(_force_rank(read_stream(d / S.SAMPLES_FILE, S.SAMPLES_SCHEMA, warnings), r))
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

    return assemble(root, run, world_size, ranks, event_tables, metric_tables, sample_tables, group_rows,
                    stacks, warnings)


def assemble(
    path: Path, run: dict[str, Any], world_size: int, ranks: dict[int, RankInfo],
    event_tables: list[pa.Table], metric_tables: list[pa.Table] | None = None,
    sample_tables: list[pa.Table] | None = None, group_rows: list[dict[str, Any]] | None = None,
    stacks: dict[int, str] | None = None, warnings: list[str] | None = None,
) -> Trace:
    """Build a Trace from Arrow tables in the schema; used by `load` and by the
    foreign-format readers in `ingest/`, so every analysis sees one shape."""
    def cat(tables: list[pa.Table] | None, sch: pa.Schema) -> pa.Table:
        return pa.concat_tables(tables) if tables else sch.empty_table()

    events = _fill_ints(_to_pandas(cat(event_tables, S.EVENTS_SCHEMA)), S.EVENTS_SCHEMA)
    offsets = pd.Series({r: info.clock_offset_ns for r, info in ranks.items()}, dtype="int64")
    events["t_ns"] = events["time_ns"] + events["rank"].map(offsets).fillna(0).astype("int64")
    metrics = _fill_ints(_to_pandas(cat(metric_tables, S.METRICS_SCHEMA)), S.METRICS_SCHEMA)
    samples = _fill_ints(_to_pandas(cat(sample_tables, S.SAMPLES_SCHEMA)), S.SAMPLES_SCHEMA)
    if len(samples):
        samples["time_ns"] = samples["time_ns"] + samples["rank"].map(offsets).fillna(0).astype("int64")
    if len(metrics):
        metrics["time_ns"] = metrics["time_ns"] + metrics["rank"].map(offsets).fillna(0).astype("int64")
    groups = pd.DataFrame(group_rows or [], columns=S.GROUP_COLUMNS)
    return Trace(
        path=path, run=run, world_size=world_size, ranks=dict(sorted(ranks.items())), events=events,
        ops=build_ops(events), metrics=metrics, samples=samples, groups=groups, stacks=stacks or {},
        warnings=warnings if warnings is not None else [],
    )


def _force_rank(table: pa.Table, rank: int) -> pa.Table:
    """Trust the directory, not the rows: a hostile file cannot claim another rank."""
    idx = table.schema.get_field_index("rank")
    return table.set_column(idx, "rank", pa.array(np.full(len(table), rank, dtype=np.int32)))
