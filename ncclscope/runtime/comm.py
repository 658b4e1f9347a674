"""The only module that calls torch.distributed collectives and point-to-point ops.

Every op is a row of one table (`Op`: name, kind, how to issue it, what a
group of one does) and goes through one wrapper, `Comm._call`, which:
  1. returns at once when the group has one rank (the op's `alone` rule),
  2. runs the before-issue hooks (`Comm.add_hook`): a hook may alter the call
     (op, group, tensor, argument, timeout), delay it or skip it. Fault drills
     attach here (runtime/faults.py); without hooks this is one empty check,
  3. writes a begin row (group, per-group sequence, per-peer p2p sequence,
     bytes, dtype, shape, step/microbatch/stage, call site, timeout),
  4. issues the op asynchronously and ends it with this call's timeout,
  5. writes the end row with status ok / timeout / error.
On a timeout it also dumps every thread's stack into stacks.txt, flushes the
trace and raises `CommTimeoutError` naming op, group, sequence and peer.

How an op ends depends on the backend:
  - gloo (CPU): the calling thread waits on the work with the timeout; the
    end row is written when the wait returns, which is when the op is done.
  - NCCL (GPU): the CPU call returns long before the GPU has done the op, so
    its return proves nothing. The op is handed to `Completions`
    (comm_nccl.py), a thread that writes the end row at GPU completion, or
    the timeout row, stacks and Flight Recorder dump when it never completes.

Why async + wait(timeout) rather than the blocking call: a per-call timeout
needs it, and the blocking form on gloo leaves no hook to record anything.
Why groups are never reused after a failure: on gloo a timed-out group is dead
(`Application timeout caused pair closure`) and an abandoned async op can still
complete later and overwrite its tensor (see ../shared/platform-notes.md).

Begin rows reach disk within one flush interval (~200 ms) even if the op then
blocks forever: the recorder's flusher is its own thread and the waiting
thread holds no GIL while inside gloo.

The process group is always passed explicitly as a `Group`; `Comm` holds one
rank's counters and nothing here is global. Beside this file: comm_types.py
(`Group`, `Op`, `Call`, `Handle`, the errors), comm_site.py (call site and tensor
metadata of a begin row), comm_nccl.py (the NCCL completion thread).
"""
from __future__ import annotations

import datetime as _dt
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ncclscope import schema as S

from ncclscope.runtime.comm_nccl import NCCL_WATCHDOG_GRACE_S, Completions
from ncclscope.runtime.comm_site import NO_TENSOR, call_site, tensor_meta
from ncclscope.runtime.comm_types import DONE, Call, CommError, CommTimeoutError, Group, Handle, Op


_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT,
}


# torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single;
# older releases only have the former. Same semantics.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


_TIMEDELTAS: dict[float, _dt.timedelta] = {}


# ---- the op table ------------------------------------------------------------
# issue(pg, t, out, arg, tag) -> async work; alone(t, out, arg): what a group of
# one does instead (None: not allowed, p2p). `arg` is the op's one parameter:
# the reduce op name, the global src/peer rank, or all_to_all's split sizes.

def _nothing(t: Any, out: Any, arg: Any) -> None:
    return None


_C, _P = S.KIND_COLLECTIVE, S.KIND_P2P
ALL_REDUCE = Op("all_reduce", _C, lambda pg, t, out, a, tag: dist.all_reduce(
    t, op=_REDUCE_OPS[a], group=pg, async_op=True), _nothing, "reduce_op")
ALL_GATHER = Op("all_gather", _C, lambda pg, t, out, a, tag: dist.all_gather(out, t, group=pg, async_op=True),
                lambda t, out, a: out[0].copy_(t))
ALL_GATHER_INTO_TENSOR = Op("all_gather_into_tensor", _C, lambda pg, t, out, a, tag: _all_gather_single(
    out, t, group=pg, async_op=True), lambda t, out, a: out.copy_(t.reshape(out.shape)))
REDUCE_SCATTER = Op("reduce_scatter", _C, lambda pg, t, out, a, tag: dist.reduce_scatter(   # t: list of inputs
    out, t, op=_REDUCE_OPS[a], group=pg, async_op=True), lambda t, out, a: out.copy_(t[0]), "reduce_op")
REDUCE_SCATTER_TENSOR = Op("reduce_scatter_tensor", _C, lambda pg, t, out, a, tag: _reduce_scatter_single(
    out, t, op=_REDUCE_OPS[a], group=pg, async_op=True), lambda t, out, a: out.copy_(t.reshape(out.shape)),
    "reduce_op")
ALL_TO_ALL_SINGLE = Op("all_to_all_single", _C, lambda pg, t, out, a, tag: dist.all_to_all_single(   # a: splits
    out, t, a[0], a[1], group=pg, async_op=True), lambda t, out, a: out.copy_(t))
BROADCAST = Op("broadcast", _C, lambda pg, t, out, a, tag: dist.broadcast(t, a, group=pg, async_op=True),
               _nothing, "peer")
BARRIER = Op("barrier", _C, lambda pg, t, out, a, tag: dist.barrier(group=pg, async_op=True), _nothing)
ISEND = Op("isend", _P, lambda pg, t, out, a, tag: dist.isend(t, a, group=pg, tag=tag), None, "peer", "send")
IRECV = Op("irecv", _P, lambda pg, t, out, a, tag: dist.irecv(t, a, group=pg, tag=tag), None, "peer", "recv")
SEND = ISEND._replace(name="send")
RECV = IRECV._replace(name="recv")
OPS = {op.name: op for op in (ALL_REDUCE, ALL_GATHER, ALL_GATHER_INTO_TENSOR, REDUCE_SCATTER,
                              REDUCE_SCATTER_TENSOR, ALL_TO_ALL_SINGLE, BROADCAST, BARRIER, ISEND, IRECV, SEND, RECV)}


Hook = Callable[["Comm", Call], None]


class Comm:
    """One rank's wrapped communication: timeouts, sequence numbers, trace rows.

    `backend` "gloo" waits on the calling thread; "nccl" ends ops at GPU
    completion on a poller thread (see the module docstring)."""

    def __init__(self, recorder: Any, rank: int, world_size: int, timeout_s: float = 60.0,
                 backend: str = "gloo") -> None:
        self.rec = recorder
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.backend = backend
        self.hooks: list[Hook] = []               # before-issue hooks, run in order
        self.groups: dict[str, Group] = {}
        self._seq: dict[str, int] = {}
        self._p2p_seq: dict[tuple[str, int], int] = {}
        self.failure: CommError | None = None     # NCCL: set by the completion thread
        self.failure_seen = False                 # ... and raised on the training thread
        self.on_stuck: Callable[[CommError], None] | None = None   # NCCL: the rank is stuck in a GPU wait
        self._completions = Completions(self) if backend == "nccl" else None

    def add_hook(self, hook: Hook) -> None:
        """Run `hook(comm, call)` before every op is issued (see `Call`)."""
        self.hooks.append(hook)

    # ---- groups ------------------------------------------------------------
    def register_world(self) -> Group:
        g = Group("world", "world", tuple(range(self.world_size)), dist.group.WORLD, 0, self.rank,
                  backend=self.backend)
        self.groups[g.name] = g
        return g

    def new_group(self, name: str, kind: str, ranks: Sequence[int]) -> Group:
        """Create a torch group. Every rank must call this for every group in
        the same order (torch's rule), members or not."""
        ranks = tuple(int(r) for r in ranks)
        pg = dist.new_group(list(ranks), timeout=_dt.timedelta(seconds=self.pg_timeout_s()))
        member = self.rank in ranks
        g = Group(name, kind, ranks, pg if member else None, len(self.groups),
                  ranks.index(self.rank) if member else -1, backend=self.backend)
        self.groups[name] = g
        return g

    def pg_timeout_s(self) -> float:
        """The backend's own timeout. On NCCL it is the watchdog's, which aborts
        the communicator: later than ours, so our evidence is written first."""
        return self.timeout_s + (NCCL_WATCHDOG_GRACE_S if self.backend == "nccl" else 0.0)

    # ---- the one wrapper ---------------------------------------------------
    def _call(self, op: Op, group: Group, t: Any, out: Any, arg: Any = None, *, tag: int = -1,
              timeout_s: float | None = None, wait: bool = True) -> Handle | None:
        """Issue `op` on `group` (hooks, begin row, issue, end row). Returns a
        Handle when wait=False (p2p), else None."""
        if group.size == 1 and op.alone is not None:
            op.alone(t, out, arg)
            return None
        if self.hooks:
            call = Call(op, group, t, out, arg, tag, timeout_s)
            for hook in self.hooks:
                hook(self, call)
                if call.skip:
                    return None if wait else DONE
            op, group, t, arg, timeout_s = call.op, call.group, call.t, call.arg, call.timeout_s
        timeout = self.timeout_s if timeout_s is None else timeout_s
        op_id, seq = self._begin(op, group, t, arg, tag, timeout)
        try:
            work = op.issue(group.pg, t, out, arg, tag)
        except RuntimeError as exc:
            msg = f"rank {self.rank}: {op.name} #{seq} on {group.label()} could not be issued: {exc}"
            self.rec.end(op_id, S.STATUS_ERROR, msg)
            group.dead = f"error issuing {op.name} #{seq}"
            self.rec.flush()
            raise CommError(msg) from exc
        desc = (op.name, group, seq, arg if op.arg == "peer" else -1)
        if self._completions is not None:           # NCCL: ended at GPU completion by the poller
            self._completions.add(work, op_id, desc, timeout)
            if not wait:
                return Handle(self, work, op_id, desc, timeout)
            self._order_after(work)
            return None
        if wait:
            self._finish(work, op_id, desc, timeout)
            return None
        return Handle(self, work, op_id, desc, timeout)

    def _begin(self, op: Op, group: Group, t: Any, arg: Any, tag: int, timeout_s: float) -> tuple[int, int]:
        if group.dead:
            if self.failure is not None:
                self.failure_seen = True
                raise self.failure
            raise CommError(f"rank {self.rank}: {op.name} on {group.label()} refused: group is dead ({group.dead})")
        if group.pg is None:
            raise CommError(f"rank {self.rank}: {op.name} on {group.label()}: this rank is not a member")
        peer = arg if op.arg == "peer" else -1
        if op.p2p:
            key = (op.p2p, peer)
            seq = self._p2p_seq.get(key, 0) + 1
            self._p2p_seq[key] = seq
            cseq = -1
        else:
            cseq = self._seq.get(group.name, 0) + 1
            self._seq[group.name] = cseq
            seq = -1
        if t is None:
            sizes, dtype, nbytes = NO_TENSOR
        else:
            sizes, dtype, nbytes = tensor_meta(t[0] if type(t) is list else t)
        # positional, in Recorder.begin's order (kind, op_name, group, seq, p2p_seq, peer, tag, nbytes, dtype,
        # sizes, reduce_op, timeout_ms, call_site): keyword matching is a tenth of the hot path's cost
        op_id = self.rec.begin(op.kind, op.name, group.name, cseq, seq, peer, tag, nbytes, dtype, sizes,
                               arg if op.arg == "reduce_op" else "", int(timeout_s * 1000), call_site())
        return op_id, cseq if cseq >= 0 else seq

    def _finish(self, work: Any, op_id: int, desc: tuple[str, Group, int, int], timeout_s: float) -> None:
        """gloo: wait on this thread with the timeout, then write the end row."""
        op, group, seq, peer = desc
        t0 = time.monotonic()
        td = _TIMEDELTAS.get(timeout_s)
        if td is None:
            td = _TIMEDELTAS[timeout_s] = _dt.timedelta(seconds=timeout_s)
        try:
            ok = work.wait(timeout=td)
            if ok is False:
                raise RuntimeError("wait() returned False")
        except RuntimeError as exc:
            waited = time.monotonic() - t0
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            timed_out = "timed out" in text.lower() or "timeout" in text.lower() and waited >= 0.9 * timeout_s
            where = f"{op} #{seq} on {group.label()}" + (f" peer {peer}" if peer >= 0 else "")
            if timed_out:
                msg = f"rank {self.rank}: {where} timed out after {timeout_s:g} s ({text})"
                self.rec.end(op_id, S.STATUS_TIMEOUT, msg)
                group.dead = f"timeout in {op} #{seq}"
                self.rec.dump_stacks(msg)
                self.rec.flush()
                raise CommTimeoutError(msg, op=op, group=group.name, seq=seq, peer=peer, timeout_s=timeout_s) from exc
            msg = f"rank {self.rank}: {where} failed: {text}"
            self.rec.end(op_id, S.STATUS_ERROR, msg)
            group.dead = f"error in {op} #{seq}"
            self.rec.flush()
            raise CommError(msg) from exc
        self.rec.end(op_id, S.STATUS_OK)

    def _order_after(self, work: Any) -> None:
        """NCCL: make the current stream wait for the op (the CPU goes on; a
        barrier's wait does block). A failure seen by the completion thread is
        raised here, on the training thread."""
        if self.failure is not None:
            self.failure_seen = True
            raise self.failure
        try:
            work.wait()
        except RuntimeError as exc:   # DistBackendError: the communicator was aborted
            raise CommError(f"rank {self.rank}: wait failed: {str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__}") from exc

    def fail(self, err: CommError, why: str) -> None:
        """Mark the rank failed (NCCL completion thread): every group is dead,
        the next wrapped op on the training thread raises `err`."""
        self.failure = err
        for g in self.groups.values():
            g.dead = g.dead or why

    # ---- collectives -------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, group: Group, op: str = "sum", timeout_s: float | None = None) -> torch.Tensor:
        self._call(ALL_REDUCE, group, t, t, op, timeout_s=timeout_s)
        return t

    def all_gather(self, out: list[torch.Tensor], t: torch.Tensor, group: Group, timeout_s: float | None = None) -> list[torch.Tensor]:
        self._call(ALL_GATHER, group, t, out, timeout_s=timeout_s)
        return out

    def all_gather_into_tensor(self, out: torch.Tensor, t: torch.Tensor, group: Group, timeout_s: float | None = None) -> torch.Tensor:
        self._call(ALL_GATHER_INTO_TENSOR, group, t, out, timeout_s=timeout_s)
        return out

    def reduce_scatter(self, out: torch.Tensor, inputs: list[torch.Tensor], group: Group, op: str = "sum",
                       timeout_s: float | None = None) -> torch.Tensor:
        self._call(REDUCE_SCATTER, group, inputs, out, op, timeout_s=timeout_s)
        return out

    def reduce_scatter_tensor(self, out: torch.Tensor, t: torch.Tensor, group: Group, op: str = "sum",
                              timeout_s: float | None = None) -> torch.Tensor:
        self._call(REDUCE_SCATTER_TENSOR, group, t, out, op, timeout_s=timeout_s)
        return out

    def all_to_all_single(self, out: torch.Tensor, t: torch.Tensor, group: Group,
                          output_split_sizes: list[int] | None = None, input_split_sizes: list[int] | None = None,
                          timeout_s: float | None = None) -> torch.Tensor:
        """Uneven splits allowed (sizes along dim 0)."""
        self._call(ALL_TO_ALL_SINGLE, group, t, out, (output_split_sizes, input_split_sizes), timeout_s=timeout_s)
        return out

    def broadcast(self, t: torch.Tensor, src: int, group: Group, timeout_s: float | None = None) -> torch.Tensor:
        """`src` is a global rank."""
        self._call(BROADCAST, group, t, t, src, timeout_s=timeout_s)
        return t

    def barrier(self, group: Group, timeout_s: float | None = None) -> None:
        self._call(BARRIER, group, None, None, timeout_s=timeout_s)

    # ---- point to point ----------------------------------------------------
    def isend(self, t: torch.Tensor, dst: int, group: Group, tag: int = 0, timeout_s: float | None = None) -> Handle:
        """`dst` is a global rank. The returned handle's wait() records the end row."""
        h = self._call(ISEND, group, t, t, dst, tag=tag, timeout_s=timeout_s, wait=False)
        assert h is not None
        return h

    def irecv(self, t: torch.Tensor, src: int, group: Group, tag: int = 0, timeout_s: float | None = None) -> Handle:
        h = self._call(IRECV, group, t, t, src, tag=tag, timeout_s=timeout_s, wait=False)
        assert h is not None
        return h

    def send(self, t: torch.Tensor, dst: int, group: Group, tag: int = 0, timeout_s: float | None = None) -> None:
        self._call(SEND, group, t, t, dst, tag=tag, timeout_s=timeout_s)

    def recv(self, t: torch.Tensor, src: int, group: Group, tag: int = 0, timeout_s: float | None = None) -> torch.Tensor:
        self._call(RECV, group, t, t, src, tag=tag, timeout_s=timeout_s)
        return t

    def batch_isend_irecv(self, ops: list[tuple[str, torch.Tensor, int]], group: Group, tag: int = 0,
                          timeout_s: float | None = None) -> list[Handle]:
        """ops: ("isend" | "irecv", tensor, global peer rank). Each op is its own
        traced p2p op; they are posted together as torch's batch API requires
        (so hooks do not see them one by one)."""
        if not ops:
            return []
        timeout = self.timeout_s if timeout_s is None else timeout_s
        begun = []
        for kind, t, peer in ops:
            op = ISEND if kind == "isend" else IRECV
            op_id, seq = self._begin(op, group, t, peer, tag, timeout)
            begun.append((op_id, seq, kind, peer))
        p2p = [dist.P2POp(dist.isend if k == "isend" else dist.irecv, t, peer, group=group.pg, tag=tag)
               for k, t, peer in ops]
        try:
            works = dist.batch_isend_irecv(p2p)
        except RuntimeError as exc:
            for op_id, seq, kind, peer in begun:
                self.rec.end(op_id, S.STATUS_ERROR, f"batch_isend_irecv could not be issued: {exc}")
            group.dead = "error issuing batch_isend_irecv"
            raise CommError(f"rank {self.rank}: batch_isend_irecv on {group.label()} failed: {exc}") from exc
        handles = [Handle(self, w, op_id, (kind, group, seq, peer), timeout)
                   for w, (op_id, seq, kind, peer) in zip(works, begun)]
        if self._completions is not None:
            for h in handles:
                self._completions.add(h._work, h._op_id, h._desc, timeout)
        return handles
