"""The only module that calls torch.distributed collectives and point-to-point ops.

Every op goes through `Comm._run`, which:
  1. asks the fault plan whether to tamper with the call (drills only),
  2. writes a begin row (group, per-group sequence, per-peer p2p sequence,
     bytes, dtype, shape, step/microbatch/stage, call site, timeout),
  3. issues the op asynchronously and waits with this call's timeout,
  4. writes the end row with status ok / timeout / error.
On a timeout it also dumps every thread's stack into stacks.txt, flushes the
trace and raises `CommTimeoutError` naming op, group, sequence and peer.

Why async + wait(timeout) rather than the blocking call: a per-call timeout
needs it, and the blocking form on gloo leaves no hook to record anything.
Why groups are never reused after a failure: on gloo a timed-out group is dead
(`Application timeout caused pair closure`) and an abandoned async op can still
complete later and overwrite its tensor (see ../shared/platform-notes.md).

Begin rows reach disk within one flush interval (~200 ms) even if the op then
blocks forever: the recorder's flusher is its own thread and the waiting
thread holds no GIL while inside gloo.

The process group is always passed explicitly as a `Group`; `Comm` holds one
rank's counters and nothing here is global.
"""
from __future__ import annotations

import datetime as _dt
import functools
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ncclscope import schema as S

_THIS_FILE = os.path.abspath(__file__)
_REDUCE_OPS = {
    "sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
    "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT,
}


# torch 2.13 deprecates all_gather_into_tensor in favour of all_gather_single;
# older releases only have the former. Same semantics.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


_TIMEDELTAS: dict[float, _dt.timedelta] = {}


class CommError(RuntimeError):
    """A wrapped op failed (not by timeout): peer died, group dead, bad call."""


class CommTimeoutError(CommError):
    """A wrapped op did not finish within its timeout."""

    def __init__(self, message: str, *, op: str, group: str, seq: int, peer: int, timeout_s: float) -> None:
        super().__init__(message)
        self.op, self.group, self.seq, self.peer, self.timeout_s = op, group, seq, peer, timeout_s


@dataclass
class Group:
    """A process group as the rest of the runtime sees it: a name, a kind,
    member global ranks (in group-rank order) and the torch handle."""

    name: str
    kind: str
    ranks: tuple[int, ...]
    pg: Any                      # torch ProcessGroup, or None when this rank is not a member
    creation_order: int
    rank: int = -1               # this process's rank inside the group (-1: not a member)
    dead: str = ""               # why the group must not be used again

    @property
    def size(self) -> int:
        return len(self.ranks)

    def label(self) -> str:
        """`dp1[1,3,5,7]`: the name plus members, as verdicts print it."""
        return f"{self.name}[{','.join(map(str, self.ranks))}]"

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "ranks": list(self.ranks),
                "creation_order": self.creation_order, "backend": "gloo" if self.pg is not None else ""}


@functools.lru_cache(maxsize=4096)
def _short_path(filename: str) -> str:
    """Path as a person would quote it: relative to the package or cwd."""
    marker = os.sep + "runtime" + os.sep
    if marker in filename:
        return "runtime/" + filename.split(marker, 1)[1]
    try:
        rel = os.path.relpath(filename)
        return filename if rel.startswith("..") else rel
    except ValueError:
        return filename


_SITES: dict[tuple[str, int], str] = {}


def call_site() -> str:
    """file:line of the first caller outside this module (cheap: a few frames,
    and the formatted string is cached per call site)."""
    f: Any = sys._getframe(1)
    while f is not None and f.f_code.co_filename == _THIS_FILE:
        f = f.f_back
    if f is None:
        return ""
    key = (f.f_code.co_filename, f.f_lineno)
    site = _SITES.get(key)
    if site is None:
        site = _SITES[key] = f"{_short_path(key[0])}:{key[1]}"
    return site


_META: dict[tuple[Any, Any], tuple[str, str, int]] = {}


def _meta(t: torch.Tensor) -> tuple[str, str, int]:
    """(input_sizes, input_dtypes, bytes) of a tensor, cached per (shape, dtype):
    the same few shapes recur every step, and formatting them is the costliest
    part of a begin row."""
    key = (t.shape, t.dtype)
    meta = _META.get(key)
    if meta is None:
        meta = _META[key] = ("[" + str(list(t.shape)) + "]", str(t.dtype).replace("torch.", ""),
                             t.numel() * t.element_size())
    return meta


_NO_TENSOR = ("[]", "", 0)


class Handle:
    """An in-flight async op (isend/irecv): `wait()` records its end row."""

    def __init__(self, comm: "Comm", work: Any, op_id: int, desc: tuple[str, Group, int, int], timeout_s: float) -> None:
        self._comm, self._work, self._op_id, self._desc, self._timeout_s = comm, work, op_id, desc, timeout_s
        self.done = work is None

    def wait(self, timeout_s: float | None = None) -> None:
        if self.done:
            return
        self.done = True
        self._comm._finish(self._work, self._op_id, self._desc, timeout_s or self._timeout_s)


class Comm:
    """One rank's wrapped communication: timeouts, sequence numbers, trace rows."""

    def __init__(self, recorder: Any, rank: int, world_size: int, timeout_s: float = 60.0,
                 faults: Any = None) -> None:
        self.rec = recorder
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.faults = faults                      # runtime.faults.FaultPlan or None
        self.groups: dict[str, Group] = {}
        self._seq: dict[str, int] = {}
        self._p2p_seq: dict[tuple[str, int], int] = {}

    # ---- groups ------------------------------------------------------------
    def register_world(self) -> Group:
        g = Group("world", "world", tuple(range(self.world_size)), dist.group.WORLD, 0, self.rank)
        self.groups[g.name] = g
        return g

    def new_group(self, name: str, kind: str, ranks: Sequence[int]) -> Group:
        """Create a torch group. Every rank must call this for every group in
        the same order (torch's rule), members or not."""
        ranks = tuple(int(r) for r in ranks)
        pg = dist.new_group(list(ranks), timeout=_dt.timedelta(seconds=self.timeout_s))
        member = self.rank in ranks
        g = Group(name, kind, ranks, pg if member else None, len(self.groups),
                  ranks.index(self.rank) if member else -1)
        self.groups[name] = g
        return g

    # ---- the one wrapper ---------------------------------------------------
    def _begin(self, kind: str, op: str, group: Group, *, t: torch.Tensor | None, peer: int = -1,
               tag: int = -1, reduce_op: str = "", timeout_s: float, p2p_dir: str = "") -> tuple[int, int]:
        if group.dead:
            raise CommError(f"rank {self.rank}: {op} on {group.label()} refused: group is dead ({group.dead})")
        if group.pg is None:
            raise CommError(f"rank {self.rank}: {op} on {group.label()}: this rank is not a member")
        if p2p_dir:
            key = (p2p_dir, peer)
            seq = self._p2p_seq.get(key, 0) + 1
            self._p2p_seq[key] = seq
            cseq = -1
        else:
            cseq = self._seq.get(group.name, 0) + 1
            self._seq[group.name] = cseq
            seq = -1
        sizes, dtype, nbytes = _meta(t) if t is not None else _NO_TENSOR
        op_id = self.rec.begin(
            kind, op, group=group.name, seq=cseq, p2p_seq=seq, peer=peer, tag=tag, nbytes=nbytes, dtype=dtype,
            sizes=sizes, reduce_op=reduce_op, timeout_ms=int(timeout_s * 1000), call_site=call_site(),
        )
        return op_id, cseq if cseq >= 0 else seq

    def _finish(self, work: Any, op_id: int, desc: tuple[str, Group, int, int], timeout_s: float) -> None:
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

    def _run(self, kind: str, op: str, group: Group, issue: Callable[[], Any], *, t: torch.Tensor | None,
             peer: int = -1, tag: int = -1, reduce_op: str = "", timeout_s: float | None = None,
             p2p_dir: str = "", wait: bool = True) -> Handle | None:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        op_id, seq = self._begin(kind, op, group, t=t, peer=peer, tag=tag, reduce_op=reduce_op,
                                 timeout_s=timeout, p2p_dir=p2p_dir)
        try:
            work = issue()
        except RuntimeError as exc:
            msg = f"rank {self.rank}: {op} #{seq} on {group.label()} could not be issued: {exc}"
            self.rec.end(op_id, S.STATUS_ERROR, msg)
            group.dead = f"error issuing {op} #{seq}"
            self.rec.flush()
            raise CommError(msg) from exc
        if wait:
            self._finish(work, op_id, (op, group, seq, peer), timeout)
            return None
        return Handle(self, work, op_id, (op, group, seq, peer), timeout)

    def _tamper(self, op: str, group: Group, t: torch.Tensor | None) -> tuple[Group, torch.Tensor | None, str, bool]:
        """Let a fault drill skip, redirect or distort this call (no-op without drills)."""
        if self.faults is None:
            return group, t, op, False
        return self.faults.tamper(self, op, group, t)

    # ---- collectives -------------------------------------------------------
    def all_reduce(self, t: torch.Tensor, group: Group, op: str = "sum", timeout_s: float | None = None) -> torch.Tensor:
        if group.size == 1:
            return t
        group, t2, name, skip = self._tamper("all_reduce", group, t)
        if skip:
            return t
        if name == "broadcast":  # a `mismatch:what=type` drill
            self._run(S.KIND_COLLECTIVE, "broadcast", group,
                      lambda: dist.broadcast(t2, group.ranks[0], group=group.pg, async_op=True),
                      t=t2, peer=group.ranks[0], timeout_s=timeout_s)
            return t
        self._run(S.KIND_COLLECTIVE, "all_reduce", group,
                  lambda: dist.all_reduce(t2, op=_REDUCE_OPS[op], group=group.pg, async_op=True),
                  t=t2, reduce_op=op, timeout_s=timeout_s)
        return t

    def all_gather(self, out: list[torch.Tensor], t: torch.Tensor, group: Group, timeout_s: float | None = None) -> list[torch.Tensor]:
        if group.size == 1:
            out[0].copy_(t)
            return out
        group, t, _, skip = self._tamper("all_gather", group, t)
        if skip:
            return out
        self._run(S.KIND_COLLECTIVE, "all_gather", group,
                  lambda: dist.all_gather(out, t, group=group.pg, async_op=True), t=t, timeout_s=timeout_s)
        return out

    def all_gather_into_tensor(self, out: torch.Tensor, t: torch.Tensor, group: Group, timeout_s: float | None = None) -> torch.Tensor:
        if group.size == 1:
            out.copy_(t.reshape(out.shape))
            return out
        group, t, _, skip = self._tamper("all_gather_into_tensor", group, t)
        if skip:
            return out
        self._run(S.KIND_COLLECTIVE, "all_gather_into_tensor", group,
                  lambda: _all_gather_single(out, t, group=group.pg, async_op=True), t=t, timeout_s=timeout_s)
        return out

    def reduce_scatter(self, out: torch.Tensor, inputs: list[torch.Tensor], group: Group, op: str = "sum",
                       timeout_s: float | None = None) -> torch.Tensor:
        if group.size == 1:
            out.copy_(inputs[0])
            return out
        group, _, _, skip = self._tamper("reduce_scatter", group, out)
        if skip:
            return out
        self._run(S.KIND_COLLECTIVE, "reduce_scatter", group,
                  lambda: dist.reduce_scatter(out, inputs, op=_REDUCE_OPS[op], group=group.pg, async_op=True),
                  t=inputs[0], reduce_op=op, timeout_s=timeout_s)
        return out

    def reduce_scatter_tensor(self, out: torch.Tensor, t: torch.Tensor, group: Group, op: str = "sum",
                              timeout_s: float | None = None) -> torch.Tensor:
        if group.size == 1:
            out.copy_(t.reshape(out.shape))
            return out
        group, t, _, skip = self._tamper("reduce_scatter_tensor", group, t)
        if skip:
            return out
        self._run(S.KIND_COLLECTIVE, "reduce_scatter_tensor", group,
                  lambda: _reduce_scatter_single(out, t, op=_REDUCE_OPS[op], group=group.pg, async_op=True),
                  t=t, reduce_op=op, timeout_s=timeout_s)
        return out

    def all_to_all_single(self, out: torch.Tensor, t: torch.Tensor, group: Group,
                          output_split_sizes: list[int] | None = None, input_split_sizes: list[int] | None = None,
                          timeout_s: float | None = None) -> torch.Tensor:
        """Uneven splits allowed (sizes along dim 0)."""
        if group.size == 1:
            out.copy_(t)
            return out
        group, t, _, skip = self._tamper("all_to_all_single", group, t)
        if skip:
            return out
        self._run(S.KIND_COLLECTIVE, "all_to_all_single", group,
                  lambda: dist.all_to_all_single(out, t, output_split_sizes, input_split_sizes,
                                                 group=group.pg, async_op=True),
                  t=t, timeout_s=timeout_s)
        return out

    def broadcast(self, t: torch.Tensor, src: int, group: Group, timeout_s: float | None = None) -> torch.Tensor:
        """`src` is a global rank."""
        if group.size == 1:
            return t
        group, t, _, skip = self._tamper("broadcast", group, t)
        if skip:
            return t
        self._run(S.KIND_COLLECTIVE, "broadcast", group,
                  lambda: dist.broadcast(t, src, group=group.pg, async_op=True), t=t, peer=src, timeout_s=timeout_s)
        return t

    def barrier(self, group: Group, timeout_s: float | None = None) -> None:
        if group.size == 1:
            return
        group, _, _, skip = self._tamper("barrier", group, None)
        if skip:
            return
        self._run(S.KIND_COLLECTIVE, "barrier", group, lambda: dist.barrier(group=group.pg, async_op=True),
                  t=None, timeout_s=timeout_s)

    # ---- point to point ----------------------------------------------------
    def isend(self, t: torch.Tensor, dst: int, group: Group, tag: int = 0, timeout_s: float | None = None) -> Handle:
        """`dst` is a global rank. The returned handle's wait() records the end row."""
        h = self._run(S.KIND_P2P, "isend", group, lambda: dist.isend(t, dst, group=group.pg, tag=tag),
                      t=t, peer=dst, tag=tag, timeout_s=timeout_s, p2p_dir="send", wait=False)
        assert h is not None
        return h

    def irecv(self, t: torch.Tensor, src: int, group: Group, tag: int = 0, timeout_s: float | None = None) -> Handle:
        h = self._run(S.KIND_P2P, "irecv", group, lambda: dist.irecv(t, src, group=group.pg, tag=tag),
                      t=t, peer=src, tag=tag, timeout_s=timeout_s, p2p_dir="recv", wait=False)
        assert h is not None
        return h

    def send(self, t: torch.Tensor, dst: int, group: Group, tag: int = 0, timeout_s: float | None = None) -> None:
        self._run(S.KIND_P2P, "send", group, lambda: dist.isend(t, dst, group=group.pg, tag=tag),
                  t=t, peer=dst, tag=tag, timeout_s=timeout_s, p2p_dir="send")

    def recv(self, t: torch.Tensor, src: int, group: Group, tag: int = 0, timeout_s: float | None = None) -> torch.Tensor:
        self._run(S.KIND_P2P, "recv", group, lambda: dist.irecv(t, src, group=group.pg, tag=tag),
                  t=t, peer=src, tag=tag, timeout_s=timeout_s, p2p_dir="recv")
        return t

    def batch_isend_irecv(self, ops: list[tuple[str, torch.Tensor, int]], group: Group, tag: int = 0,
                          timeout_s: float | None = None) -> list[Handle]:
        """ops: ("isend" | "irecv", tensor, global peer rank). Each op is its own
        traced p2p op; they are posted together as torch's batch API requires."""
        if not ops:
            return []
        timeout = self.timeout_s if timeout_s is None else timeout_s
        begun = []
        for kind, t, peer in ops:
            direction = "send" if kind == "isend" else "recv"
            op_id, seq = self._begin(S.KIND_P2P, kind, group, t=t, peer=peer, tag=tag, timeout_s=timeout,
                                     p2p_dir=direction)
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
        return [Handle(self, w, op_id, (kind, group, seq, peer), timeout)
                for w, (op_id, seq, kind, peer) in zip(works, begun)]
