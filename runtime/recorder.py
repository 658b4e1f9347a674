"""Per-rank event writer: crash-safe Arrow IPC streams, flusher thread, heartbeat, watchdog.

Why this shape: a debugger is only useful if the trace survives the failure
it is meant to explain. Rows are appended to an in-memory deque by the
training thread (a tuple append, no locks, no I/O: the wrapped op must stay
cheap) and a flusher thread writes them as small Arrow record batches about
every 200 ms. The stream format needs no footer, so a SIGKILLed rank loses at
most one flush interval and a reader skips a torn last batch.

The flusher also writes a heartbeat row every second (a hung rank whose
heartbeats go on is alive but stuck; one whose heartbeats stop is dead) and
runs the watchdog that marks an in-flight op `suspect` when it has run far
longer than that op's own history, before the hard timeout fires.

Usage (what comm.py and train.py do):

    rec = Recorder(run_dir, rank)
    op = rec.begin("collective", "all_reduce", group="dp0", seq=3, ...)
    ...
    rec.end(op, "ok")
    rec.close()
"""
from __future__ import annotations

import collections
import faulthandler
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa

from ncclscope import schema as S

FLUSH_INTERVAL_S = 0.2
HEARTBEAT_INTERVAL_S = 1.0
# An op is suspect when it has run SUSPECT_FACTOR times longer than the slowest
# completed instance of the same op (kind, name, group, peer, bytes: its own
# history; (kind, name, group) when that exact op has not completed yet) and at
# least SUSPECT_MIN_S. An op with no completed instance of either key is never
# suspect: there is nothing to compare its wait with.
SUSPECT_FACTOR = 20.0
SUSPECT_MIN_S = 2.0

_EVENT_INDEX = {name: i for i, name in enumerate(S.EVENT_COLUMNS)}
_BLANK_EVENT: tuple[Any, ...] = tuple(
    "" if pa.types.is_string(t) else -1 for _, t in S.EVENT_FIELDS
)


def _fmt_s(seconds: float) -> str:
    """A duration with the unit that shows it (never "0.0 s" for a short one)."""
    if seconds >= 1.0:
        return f"{seconds:.1f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.1f} ms"
    return f"{max(seconds, 0.0) * 1e6:.0f} us"


class Context:
    """Where the training loop is: stamped on every row so analyses can
    reconstruct steps, microbatches and pipeline schedules."""

    __slots__ = ("step", "microbatch", "stage", "chunk")

    def __init__(self) -> None:
        self.step = -1
        self.microbatch = -1
        self.stage = -1
        self.chunk = -1


class _Stream:
    """One append-only Arrow IPC stream file fed from a deque of row tuples."""

    def __init__(self, path: Path, schema: pa.Schema) -> None:
        self.path = path
        self.schema = schema
        self.rows: collections.deque[tuple[Any, ...]] = collections.deque()
        self._file = open(path, "wb")
        self._writer = pa.ipc.new_stream(self._file, schema)
        self._file.flush()  # the schema message on disk at once: an empty but valid stream
        self.written = 0

    def drain(self) -> int:
        """Write whatever rows are queued as one record batch; return the count."""
        n = len(self.rows)
        if n == 0:
            return 0
        batch_rows = [self.rows.popleft() for _ in range(n)]
        columns = list(zip(*batch_rows))
        arrays = [pa.array(col, type=fld.type) for col, fld in zip(columns, self.schema)]
        self._writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=self.schema))
        self._file.flush()  # into the OS page cache: survives SIGKILL of this process
        self.written += n
        return n

    def close(self) -> None:
        self.drain()
        self._writer.close()
        self._file.close()


def warm_pyarrow() -> None:
    """The first `pa.array` call of a process imports pandas (pyarrow checks for
    pandas objects), which costs 1-2 s on this machine. Pay it up front: else
    the flusher's first batch lands seconds late, and a rank that dies early
    leaves an empty log. The launcher calls this before forking, so ranks
    inherit a warm interpreter."""
    pa.array([0], type=pa.int64())


class Recorder:
    """Writes one rank's trace directory. Thread-safe for the calls it exposes."""

    enabled = True

    def __init__(self, run_dir: str | os.PathLike[str], rank: int, world_size: int = 1,
                 flush_interval_s: float = FLUSH_INTERVAL_S) -> None:
        self.rank = rank
        self.world_size = world_size
        self.dir = Path(run_dir) / S.rank_dir_name(rank)
        self.dir.mkdir(parents=True, exist_ok=True)
        warm_pyarrow()
        self.context = Context()
        self.meta: dict[str, Any] = {
            "schema": S.SCHEMA_VERSION, "rank": rank, "world_size": world_size,
            "host": socket.gethostname(), "pid": os.getpid(), "device": "cpu",
            "clock_offset_ns": 0, "clock_uncertainty_ns": 0, "coords": {},
            "started_ns": time.time_ns(),
            # cores this process may run on: lets the analyzer tell a saturated host (ranks >= cores,
            # where time between ops is scheduling) from a stalled interconnect
            "host_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 0),
        }
        self.events = _Stream(self.dir / S.EVENTS_FILE, S.EVENTS_SCHEMA)
        self.metrics = _Stream(self.dir / S.METRICS_FILE, S.METRICS_SCHEMA)
        self.samples = _Stream(self.dir / S.SAMPLES_FILE, S.SAMPLES_SCHEMA)
        self._next_op = 0
        self._inflight: dict[int, tuple[float, str, str, int]] = {}  # op_id -> (start, name, group, seq)
        self._op_keys: dict[int, tuple[str, str, str, int, int]] = {}  # op_id -> (kind, name, group, peer, bytes)
        self._history: dict[tuple, float] = {}  # op key and (kind, name, group) -> slowest ok duration (s)
        self._suspected: set[int] = set()
        self._stacks_path = self.dir / S.STACKS_FILE
        self._stacks_file = open(self._stacks_path, "a")
        self._flush_interval = flush_interval_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._io_lock = threading.Lock()
        self._closed = False
        self.write_meta()
        # SIGUSR1 dumps every thread's stack: the launcher asks for it before it
        # terminates a rank, so a hang's post-mortem has the stacks.
        try:
            faulthandler.register(signal.SIGUSR1, file=self._stacks_file, all_threads=True, chain=False)
        except (ValueError, AttributeError, RuntimeError):  # not main thread / platform
            pass
        # A rank that gloo aborts (SIGABRT on a size mismatch) or that crashes
        # in native code leaves its stacks too.
        faulthandler.enable(file=self._stacks_file, all_threads=True)
        self._thread = threading.Thread(target=self._run, name=f"ncclscope-flusher-{rank}", daemon=True)
        self._thread.start()

    # ---- rows -------------------------------------------------------------
    def begin(self, kind: str, op_name: str, *, group: str = "", seq: int = -1, p2p_seq: int = -1,
              peer: int = -1, tag: int = -1, nbytes: int = -1, dtype: str = "", sizes: str = "",
              reduce_op: str = "", timeout_ms: int = -1, call_site: str = "", message: str = "") -> int:
        """Append a begin row and return the op id to pass to `end`."""
        op_id = self._next_op
        self._next_op = op_id + 1
        ctx = self.context
        now = time.time_ns()
        self.events.rows.append((
            self.rank, op_id, S.PHASE_BEGIN, now, kind, op_name, group, seq, p2p_seq, peer, tag,
            nbytes, dtype, sizes, reduce_op, ctx.step, ctx.microbatch, ctx.stage, ctx.chunk, "",
            timeout_ms, call_site, message,
        ))
        self._inflight[op_id] = (now, op_name, group, seq)
        self._op_keys[op_id] = (kind, op_name, group, peer, nbytes)
        return op_id

    def end(self, op_id: int, status: str = S.STATUS_OK, message: str = "") -> None:
        """Append the end row of `op_id` (its name, group and sequence repeated; new time and status)."""
        now = time.time_ns()
        started = self._inflight.pop(op_id, None)
        name, group, seq = ("", "", -1) if started is None else started[1:]
        # literal tuple in EVENT_FIELDS order: this is on every op's hot path
        self.events.rows.append((
            self.rank, op_id, S.PHASE_END, now, "", name, group, seq, -1, -1, -1, -1, "", "", "",
            self.context.step, -1, -1, -1, status, -1, "", message,
        ))
        key = self._op_keys.pop(op_id, None)
        if started is not None and status == S.STATUS_OK and key is not None:
            dur = (now - started[0]) / 1e9
            hist = self._history
            if dur > hist.get(key, -1.0):
                hist[key] = dur
            if dur > hist.get(key[:3], -1.0):
                hist[key[:3]] = dur

    def instant(self, kind: str, op_name: str, message: str = "", status: str = "") -> None:
        """A marker row (heartbeat, step boundary, fault injected, ...)."""
        row = list(_BLANK_EVENT)
        ctx = self.context
        row[0], row[1], row[2], row[3] = self.rank, -1, S.PHASE_INSTANT, time.time_ns()
        row[_EVENT_INDEX["kind"]] = kind
        row[_EVENT_INDEX["op_name"]] = op_name
        row[_EVENT_INDEX["message"]] = message
        row[_EVENT_INDEX["status"]] = status
        row[_EVENT_INDEX["step"]] = ctx.step
        self.events.rows.append(tuple(row))

    class _Span:
        __slots__ = ("rec", "op_id")

        def __init__(self, rec: "Recorder", op_id: int) -> None:
            self.rec, self.op_id = rec, op_id

        def __enter__(self) -> int:
            return self.op_id

        def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
            self.rec.end(self.op_id, S.STATUS_OK if et is None else S.STATUS_ERROR,
                         "" if ev is None else f"{type(ev).__name__}: {ev}"[:500])

    def span(self, name: str, kind: str = S.KIND_COMPUTE, message: str = "") -> "Recorder._Span":
        """`with rec.span("forward"):` records a compute op (begin/end rows)."""
        return Recorder._Span(self, self.begin(kind, name, message=message))

    def metric(self, **values: Any) -> None:
        """Append one metrics row; missing fields get their null value."""
        row = []
        for name, typ in S.METRIC_FIELDS:
            if name == "rank":
                row.append(self.rank)
            elif name in values:
                row.append(values[name])
            elif name == "time_ns":
                row.append(time.time_ns())
            elif pa.types.is_floating(typ):
                row.append(float("nan"))
            elif pa.types.is_list(typ):
                row.append([])
            elif pa.types.is_string(typ):
                row.append("")
            else:
                row.append(-1)
        self.metrics.rows.append(tuple(row))

    def sample(self, row: tuple[Any, ...]) -> None:
        self.samples.rows.append(row)

    # ---- metadata, stacks --------------------------------------------------
    def write_meta(self, **updates: Any) -> None:
        """Rewrite rank.json atomically (tmp + rename): never a half-written file.

        The group table goes to its own groups.json: `groups` is the object
        `mesh.group_file` builds (this rank's own groups, the fingerprint of
        its whole plan, and the whole plan only on rank 0 and on the lowest
        rank of any other fingerprint), so a 16,384-rank mesh's 2 MB plan is
        written once, not once per rank. A plain list (a full view, the
        format before) is still written as given."""
        groups = updates.pop("groups", None)
        if groups is not None:
            self._atomic_write(S.GROUPS_JSON, json.dumps(groups, separators=(",", ":")))
            self.meta["groups_file"] = S.GROUPS_JSON
        self.meta.update(updates)
        self._atomic_write(S.RANK_JSON, json.dumps(self.meta, indent=1, default=str))

    def _atomic_write(self, name: str, text: str) -> None:
        tmp = self.dir / (name + ".tmp")
        tmp.write_text(text)
        os.replace(tmp, self.dir / name)

    def dump_stacks(self, reason: str) -> None:
        """Append every thread's Python stack to stacks.txt (used on timeout)."""
        with self._io_lock:
            self._stacks_file.write(f"\n=== ncclscope rank {self.rank}: {reason} at {time.time_ns()} ns ===\n")
            self._stacks_file.flush()
            faulthandler.dump_traceback(file=self._stacks_file, all_threads=True)
            self._stacks_file.flush()

    # ---- flushing ----------------------------------------------------------
    def flush(self) -> None:
        """Write queued rows now (the flusher does this on its own timer)."""
        with self._io_lock:
            if self._closed:
                return
            for stream in (self.events, self.metrics, self.samples):
                stream.drain()

    def request_flush(self) -> None:
        """Wake the flusher without waiting for it (cheap: used before blocking waits)."""
        self._wake.set()

    def _run(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            self._wake.wait(self._flush_interval)
            self._wake.clear()
            now = time.monotonic()
            if now >= next_beat:
                self.instant(S.KIND_MARKER, S.HEARTBEAT)
                next_beat = now + HEARTBEAT_INTERVAL_S
                self._watchdog()
            try:
                self.flush()
            except Exception as exc:  # a full disk must not kill training; say it once
                print(f"ncclscope: rank {self.rank}: trace flush failed: {exc}", file=sys.stderr)
                self._stop.set()

    def _watchdog(self) -> None:
        """Mark ops that run far longer than their own history as suspect (once each).

        The history is the slowest completed instance of the same op (see
        SUSPECT_FACTOR); the wait is measured from the op's own begin row, so a
        suspect row always says a wait of at least SUSPECT_MIN_S."""
        now = time.time_ns()
        for op_id, (start, name, group, seq) in list(self._inflight.items()):
            if op_id in self._suspected:
                continue
            key = self._op_keys.get(op_id)
            if key is None:
                continue
            slowest = self._history.get(key)
            if slowest is None:
                slowest = self._history.get(key[:3])
            if slowest is None:
                continue
            waited = (now - start) / 1e9
            if waited >= SUSPECT_MIN_S and waited > SUSPECT_FACTOR * slowest:
                self._suspected.add(op_id)
                row = list(_BLANK_EVENT)
                row[0], row[1], row[2], row[3] = self.rank, op_id, S.PHASE_INSTANT, now
                row[_EVENT_INDEX["kind"]] = S.KIND_MARKER
                row[_EVENT_INDEX["op_name"]] = name
                row[_EVENT_INDEX["process_group"]] = group
                row[_EVENT_INDEX["collective_seq_id"]] = seq
                row[_EVENT_INDEX["status"]] = S.STATUS_SUSPECT
                row[_EVENT_INDEX["message"]] = (f"in flight {_fmt_s(waited)}; slowest earlier {_fmt_s(slowest)} "
                                                f"({waited / max(slowest, 1e-9):.0f}x)")
                self.events.rows.append(tuple(row))

    def close(self, status: str = "ok", message: str = "") -> None:
        """Stop the flusher, write the last rows and the end record. Idempotent."""
        if self._closed:
            return
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)
        with self._io_lock:
            for stream in (self.events, self.metrics, self.samples):
                try:
                    stream.close()
                except Exception as exc:
                    print(f"ncclscope: rank {self.rank}: closing {stream.path.name} failed: {exc}", file=sys.stderr)
            self._closed = True
        try:
            faulthandler.unregister(signal.SIGUSR1)
        except (ValueError, AttributeError, RuntimeError):
            pass
        faulthandler.disable()
        self._stacks_file.close()
        if self._stacks_path.exists() and self._stacks_path.stat().st_size == 0:
            self._stacks_path.unlink()  # an empty stacks.txt would suggest a dump happened
        self.write_meta(end={"status": status, "message": message[:2000], "time_ns": time.time_ns()})


class NullRecorder:
    """`--no-trace`: the same interface, no rows, no files, no threads."""

    enabled = False

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.rank = rank
        self.world_size = world_size
        self.context = Context()
        self.meta: dict[str, Any] = {}

    def begin(self, *args: Any, **kwargs: Any) -> int:
        return -1

    def end(self, *args: Any, **kwargs: Any) -> None:
        pass

    def instant(self, *args: Any, **kwargs: Any) -> None:
        pass

    def span(self, *args: Any, **kwargs: Any) -> "_NullSpan":
        return _NULL_SPAN

    def metric(self, **values: Any) -> None:
        pass

    def sample(self, row: Iterable[Any]) -> None:
        pass

    def write_meta(self, **updates: Any) -> None:
        self.meta.update(updates)

    def dump_stacks(self, reason: str) -> None:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    def flush(self) -> None:
        pass

    def request_flush(self) -> None:
        pass

    def close(self, status: str = "ok", message: str = "") -> None:
        pass


class _NullSpan:
    def __enter__(self) -> int:
        return -1

    def __exit__(self, *exc: Any) -> None:
        return None


_NULL_SPAN = _NullSpan()
