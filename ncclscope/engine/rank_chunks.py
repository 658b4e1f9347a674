"""Stage 1 of the plan (docs/scale.md), per rank: a chunk of rank directories read on a worker, merged on the
driver into exactly what the in-process loader would have built.

Why a chunk and not one rank per task: a rank directory of a 16,384-rank run is a few hundred KB; one task per
rank would spend more time scheduling than reading. A chunk is read by the very code the in-process path runs
(`RunDirLoader.add_rank`), so torn files, missing streams and odd schemas give the same warnings, and its tables
leave the worker as compact columns (numpy codes + one dictionary per string column), not as Arrow read buffers.

Exactness: the driver merges chunks in rank order. A string column's codes are remapped into the driver's
dictionary, registering each chunk's values in the order the chunk first met them: the dictionary then grows in
the same order as it would have in one process (a value new to the driver is new to the chunk, met in the same
order), so categories, codes and every groupby order downstream are the same. Warnings and group views are
replayed in the order the chunk produced them, interleaved as `add_rank` interleaves them.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ncclscope.engine.tasks import working_dir
from ncclscope.load.columns import Columns
from ncclscope.load.trace import RankInfo, RunDirLoader


class _RecordingViews:
    """Stands in for GroupViews on a worker: each `add` is kept, in order, with how many warnings came before it,
    and replayed on the driver's real GroupViews (group views are voted over the whole world, never per chunk)."""

    def __init__(self, log: list[Any]) -> None:
        self.log = log

    def add(self, rank: int, raw: Any, warnings: list[str], where: Any) -> None:
        if isinstance(raw, (bytes, bytearray)):
            raw = bytes(raw)
        self.log.append(("view", len(warnings), rank, raw, str(where)))


@dataclass
class RankChunk:
    """What one worker read from a chunk of rank directories; small metadata plus the three column engines."""

    ranks: dict[int, RankInfo]
    stacks: dict[int, str]
    warnings: list[str]
    views: list[Any]                     # ("view", warnings before it, rank, raw, where), in add order
    events: Columns | None               # None once joined into ops on the worker (ops_chunks.py)
    metrics: Columns
    samples: Columns
    declared_world: int = 0
    rows: int = 0                        # event rows (benchmarks/engine_choice.py counts them)


def read_chunk(root: str, dirs: list[tuple[int, str]], cwd: str | None = None) -> RankChunk:
    """Read these rank directories with the in-process loader's own code (runs on a worker, in the driver's
    working directory `cwd`: engine.tasks.working_dir)."""
    warnings: list[str] = []
    loader = RunDirLoader(Path(root), warnings)
    log: list[Any] = []
    loader.views = _RecordingViews(log)      # type: ignore[assignment]
    with working_dir(cwd):
        for r, d in dirs:
            loader.add_rank(r, Path(d))
    for cols in (loader.events, loader.metrics, loader.samples):
        cols.flush()
    return RankChunk(ranks=loader.ranks, stacks=loader.stacks, warnings=warnings, views=log,
                     events=loader.events, metrics=loader.metrics, samples=loader.samples,
                     declared_world=loader.declared_world, rows=loader.events.rows)


def merge_chunk(loader: RunDirLoader, chunk: RankChunk) -> None:
    """Add a chunk to the driver's loader as if its ranks had been read here (chunks in rank order)."""
    w = 0
    for _, before, rank, raw, where in chunk.views:
        loader.warnings.extend(chunk.warnings[w:before])
        w = before
        loader.views.add(rank, raw, loader.warnings, Path(where))
    loader.warnings.extend(chunk.warnings[w:])
    loader.ranks.update(chunk.ranks)
    loader.stacks.update(chunk.stacks)
    loader.declared_world = max(loader.declared_world, chunk.declared_world)
    for mine, theirs in ((loader.events, chunk.events), (loader.metrics, chunk.metrics),
                         (loader.samples, chunk.samples)):
        if theirs is not None:           # None: the chunk's events were joined into ops there (ops_chunks.py)
            absorb(mine, theirs)


def absorb(into: Columns, part: Columns) -> None:
    """Append `part`'s rows to `into`, its string codes remapped into `into`'s dictionaries (see the module
    docstring for why the result is the one-process result)."""
    into.flush()
    part.flush()
    for name, pieces in part.parts.items():
        if name in into.cats:
            d = into.cats[name]
            lut = np.fromiter((d.setdefault(v, len(d)) for v in part.cats[name]), dtype=np.int32,
                              count=len(part.cats[name]))
            lut = lut.astype(np.int16) if len(d) < 32_000 else lut
            into.parts[name].extend(lut[p] if len(lut) else p for p in pieces)
        else:
            into.parts[name].extend(pieces)
    into.rows += part.rows


def chunk_size(n_ranks: int, workers: int) -> int:
    """Rank directories per task: about eight tasks per worker (so a slow chunk does not leave the others
    idle at the end), at least 16 ranks (scheduling costs ~1 ms a task) and at most 512 (a worker's memory
    holds one chunk's columns: 512 synthetic ranks of 1,900 events each are ~300 MB)."""
    return max(16, min(512, -(-n_ranks // max(8 * workers, 1))))


def chunk_tasks(engine: Any, loader: RunDirLoader, dirs: dict[int, Path]) -> tuple[list[tuple], list[int]]:
    """The tasks that read `dirs` in chunks, in rank order: each one's (root, [(rank, dir)], cwd) arguments,
    and its number of ranks (the progress count)."""
    items = sorted(dirs.items())
    size = chunk_size(len(items), engine.workers)
    chunks = [[(r, str(d)) for r, d in items[i:i + size]] for i in range(0, len(items), size)]
    root, cwd = str(loader.root), os.getcwd()
    return [(root, c, cwd) for c in chunks], [len(c) for c in chunks]


def read_rank_dirs(engine: Any, loader: RunDirLoader, dirs: dict[int, Path]) -> None:
    """Every rank directory of `dirs` read on the engine's workers and merged into `loader`, in rank order
    (`load`'s loop, distributed)."""
    args, sizes = chunk_tasks(engine, loader, dirs)
    for chunk in engine.map_large(read_chunk, args, "rank directories read", sizes, RankChunk):
        merge_chunk(loader, chunk)
