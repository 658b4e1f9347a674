"""PyTorch profiler traces (Chrome trace JSON, optionally gzipped) -> Trace.

    ncclscope analyze ./profiles/      # one <name>.pt.trace.json[.gz] per rank

What is read from each rank's trace (everything else is skipped unparsed):
- communication ops: on GPU traces the NCCL kernels (`ncclKernel_*`,
  `ncclDevKernel_*`, cat "kernel"), whose args carry "Collective name",
  "Process Group Name/Description/Ranks", "In msg nelems", "dtype",
  "Src Rank"/"Dst Rank" for p2p; on CPU traces (gloo) the `gloo:*`
  user annotations, with "Input Dims"/"Input type" when record_shapes was on,
  and the peer of a send/recv from the `c10d::send` / `c10d::recv_` op that
  issued it. Where a GPU trace has no kernels, `record_param_comms` CPU ops
  stand in;
- steps: `ProfilerStep#N` spans (schedule + `prof.step()`) -> `step` on every
  row inside, and one metrics row per step with its duration;
- microbatches: `torch.distributed.pipelining` annotations (`PP:1F3`,
  `Forward 3`, `Backward 3`) and names like `forward_mb3` / `bwd 3` -> compute
  rows with step, microbatch and stage, the shape the bubble analysis needs.

The rank comes from `distributedInfo.rank`, else from the file name
(`rank3`, `rank_3`, `...3.pt.trace.json`). Times: `baseTimeNanoseconds` +
ts (µs) is the wall clock, comparable across ranks on one host (on several
hosts, as good as their NTP). Profiler traces hold finished ops only.

Speed: kineto writes one event per indented block, so the reader finds the
interesting events with one regex pass over the text and json-parses only
those (usually well under 1% of a trace); any other layout falls back to a
full `json.loads`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ncclscope.load import safe_io
from ncclscope.load.trace import RankInfo, RunInfo, Tables, Trace, TraceError, assemble
from ncclscope.load.foreign.prof_clock import time_base_warning
from ncclscope.load.foreign.prof_read import (CUT_OFF, SNIFF_BYTES, UNKNOWN_GROUP, header_and_events, read_trace_bytes,
                                              rank_from_name, sniff, trace_files)
from ncclscope.load.foreign.prof_rows import comm_table, metrics_table, rank_rows, to_number
from ncclscope.load.foreign.vocab import GroupNamer, group_kind, parse_ranks

__all__ = ["load_profiler", "sniff", "trace_files", "rank_from_name", "SNIFF_BYTES", "UNKNOWN_GROUP"]

# --------------------------------------------------------------------------
# Loader
# --------------------------------------------------------------------------
_Parsed = dict[int, tuple[Path, dict[str, Any], dict[str, Any], int]]     # rank -> (file, header, rows, base ns)
_View = tuple[str, str, "tuple[int, ...] | None", str]                      # (pg name, desc, members, backend)


def load_profiler(path: str | Path) -> Trace:
    """Load a directory of per-rank profiler traces (or one trace file): read every file, settle the
    world and the groups, then one comm table and one metrics table per rank into `assemble`."""
    root = Path(path)
    if root.is_dir():
        files = trace_files(root)
        if not files:
            raise TraceError(f"{root}: no PyTorch profiler traces (*.json / *.json.gz with traceEvents)")
    elif root.is_file():
        files = [root]
    else:
        raise TraceError(f"{root}: no such file or directory")
    warnings: list[str] = []
    cap = safe_io.plausible_world(1, len(files), len(files) - 1)     # no rank or member at or past this
    parsed = _read_ranks(files, cap, warnings)
    if not parsed:
        first = f" ({warnings[0]})" if warnings else ""
        raise TraceError(f"{root}: no readable profiler trace{first}")
    _require_rows(root, parsed, len(files))
    world = _world(parsed, len(files), cap, warnings)
    clocks = time_base_warning(_windows(parsed))
    if clocks:
        warnings.append(clocks)
    group_views = {r: _views(header, cap) for r, (_, header, _, _) in parsed.items()}
    tables, metric_tables, group_rows, ranks = _rank_tables(parsed, group_views, world, warnings)
    _pipeline_from_annotations(parsed, ranks, group_rows, warnings)
    # Ranks without a trace are untraced, not missing: a job profiles a sample of its ranks (a trace per rank
    # is GBs), so no warning per rank; the faces say "N of M ranks traced" and the index calls them untraced.
    for r in range(world):
        ranks.setdefault(r, RankInfo(rank=r, present=False))
    run = {"source": "torch_profiler", "world_size": world, "files": {str(r): str(v[0]) for r, v in parsed.items()},
           "backend": ",".join(sorted({b for views in group_views.values() for *_, b in views if b}))}
    return assemble(root, RunInfo.from_dict(run), world, ranks, Tables(events=tables, metrics=metric_tables, group_rows=group_rows,
                                                   warnings=warnings))


def _dist_info(header: dict[str, Any]) -> dict[str, Any]:
    return header.get("distributedInfo") if isinstance(header.get("distributedInfo"), dict) else {}


def _read_ranks(files: list[Path], cap: int, warnings: list[str]) -> _Parsed:
    """Each file's interesting rows, by rank: `distributedInfo.rank`, else the file name, else (a rank
    read twice, or none) the lowest free rank, with a warning. A file that cannot be read is skipped."""
    parsed: _Parsed = {}
    pending: list[tuple[Path, dict[str, Any], dict[str, Any], int]] = []
    for f in files:
        try:
            header, rows, base_ns = _read_one(f)
        except TraceError as exc:
            warnings.append(f"{exc}; skipped")
            continue
        except Exception as exc:   # noqa: BLE001 - a hostile file costs itself, not the analysis
            warnings.append(f"{f}: unusable ({type(exc).__name__}: {safe_io.short(exc)}); skipped")
            continue
        if header.get(CUT_OFF):
            warnings.append(f"{f}: cut off inside traceEvents (the profiler stopped while writing it?); "
                            "the events before the cut are read")
        info = _dist_info(header)
        rank = safe_io.to_int(info.get("rank"), -1, 0, cap - 1) if info else -1
        if rank < 0:
            r = rank_from_name(f.name)
            rank = r if r is not None and r < cap else -1
        if rank < 0 or rank in parsed:
            if rank in parsed:
                warnings.append(f"{f}: rank {rank} already read from {parsed[rank][0].name}; assigned a free rank")
            pending.append((f, header, rows, base_ns))
            continue
        parsed[rank] = (f, header, rows, base_ns)
    for f, header, rows, base_ns in pending:
        rank = next(r for r in range(len(parsed) + len(pending) + 1) if r not in parsed)
        warnings.append(f"{f}: no distributedInfo and no rank in the file name; read as rank {rank}")
        parsed[rank] = (f, header, rows, base_ns)
    return parsed


def _read_one(f: Path) -> tuple[dict[str, Any], dict[str, Any], int]:
    """(top-level fields, interesting rows, base ns) of one file. The file's text is held only here: the
    event and launch readers look into it, and are done when rank_rows returns."""
    text = read_trace_bytes(f)
    header, events, launches = header_and_events(text, f)
    base_ns = safe_io.to_int(header.get("baseTimeNanoseconds"), 0, -(2**62), 2**62)
    return header, rank_rows(header, events, base_ns, launches), base_ns


def _has_rows(rows: dict[str, Any]) -> bool:
    """Whether a rank's trace gave anything to analyze: a communication op or a microbatch annotation."""
    return bool(rows["comm"] or rows["mbs"])


def _require_rows(root: Path, parsed: _Parsed, n_files: int) -> None:
    """TraceError, worded by the real reason, when no trace gave a single row: a single-GPU or single-process
    trace has no communication ops, and that (not whichever warning came first) is what the one line says."""
    if any(_has_rows(rows) for _, _, rows, _ in parsed.values()):
        return
    files = [f for f, _, _, _ in parsed.values()]
    others = f" (and {len(files) - 1} more traces without any)" if len(files) > 1 else ""
    if n_files > len(files):
        others += f"; {n_files - len(files)} more unreadable"
    cut = [f for f, header, _, _ in parsed.values() if header.get(CUT_OFF)]
    if cut:
        raise TraceError(f"{root}: nothing readable: {cut[0]} is cut off inside traceEvents before its first "
                         f"communication op{others}")
    where = ("this profiler trace" if root.is_file() else
             f"the profiler trace {files[0].name}" if len(files) == 1 else f"any of its {len(files)} profiler traces")
    raise TraceError(f"{root}: no communication ops in {where} (no NCCL kernels, gloo:* annotations, "
                     "record_param_comms or pipeline microbatch annotations): a single-process trace has nothing "
                     "for ncclscope to analyze")


def _windows(parsed: _Parsed) -> dict[int, tuple[int, int]]:
    """Each rank's (first, last) event time, for the were-they-taken-together check: only the ranks with a
    baseTimeNanoseconds when some have one (a trace without it, e.g. an old one cut before its tail, is on
    another scale, which `_world`'s warning already says)."""
    based = any(base for _, _, _, base in parsed.values())
    return {r: rows["window"] for r, (_, _, rows, base) in parsed.items() if rows["window"] and (base or not based)}


def _world(parsed: _Parsed, n_files: int, cap: int, warnings: list[str]) -> int:
    """The world size: the highest rank read + 1, or a plausible declared `world_size` above it."""
    world = max(parsed) + 1
    for _, header, _, _ in parsed.values():
        declared = safe_io.to_int(_dist_info(header).get("world_size"), 0)
        if declared >= cap:
            warnings.append(f"distributedInfo says world_size {declared} next to {n_files} trace file(s); "
                            "not believed")
            declared = 0
        world = max(world, declared)
    missing_base = [r for r, v in parsed.items() if v[3] == 0]
    if missing_base and len(parsed) > 1:
        warnings.append(f"ranks {missing_base[:8]}: trace has no baseTimeNanoseconds; times taken as absolute µs")
    return world


def _views(header: dict[str, Any], cap: int) -> list[_View]:
    """One rank's groups from its distributedInfo pg_config (members past `cap` are not believed)."""
    info = _dist_info(header)
    backend = str(info.get("backend", ""))
    views: list[_View] = []
    for pg in info.get("pg_config", []) if isinstance(info.get("pg_config"), list) else []:
        if isinstance(pg, dict):
            members = parse_ranks(pg.get("ranks"))
            if members and max(members) >= cap:
                members = None
            views.append((str(pg.get("pg_name", "")), str(pg.get("pg_desc", "")), members, backend))
    return views


def _namer(parsed: _Parsed, group_views: dict[int, list[_View]]) -> GroupNamer:
    """Group labels for every group the pg_configs or the NCCL kernels' args name."""
    namer_items = {(g, d, m) for views in group_views.values() for g, d, m, _ in views}
    for r, (_, _, rows, _) in parsed.items():
        for c in rows["comm"]:
            a = c["args"]
            if "Process Group Name" in a:
                namer_items.add((str(a.get("Process Group Name", "")), str(a.get("Process Group Description", "")),
                                 parse_ranks(a.get("Process Group Ranks"))))
    return GroupNamer(namer_items)


def _rank_tables(parsed: _Parsed, group_views: dict[int, list[_View]], world: int, warnings: list[str]
                 ) -> tuple[list[Any], list[Any], list[dict[str, Any]], dict[int, RankInfo]]:
    """Per rank read: its comm table, its metrics table, its group rows and its RankInfo."""
    namer = _namer(parsed, group_views)
    tables, metric_tables, group_rows = [], [], []
    ranks: dict[int, RankInfo] = {}
    multi_pg_gloo = False
    for r, (f, header, rows, base_ns) in sorted(parsed.items()):
        views = group_views.get(r, [])
        default = next(((g, d, m) for g, d, m, _ in views if d == "default_pg"), None)
        only = (views[0][0], views[0][1], views[0][2]) if len(views) == 1 else None
        gloo_group = only or (None if len(views) > 1 else default)
        if rows["comm"] and any(c["src"] == "gloo" for c in rows["comm"]) and len(views) > 1:
            multi_pg_gloo = True
        tables.append(comm_table(r, rows, namer, gloo_group, world, views))
        metric_tables.append(metrics_table(r, rows["steps"]))
        dev = header.get("deviceProperties")
        device = str(dev[0].get("name", "")) if isinstance(dev, list) and dev and isinstance(dev[0], dict) else "cpu"
        ranks[r] = RankInfo(rank=r, present=True, host=str(header.get("host_name", "")),
                            pid=int(to_number(rows["pid"], -1)) if isinstance(rows["pid"], (int, float, str)) else -1,
                            device=device, end_status="ok")
        for order, (g, d, m, backend) in enumerate(views):
            if m is None:
                continue
            label = namer(g, d, m)
            group_rows.append({"rank": r, "process_group": label, "group_kind": group_kind(d, g),
                               "ranks": [int(x) for x in m], "creation_order": order, "backend": backend})
        if not rows["comm"]:
            warnings.append(f"{f}: no communication ops found (no NCCL kernels, gloo:* annotations or "
                            "record_param_comms)")
    if multi_pg_gloo:
        warnings.append("gloo profiler traces do not say which process group a collective ran on; with "
                        f"several groups they are all attributed to '{UNKNOWN_GROUP}' and numbered per rank "
                        "in start order, so per-group alignment may be off")
    return tables, metric_tables, group_rows, ranks


def _pipeline_from_annotations(parsed: dict[int, Any], ranks: dict[int, RankInfo], group_rows: list[dict[str, Any]],
                               warnings: list[str]) -> None:
    """torch.distributed.pipelining names its actions "PP:<stage><F|B|I|W><mb>": the
    stage each rank runs is then known even when no process group is tagged as the
    pipeline one. Record it as the rank's pp coordinate and, when the trace names no
    pp group, add one (members in stage order) so the bubble analysis can run."""
    stage_of: dict[int, int] = {}
    for r, (_, _, rows, _) in parsed.items():
        stages = [m[4] for m in rows["mbs"] if m[4] >= 0]
        if stages:
            stage_of[r] = min(stages)
            ranks[r].coords["pp"] = min(stages)
    if len(stage_of) < 2 or any(g["group_kind"] == "pp" for g in group_rows):
        return
    members = sorted(stage_of, key=lambda r: (stage_of[r], r))
    order = 1 + max((g["creation_order"] for g in group_rows), default=-1)
    for r in members:
        group_rows.append({"rank": r, "process_group": "pp", "group_kind": "pp", "ranks": members,
                           "creation_order": order, "backend": ""})
    warnings.append(f"pipeline stages taken from PP:<stage>... annotations: pp group {members} (no process group "
                    "in the traces is tagged as the pipeline one)")

