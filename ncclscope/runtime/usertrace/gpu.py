"""On NCCL an op ends at its GPU completion, not when the CPU call returns.

A sync NCCL collective (`async_op=False`) returns as soon as its kernel is
enqueued and the current stream is made to wait for it; the GPU finishes it
later. So for a call on a CUDA tensor the wrapper records a CUDA event on the
current stream right after the call (everything the stream does after that
point waits for the collective, so the event completes when the collective
has) and hands (event, op id) to `GpuEnds.track`; the tracer's watch thread
calls `poll()` every GPU_POLL_S while any are pending, which writes the end
row of each op whose `event.query()` is True. An op whose kernel never
finishes (a hung NCCL collective) stays an open begin row: the evidence of
the hang. The end time is the poll's, so it is late by at most GPU_POLL_S
plus the poll's own wait for the GIL.

Nothing here touches CUDA unless a CUDA tensor was given: `track` is only
called for tensors whose `is_cuda` is True, and torch.cuda is only reached
through the event factory (a fake in the unit tests). Any failure of an event
call turns GPU ends off for the rest of the job (one stderr line), and ops end
when the call returns, as on gloo.
"""
from __future__ import annotations

import sys
import threading
from typing import Any, Callable

from ncclscope import schema as S

GPU_POLL_S = 0.001


def cuda_event_after(tensor: Any) -> Any:
    """A torch.cuda.Event recorded on the current stream of `tensor`'s device."""
    import torch   # already imported by the time a CUDA tensor exists: no import happens here
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(tensor.device))
    return ev


class GpuEnds:
    """Ops whose end row waits for a CUDA event. `track` from the op's thread, `poll` from the watch thread."""

    def __init__(self, rec: Any, inflight: dict[int, Any],
                 event_after: Callable[[Any], Any] = cuda_event_after) -> None:
        self.rec = rec
        self.inflight = inflight
        self.event_after = event_after
        self.pending: list[tuple[Any, int]] = []   # (event, op id), in issue order
        self.lock = threading.Lock()
        self.broken = ""                           # why GPU ends are off (an event call failed)
        self.wake: Callable[[], None] = lambda: None

    def track(self, op_id: int, tensor: Any) -> bool:
        """Record the completion event for `op_id`; False (the caller ends the row now) if that fails."""
        if self.broken:
            return False
        try:
            ev = self.event_after(tensor)
        except Exception as exc:   # never let the tracer break the op: fall back to CPU-return ends
            self.broken = f"{type(exc).__name__}: {exc}"[:200]
            print(f"ncclscope: rank {self.rec.rank}: GPU completion times off ({self.broken}); "
                  "NCCL ops end when the call returns", file=sys.stderr)
            return False
        with self.lock:
            first = not self.pending
            self.pending.append((ev, op_id))
        if first:
            self.wake()
        return True

    def __len__(self) -> int:
        return len(self.pending)

    def poll(self) -> int:
        """End the rows of the ops whose event has completed; return how many are still pending.

        Events complete in stream order, but ops on different streams or devices
        need not: every pending event is asked, not only the oldest."""
        with self.lock:
            items = self.pending
            self.pending = []
        still: list[tuple[Any, int]] = []
        for ev, op_id in items:
            try:
                done = bool(ev.query())
            except Exception as exc:   # a CUDA error: the op's outcome is the job's to report
                self.inflight.pop(op_id, None)
                self.rec.end(op_id, S.STATUS_ERROR, f"{type(exc).__name__}: {exc}"[:500])
                continue
            if done:
                self.inflight.pop(op_id, None)
                self.rec.end(op_id, S.STATUS_OK)
            else:
                still.append((ev, op_id))
        with self.lock:
            self.pending = still + self.pending
            return len(self.pending)
