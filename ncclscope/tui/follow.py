"""Incremental reading of a run directory that a live job is still writing (`--follow`).

The trace files are Arrow IPC *streams* appended batch by batch (no footer),
so following one is: remember how many bytes were consumed, read what was
appended since, and parse it message by message. A batch the writer has only
half written (a torn tail, now or forever if the rank died mid-write) fails to
parse for lack of bytes; its bytes are left unconsumed and retried on the next
poll, so it appears once complete and never as garbage. Nothing already read
is read again; rank.json, stacks.txt and run.json are small and re-read only
when their size or mtime changes.

    f = Follower("runs/live")
    while True:
        if f.poll():
            trace = f.trace()          # a ncclscope.load.trace.Trace, like trace.load()
        time.sleep(1)

`trace()` is incremental (the default; tui/follow_trace.py): the appended rows
extend the last poll's tables, begin/end join and index views instead of a
whole `trace.assemble` and a fresh index per poll; `Follower(path,
incremental=False)` does the whole rebuild, the reference the tests hold the
incremental one to (tests/test_follow_incremental.py).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.ipc

from ncclscope import schema as S
from ncclscope.findings import FindingKind
from ncclscope.load.columns import conform_table, force_rank
from ncclscope.load.groupviews import GroupViews
from ncclscope.load.run_info import RunInfo
from ncclscope.load.trace import RankInfo, Tables, Trace, apply_exit, assemble

Progress = Callable[[int, int], None]
_PARSE_ERRORS = (pa.ArrowInvalid, pa.ArrowIOError, OSError, ValueError)


class StreamTail:
    """One append-only Arrow IPC stream, read from where the last poll stopped."""

    def __init__(self, path: Path, schema: pa.Schema, keep: bool = True) -> None:
        self.path = path
        self.schema = schema                  # what the analyzer wants (files are conformed to it)
        self.keep = keep                      # keep every table read (`table()`); else only `take_fresh`
        self.generation = 0                   # +1 each time the file is found recreated
        self._reset()
        self.generation = 0

    def _reset(self) -> None:
        self.pos = 0                          # bytes consumed: always at a message boundary
        self.pending = 0                      # bytes after pos that do not yet parse (torn tail)
        self.file_schema: pa.Schema | None = None
        self.ended = False                    # end-of-stream marker seen: the writer closed it
        self.error = ""
        self._tables: list[pa.Table] = []
        self._cached: pa.Table | None = None
        self._fresh: list[tuple[pa.Table, list[int]]] = []    # read since the last take_fresh, batch lengths
        self.rows = 0
        self.generation += 1

    def poll(self) -> int:
        """Read complete batches appended since the last call; return how many rows they hold."""
        try:
            size = self.path.stat().st_size
        except OSError:
            return 0
        if size < self.pos:                   # recreated file (a restarted rank): start over
            self._reset()
        if size == self.pos or self.ended or self.error:
            self.pending = size - self.pos
            return 0
        with open(self.path, "rb") as fh:
            fh.seek(self.pos)
            data = fh.read(size - self.pos)
        reader = pa.BufferReader(pa.py_buffer(data))
        consumed, batches = 0, []
        while consumed < len(data):
            try:
                msg = pa.ipc.read_message(reader)
            except EOFError:                  # the 8-byte end-of-stream marker
                self.ended, consumed = True, len(data)
                break
            except _PARSE_ERRORS:             # incomplete message: wait for the rest
                break
            if msg is None:
                break
            if msg.type == "schema":
                self.file_schema = pa.ipc.read_schema(msg)
                version = (self.file_schema.metadata or {}).get(b"ncclscope_schema", b"").decode(errors="replace")
                if version and S.major(version) != S.major(S.SCHEMA_VERSION):
                    self.error = f"schema version {version}, this reader understands {S.SCHEMA_VERSION}"
                    break
            elif msg.type == "record batch" and self.file_schema is not None:
                batches.append(pa.ipc.read_record_batch(msg, self.file_schema))
            consumed = reader.tell()
        self.pos += consumed
        self.pending = size - self.pos
        n = sum(len(b) for b in batches)
        if batches:
            table = pa.Table.from_batches(batches, schema=self.file_schema)
            if not self.keep:
                self._fresh.append((table, [len(b) for b in batches]))
            else:
                self._tables.append(table)
                if len(self._tables) > 32:    # keep the chunk count bounded on long follows
                    self._tables = [pa.concat_tables(self._tables).combine_chunks()]
                self._cached = None
            self.rows += n
        return n

    def take_fresh(self, warnings: list[str]) -> list[tuple[pa.Table, list[int]]]:
        """The tables read since the last call (conformed to the analyzer's schema), with their batch lengths."""
        fresh, self._fresh = self._fresh, []
        return [(t if t.schema.equals(self.schema, check_metadata=True)
                 else conform_table(t, self.schema, self.path, warnings), lengths) for t, lengths in fresh]

    def table(self, warnings: list[str]) -> pa.Table:
        """Everything read so far, conformed to the analyzer's schema."""
        if self._cached is None:
            raw = pa.concat_tables(self._tables) if self._tables else (
                self.file_schema or self.schema).empty_table()
            self._cached = conform_table(raw, self.schema, self.path, warnings)
        return self._cached


@dataclass
class _Rank:
    dir: Path
    tails: dict[str, StreamTail]
    meta: dict[str, Any] = field(default_factory=dict)
    meta_sig: tuple[int, int] = (-1, -1)
    stacks: str = ""
    stacks_size: int = -1


def _sig(path: Path) -> tuple[int, int]:
    try:
        st = path.stat()
        return st.st_mtime_ns, st.st_size
    except OSError:
        return (-1, -1)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(errors="replace"))
    except (OSError, ValueError):
        return None                           # mid-rename or half written: keep the old one
    return data if isinstance(data, dict) else None


def _int(v: Any, default: int = -1) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


class Follower:
    """Follows a run directory; `poll()` says whether anything changed, `trace()` builds the Trace.

    `incremental=True` (the TUI's): `trace()` extends the last poll's tables, ops join and index
    views from the appended batches (follow_trace.py); `incremental=False` assembles a whole new
    Trace from everything read (`trace.assemble`), the reference the incremental one must equal."""

    def __init__(self, path: str | os.PathLike[str], incremental: bool = True) -> None:
        self.root = Path(path)
        self.run = RunInfo()                  # run.json as last read (typed once per change)
        self._run_sig = (-1, -1)
        self.ranks: dict[int, _Rank] = {}
        self._trace: Trace | None = None
        self.incremental = incremental
        self._live: Any = None
        self._views: tuple[tuple, GroupViews, list[str]] | None = None

    @property
    def ended(self) -> bool:
        """The launcher wrote its end reason: nothing more will be appended."""
        return bool(self.run.end_reason)

    def poll(self, progress: Progress | None = None) -> bool:
        changed = False
        sig = _sig(self.root / S.RUN_JSON)
        if sig != self._run_sig:
            data = _read_json(self.root / S.RUN_JSON)
            if data is not None:
                self.run, self._run_sig, changed = RunInfo.from_dict(data), sig, True
        try:
            entries = [e for e in os.scandir(self.root) if e.name.startswith("rank-") and e.is_dir()]
        except OSError:
            entries = []
        for e in entries:
            r = _int(e.name[5:])
            if r >= 0 and r not in self.ranks:
                d = Path(e.path)
                self.ranks[r] = _Rank(dir=d, tails={
                    name: StreamTail(d / name, schema, keep=not self.incremental)
                    for name, schema in S.TABLE_SCHEMAS.items()})
                changed = True
        total = len(self.ranks)
        for i, (r, rk) in enumerate(sorted(self.ranks.items())):
            sig = _sig(rk.dir / S.RANK_JSON)
            if sig != rk.meta_sig:
                data = _read_json(rk.dir / S.RANK_JSON)
                if data is not None:
                    rk.meta, rk.meta_sig, changed = data, sig, True
            size = _sig(rk.dir / S.STACKS_FILE)[1]
            if size != rk.stacks_size:
                rk.stacks_size = size
                rk.stacks = (rk.dir / S.STACKS_FILE).read_text(errors="replace") if size >= 0 else ""
                changed = True
            for tail in rk.tails.values():
                gen = tail.generation
                if tail.poll() or tail.generation != gen:     # new rows, or a recreated file
                    changed = True
            if progress is not None and (i % 32 == 0 or i == total - 1):
                progress(i + 1, total)
        if changed:
            self._trace = None
        return changed

    def pending_bytes(self) -> int:
        """Bytes of batches still being written (torn tails) across all ranks."""
        return sum(t.pending for rk in self.ranks.values() for t in rk.tails.values())

    def trace(self) -> Trace:
        """The Trace of everything read so far (cached until the next change)."""
        if self._trace is not None:
            return self._trace
        world, infos, views, warnings = self._meta()
        stacks = {r: rk.stacks for r, rk in self.ranks.items() if rk.stacks_size >= 0}
        if self.incremental:
            from ncclscope.tui.follow_trace import LiveTrace
            if self._live is None:
                self._live = LiveTrace()
            try:
                self._trace = self._live.build(self, world, infos, views, stacks, warnings)
            except BaseException:
                # half-extended state must not be extended again: read every file afresh at the next poll
                self._live = None
                for rk in self.ranks.values():
                    for tail in rk.tails.values():
                        tail._reset()
                raise
            return self._trace
        events, metrics, samples = [], [], []
        for r, rk in sorted(self.ranks.items()):
            events.append(force_rank(rk.tails[S.EVENTS_FILE].table(warnings), r))
            metrics.append(force_rank(rk.tails[S.METRICS_FILE].table(warnings), r))
            samples.append(force_rank(rk.tails[S.SAMPLES_FILE].table(warnings), r))
        self._trace = assemble(self.root, self.run, world, infos, Tables(
            events=events, metrics=metrics, samples=samples, group_views=views, stacks=stacks, warnings=warnings))
        return self._trace

    @property
    def index_timings(self) -> dict[str, Any]:
        """How the last incremental trace was built (full or merged views, seconds per stage)."""
        return dict(self._live.timings) if self._live is not None else {}

    def _meta(self) -> tuple[int, dict[int, RankInfo], GroupViews, list[str]]:
        """(world size, rank infos, group views, warnings): what both builds read besides the tables."""
        warnings: list[str] = []
        world = max([self.run.world_size] + [_int(rk.meta.get("world_size"), 0) for rk in self.ranks.values()]
                    + [max(self.ranks, default=-1) + 1])
        infos: dict[int, RankInfo] = {}
        for r, rk in sorted(self.ranks.items()):
            infos[r] = _rank_info(r, rk.meta)
            for name, tail in rk.tails.items():
                if tail.error:
                    warnings.append(f"{tail.path}: {tail.error}; skipped")
                elif tail.pending and self.ended:
                    warnings.append(f"{tail.path}: torn batch at the end ({tail.pending} bytes); kept the "
                                    f"{tail.rows} complete rows")
        views = self._group_views(warnings)
        for r in range(world):
            if r not in infos:
                infos[r] = RankInfo(rank=r, present=False)
            ex = self.run.exits.get(r)
            if ex is not None:
                apply_exit(infos[r], ex)
        return world, infos, views, warnings

    def _group_views(self, warnings: list[str]) -> GroupViews:
        """Every rank's group view (groups.json, else rank.json's list); re-read only when a file changed."""
        key = tuple((r, _sig(rk.dir / S.GROUPS_JSON), rk.meta_sig) for r, rk in sorted(self.ranks.items()))
        if self.incremental and self._views is not None and self._views[0] == key:
            warnings += self._views[2]
            return self._views[1]
        mine: list[str] = []
        views = GroupViews()
        complete = True
        for r, rk in sorted(self.ranks.items()):
            gpath = rk.dir / S.GROUPS_JSON
            if gpath.exists():
                try:
                    views.add(r, gpath.read_bytes(), mine, gpath)
                except OSError:
                    complete = False   # being replaced right now: the next poll reads it
            elif isinstance(rk.meta.get("groups"), list):
                views.add(r, rk.meta["groups"], mine, rk.dir / S.RANK_JSON)
        self._views = (key, views, mine) if complete else None
        warnings += mine
        return views


def _rank_info(r: int, meta: dict[str, Any]) -> RankInfo:
    """RankInfo from rank.json, as `trace.load` builds it."""
    end = meta.get("end") if isinstance(meta.get("end"), dict) else {}
    coords = meta.get("coords") if isinstance(meta.get("coords"), dict) else {}
    return RankInfo(rank=r, present=True, host=str(meta.get("host", "")), pid=_int(meta.get("pid")),
                    device=str(meta.get("device", "")), clock_offset_ns=_int(meta.get("clock_offset_ns"), 0),
                    clock_uncertainty_ns=_int(meta.get("clock_uncertainty_ns"), 0),
                    coords={str(k): _int(v) for k, v in coords.items()},
                    end_status=str(end.get("status", "")), end_message=str(end.get("message", "")))


# ---- a live job: no hang verdict before the wait is long -------------------------------
# A healthy job always has ops in flight: rank 0 has just entered its optimizer, rank 1 has
# posted all_reduce #5 and rank 0 has not yet. A post-mortem reads that as a hang; a job that is
# still running must wait longer than the op's own history says it takes before calling one.
HISTORY_FACTOR = 5.0        # a wait must exceed this many times the op's median duration ...
MIN_WAIT_S = 1.0            # ... and at least this long, and half the run's --timeout-s when known
NO_HISTORY_WAIT_S = 10.0    # an op never seen to finish (and no timeout known): this long


def hold_premature_hang(analysis: Any, trace: Trace) -> tuple[Any, str]:
    """(analysis, note): in a live job, the hang diagnosis' findings are held back while every op the
    ranks it names or cites as evidence are waiting in is still within its own history
    (`wait_threshold_s`). The verdict then comes from the composer's `compose_verdict` over the other
    findings; `note` says what is being watched. A timeout, an error or a dead process is a fact: never
    held."""
    diag = getattr(analysis, "diagnosis", None)
    unstarted = [f for f in analysis.findings if f.kind == FindingKind.DEAD_RANK
                 and all(r not in trace.ranks or not trace.ranks[r].present for r in f.ranks)]
    if unstarted and (diag is None or getattr(diag, "ok", True)) and not trace.ops["status"].astype(str).isin(
            [S.STATUS_TIMEOUT, S.STATUS_ERROR]).any():
        # nobody waits on a rank that has written nothing yet: live, it has not started (a loaded machine
        # starts ranks seconds apart); a wait on it is judged below, as any wait
        return _without(analysis, unstarted), "live: waiting for ranks to start"
    if diag is None or getattr(diag, "ok", True):
        return analysis, ""
    hang = [f for f in analysis.findings if any(f is g for g in diag.findings)]
    # the ranks in the story and the ranks its evidence cites: an unmatched p2p names only the rank that
    # never posted its side (between ops, nothing in flight); the wait is the poster's, in its evidence
    ranks = sorted(set().union(*(f.involved_ranks | {int(e.rank) for e in f.evidence if int(e.rank) >= 0}
                                 for f in hang)) if hang else set())
    ops = trace.ops
    if not len(ops) or all(f.kind == FindingKind.NO_OP_IN_FLIGHT for f in hang):
        # a live job that has posted nothing yet, or whose ranks are all between ops, is starting or
        # computing, not stopped: "stopped" is a post-mortem's word
        return _without(analysis, hang), "live: no op in flight yet" if not len(ops) else "live: between ops"
    if not ranks:
        return analysis, ""
    absent = {r for r in ranks if r not in trace.ranks or not trace.ranks[r].present}   # no rank.json yet
    if absent and all(f.kind == FindingKind.DEAD_RANK and set(f.ranks) <= absent for f in hang):
        # a live job's rank with no directory yet has not started (a loaded machine starts ranks seconds
        # apart), which is no death: judged by its peers' waits on it, as any wait
        ranks = sorted(set(trace.ranks) - absent)
    mine = ops[ops["rank"].isin(ranks).to_numpy() & (ops["kind"] != S.KIND_MARKER).to_numpy()]
    status = mine["status"].astype(str)
    if status.isin([S.STATUS_TIMEOUT, S.STATUS_ERROR]).any():
        return analysis, ""
    if any(trace.ranks[r].died for r in ranks if r in trace.ranks):
        return analysis, ""
    infl = mine[(status == "inflight").to_numpy()]
    if not len(infl):
        return (_without(analysis, hang), "live: waiting for ranks to start") if absent else (analysis, "")
    worst, worst_ratio = worst_wait(trace, infl)        # the in-flight ops of the named ranks: a handful
    if worst_ratio > 1.0:
        return analysis, ""
    rank, name, wait, limit = worst
    note = (f"live: rank {rank} in {name} for {wait:.1f} s, within its history; "
            f"a hang is called after {limit:.1f} s")
    return _without(analysis, hang), note


def worst_wait(trace: Trace, infl: Any) -> tuple[tuple[int, str, float, float] | None, float]:
    """Of the in-flight ops `infl` (rows of `trace.ops`), the one whose wait is furthest past its live
    threshold (`wait_threshold_s`: its op's median duration over the trace's finished ops, the run's
    --timeout-s): ((rank, op name, wait s, threshold s), wait / threshold); (None, 0.0) for no rows. Past
    its threshold (a ratio over 1), a live job's wait is a hang."""
    ops = trace.ops
    cfg = trace.run.config
    timeout_s = cfg.get("timeout_s") if isinstance(cfg.get("timeout_s"), (int, float)) else None
    done = ops[(ops["status"].astype(str) == "ok").to_numpy()]
    median = done.groupby(done["op_name"].astype(str))["duration_ns"].median() / 1e9 if len(done) else None
    now = trace.end_ns
    worst, worst_ratio = None, 0.0
    for row in infl.itertuples(index=False):
        name = str(row.op_name)
        med = float(median.get(name, np.nan)) if median is not None else np.nan
        limit = wait_threshold_s(med, timeout_s)
        wait = max(now - int(row.start_ns), 0) / 1e9
        if wait / limit > worst_ratio or worst is None:
            worst, worst_ratio = (int(row.rank), name, wait, limit), wait / limit
    return worst, worst_ratio


def _without(analysis: Any, hang: list[Any]) -> Any:
    """The analysis with the hang diagnosis' findings held back: the verdict from the composer's
    `compose_verdict` over the rest."""
    from dataclasses import replace
    from ncclscope.verdict.compose import compose_verdict
    rest = [f for f in analysis.findings if not any(f is g for g in hang)]
    verdict, level = compose_verdict(None, rest, analysis.errors)
    return replace(analysis, verdict=verdict, level=level, findings=rest)


def wait_threshold_s(median_s: float, timeout_s: float | None) -> float:
    """How long an op may be in flight in a live job before it counts as a hang."""
    parts = [MIN_WAIT_S]
    if np.isfinite(median_s) and median_s > 0:
        parts.append(HISTORY_FACTOR * median_s)
    elif timeout_s is None:
        parts.append(NO_HISTORY_WAIT_S)
    if timeout_s is not None and timeout_s > 0:
        parts.append(timeout_s / 2)
    return max(parts)
