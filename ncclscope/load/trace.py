"""Load a run directory into tables, tolerating whatever a dying job left behind.

A hung or killed job leaves torn Arrow streams, missing rank directories,
half-written JSON and ranks that never said goodbye. None of that may stop the
analysis: each problem becomes one line in `Trace.warnings` that says what and
where, and everything else is still loaded. Nothing in it is ever written to.

Tables (pandas, one row per record, all ranks concatenated):
- `events`  : raw begin/end/instant rows (schema.EVENTS_SCHEMA) plus `t_ns`,
              the time aligned to rank 0's clock.
- `ops`     : one row per op (begin joined with its end): `start_ns`,
              `end_ns` (-1 if the op never ended), `duration_ns`, `status`
              ("inflight" when there is no end row) and the begin row's fields.
- `metrics`, `samples`, `groups` as in the schema.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa

from ncclscope.load import safe_io
from ncclscope import schema as S

from ncclscope.load.foreign.errors import TraceError
from ncclscope.load.fr_merge import FR_FILE, FR_NCCL_PREFIX, merge_rank
from ncclscope.load.columns import Columns, aligned_times, as_columns, fill_ints
from ncclscope.load.heap import copy_on_write, no_hugepages, trim
from ncclscope.load.opsjoin import build_ops
from ncclscope.load.groupviews import GroupViews
from ncclscope.load.ipc_read import read_stream_lazy
from ncclscope.load.run_info import RankExit, RunInfo
from ncclscope.load.trace_model import RankInfo, Trace

__all__ = ["RankInfo", "Trace", "TraceError", "RunDirLoader", "Tables", "apply_exit", "assemble", "clock_offsets",
           "events_frame", "load", "timed_frame"]


def _empty(schema: pa.Schema) -> pa.Table:
    return schema.empty_table()


def _read_json(path: Path | str, warnings: list[str], root: Path | None = None) -> dict[str, Any]:
    """A JSON object from a regular file of bounded size, through the guarded
    parser (safe_io.loads); {} with one warning for anything else. A declared
    world size is bounded by the rank directories on disk (`_bound_world`);
    `root`: the run directory of a rank.json, when the caller knows it (saves pathlib's parents)."""
    from ncclscope.load import safe_io
    try:
        os.stat(path)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError):
        pass       # read_bytes words the error
    try:
        data = safe_io.read_json(path)
    except safe_io.InputError as exc:
        data, line = safe_io.first_object(path) or ({}, f"{exc}; ignored")
        warnings.append(line)
    if not isinstance(data, dict):
        warnings.append(f"{path}: expected a JSON object, got {type(data).__name__}; ignored")
        return {}
    name = os.path.basename(path)
    if name in (S.RUN_JSON, S.RANK_JSON) and "world_size" in data:
        if root is None:
            p = Path(path)
            root = p.parent if name == S.RUN_JSON else p.parent.parent
        _bound_world(data, root, path, warnings)
    return data


_DIRS_CACHE: dict[str, tuple[int, dict[int, Path], int]] = {}


def _rank_dirs_cached(root: Path) -> dict[int, Path]:
    """_rank_dirs(root), listed once per directory state (its mtime) instead of once per rank.json:
    every rank.json of a 16,384-rank run asks, and 16,384 listings of 16,384 entries took minutes."""
    return _rank_dirs_entry(root)[0]


def _rank_dirs_entry(root: Path) -> tuple[dict[int, Path], int]:
    """(_rank_dirs(root), its highest rank or 0), cached as `_rank_dirs_cached` says: the highest rank is
    kept with the listing because every rank.json asks for it (max over 16,384 keys, 16,384 times: 6 s)."""
    try:
        stamp = os.stat(root).st_mtime_ns
    except (OSError, ValueError):
        ranks = _rank_dirs(root, [])
        return ranks, (max(ranks) if ranks else 0)
    hit = _DIRS_CACHE.get(str(root))
    if hit is None or hit[0] != stamp:
        _DIRS_CACHE.clear()          # one run at a time
        ranks = _rank_dirs(root, [])
        hit = _DIRS_CACHE[str(root)] = (stamp, ranks, max(ranks) if ranks else 0)
    return hit[1], hit[2]


def _bound_world(data: dict[str, Any], root: Path, where: Path, warnings: list[str]) -> None:
    """Replace a declared world_size no rank directory layout supports (2**31
    next to four directories) by the highest rank on disk + 1, with a warning."""
    from ncclscope.load import safe_io
    declared = _int(data.get("world_size"), 0)
    if declared <= 4096:
        return
    ranks, highest = _rank_dirs_entry(root)
    cap = safe_io.plausible_world(declared, len(ranks), highest)
    if declared > cap:
        warnings.append(f"{where}: says world_size {declared}, but {len(ranks)} rank directories are on disk "
                        f"(highest rank {highest}); using {highest + 1}")
        data["world_size"] = highest + 1


_int = safe_io.trace_int     # an int from input, bounded to |x| <= 2**53, else the default


def _group_sites(value: Any, limit: int = 100_000) -> dict[str, str]:
    """rank.json `group_sites` ({group: call site}); entries of any other shape are dropped."""
    if not isinstance(value, dict):
        return {}
    return {str(k)[:200]: v[:2000] for k, v in list(value.items())[:limit] if isinstance(v, str)}


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
    from ncclscope.load.safe_io import MAX_RANK
    found: dict[int, Path] = {}
    try:
        entries = sorted(path.iterdir(), key=lambda e: e.name)   # Path order within one directory, by name
    except OSError as exc:
        warnings.append(f"{path}: cannot list ({safe_io.short(exc)})")
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


def _listing(d: str) -> frozenset[str] | None:
    """The names in a rank directory (None when it cannot be listed): one listdir answers "is there a
    stacks.txt, a Flight Recorder dump" for the whole directory, where each question was a stat or a
    listing of its own (16,384 ranks: 2.4 s in fr_merge.dump_path's listing alone)."""
    try:
        return frozenset(os.listdir(d))
    except (OSError, ValueError):
        return None


def _has(names: frozenset[str] | None, d: str, name: str) -> bool:
    """Path(d, name).exists(), without the stat when the listing says it is not there."""
    if names is not None and name not in names:
        return False
    return os.path.exists(f"{d}/{name}")


def _has_dump(names: frozenset[str] | None) -> bool:
    """Whether `fr_merge.dump_path` could find a dump among `names` (True when unknown: then it looks)."""
    if names is None:
        return True
    return any(n == FR_FILE or (n.startswith(FR_NCCL_PREFIX) and not n.endswith(".tmp")) for n in names)


class RunDirLoader:
    """One run directory being loaded, rank directory by rank directory (`load`'s loop).

    Owns what the ranks add to: their RankInfo, the group views, the stacks, the three column engines
    (each rank's tables become compact columns as soon as they are read, so its read buffers go at
    once) and the highest world size a rank.json declares. `finish` adds what run.json says about each
    rank and assembles the Trace."""

    def __init__(self, root: Path, warnings: list[str]) -> None:
        self.root = root
        self.warnings = warnings
        self.ranks: dict[int, RankInfo] = {}
        self.views = GroupViews()
        self.stacks: dict[int, str] = {}
        self.events = Columns(S.EVENTS_SCHEMA)
        self.metrics = Columns(S.METRICS_SCHEMA)
        self.samples = Columns(S.SAMPLES_SCHEMA)
        self.declared_world = 0              # the highest world_size a rank.json declares (0: none)
        self.joined: Any = None              # an engine's ops, marks and times (engine/ops_chunks.py), if any

    def add_rank(self, r: int, d: Path) -> None:
        """One rank directory: rank.json, its group view, its three streams (and Flight Recorder dump), stacks.

        Paths are plain strings (str(d / name) is f"{d}/{name}" for a rank directory of `_rank_dirs`): at
        16,384 ranks pathlib's joins alone cost 2 s. Every warning reads as before."""
        warnings = self.warnings
        ds = str(d)
        names = _listing(ds)
        rank_json = f"{ds}/{S.RANK_JSON}"
        meta = _read_json(rank_json, warnings, root=self.root) if names is None or S.RANK_JSON in names else {}
        if meta and _int(meta.get("rank"), r) != r:
            warnings.append(f"{rank_json}: says rank {meta.get('rank')} but lives in {d.name}; using {r}")
        self.ranks[r] = _rank_info(r, meta)
        gpath = f"{ds}/{S.GROUPS_JSON}"
        if _has(names, ds, S.GROUPS_JSON):
            try:
                self.views.add(r, safe_io.read_bytes(gpath, safe_io.JSON_LIMIT), warnings, gpath)
            except (OSError, ValueError) as exc:     # safe_io.InputError: not a regular file, too big
                warnings.append(f"{gpath}: unreadable ({safe_io.short(exc)}); this rank's group view is unknown")
        elif isinstance(meta.get("groups"), list):   # traces written before groups.json
            self.views.add(r, meta["groups"], warnings, rank_json)
        epath = f"{ds}/{S.EVENTS_FILE}"
        dump = _has_dump(names)
        # a rank with a dump has its rows read by merge_rank: those come in the schema (no lazy fill)
        ev, absent = read_stream_lazy(epath, S.EVENTS_SCHEMA, warnings, lazy=not dump)
        if dump:
            ev = merge_rank(d, ev, warnings)      # ncclscope run: Flight Recorder-only ops (none without a dump)
        if absent:
            warnings.append(f"{epath}: missing (the rank wrote no events)")
        self.events.add(ev, rank=r)          # every row's rank is r (force_rank), set once per batch
        del ev
        self.metrics.add(read_stream_lazy(f"{ds}/{S.METRICS_FILE}", S.METRICS_SCHEMA, warnings)[0], rank=r)
        self.samples.add(read_stream_lazy(f"{ds}/{S.SAMPLES_FILE}", S.SAMPLES_SCHEMA, warnings)[0], rank=r)
        if _has(names, ds, S.STACKS_FILE):
            spath = f"{ds}/{S.STACKS_FILE}"
            try:
                self.stacks[r] = safe_io.read_text(spath)
            except (OSError, ValueError) as exc:
                warnings.append(f"{spath}: unreadable ({safe_io.short(exc)}); no stacks for rank {r}")
        self.declared_world = max(self.declared_world, _int(meta.get("world_size"), 0))

    def finish(self, run: RunInfo, world_size: int) -> Trace:
        """Ranks without a directory become RankInfo(present=False); run.json's exit codes and signals go
        onto each rank; the group views are resolved and everything is assembled."""
        ranks, root = self.ranks, self.root
        for r in range(world_size):
            if r not in ranks:
                ranks[r] = RankInfo(rank=r, present=False)
                self.warnings.append(f"{root}: rank {r} has no directory {S.rank_dir_name(r)}; analyzing the other ranks")
            ex = run.exits.get(r)
            if ex is not None:
                apply_exit(ranks[r], ex)
        self.views.resolve(self.warnings)
        return assemble(root, run, world_size, ranks, Tables(events=self.events, metrics=self.metrics,
                                                               samples=self.samples, group_views=self.views,
                                                               stacks=self.stacks, warnings=self.warnings,
                                                               joined=self.joined))


def apply_exit(info: RankInfo, ex: RankExit) -> None:
    """The launcher's view of how the rank ended (run.json `ranks`), onto its RankInfo."""
    info.exitcode, info.signal, info.stopped_by_launcher = ex.exitcode, ex.signal, ex.stopped_by_launcher


def _rank_info(r: int, meta: dict[str, Any]) -> RankInfo:
    """RankInfo of a present rank from its rank.json (`meta`, {} when there is none)."""
    end = meta.get("end") if isinstance(meta.get("end"), dict) else {}
    coords = meta.get("coords") if isinstance(meta.get("coords"), dict) else {}
    return RankInfo(
        rank=r, present=True, host=str(meta.get("host", "")), pid=_int(meta.get("pid")),
        device=str(meta.get("device", "")),
        clock_offset_ns=_int(meta.get("clock_offset_ns"), 0),
        clock_uncertainty_ns=_int(meta.get("clock_uncertainty_ns"), 0),
        host_cpus=max(_int(meta.get("host_cpus"), 0), 0),
        coords={str(k): _int(v) for k, v in coords.items()},
        end_status=str(end.get("status", "")), end_message=str(end.get("message", "")),
        call_sites=_call_sites(meta.get("call_sites")),
        cwd=str(meta.get("cwd", ""))[:4096],
        group_sites=_group_sites(meta.get("group_sites")),
    )


def load(path: str | os.PathLike[str], engine: Any = None, ops_only: bool = False) -> Trace:
    """A run directory's Trace (`engine`: read on its workers, the same Trace); TraceError only if nothing is.
    `ops_only` (with an engine): the begin/end rows are joined on the workers and only the ops and the marks
    come to this process (`Trace.ops_only`; every analysis answers the same, the TUI and exports need events)."""
    root = Path(path)
    no_hugepages()          # big fresh arrays from here on: heap.no_hugepages says why
    if not root.exists():
        raise TraceError(f"{root}: no such directory")
    if not root.is_dir():
        raise TraceError(f"{root}: not a directory (expected a run directory with rank-NNNNN/ inside)")
    warnings: list[str] = []
    run = RunInfo.from_dict(_read_json(root / S.RUN_JSON, warnings), warnings, str(root / S.RUN_JSON))
    dirs = _rank_dirs(root, warnings)
    if not dirs:
        raise TraceError(f"{root}: no rank-NNNNN directories (is this a run directory?)")
    loader = RunDirLoader(root, warnings)
    if engine is not None:
        engine.read_rank_dirs(loader, dirs, joined=ops_only)
    else:
        for r, d in dirs.items():
            loader.add_rank(r, d)
    world_size = max(run.world_size, loader.declared_world, max(dirs) + 1)
    return loader.finish(run, world_size)


@dataclass
class Tables:
    """What a loader read, for `assemble`: the event, metric and sample tables (lists of Arrow tables in
    the schema, consumed as they are converted, or the column engines `RunDirLoader` filled), the group
    table (rows, or the views already collected), the stacks and the warnings so far."""

    events: "list[pa.Table] | Columns"
    metrics: "list[pa.Table] | Columns | None" = None
    samples: "list[pa.Table] | Columns | None" = None
    group_rows: list[dict[str, Any]] | None = None
    group_views: GroupViews | None = None
    stacks: dict[int, str] | None = None
    warnings: list[str] | None = None
    joined: Any = None        # engine/ops_chunks.JoinedTables: ops, marks and times instead of event rows


def clock_offsets(ranks: dict[int, RankInfo]) -> dict[int, int]:
    """Rank -> the offset that aligns its clock to rank 0's (rank.json)."""
    return {r: int(info.clock_offset_ns) for r, info in ranks.items()}


def events_frame(tables: "list[pa.Table] | Columns", offsets: dict[int, int]) -> pd.DataFrame:
    """The events frame with `t_ns`, each row's time aligned by its rank's offset; begin rows first, so the
    ops columns can be views of them (`Columns.frame`, `opsjoin.ops_from_join`). Shared by `assemble` and
    an engine's worker, which joins its chunk's ops itself (engine/ops_chunks.py)."""
    events = fill_ints(as_columns(tables, S.EVENTS_SCHEMA).frame(lead=("phase", S.PHASE_BEGIN)), S.EVENTS_SCHEMA)
    if any(offsets.values()):
        events["t_ns"] = aligned_times(events["time_ns"].to_numpy(), events["rank"].to_numpy(), offsets)
    else:        # one clock (one host, a dump): t_ns is time_ns, one buffer under copy-on-write
        events["t_ns"] = events["time_ns"] if copy_on_write() else events["time_ns"].copy()
    return events


def timed_frame(tables: "list[pa.Table] | Columns | None", schema: pa.Schema,
                offsets: dict[int, int]) -> pd.DataFrame:
    """The metrics or samples frame, its `time_ns` aligned by each row's rank's offset."""
    df = fill_ints(as_columns(tables, schema).frame(), schema)
    if len(df):
        df["time_ns"] = aligned_times(df["time_ns"].to_numpy(), df["rank"].to_numpy(), offsets)
    return df


def assemble(path: Path, run: RunInfo, world_size: int, ranks: dict[int, RankInfo], tables: Tables) -> Trace:
    """Build a Trace from Arrow tables in the schema; used by `load` and by the
    foreign-format readers in `load/foreign/`, so every analysis sees one shape.
    The table lists are consumed (emptied) to keep peak memory near one copy."""
    no_hugepages()
    joined = tables.joined
    offsets = clock_offsets(ranks)
    # joined on an engine's workers, times aligned there: the marks stand for events
    events = joined.marks if joined is not None else events_frame(tables.events, offsets)
    metrics = timed_frame(tables.metrics, S.METRICS_SCHEMA, offsets)
    samples = timed_frame(tables.samples, S.SAMPLES_SCHEMA, offsets)
    group_views = tables.group_views
    if group_views is None:
        group_views = GroupViews()
        group_views.add_rows(tables.group_rows or [])
    groups = group_views.table()
    ops = joined.ops if joined is not None else build_ops(events)
    trim()
    return Trace(
        group_views=group_views,
        path=path, run=run, world_size=world_size, ranks=dict(sorted(ranks.items())), events=events,
        ops=ops, metrics=metrics, samples=samples, groups=groups, stacks=tables.stacks or {},
        warnings=tables.warnings if tables.warnings is not None else [],
        bounds_ns=joined.bounds_ns if joined is not None else None,
        rank_last_ns=joined.rank_last_ns if joined is not None else None, ops_only=joined is not None,
        partials=dict(joined.partials) if joined is not None else {},
    )

