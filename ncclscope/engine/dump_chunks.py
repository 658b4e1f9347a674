"""Stage 1 of the plan for Flight Recorder dumps: a chunk of dump files read and reduced on a worker (unpickling
a 2,000-entry dump and turning its entries into columns is the CPU-heavy part of reading dumps), merged on the
driver into the same `Entries` one process would have built (`Entries.absorb` says why it is the same).

Dumps may sit in one directory or in one directory per node (`fr_read.dump_files`); either way each rank's file
is read where it is, by path: the workers need the same filesystem view as the driver.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ncclscope.engine.tasks import working_dir
from ncclscope.load.foreign.fr_entries import Entries


@dataclass
class DumpChunk:
    """What a worker read from a chunk of dumps: their reduced entries, the rest of each dump, format versions
    and the warnings, in rank order."""

    ents: Entries
    dumps: dict[int, dict[str, Any]]
    versions: dict[str, list[int]]
    warnings: list[str]


def read_dump_chunk(items: list[tuple[int, tuple[str, str]]], cwd: str | None = None) -> DumpChunk:
    """Read these (rank, (file, format)) dumps with the in-process reader's own loop (runs on a worker, in the
    driver's working directory `cwd`)."""
    from ncclscope.load.foreign.flight_recorder import add_dumps
    ents, dumps, versions, warnings = Entries(), {}, {}, []      # type: ignore[var-annotated]
    with working_dir(cwd):
        add_dumps([(r, (Path(f), fmt)) for r, (f, fmt) in items], ents, dumps, versions, warnings)
    return DumpChunk(ents, dumps, versions, warnings)


def chunk_size(n_dumps: int, workers: int) -> int:
    """Dumps per task: about eight tasks per worker, 4 to 64 dumps (a torchtitan-sized dump, 20,000 entries,
    is ~100 MB unpickled: a worker holds one at a time plus the chunk's columns)."""
    return max(4, min(64, -(-n_dumps // max(8 * workers, 1))))


def read_dumps(engine: Any, items: list[tuple[int, tuple[Path, str]]], ents: Entries,
               dumps: dict[int, dict[str, Any]], versions: dict[str, list[int]], warnings: list[str]) -> None:
    """`flight_recorder.add_dumps` on the engine's workers: chunks in rank order, merged as they arrive."""
    plain = [(r, (str(f), fmt)) for r, (f, fmt) in items]
    size = chunk_size(len(plain), engine.workers)
    chunks = [plain[i:i + size] for i in range(0, len(plain), size)]
    cwd = os.getcwd()
    for chunk in engine.map_large(read_dump_chunk, [(c, cwd) for c in chunks], "dumps read",
                                  [len(c) for c in chunks], DumpChunk):
        ents.absorb(chunk.ents)
        dumps.update(chunk.dumps)
        for v, rs in chunk.versions.items():
            versions.setdefault(v, []).extend(rs)
        warnings.extend(chunk.warnings)
