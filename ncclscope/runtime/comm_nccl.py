"""NCCL: end rows at GPU completion.

On NCCL the CPU call returns long before the GPU has done the op, so its
return proves nothing. `Comm._call` hands the op to `Completions`, a thread
that polls `work.is_completed()` and writes the end row at GPU completion; the
caller only orders its stream after the op (`work.wait()` without a timeout
does not block the CPU). An op that never completes stays an open begin row
until its timeout, when the thread writes the timeout row, dumps stacks and
NCCL's Flight Recorder, and fails the rank (docs/nccl.md). gloo never starts
this thread.
"""
from __future__ import annotations

import collections
import os
import sys
import threading
import time
from typing import Any

import torch

from ncclscope import schema as S

from ncclscope.runtime.comm_types import CommError, CommTimeoutError, Group

NCCL_WATCHDOG_GRACE_S = 30.0   # NCCL's watchdog (pg timeout) fires this long after our own timeout
POLL_S = 0.0005                # completion poll period while ops are in flight
STUCK_GRACE_S = 3.0            # after a timeout: time for the training thread to notice before on_stuck


class Completions:
    """The NCCL poller thread: writes each op's end row when `work.is_completed()`
    turns true (GPU completion, to within POLL_S), or its timeout row when the
    op's own timeout passes first. Only started on NCCL; gloo never pays for it.
    Public: `Comm` (comm.py) starts one per rank on NCCL and hands it each op."""

    def __init__(self, comm: Any) -> None:   # the `Comm` (comm.py) whose ops it ends
        self.comm = comm
        self.pending: collections.deque[tuple[Any, int, tuple[str, Group, int, int], float, float]] = \
            collections.deque()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"ncclscope-completions-{comm.rank}", daemon=True)
        self._thread.start()

    def add(self, work: Any, op_id: int, desc: tuple[str, Group, int, int], timeout_s: float) -> None:
        self.pending.append((work, op_id, desc, timeout_s, time.monotonic() + timeout_s))
        self._wake.set()

    def _loop(self) -> None:
        while True:
            if not self.pending:
                self._wake.wait(1.0)
                self._wake.clear()
                continue
            now = time.monotonic()
            for _ in range(len(self.pending)):
                item = self.pending.popleft()
                if not self.check(item, now):
                    self.pending.append(item)
            time.sleep(POLL_S)

    def check(self, item: tuple[Any, int, tuple[str, Group, int, int], float, float], now: float) -> bool:
        """True when the item is finished with (end row written)."""
        work, op_id, (op, group, seq, peer), timeout_s, deadline = item
        comm, rec = self.comm, self.comm.rec
        where = f"{op} #{seq} on {group.label()}" + (f" peer {peer}" if peer >= 0 else "")
        error: Any = None
        try:
            done = work.is_completed()
            if done:
                error = work.exception()
        except RuntimeError as exc:      # is_completed re-raises the op's error on some versions
            done, error = True, exc
        if done and error is None:
            rec.end(op_id, S.STATUS_OK)
            return True
        if done:
            text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            msg = f"rank {comm.rank}: {where} failed on the GPU: {text}"
            rec.end(op_id, S.STATUS_ERROR, msg)
            comm.fail(CommError(msg), f"error in {op} #{seq}")
            rec.flush()
            return True
        if now < deadline:
            return False
        msg = f"rank {comm.rank}: {where} timed out after {timeout_s:g} s (not completed on the GPU)"
        rec.end(op_id, S.STATUS_TIMEOUT, msg)
        err = CommTimeoutError(msg, op=op, group=group.name, seq=seq, peer=peer, timeout_s=timeout_s)
        comm.fail(err, f"timeout in {op} #{seq}")
        rec.dump_stacks(msg)
        dump_flight_recorder(rec)
        rec.flush()
        threading.Thread(target=self._stuck, args=(err,), daemon=True).start()
        return True

    def _stuck(self, err: CommError) -> None:
        """The training thread raises `err` at its next wrapped op; if it is
        blocked in a GPU wait instead, hand over to `comm.on_stuck` (train.py
        closes the trace and exits with the timeout code)."""
        time.sleep(STUCK_GRACE_S)
        if self.comm.on_stuck is not None and not self.comm.failure_seen:
            self.comm.on_stuck(err)


def dump_flight_recorder(rec: Any) -> None:
    """NCCL's own Flight Recorder (TORCH_NCCL_TRACE_BUFFER_SIZE > 0) into the
    rank directory, next to our rows: what the backend saw enqueued."""
    path = getattr(rec, "dir", None)
    dump = getattr(torch._C._distributed_c10d, "_dump_nccl_trace", None)
    if path is None or dump is None:
        return
    try:
        data = dump()
        with open(os.path.join(path, "nccl_flight_recorder.pkl"), "wb") as f:
            f.write(data)
    except Exception as exc:   # evidence, never a second failure
        print(f"ncclscope: rank {rec.rank}: Flight Recorder dump failed: {exc}", file=sys.stderr)
