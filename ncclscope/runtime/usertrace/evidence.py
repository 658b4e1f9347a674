"""Evidence, never intervention: what the tracer writes when the job is stuck or ending.

    watch thread (every WATCH_S) .. an op in flight FR_EARLY_S: a Flight Recorder snapshot;
                                    in flight --timeout-s: stacks + FR + flush, a `suspect`
                                    marker; no traced op or step for --timeout-s: the same
                                    with an `idle` marker (the job may be blocked in an op
                                    only the backend sees: DDP's reducer, DTensor)
    poller (every POLL_S / GPU_POLL_S while any are pending)
                                 .. end rows of future-less works (gloo p2p), of CUDA works
                                    (`is_completed()`) and of sync NCCL ops (gpu.py)
    SIGTERM (torchrun stopping the survivors of a failed rank)
                                 .. stacks + FR + flush from a helper thread, then the signal's
                                    default action (the script's own handler wins)

Nothing is raised into the script and no op is cancelled. Every module these
threads use is imported at the top of this file (and torch._dynamo by the
bootstrap) before any of them starts: a thread that imports lazily while the
script's main thread imports the same package can hand the main thread a
partially initialised module (see bootstrap.warm_imports).
`EvidenceMixin` is one facet of `tracer.Tracer`.
"""
from __future__ import annotations

import ctypes
import os
import pickle
import select
import signal
import threading
import time
from typing import Any

import torch

from ncclscope import schema as S
from ncclscope.load.fr_merge import FR_FILE  # snapshot name; NCCL's own dump is FR_NCCL_PREFIX<rank>

from ncclscope.runtime.usertrace.callsite import site_functions
from ncclscope.runtime.usertrace.gpu import GPU_POLL_S

POLL_S = 0.02
_REAL_EXIT = os._exit     # before watch_exit wraps it: a signal's exit writes no os._exit evidence
WATCH_S = 0.25
FR_EARLY_S = 1.0   # an op in flight this long gets a Flight Recorder snapshot (cheap, before any kill)


def warm_fr_dump() -> None:
    """`_dump_fr_trace()` imports torch._inductor (and so torch._dynamo) the first
    time it runs: import them now, in the calling (main) thread, so that a dump
    from the watch thread never imports while the script's main thread does
    (bootstrap.warm_imports says why that kills the script). Idempotent."""
    import torch._dynamo  # noqa: F401
    import torch._inductor  # noqa: F401


class EvidenceMixin:
    rec: Any
    rank: int
    timeout_s: float
    _inflight: dict[int, tuple[float, str, str, int]]
    _pending: dict[int, tuple[Any, int]]
    _waiting: set[int]
    _gpu_works: set[int]
    _pending_lock: threading.Lock
    _fr_lock: threading.Lock
    _stop: threading.Event
    _wake: threading.Event
    _evidenced: set[int]
    _fr_for: set[int]
    _last_activity: float
    _idle_evidenced: float
    _world_pg: Any
    _installed: bool
    _gpu: Any

    def dump_fr(self) -> bool:
        """Write this rank's Flight Recorder buffer into the rank directory (atomic)."""
        fn = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
        if fn is None:
            return False
        with self._fr_lock:
            try:
                data = fn()
            except Exception:
                return False
            if not data:
                return False
            try:
                tmp = self.rec.dir / (FR_FILE + ".tmp")
                tmp.write_bytes(data if isinstance(data, bytes) else pickle.dumps(data))
                os.replace(tmp, self.rec.dir / FR_FILE)
            except OSError:
                return False
        return True

    def evidence(self, reason: str, stacks: bool = True) -> None:
        if stacks:
            try:
                self.rec.dump_stacks(reason)
            except (OSError, ValueError):
                pass
        self.dump_fr()
        try:
            self.rec.flush()
        except Exception:
            pass

    def _watch(self) -> None:
        next_watch = 0.0
        gpu = self._gpu
        while not self._stop.is_set():
            pending = bool(self._pending)
            on_gpu = bool(len(gpu) or self._gpu_works)
            self._wake.wait(GPU_POLL_S if on_gpu else POLL_S if pending else WATCH_S)
            self._wake.clear()
            if len(gpu):
                gpu.poll()
            if self._pending:
                self._poll()
            now = time.monotonic()
            if now < next_watch:
                continue
            next_watch = now + WATCH_S
            self._watch_inflight(now)

    def _watch_inflight(self, now: float) -> None:
        idle = now - self._last_activity
        if (self.timeout_s and idle >= self.timeout_s and not self._inflight
                and self._idle_evidenced != self._last_activity and self._world_pg is not None):
            # nothing the tracer sees is in flight, yet nothing moved: the job may be blocked in an op
            # only the backend knows (DDP's reducer, a DTensor collective) or in compute
            self._idle_evidenced = self._last_activity
            msg = (f"no traced op or step for {idle:.1f} s (--timeout-s {self.timeout_s:g}): stacks, "
                   "Flight Recorder and trace dumped; the job goes on")
            self.rec.instant(S.KIND_MARKER, "idle", message=msg)
            self.evidence(msg)
        for op_id, (start, name, group, seq) in list(self._inflight.items()):
            age = now - start
            if age >= FR_EARLY_S and op_id not in self._fr_for:
                self._fr_for.add(op_id)
                self.dump_fr()
            if self.timeout_s and age >= self.timeout_s and op_id not in self._evidenced:
                self._evidenced.add(op_id)
                msg = (f"{name} #{seq} on {group} in flight {age:.1f} s (--timeout-s {self.timeout_s:g}): "
                       "stacks, Flight Recorder and trace dumped; the op continues")
                self.rec.instant(S.KIND_MARKER, name, message=msg, status=S.STATUS_SUSPECT)
                self.evidence(msg)

    def _poll(self) -> None:
        """End rows for works without a future (gloo p2p) or on CUDA tensors that completed
        without anyone waiting on them."""
        with self._pending_lock:
            items = list(self._pending.items())
        for key, (work, op_id) in items:
            if key in self._waiting:
                continue   # the wait() wrapper records it, with the outcome
            try:
                done = work.is_completed()
            except Exception:
                done = True
            if done:
                with self._pending_lock:
                    if key in self._waiting or self._pending.pop(key, None) is None:
                        continue
                    self._gpu_works.discard(key)
                self._inflight.pop(op_id, None)
                self.rec.end(op_id, S.STATUS_OK)

    def watch_sigterm(self) -> None:
        """Dump evidence on SIGTERM even while the main thread is blocked inside a collective.

        A Python signal handler only runs when the main thread gets back to the
        interpreter, which a rank hung in gloo or NCCL never does. The C-level
        handler does write the signal number to the wakeup fd, though, so a helper
        thread reading that fd dumps stacks, Flight Recorder and the trace, then lets
        SIGTERM do what it would have done without ncclscope (terminate), unless the
        script installed its own handler, which then runs as usual."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
            return   # the script (or its launcher) owns SIGTERM
        try:
            r, w = os.pipe()
            os.set_blocking(w, False)
            signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):
            return

        term_lock = threading.Lock()

        def on_sigterm() -> None:
            """Evidence once, then the default action; on the reader thread only (see `handler`)."""
            if not term_lock.acquire(blocking=False):
                return
            try:
                self.rec.instant(S.KIND_MARKER, "signal", message="SIGTERM received")
                self.evidence("SIGTERM received")
                self.rec.close("error", S.END_TERMINATED)
            finally:
                _die(signal.SIGTERM)

        def handler(signum: int, frame: Any) -> None:
            """Nothing here: the reader thread dumps and ends the process. Run in the main thread,
            the dump deadlocked: the signal can land while that thread holds the very lock the dump
            takes (seen: an uncaught gloo error's evidence was writing the Flight Recorder file when
            torchrun's SIGTERM came, and the rank hung until the agent's SIGKILL 30 s later, its end
            record never written). Installed only so that SIGTERM reaches the wakeup fd instead of
            killing the process at once."""

        signal.signal(signal.SIGTERM, handler)
        self._sig_handler = handler

        def reader() -> None:
            while True:
                try:
                    ready, _, _ = select.select([r], [], [], 1.0)
                    if not ready:
                        if self._stop.is_set() and not self._installed:
                            return
                        continue
                    data = os.read(r, 64)
                except OSError:
                    return
                if signal.SIGTERM in data:
                    if signal.getsignal(signal.SIGTERM) is handler:
                        on_sigterm()
                    return

        t = threading.Thread(target=reader, name="ncclscope-sigterm", daemon=True)
        t.start()

    def watch_exit(self) -> None:
        """Leave the line a rank left from when the script calls `os._exit`.

        `os._exit` ends the process at once: no exception unwinds, no `finally` runs, so
        the rank's trace ends without an end record or a stack, and all a verdict could
        say is "exit code N". The wrapper writes the stack (the user's line is in it),
        a Flight Recorder snapshot and an end record saying `os._exit(N)`, then exits as
        asked. Only `os._exit`: `sys.exit` raises SystemExit, which the bootstrap sees."""
        real = os._exit

        def _exit(code: int) -> None:
            try:
                if self._installed:
                    self.rec.dump_stacks(f"os._exit({code})")
                    self.dump_fr()
                    if self._groups_dirty or self._pending_meta:
                        self.write_groups()
                    self.rec.write_meta(call_sites=site_functions())
                    self.rec.close("error", f"os._exit({code})")
            except BaseException:   # never stand between the script and its exit
                pass
            real(code)

        os._exit = _exit
        self._real_exit = real

    def _restore_exit(self) -> None:
        real = getattr(self, "_real_exit", None)
        if real is not None:
            os._exit = real
            self._real_exit = None

    def _restore_sigterm(self) -> None:
        handler = getattr(self, "_sig_handler", None)
        if handler is not None and threading.current_thread() is threading.main_thread():
            try:
                if signal.getsignal(signal.SIGTERM) is handler:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    signal.set_wakeup_fd(-1)
            except (ValueError, OSError):
                pass


def _die(signum: int) -> None:
    """End the process by `signum` with the default action, from any thread."""
    try:
        libc = ctypes.CDLL(None)
        libc.signal(signum, ctypes.c_void_p(0))   # SIG_DFL, process-wide, no main-thread rule
        os.kill(os.getpid(), signum)
        time.sleep(5)
    finally:
        _REAL_EXIT(128 + signum)
