"""NCCL's own evidence (Inspector, RAS) and the torch debug server's dumps, alone or beside another
source of the same job, made into one Trace.

    trace = with_nccl_evidence(primary, files, root)    # primary: a run directory's, FR dumps', ... or None

The design (docs/architecture.md, "Several sources, one trace"): one source records the ops and is
the trace (a run directory, Flight Recorder dumps, profiler traces, else NCCL Inspector); the others
add what only they know, in the terms the analyses already read, so the verdict stays the one
composer's:

- NCCL Inspector alone: its records are the ops (`nccl_inspector_trace`). Beside another source, its
  records join the trace as ops of their own groups, labelled "nccl:<communicator>" (the same
  collectives seen from the GPU; never merged into the other source's instances, whose numbering
  differs), their ranks taken from the other source's (hostname, pid) where it has them.
- NCCL RAS: dead and unresponsive ranks end "failed" with RAS's words; where no source recorded the
  ops (RAS alone, or only Inspector), a laggard's peers get the in-flight op they wait in
  (`nccl_ras_rows`). Beside recorded ops, the counts are one warning line.
- torch debug server: its stacks become the ranks' stacks (appended to any the source has).
- Inspector's Prometheus files carry no rank or sequence: one warning line says what they hold.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from ncclscope import schema as S
from ncclscope.load.foreign import nccl_inspector as insp
from ncclscope.load.foreign.nccl_debug_server import debug_kind, read_debug_dumps
from ncclscope.load.foreign.nccl_inspector_trace import InspectorParts, inspector_parts, inspector_run
from ncclscope.load.foreign.nccl_ras import read_ras, sniff_head as ras_sniff
from ncclscope.load.foreign.nccl_ras_facts import RankMap, RasFacts, ras_facts
from ncclscope.load.foreign.nccl_ras_rows import apply_dead, lag_lines, ras_rows
from ncclscope.load.trace import RankInfo, RunInfo, Tables, Trace, TraceError, assemble

RAS_ONLY_T_NS = 1_000_000_000        # RAS has no clock: its rows sit at 1 s, and no duration is said
BESIDE_PREFIX = "nccl:"


@dataclass
class NcclFiles:
    """The NCCL evidence files of an input, by kind."""

    inspector: list[Path] = field(default_factory=list)
    prom: list[Path] = field(default_factory=list)
    ras: list[Path] = field(default_factory=list)
    debug: list[Path] = field(default_factory=list)

    def add(self, kind: str, path: Path) -> None:
        {"inspector": self.inspector, "inspector_prom": self.prom, "ras": self.ras}.get(kind, self.debug).append(path)

    def __bool__(self) -> bool:
        return bool(self.inspector or self.prom or self.ras or self.debug)

    def words(self) -> str:
        parts = [(len(self.inspector), "NCCL Inspector"), (len(self.prom), "Inspector Prometheus"),
                 (len(self.ras), "NCCL RAS"), (len(self.debug), "torch debug server")]
        return ", ".join(f"{n} {what}" for n, what in parts if n)


def nccl_kind(path: Path, head: bytes) -> str | None:
    """"inspector" | "inspector_prom" | "ras" | "debug" for a file whose first bytes (`head`) or, for the
    debug server, name say so; else None."""
    kind = insp.sniff_head(head)
    if kind:
        return kind
    if ras_sniff(head):
        return "ras"
    return "debug" if debug_kind(path) else None


def with_nccl_evidence(primary: Trace | None, files: NcclFiles, root: Path) -> Trace:
    """The one Trace of `primary` (None: the NCCL evidence is all there is) and the NCCL files."""
    warnings: list[str] = []
    read = insp.read_inspector(files.inspector) if files.inspector else None
    if read is not None and not len(read.records):
        warnings += read.warnings
        read = None
    snap = read_ras(files.ras) if files.ras else None
    if files.prom:
        prom = insp.prom_summary(files.prom)
        warnings += prom.warnings + [f"{prom.words()}: per-bucket averages with no rank or sequence, not analyzed "
                                     "(the JSON output, NCCL_INSPECTOR_PROM_DUMP=0, is)"]
    if primary is None:
        if read is None and (snap is None or not snap.comms):
            why = ((snap.warnings[:1] if snap else []) or warnings[:1]
                   or [f"{files.words()} file(s), no op or rank state"])
            raise TraceError(f"{root}: nothing readable: {why[0]}")
        trace = _alone(read, snap, root, warnings)
    else:
        trace = _beside(primary, read, snap, root, warnings)
    if files.debug:
        _attach_stacks(trace, files.debug)
    return trace


def _pids(ranks: dict[int, RankInfo]) -> dict[int, int]:
    """pid -> global rank, for pids only one rank has (pids repeat across hosts)."""
    seen: dict[int, list[int]] = {}
    for r, info in ranks.items():
        if info.pid >= 0:
            seen.setdefault(info.pid, []).append(r)
    return {pid: rs[0] for pid, rs in seen.items() if len(rs) == 1}


def _facts(snap: Any, world: int, ranks: dict[int, RankInfo], known: dict[str, dict[int, int]]) -> tuple[RasFacts, int]:
    """RAS facts in global ranks, and the world they imply."""
    rmap = RankMap.build(snap, world, _pids(ranks), known)
    return ras_facts(snap, rmap), max(world, rmap.world)


def _notes(facts: RasFacts | None) -> dict[str, list[str]]:
    """`RunInfo.raw["rank_notes"]` (verdict/cite.py): what RAS says of each laggard, to cite in its finding."""
    out: dict[str, list[str]] = {}
    for lag in facts.lags if facts is not None else []:
        for r in lag.ranks:
            out.setdefault(str(r), []).append(lag.words())
    return out


def _alone(read: insp.InspectorRead | None, snap: Any, root: Path, warnings: list[str]) -> Trace:
    """No other source: Inspector's records (if any) are the ops, RAS adds rank ends and waits."""
    parts = inspector_parts(read, root) if read is not None else InspectorParts([], [], {}, 0, [])
    warnings[:0] = parts.warnings
    world, ranks, facts = parts.world, parts.ranks, None
    tables, group_rows = list(parts.tables), list(parts.group_rows)
    if snap is not None:
        facts, world = _facts(snap, world, ranks, parts.comm_ranks)
        warnings += facts.warnings
        for r in sorted(facts.answered):
            ranks.setdefault(r, RankInfo(rank=r, present=True))
        marked = apply_dead(ranks, facts, world)
        t_ns = parts.end_ns + 1_000_000 if parts.end_ns else RAS_ONLY_T_NS
        more, rows = ras_rows(facts, parts.labels, parts.last_seq, t_ns, set(marked))
        tables += more
        group_rows += rows
    if read is not None:
        run = inspector_run(read, world, rank_notes=_notes(facts))
    else:
        run = RunInfo.from_dict({"source": "nccl_ras", "world_size": world, "backend": "nccl",
                                 "rank_notes": _notes(facts), "version": snap.nccl_version,
                                 "files": [str(p) for p in snap.files]})
    if world <= 0:
        raise TraceError(f"{root}: nothing readable: the NCCL RAS output names no communicator size")
    for r in range(world):
        ranks.setdefault(r, RankInfo(rank=r, present=False))
    return assemble(root, run, world, ranks, Tables(events=tables, group_rows=group_rows, stacks={}, warnings=warnings))


def _beside(primary: Trace, read: insp.InspectorRead | None, snap: Any, root: Path, warnings: list[str]) -> Trace:
    """Another source recorded the ops: Inspector's join as groups of their own, RAS marks rank ends."""
    trace, known = primary, {}
    if read is not None:
        parts = _parts_beside(primary, read, root, warnings)
        if parts is not None:
            known = parts.comm_ranks
            trace = _reassembled(primary, parts)
    if snap is not None:
        facts, _ = _facts(snap, trace.world_size, trace.ranks, known)
        warnings += facts.warnings + lag_lines(facts)
        apply_dead(trace.ranks, facts, trace.world_size)
        if isinstance(trace.run.raw, dict) and facts.lags:
            notes = trace.run.raw.setdefault("rank_notes", {})
            for r, said in _notes(facts).items():
                notes.setdefault(r, []).extend(said)
    trace.warnings.extend(warnings)
    return trace


def _parts_beside(primary: Trace, read: insp.InspectorRead, root: Path, warnings: list[str]) -> InspectorParts | None:
    """Inspector's rows in the primary's ranks: by (hostname, pid) where the primary names processes,
    else by Inspector's own world communicator when its size is the primary's world; else not used."""
    rank_of = {(i.host, i.pid): r for r, i in primary.ranks.items() if i.host and i.pid >= 0}
    names = set(zip(read.records["host"], read.records["pid"]))
    try:
        if rank_of and names & set(rank_of):
            return inspector_parts(read, root, rank_of, prefix=BESIDE_PREFIX)
        parts = inspector_parts(read, root, prefix=BESIDE_PREFIX)
    except TraceError as exc:
        warnings.append(f"{exc}; the NCCL Inspector records are not used")
        return None
    if parts.world != primary.world_size:
        warnings.append(f"NCCL Inspector records speak of {parts.world} ranks, the other evidence of "
                        f"{primary.world_size}: not the same job's ranks, not used")
        return None
    return parts


def _reassembled(primary: Trace, parts: InspectorParts) -> Trace:
    """The primary's events and groups plus Inspector's, assembled again (the ops table is rebuilt
    from all of them); the primary's ranks, run, stacks and warnings are kept."""
    ev = pa.Table.from_pandas(primary.events[S.EVENT_COLUMNS], preserve_index=False)
    rows = primary.groups[S.GROUP_COLUMNS].to_dict("records")
    for row in rows:
        row["ranks"] = [int(r) for r in row["ranks"]]
    warnings = list(primary.warnings) + parts.warnings
    return assemble(primary.path, primary.run, primary.world_size, primary.ranks,
                    Tables(events=[ev, *parts.tables], group_rows=rows + parts.group_rows, stacks=primary.stacks,
                           warnings=warnings))


def _attach_stacks(trace: Trace, paths: list[Path]) -> None:
    """The debug server's stacks onto the ranks' (after what the source had); its warnings onto the trace's."""
    dumps = read_debug_dumps(paths, trace.world_size)
    for r, text in dumps.stacks.items():
        trace.stacks[r] = trace.stacks.get(r, "") + text
    trace.warnings.extend(dumps.warnings)
