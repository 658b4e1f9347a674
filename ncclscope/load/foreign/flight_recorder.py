"""PyTorch Flight Recorder dumps -> Trace.

    ncclscope analyze /tmp/fr_dumps/          # one dump per rank, pickle or JSON

What a dump is: one file per rank, written by the NCCL watchdog on a timeout
(TORCH_FR_DUMP_TEMP_FILE=<prefix>, the file is <prefix><rank>) or on demand
(`torch._C._distributed_c10d._dump_fr_trace()` returns the pickle,
`_dump_fr_trace_json()` the JSON). Format version 2.x: a dict with `version`,
`pg_config` ({pg_name: {name, desc, ranks}}), `pg_status` and `entries`, one
per recorded op: `record_id` (process-wide ring-buffer index), `process_group`
(pg_name, desc), `collective_seq_id`, `p2p_seq_id`, `profiling_name`
("nccl:all_reduce", "nccl:send 0->1"), `input_sizes`, `input_dtypes`,
`state` (scheduled | started | completed), `time_created_ns`,
`time_discovered_*_ns`, `timeout_ms`, `is_p2p`, `thread_id`, `frames`.

Mapping (see docs/ingest.md for the whole table):
- every entry -> a begin row at `time_created_ns`; a completed one also gets an
  end row at `time_discovered_completed_ns` (status ok); `scheduled`/`started`
  entries get none, i.e. they are in flight, which is the evidence of a hang;
- p2p entries (is_p2p, or nccl:send / nccl:recv) -> kind p2p with the peer's
  global rank and `p2p_seq_id` = the k-th op of this rank in that direction
  with that peer (how our runtime and `hang/p2p.py` count), aligned between
  the two sides when a ring buffer wrapped (see `p2p_sequences`);
- groups come from `pg_config` when it lists members; otherwise (gloo writes an
  empty pg_config) they are rebuilt from the entries: default_pg spans the
  world, any other group the ranks that recorded an op on it;
- a rank with no dump is RankInfo(present=False): the hang analysis treats it
  as dead, which is what a missing dump usually means.

Ring buffers wrap (2000 entries by default), and they wrap at different
points on different ranks, so alignment is per process group by
`collective_seq_id`, never by `record_id` (which is process-local). Completed
ops older than what every member of their group still holds are dropped, so
an evicted entry never reads as "rank r never joined"; in-flight ops are
always kept.

gloo records much less (platform-notes.md): no p2p, `state` stays
`scheduled`, no completion time. Completion is inferred, see `infer_gloo`.
"""
from __future__ import annotations

import gc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ncclscope.load import safe_io
from ncclscope import schema as S
from ncclscope.load.heap import trim
from ncclscope.load.trace import RankInfo, RunInfo, Tables, Trace, TraceError, assemble
from ncclscope.load.foreign.fr_entries import Entries
from ncclscope.load.foreign.fr_extras import DUMP_MARKER, dump_markers, pending_stacks
from ncclscope.load.foreign.fr_fixup_stage import FixedUp
from ncclscope.load.foreign.fr_groups import build_group_rows, config_disagreements
from ncclscope.load.foreign.fr_memory import slim_tables
from ncclscope.load.foreign.fr_read import (SNIFF_BYTES, SUPPORTED_MAJOR, DumpBuffer, call_site, dump_files, format_stack,
                                            rank_from_name, read_dump, sniff)
from ncclscope.load.foreign.vocab import coded, events_table, parse_ranks
from ncclscope.load.foreign.fr_world import family_floor, group_floors, group_widths, world_from_shapes
from ncclscope.ranklists import fmt_ranks

__all__ = ["load_flight_recorder", "sniff", "rank_from_name", "dump_files", "read_dump", "call_site", "format_stack",
           "Entries", "SUPPORTED_MAJOR", "SNIFF_BYTES", "INFERRED_NOTE", "DUMP_MARKER"]

INFERRED_NOTE = "completion inferred: gloo Flight Recorder records none"


# --------------------------------------------------------------------------
# Loader
# --------------------------------------------------------------------------
def load_flight_recorder(path: str | Path, world_size: int | None = None, engine: Any = None) -> Trace:
    """Load a directory of per-rank Flight Recorder dumps (or one dump file).

    `world_size` overrides what the dumps imply (the largest rank seen, the
    members of default_pg); give it when the highest ranks' dumps are missing
    on gloo, whose dumps do not list group members."""
    enabled = gc.isenabled()
    gc.disable()            # millions of small containers, no cycles: the collector only costs time
    try:
        return _load(path, world_size, engine)
    finally:
        if enabled:
            gc.enable()


def _load(path: str | Path, world_size: int | None, engine: Any = None) -> Trace:
    """read -> fix up -> assemble: the dumps' entries as columns (`_read`), the columns a dump does not
    hold directly (`fr_fixup_stage.FixedUp`), then rows, groups and run info into `trace.assemble`."""
    read = _read(Path(path), world_size, engine)
    if not read.ents.n:
        read.warnings.append(f"{read.root}: the dumps hold no entries (Flight Recorder off, or nothing ran yet)")
        ranks = {r: RankInfo(rank=r, present=r in read.dumps) for r in range(read.world)}
        run = RunInfo.from_dict({"source": "flight_recorder", "world_size": read.world})
        return assemble(read.root, run, read.world, ranks,
                        Tables(events=[], group_rows=[], stacks={}, warnings=read.warnings))
    fixed = FixedUp(read.ents, read.dumps, read.world, world_size, read.warnings, read.widths)
    return _assemble(read, fixed)


@dataclass
class _Read:
    """Stage 1: every readable dump's entries (one `Entries`), the rest of each dump, and the world."""

    root: Path
    files: dict[int, tuple[Path, str]]         # rank -> (dump file, format)
    dumps: dict[int, dict[str, Any]]           # rank -> everything but the entries
    versions: dict[str, list[int]]             # format version -> ranks that wrote it
    ents: Entries
    world: int
    warnings: list[str]
    widths: dict[str, int]                     # pg name -> its size by its all_gather shapes (fr_world)


def _dump_files(root: Path, warnings: list[str]) -> dict[int, tuple[Path, str]]:
    """rank -> (file, format) of a directory of dumps, or of one dump file."""
    if root.is_dir():
        files = dump_files(root, warnings)
        if not files:
            raise TraceError(f"{root}: no Flight Recorder dumps (files named <prefix><rank>, pickle or JSON)")
        return files
    if root.is_file():
        fmt = sniff(root)
        rank = rank_from_name(root.name)
        if fmt is None:
            raise TraceError(f"{root}: not a Flight Recorder dump")
        if rank is not None and rank > 4095:
            warnings.append(f"{root}: rank {rank} from the file name is not plausible for a single dump; read as rank 0")
            rank = None
        return {rank if rank is not None else 0: (root, fmt)}
    raise TraceError(f"{root}: no such file or directory")


def add_dumps(items: list[tuple[int, tuple[Path, str]]], ents: Entries, dumps: dict[int, dict[str, Any]],
              versions: dict[str, list[int]], warnings: list[str]) -> None:
    """Read these dumps (rank order) into `ents`, `dumps` (all but the entries) and `versions` (one read buffer
    for all); a dump that cannot be read costs its rank only. Public: an engine worker runs this on its chunk
    (engine/dump_chunks.py)."""
    buffer = DumpBuffer()
    for rank, (file, fmt) in items:
        try:
            dump = read_dump(file, fmt, buffer)
        except TraceError as exc:
            if type(exc) is not TraceError:   # UnsafePickleError: refuse the whole input, loudly
                raise
            warnings.append(f"{exc}; rank {rank} treated as having no dump")
            continue
        try:
            ents.add(rank, dump.pop("entries"))
        except Exception as exc:   # noqa: BLE001 - a hostile field: this dump is lost, not the analysis
            warnings.append(f"{file}: entries unusable ({type(exc).__name__}: {safe_io.short(exc)}); "
                            f"rank {rank} treated as having no dump")
            continue
        dumps[rank] = dump
        versions.setdefault(str(dump.get("version", "?")), []).append(rank)


def _read(root: Path, world_size: int | None, engine: Any = None) -> _Read:
    """Stage 1: read every dump (one read buffer for all), a dump that cannot be read costing its rank
    only; the world from the ranks, pg_config's plausible members and `world_size`."""
    warnings: list[str] = []
    files = _dump_files(root, warnings)
    dumps: dict[int, dict[str, Any]] = {}
    versions: dict[str, list[int]] = {}
    ents = Entries()
    items = sorted(files.items())
    if engine is not None:
        engine.read_dumps(items, ents, dumps, versions, warnings)
    else:
        add_dumps(items, ents, dumps, versions, warnings)
    if not dumps:
        raise TraceError(f"{root}: no readable Flight Recorder dump")
    for v, rs in versions.items():
        if v.split(".", 1)[0] != SUPPORTED_MAJOR:
            warnings.append(f"dump format version {v} (ranks {rs[:8]}): this reader knows {SUPPORTED_MAJOR}.x; "
                            "reading what it recognises")
    if len(versions) > 1:
        warnings.append(f"ranks wrote different dump versions: {sorted(versions)}")
    ents.finish()
    trim()             # the per-dump pieces' heap (~0.25 GB at 2 M entries) goes back before the next stage
    world = _world(files, dumps, world_size, warnings)
    widths = group_widths(ents, cap=max(8 * len(files), 4096))
    if not world_size:        # gloo lists no members: the default group's all_gather shapes may say more (fr_world)
        implied = world_from_shapes(ents, widths)
        if implied is not None and implied > world:
            warnings.append(f"the default group's all_gather shapes say the world has {implied} ranks; the dumps "
                            f"end at rank {world - 1}, so rank(s) {fmt_ranks(list(range(world, implied)))} "
                            "left no dump")
            world = implied
        mesh = family_floor(ents, widths)
        if mesh > world:      # a mesh dimension's groups hold that many distinct ranks (fr_world.family_floor)
            warnings.append(f"consecutively created groups of one size with no rank in common (a mesh dimension) "
                            f"hold at least {mesh} ranks; the dumps end at rank {world - 1}, so rank(s) "
                            f"{fmt_ranks(list(range(world, mesh)))} left no dump")
            world = mesh
        floor = max([*widths.values(), *group_floors(ents).values(), 0])
        if floor > world:     # no group is larger than the world: ranks up to floor - 1 exist
            warnings.append(f"a group's all_gather or all_to_all shapes say it has at least {floor} members; the "
                            f"dumps end at rank {world - 1}, so the world has at least {floor} ranks and rank(s) "
                            f"{fmt_ranks(list(range(world, floor)))} left no dump")
            world = floor
        if world == 1 and len(ents.rank):
            # torch writes these dumps on a timeout or an error, and a job of one rank has nothing to hang on:
            # the others left no dump (their processes died first). Read as one rank, a failed job's lone dump
            # read OK (seeds 20261210 #155, 20261213 #109, 20261214 #251: rank 1 exited or raised)
            world = 2
            warnings.append("only rank 0's dump, and nothing in it counts another rank: read as a job of at least "
                            "2 ranks, rank 1 (and any above it) without a dump; give --world-size N for the "
                            "job's number of ranks")
    return _Read(root, files, dumps, versions, ents, world, warnings, widths)


def _world(files: dict[int, tuple[Path, str]], dumps: dict[int, dict[str, Any]], world_size: int | None,
           warnings: list[str]) -> int:
    """The highest rank + 1, grown by pg_config's members; member lists naming implausible ranks are
    emptied (in memory) with a warning; `world_size`, when given, wins."""
    world = max(max(files) + 1, world_size or 0)
    cap = safe_io.plausible_world(1, len(files), max(max(files), world - 1))
    implausible: set[str] = set()
    for dump in dumps.values():
        cfg = dump.get("pg_config")
        if isinstance(cfg, dict):
            for pg_name, info in cfg.items():
                members = parse_ranks(info.get("ranks")) if isinstance(info, dict) else None
                if members and max(members) >= cap:     # 10**11: not a rank of a job with these dumps
                    implausible.add(safe_io.clean_text(pg_name)[:40])
                    info["ranks"] = []                   # the in-memory copy; the file is not touched
                elif members:
                    world = max(world, max(members) + 1)
    if implausible:
        names = sorted(implausible)
        warnings.append(f"pg_config of group(s) {', '.join(names[:8])}{' ...' if len(names) > 8 else ''} names "
                        f"ranks of {cap} or more next to {len(files)} dump(s); those member lists are ignored")
    if world_size and world_size <= max(files):
        warnings.append(f"world size {world_size} given, but there is a dump of rank {max(files)}: the world is "
                        f"taken as {max(files) + 1}")
        return max(files) + 1
    return world_size if world_size else world


def _assemble(read: _Read, fixed: FixedUp) -> Trace:
    """Stage 3: begin/end rows of the kept entries plus one marker per dump, the stacks of in-flight ops,
    the group table, the run info; the per-entry columns are freed before the tables are built."""
    ents, f, files, warnings = read.ents, fixed, read.files, read.warnings
    present = f.present
    markers = dump_markers(ents.rank_stats, files, present, warnings)
    stacks = pending_stacks(ents, ~f.completed & f.keep, f.op_names, f.op, f.labels, f.label, f.peer, f.p2p_seq,
                            f.is_p2p)
    backend_of_label = f.backend_of_label(ents)
    cols = {"rank": ents.rank, "op_id": ents.record_id, "kind": f.is_p2p, "op_name": f.op, "process_group": f.label,
            "collective_seq_id": ents.cseq, "p2p_seq_id": f.p2p_seq, "peer": f.peer, "bytes": f.nbytes,
            "input_dtypes": f.dtype_code, "input_sizes": f.size_code, "timeout_ms": ents.timeout_ms,
            "call_site": ents.site_code, "time_ns": ents.created, "ended": f.completed, "end_ns": f.end_ns,
            "inferred": f.inferred}
    texts = {"op_name": f.op_names, "process_group": f.labels, "input_dtypes": f.dtype_texts,
             "input_sizes": f.size_texts, "call_site": ents.sites}      # sizes: "[[8]] -> [[16]]" with outputs
    keep = f.keep
    # the per-entry columns are spent but for `cols`: free them before the tables are built (~0.4 GB at 2 M entries)
    f.release()
    del ents
    read.ents = None          # type: ignore[assignment]
    tables = _event_tables(cols, keep, texts)
    del cols, keep
    trim()
    tables.append(markers)

    world = f.world
    ranks = {r: RankInfo(rank=r, present=r in present, group_ids=f.group_ids.get(r, {})) for r in range(world)}
    for r in range(world):
        if r not in files:
            warnings.append(f"rank {r}: no Flight Recorder dump (the rank died or never dumped); "
                            "analyzing the other ranks")
    group_rows = build_group_rows(f.labels, f.members_of_label, f.info_of_label, present, backend_of_label)
    group_rows += config_disagreements(read.dumps, set(f.labels), set(f.pair_pg))
    run = {
        "source": "flight_recorder", "format": sorted({fmt for _, fmt in files.values()}),
        "version": sorted(read.versions), "backend": ",".join(sorted(set(f.backend_of_pn) - {""})),
        "world_size": world, "dumps": {str(r): str(files[r][0]) for r in sorted(files)},
        "comm_lib_version": next((str(d.get("comm_lib_version", "")) for d in read.dumps.values()), ""),
        "members_rebuilt": f.rebuilt,        # groups no pg_config listed: their size is a guess (hang/shape_rules)
    }
    return slim_tables(assemble(read.root, RunInfo.from_dict(run), world, ranks,
                                Tables(events=tables, group_rows=group_rows, stacks=stacks, warnings=warnings)))


def _kept(cols: dict[str, np.ndarray], keep: np.ndarray) -> dict[str, Any]:
    """The event columns of the kept entries, each source column dropped as soon as its kept copy
    is made (the peak is the kept columns plus what is left of the sources, not both in full)."""
    all_kept = bool(keep.all())
    kept = None if all_kept else np.flatnonzero(keep)
    out: dict[str, Any] = {}
    for name in list(cols):
        col = cols.pop(name)
        out[name] = col if all_kept else col[kept]
        del col
    return out


def _event_tables(cols: dict[str, np.ndarray], keep: np.ndarray, texts: dict[str, list[str]]) -> list[pa.Table]:
    """Begin rows for the kept entries, end rows for those that completed. String columns stay
    dictionary-encoded (codes into the few distinct values) up to trace.assemble; the end rows are
    the begin rows filtered, with their own phase, time, status and message."""
    c = _kept(cols, keep)
    n = len(c["rank"])
    is_p2p = c.pop("kind")
    common: dict[str, Any] = {
        "rank": c.pop("rank"), "op_id": c.pop("op_id"),
        "kind": coded(is_p2p.astype(np.int32), [S.KIND_COLLECTIVE, S.KIND_P2P], decode=False),
        "collective_seq_id": np.where(is_p2p, -1, c.pop("collective_seq_id")), "p2p_seq_id": c.pop("p2p_seq_id"),
        "peer": c.pop("peer"), "tag": np.where(is_p2p, 0, -1), "bytes": c.pop("bytes"),
        "timeout_ms": c.pop("timeout_ms"),
    }
    del is_p2p
    for name in ("op_name", "process_group", "input_dtypes", "input_sizes", "call_site"):
        common[name] = coded(c.pop(name), texts[name], decode=False)
    ended, end_ns, inferred = c.pop("ended"), c.pop("end_ns"), c.pop("inferred")
    begin = events_table({**common, "phase": S.PHASE_BEGIN, "time_ns": c.pop("time_ns")}, n, dictionary=True)
    del common
    end = begin.filter(pa.array(ended))
    m = end.num_rows
    note = coded(inferred[ended].astype(np.int32), ["", INFERRED_NOTE][:1 + int(inferred.any())], decode=False)
    own = events_table({"phase": S.PHASE_END, "time_ns": end_ns[ended], "status": S.STATUS_OK, "message": note}, m,
                       dictionary=True)
    for name in ("phase", "time_ns", "status", "message"):
        i = end.schema.get_field_index(name)
        end = end.set_column(i, own.schema.field(name), own.column(name))
    return [begin, end]
