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

from . import safe_io
from . import schema as S

from .ingest.errors import TraceError
from .usertrace.fr_merge import merge_rank
from .columns import _CATEGORICAL, conform_table, STATUS_INFLIGHT, _aligned, _columns, _Columns, _equals, _fill_ints, _trim, build_ops, no_hugepages, _force_rank  # noqa: F401,E501
from .groupviews import GROUP_ROW_BUDGET, GroupViews, _parse_view  # noqa: F401


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
    # call site -> (function name, its def line), from rank.json `call_sites` (the runtime's own traces)
    call_sites: dict[str, tuple[str, int]] = field(default_factory=dict)

    @property
    def died(self) -> bool:
        """A signal or an error ended the process (state killed or failed), not the launcher's stop."""
        return self.state in ("killed", "failed")

    @property
    def state(self) -> str:
        """finished | failed | killed | stopped | unknown | missing: how the process ended.

        "stopped" means the rank was still alive (hung or waiting) when the
        launcher (or torchrun's agent, or a scheduler's SIGTERM) ended the job;
        "killed" means a signal ended it first."""
        if not self.present:
            return "missing"
        if self.signal and not self.stopped_by_launcher:
            return "killed"
        terminated = self.end_status == "error" and self.end_message == S.END_TERMINATED
        if self.stopped_by_launcher or terminated:
            # SIGTERM's evidence path ended it: the job was being stopped (after another rank's
            # failure, or by a scheduler), which is not a failure of this rank's own
            return "failed" if self.end_status == "error" and not terminated else "stopped"
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
    same = table.replace_schema_metadata(schema.metadata)      # already in this schema: nothing to conform
    if same.schema.equals(schema, check_metadata=True):
        return same
    return conform_table(table, schema, path, warnings)


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


def _call_sites(value: Any, limit: int = 100_000) -> dict[str, tuple[str, int]]:
    """rank.json `call_sites` ({site: [function, def line]}); entries of any other shape are dropped."""
    out: dict[str, tuple[str, int]] = {}
    if not isinstance(value, dict):
        return out
    for site, v in list(value.items())[:limit]:
        if isinstance(site, str) and isinstance(v, list) and len(v) == 2 and isinstance(v[0], str):
            first = _int(v[1])
            if first >= 0:
                out[site] = (v[0], first)
    return out


def _rank_dirs(path: Path, warnings: list[str]) -> dict[int, Path]:
    """rank -> its directory, for every rank-N directory with a plausible N: a
    30-digit name or a stray rank-1000000000 next to four real directories is
    skipped with a warning instead of making a world of a billion ranks."""
    from .safe_io import MAX_RANK
    found: dict[int, Path] = {}
    try:
        entries = sorted(path.iterdir(), key=lambda e: e.name)   # Path order within one directory, by name
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


def load(path: str | os.PathLike[str]) -> Trace:
    """Load a run directory. Raises TraceError only when nothing can be analyzed."""
    root = Path(path)
    no_hugepages()          # big fresh arrays from here on: columns.no_hugepages says why
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
            call_sites=_call_sites(meta.get("call_sites")),
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
        ev = merge_rank(d, ev, warnings)      # ncclscope run: Flight Recorder-only ops (none without a dump)
        if not (d / S.EVENTS_FILE).exists():
            warnings.append(f"{d / S.EVENTS_FILE}: missing (the rank wrote no events)")
        event_tables.add(ev, rank=r)          # every row's rank is r (force_rank), set once per batch
        del ev
        metric_tables.add(read_stream(d / S.METRICS_FILE, S.METRICS_SCHEMA, warnings), rank=r)
        sample_tables.add(read_stream(d / S.SAMPLES_FILE, S.SAMPLES_SCHEMA, warnings), rank=r)
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
    no_hugepages()
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
    """Trust the directory, not the rows: a hostile file cannot claim another rank. (`load` has the column
    engine do it per batch: `_Columns.add(table, rank=r)`.)"""
    return _force_rank(table, rank)
