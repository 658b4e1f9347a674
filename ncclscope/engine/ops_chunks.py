"""The begin/end join on the workers (docs/scale.md, stage 1): a chunk of rank directories leaves its worker as
ops, marks and per-rank event times, never as event rows, so the driver of an analysis never holds the events.

Why: at 16,384 ranks the event rows are 31 M (3 GB in the driver), twice the ops they are joined into, and the
analysis reads only the ops, the marks (instants: heartbeats, markers, dump times) and the first and last time
of the events (`Trace.marks`, `Trace.start_ns`, `Trace.end_ns`, `Trace.last_event_ns`). The join never crosses
ranks (its key is (rank, op id)), so each chunk joins its own rows with the loader's own code
(`opsjoin.build_ops`), exactly as one process joins them all.

Exactness: as for the event columns of stage 1 (rank_chunks.py), each categorical column's dictionary grows in
the order one process would have grown it: the chunk's dictionary of the *event* column (values of begin, end
and instant rows, in the order the chunk met them) is registered chunk by chunk in rank order, and every ops and
marks column takes that dictionary as its categories (plus what the join adds: `opsjoin.ops_categories`), its
codes remapped. tests/test_engine.py holds the frames and the JSON equal to the in-process ones.

What keeps the events whole: `ncclscope tui` and `export` (they show and write the rows themselves), and an input
with NCCL evidence beside it (merged by event rows, load/foreign/nccl_evidence.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ncclscope import schema as S
from ncclscope.engine.rank_chunks import RankChunk, chunk_tasks, merge_chunk, read_chunk
from ncclscope.load.trace import clock_offsets, events_frame, timed_frame
from ncclscope.load.opsjoin import build_ops, marks_of, ops_categories
from ncclscope.perf.utilization import UtilParts, merge_util_parts, utilization_parts


@dataclass
class Packed:
    """A frame as picklable columns: numpy arrays (a categorical's codes) and each categorical's categories."""

    columns: dict[str, Any]
    cats: dict[str, list[str]]

    @staticmethod
    def of(df: pd.DataFrame) -> "Packed":
        cols: dict[str, Any] = {}
        cats: dict[str, list[str]] = {}
        for name in df.columns:
            col = df[name]
            if isinstance(col.dtype, pd.CategoricalDtype):
                cols[name] = col.cat.codes.to_numpy()
                cats[name] = [str(c) for c in col.cat.categories]
            else:
                cols[name] = col.to_numpy() if isinstance(col.dtype, np.dtype) else col.array
        return Packed(cols, cats)


@dataclass
class OpsChunk:
    """One chunk's ops, marks and event times, with its stage-1 metadata (`base.events` is None)."""

    base: RankChunk
    event_cats: dict[str, list[str]]         # every categorical event column's dictionary, in the order met
    ops: Packed
    marks: Packed
    last_ns: pd.Series                       # rank -> its last event's aligned time
    bounds: tuple[int, int] | None           # (first, last) aligned time of the chunk's events
    samples_last: int | None                 # the last aligned time of its samples (the samples stay here)
    utilization: UtilParts                   # the per-rank half of the utilization analysis, of these ranks


def read_ops_chunk(root: str, dirs: list[tuple[int, str]], cwd: str | None = None) -> OpsChunk:
    """Read a chunk (`rank_chunks.read_chunk`), then align its times and join its ops here (on a worker), with
    the frame builders `load.trace.assemble` uses."""
    chunk = read_chunk(root, dirs, cwd)
    event_cats = {name: list(d) for name, d in chunk.events.cats.items()}
    offsets = clock_offsets(chunk.ranks)
    events = events_frame(chunk.events, offsets)
    # the analysis reads the samples through the utilization's per-rank half only: they stay here
    samples = timed_frame(chunk.samples, S.SAMPLES_SCHEMA, offsets)
    chunk.events = chunk.samples = None
    t = events["t_ns"]
    bounds = (int(t.min()), int(t.max())) if len(events) else None
    last = events.groupby("rank", observed=True)["t_ns"].max() if len(events) else pd.Series(dtype="int64")
    last.index = last.index.astype("int64")
    marks = Packed.of(marks_of(events))
    joined = build_ops(events)
    del events
    util = utilization_parts(joined, samples)
    return OpsChunk(base=chunk, event_cats=event_cats, ops=Packed.of(joined), marks=marks, last_ns=last,
                    bounds=bounds, utilization=util,
                    samples_last=int(samples["time_ns"].max()) if len(samples) else None)


@dataclass
class JoinedTables:
    """What the driver assembles a Trace from instead of event rows (`load.trace.Tables.joined`)."""

    ops: pd.DataFrame
    marks: pd.DataFrame
    rank_last_ns: pd.Series
    bounds_ns: tuple[int, int]               # load.trace.Trace.bounds_ns
    partials: dict[str, Any]                 # load.trace.Trace.partials


@dataclass
class OpsMerge:
    """The driver's side: chunks added in rank order, one frame per table at the end (`result`)."""

    dicts: dict[str, dict[str, int]] = field(default_factory=dict)
    ops: list[Packed] = field(default_factory=list)
    marks: list[Packed] = field(default_factory=list)
    last: list[pd.Series] = field(default_factory=list)
    bounds: tuple[int, int] | None = None
    samples_last: int | None = None
    utilization: list[UtilParts] = field(default_factory=list)

    def add(self, chunk: OpsChunk) -> None:
        for name, values in chunk.event_cats.items():
            d = self.dicts.setdefault(name, {})
            for v in values:
                d.setdefault(v, len(d))
        self.ops.append(chunk.ops)
        self.marks.append(chunk.marks)
        self.last.append(chunk.last_ns)
        self.utilization.append(chunk.utilization)
        if chunk.bounds is not None:
            b = self.bounds
            self.bounds = chunk.bounds if b is None else (min(b[0], chunk.bounds[0]), max(b[1], chunk.bounds[1]))
        if chunk.samples_last is not None:
            self.samples_last = max(self.samples_last or chunk.samples_last, chunk.samples_last)

    def result(self) -> JoinedTables:
        ops = self._frame(self.ops, joined=True)
        marks = self._frame(self.marks, joined=False)
        full = [s for s in self.last if len(s)]
        last = pd.concat(full) if full else pd.Series(dtype="int64")
        last.index = last.index.astype("int64")
        partials = {"utilization": merge_util_parts(self.utilization)} if self.utilization else {}
        # Trace.start_ns and end_ns as one process computes them: the events' first time (0 with none), the
        # last time of any event or sample
        first, end = self.bounds if self.bounds is not None else (0, 0)
        if self.samples_last is not None:
            end = max(end, self.samples_last) if self.bounds is not None else self.samples_last
        return JoinedTables(ops=ops, marks=marks, rank_last_ns=last, bounds_ns=(first, end), partials=partials)

    def _frame(self, parts: list[Packed], joined: bool) -> pd.DataFrame:
        """The parts as one frame, column by column (each column's parts dropped as it is built). `joined`:
        the ops, whose categories are the events' plus what the join adds."""
        if not parts:
            return pd.DataFrame()
        cols: dict[str, Any] = {}
        for name in list(parts[0].columns):
            pieces = [p.columns.pop(name) for p in parts]
            if name in parts[0].cats:
                events_cats = list(self.dicts.get(name, {}))
                cats = ops_categories(name, events_cats) if joined else (events_cats or [""])
                cols[name] = pd.Categorical.from_codes(self._codes(name, pieces, parts, cats),
                                                       categories=pd.Index(cats), validate=False)
            elif isinstance(pieces[0], np.ndarray):
                cols[name] = np.concatenate(pieces) if len(pieces) > 1 else pieces[0]
            else:
                cols[name] = pd.concat([pd.Series(p) for p in pieces], ignore_index=True).array
            del pieces
        return pd.DataFrame(cols, copy=False)

    @staticmethod
    def _codes(name: str, pieces: list[np.ndarray], parts: list[Packed], cats: list[str]) -> np.ndarray:
        """Each part's codes remapped from its own categories into `cats`, concatenated."""
        pos = {v: i for i, v in enumerate(cats)}
        out = []
        for codes, part in zip(pieces, parts):
            mine = part.cats[name]
            lut = np.fromiter((pos.get(v, -1) for v in mine), dtype=np.int32, count=len(mine))
            if len(codes) and len(lut):
                mapped = lut[np.maximum(codes, 0)]
                out.append(np.where(codes < 0, -1, mapped) if (codes < 0).any() else mapped)
            else:
                out.append(np.full(len(codes), -1, dtype=np.int32))
        return np.concatenate(out) if out else np.empty(0, dtype=np.int32)


def read_rank_dirs_joined(engine: Any, loader: Any, dirs: dict[Any, Any]) -> None:
    """Stage 1 with the join on the workers: `loader` gets every chunk's metadata, metrics and samples as in
    `rank_chunks.read_rank_dirs`, and `loader.joined` the ops, marks and times (load.trace.RunDirLoader.finish)."""
    args, sizes = chunk_tasks(engine, loader, dirs)
    merge = OpsMerge()
    for chunk in engine.map_large(read_ops_chunk, args, "rank directories read", sizes, OpsChunk):
        merge_chunk(loader, chunk.base)
        merge.add(chunk)
    loader.joined = merge.result()
