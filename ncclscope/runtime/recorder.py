"""Per-rank event writer: crash-safe Arrow IPC streams, flusher thread, heartbeat, watchdog.

Why this shape: a debugger is only useful if the trace survives the failure
it is meant to explain. Rows are appended to an in-memory buffer by the
training thread (one `list.extend` of a literal tuple: no locks, no I/O, no
object that outlives the call, so the wrapped op stays cheap) and a flusher
thread writes them as small Arrow record batches about every 200 ms. The
stream format needs no footer, so a SIGKILLed rank loses at most one flush
interval and a reader skips a torn last batch.

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

What each row costs, and why this code looks the way it does. Measured on
the shared 2-core dev box (one thread calling begin+end with the flusher
running, best of 3 runs): the training thread spends ~0.9 us of CPU per
begin+end pair (a deque of row tuples and pa.array per column: ~1.7 us),
the flusher ~0.5 us per row (was 1.2-2 us), all of it holding the GIL:
- The buffer is one flat list, `width` values per row, row-major. A row
  tuple kept in a deque until the flush survives the garbage collector's
  young generation and is scanned and promoted: that cost more than
  building it. The flusher takes a column as one C-level slice
  (`buf[j:n:width]`) instead of a `zip(*rows)`.
- `begin` takes its fields positionally too (one keyword match less per
  field); the op id comes from `itertools.count` (atomic under the GIL);
  the watchdog's history is updated in `end` through one dict lookup.
- Integer columns go through `array.array` (else numpy), string columns through
  two `str.join`s and numpy (`_strings`), a column with one value in the
  whole batch is `pa.repeat`ed (rank; -1 p2p fields in a collective-only
  batch; empty messages), floats and lists through `pa.array`. A value
  that path refuses (None, out of range, not a str) falls back to
  `pa.array`, which accepts or rejects it as before (see column_converter).
- The stream goes to a native `pa.OSFile` behind `pa.BufferedOutputStream`:
  a batch is one write system call, made by Arrow without calling back into
  Python for every column buffer (a Python file object costs both). The
  file's bytes are the same as before, batch for batch.
"""
from __future__ import annotations

import faulthandler
import itertools
import json
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa

from ncclscope import schema as S

from ncclscope.runtime import abort_flush
from ncclscope.runtime.ipc_write import IpcStream

FLUSH_INTERVAL_S = 0.2
HEARTBEAT_INTERVAL_S = 1.0
# An op is suspect when it has run SUSPECT_FACTOR times longer than the slowest
# completed instance of the same op (kind, name, group, peer, bytes: its own
# history; (kind, name, group) when that exact op has not completed yet) and at
# least SUSPECT_MIN_S. An op with no completed instance of either key is never
# suspect: there is nothing to compare its wait with.
SUSPECT_FACTOR = 20.0
SUSPECT_MIN_S = 2.0

# The hot path builds event rows as literal tuples in this column order (a
# dict or a list filled by name costs more than the row itself). A schema that
# moves a column must move it here too: fail at import, not with a skewed trace.
_ROW_LAYOUT = ["rank", "op_id", "phase", "time_ns", "kind", "op_name", "process_group", "collective_seq_id",
               "p2p_seq_id", "peer", "tag", "bytes", "input_dtypes", "input_sizes", "reduce_op", "step",
               "microbatch", "stage", "chunk", "status", "timeout_ms", "call_site", "message"]
if S.EVENT_COLUMNS != _ROW_LAYOUT:
    raise RuntimeError(f"recorder.py builds event rows as {_ROW_LAYOUT}; the schema says {S.EVENT_COLUMNS}")
_BEGIN, _END, _INSTANT, _OK = S.PHASE_BEGIN, S.PHASE_END, S.PHASE_INSTANT, S.STATUS_OK
_time_ns = time.time_ns


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
        self.events = IpcStream(self.dir / S.EVENTS_FILE, S.EVENTS_SCHEMA)
        self.metrics = IpcStream(self.dir / S.METRICS_FILE, S.METRICS_SCHEMA)
        self.samples = IpcStream(self.dir / S.SAMPLES_FILE, S.SAMPLES_SCHEMA)
        self._op_ids = itertools.count()    # next() is atomic under the GIL: ids stay unique across threads
        self._append = self.events.append_row
        # op_id -> (begin time ns, begin row, history key (kind, name, group, peer, bytes))
        self._inflight: dict[int, tuple[int, tuple[Any, ...], tuple[str, str, str, int, int]]] = {}
        # history key -> [slowest ok duration (ns), the [slowest (ns)] shared by its (kind, name, group)]
        self._history: dict[tuple[str, str, str, int, int], list[Any]] = {}
        self._history3: dict[tuple[str, str, str], list[int]] = {}
        self._suspected: set[int] = set()
        self._stacks_path = self.dir / S.STACKS_FILE
        self._stacks_file = open(self._stacks_path, "a")
        self._flush_interval = flush_interval_s
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._io_lock = threading.Lock()
        self._write_ids = itertools.count()   # one temporary file per metadata write (_atomic_write)
        self._closed = False
        self.write_meta()
        # SIGUSR1 dumps every thread's stack: the launcher asks for it before it
        # terminates a rank, so a hang's post-mortem has the stacks.
        try:
            faulthandler.register(signal.SIGUSR1, file=self._stacks_file, all_threads=True, chain=False)
        except (ValueError, AttributeError, RuntimeError):  # not main thread / platform
            pass
        # A rank that gloo aborts (SIGABRT on a size mismatch) or that crashes
        # in native code leaves its stacks too; on SIGABRT the queued rows are
        # written after them (abort_flush: the handler faulthandler chains to).
        abort_flush.install(self._flush_on_abort)
        faulthandler.enable(file=self._stacks_file, all_threads=True)
        self._thread = threading.Thread(target=self._run, name=f"ncclscope-flusher-{rank}", daemon=True)
        self._thread.start()

    # ---- rows -------------------------------------------------------------
    def begin(self, kind: str, op_name: str, group: str = "", seq: int = -1, p2p_seq: int = -1,
              peer: int = -1, tag: int = -1, nbytes: int = -1, dtype: str = "", sizes: str = "",
              reduce_op: str = "", timeout_ms: int = -1, call_site: str = "", message: str = "") -> int:
        """Append a begin row and return the op id to pass to `end`.

        Every field may be passed by keyword (what most callers do) or, on a
        hot path, positionally in this order, which saves the keyword matching."""
        op_id = next(self._op_ids)
        ctx = self.context
        now = _time_ns()
        # literal tuple in EVENT_FIELDS order (_ROW_LAYOUT): this is on every op's hot path
        row = (self.rank, op_id, _BEGIN, now, kind, op_name, group, seq, p2p_seq, peer, tag,
               nbytes, dtype, sizes, reduce_op, ctx.step, ctx.microbatch, ctx.stage, ctx.chunk, "",
               timeout_ms, call_site, message)
        self._append(row)
        self._inflight[op_id] = (now, row, (kind, op_name, group, peer, nbytes))
        return op_id

    def end(self, op_id: int, status: str = _OK, message: str = "") -> None:
        """Append the end row of `op_id` (its name, group and sequence repeated; new time and status)."""
        now = _time_ns()
        started = self._inflight.pop(op_id, None)
        if started is None:
            self._append((self.rank, op_id, _END, now, "", "", "", -1, -1, -1, -1, -1, "", "", "",
                          self.context.step, -1, -1, -1, status, -1, "", message))
            return
        start, row, key = started
        self._append((self.rank, op_id, _END, now, "", row[5], row[6], row[7], -1, -1, -1, -1, "", "", "",
                      self.context.step, -1, -1, -1, status, -1, "", message))
        if status == _OK:
            slowest = self._history.get(key)
            if slowest is None:
                slowest = self._new_history(key)
            dur = now - start
            if dur > slowest[0]:
                slowest[0] = dur
                of3 = slowest[1]          # never below slowest[0]: checked only when that moved
                if dur > of3[0]:
                    of3[0] = dur

    def _new_history(self, key: tuple[str, str, str, int, int]) -> list[Any]:
        of3 = self._history3.setdefault(key[:3], [-1])
        return self._history.setdefault(key, [-1, of3])

    def instant(self, kind: str, op_name: str, message: str = "", status: str = "", call_site: str = "") -> None:
        """A marker row (heartbeat, a call on a group this rank is not in, ...)."""
        self._append((self.rank, -1, _INSTANT, _time_ns(), kind, op_name, "", -1, -1, -1, -1, -1, "", "", "",
                      self.context.step, -1, -1, -1, status, -1, call_site, message))

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
        self.samples.rows.append(tuple(row))

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
        """`name` replaced by `text` in one rename. Each write has a temporary file of its own: two writers at
        once (a signal's end record interrupting the script's own, the sampler's thread) sharing one name
        wrote one document over the other's open file, and rank.json ended with the tail of the longer one
        (seed 20261217 #78: "extra data at character 1923"; the rank's group names went with it)."""
        tmp = self.dir / f"{name}.{os.getpid()}.{threading.get_ident()}.{next(self._write_ids)}.tmp"
        try:
            tmp.write_text(text)
            os.replace(tmp, self.dir / name)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise

    def dump_stacks(self, reason: str) -> None:
        """Append every thread's Python stack to stacks.txt (used on timeout)."""
        with self._io_lock:
            self._stacks_file.write(f"\n=== ncclscope rank {self.rank}: {reason} at {time.time_ns()} ns ===\n")
            self._stacks_file.flush()
            faulthandler.dump_traceback(file=self._stacks_file, all_threads=True)
            self._stacks_file.flush()

    def dump_exception(self, exc: BaseException) -> None:
        """Append the stack an exception unwound, in faulthandler's layout, to stacks.txt.

        A rank that dies of a Python exception leaves no faulthandler dump, yet where it was
        when it raised is the evidence: past the line of a collective it never issued, it
        skipped that collective. Each frame also says its function's def line, so a frame is
        matched to the function of a call site (rank.json `call_sites`), not to a namesake."""
        frames = []
        tb = exc.__traceback__
        outer = tb.tb_frame.f_back if tb is not None else None
        while tb is not None:
            frames.append((tb.tb_frame.f_code, tb.tb_lineno))
            tb = tb.tb_next
        chain = []
        while outer is not None:                     # the callers of the frame that caught it
            chain.append((outer.f_code, outer.f_lineno))
            outer = outer.f_back
        lines = [f'  File "{c.co_filename}", line {n} in {c.co_name} (def line {c.co_firstlineno})'
                 for c, n in reversed(frames)] + [f'  File "{c.co_filename}", line {n} in {c.co_name}' for c, n in chain]
        with self._io_lock:
            if self._stacks_file.closed:
                return
            self._stacks_file.write(f"\n=== ncclscope rank {self.rank}: exception {type(exc).__name__} "
                                    f"at {time.time_ns()} ns ===\n"
                                    f"Current thread 0x{threading.get_ident():016x} (most recent call first):\n"
                                    + "\n".join(lines) + "\n")
            self._stacks_file.flush()

    # ---- flushing ----------------------------------------------------------
    def flush(self) -> None:
        """Write queued rows now (the flusher does this on its own timer)."""
        with self._io_lock:
            if self._closed:
                return
            for stream in (self.events, self.metrics, self.samples):
                stream.drain()

    def _flush_on_abort(self) -> None:
        """The SIGABRT path: write the queued rows (events first: they say what the rank was in)
        unless a flush is in progress on the thread that is dying (its lock would never be
        released), then the end record. Why the end record: a launcher that is itself stopped
        (a scheduler's SIGTERM while torchrun's agent is stopping the job) never learns how
        each rank ended, and a rank aborted by gloo would then read as one it terminated."""
        if self._io_lock.acquire(timeout=1.0):
            try:
                if self._closed:
                    return
                for stream in (self.events, self.metrics, self.samples):
                    try:
                        stream.drain()
                    except Exception:                  # noqa: BLE001 - dying anyway: the next stream
                        pass
            finally:
                self._io_lock.release()
        self.write_meta(end={"status": "error", "message": S.END_ABORTED, "time_ns": time.time_ns()})

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
        now = _time_ns()
        for op_id, (start, row, key) in list(self._inflight.items()):
            if op_id in self._suspected:
                continue
            slowest_ns = self._history.get(key, (-1,))[0]
            if slowest_ns < 0:
                slowest_ns = self._history3.get(key[:3], (-1,))[0]
            if slowest_ns < 0:
                continue
            waited, slowest = (now - start) / 1e9, slowest_ns / 1e9
            if waited >= SUSPECT_MIN_S and waited > SUSPECT_FACTOR * slowest:
                self._suspected.add(op_id)
                self._append((self.rank, op_id, _INSTANT, now, S.KIND_MARKER, row[5], row[6], row[7],
                              -1, -1, -1, -1, "", "", "", -1, -1, -1, -1,
                              S.STATUS_SUSPECT, -1, "",
                              f"in flight {_fmt_s(waited)}; slowest earlier {_fmt_s(slowest)} "
                              f"({waited / max(slowest, 1e-9):.0f}x)"))

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
        abort_flush.uninstall(self._flush_on_abort)
        self._stacks_file.close()
        if self._stacks_path.exists() and self._stacks_path.stat().st_size == 0:
            self._stacks_path.unlink()  # an empty stacks.txt would suggest a dump happened
        self.write_meta(end={"status": status, "message": message[:2000], "time_ns": time.time_ns()})
