"""The op wrappers: a begin row before each public torch.distributed call, an end row when it completes.

    sync call, CPU tensor (gloo) ...... end row when the call returns
    sync call, CUDA tensor (NCCL) ..... end row at GPU completion: a CUDA event on the
                                        current stream, polled by the watch thread (gpu.py)
    async_op=True / isend / irecv ..... the Work's future callback; a Work without a future
                                        (gloo p2p), or one on a CUDA tensor, goes to the poller
                                        (`work.is_completed()`), and `Work.wait` records it
    it raised ......................... end row with status error / timeout, the exception
                                        re-raised untouched

Sequence numbers: `collective_seq_id` is the process group's own counter
(`ProcessGroup._get_sequence_number_for_group() + 1`), the number Flight
Recorder stores, so a traced all_reduce and the DDP reducer's all_reduces
(which only Flight Recorder sees) are numbered on one scale. gloo's counter
also counts p2p ops, which FR's never does: the wrapper remembers how far p2p
moved it (`_p2p_shift`). p2p ops count per (direction, peer), as `ncclscope
train` does.

The hot path is what a tiny all_reduce pays on top of the call: argument
positions are resolved once at install, the group is a dict hit, the call
site a frame step and two dict hits (callsite.py), tensor metadata cached by
(shape, dtype). all_reduce and the other one-tensor, rootless collectives get
a leaner wrapper still (hotpath.py), which hands anything unusual to the
general one here. `OpsMixin` is one facet of `tracer.Tracer`.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable

import torch
import torch.distributed.distributed_c10d as c10d

from ncclscope import schema as S

from ncclscope.runtime.comm_site import tensor_meta
from ncclscope.runtime.usertrace.callsite import call_site, text_of
from ncclscope.runtime.usertrace.hotpath import covers, make_fast
from ncclscope.runtime.usertrace.opspec import (NO_META, OBJECT_LISTS, OWN_SEQ, REDUCE_NAMES, a2a_list_splits,
                                                a2a_splits, arg, list_meta, object_list_meta, positions, tls)


NOT_MEMBER_NOTE = ("called on a process group this rank is not a member of: torch returned at once, "
                   "without communicating")


def _arg_layout(fname: str, spec: tuple[Any, ...], pos: dict[str, int]) -> tuple[Any, ...]:
    """Where the general wrapper finds its arguments (-1: absent) and which rules apply, resolved once
    per op at install: (tensor, group, async_op, op, peer, tag) positions, then own_seq (the group's
    counter does not count it), a2a, rooted."""
    kind, in_arg, peer_arg = spec[1], OBJECT_LISTS.get(fname, spec[2]), spec[4]
    return (pos.get(in_arg, -1), pos.get("group", -1), pos.get("async_op", -1), pos.get("op", -1),
            pos.get(peer_arg, -1), pos.get("tag", -1), fname in OWN_SEQ,
            # all_to_all(_single): what each member sends to and expects from each other is part of the call
            {"all_to_all_single": "single", "all_to_all": "list"}.get(fname, ""),
            kind == S.KIND_COLLECTIVE and bool(peer_arg))   # broadcast, reduce, gather, scatter (+ _object)


def _group_peer(g: Any, group_peer: Any) -> int:
    """The global rank of a peer given group-locally (`group_dst=` / `group_src=`), -1 when not given
    or outside the group."""
    if group_peer is None:
        return -1
    return int(g.ranks[int(group_peer)]) if int(group_peer) < len(g.ranks) else -1


class OpsMixin:
    rec: Any
    timeout_s: float
    groups: dict[Any, Any]
    _world_pg: Any
    _groups_dirty: bool
    _p2p_seq: dict[tuple[str, int], int]
    _own_seq: dict[str, int]
    _inflight: dict[int, tuple[float, str, str, int]]
    _pending: dict[int, tuple[Any, int]]
    _waiting: set[int]
    _gpu_works: set[int]
    _sites: set[tuple[str, str, str]]
    _p2p_shift: dict[str, int]
    _last_activity: float
    ops: int
    _gpu: Any
    _pending_lock: Any
    _nan_live: bool
    patch_wait: Callable[[], None]
    nan_check_for: Callable[[str], bool]
    check_input: Callable[..., bool]

    def settle(self, out: Any, op_id: int, is_async: bool, t: torch.Tensor | None) -> None:
        """After the call returned: its end row now, or once its Work (async) or GPU event (a CUDA
        tensor on NCCL) completes."""
        cuda = t is not None and t.is_cuda
        if is_async and out is not None and not isinstance(out, (int, list)):
            self._on_complete(out, op_id, cuda)
        elif cuda and self._gpu.track(op_id, t):
            pass   # ends at GPU completion: the watch thread polls the event
        else:
            self._inflight.pop(op_id, None)
            self.rec.end(op_id, S.STATUS_OK)

    def hot_refs(self) -> tuple[Any, ...]:
        """What a wrapper binds as locals once, for every one of its calls (a local is one load; an
        attribute a dict lookup): the recorder's begin, groups, in-flight table, call sites, p2p shifts,
        timeout in ms."""
        return (self.rec.begin, self.groups, self._inflight, self._sites, self._p2p_shift,
                int(self.timeout_s * 1000) if self.timeout_s else -1)

    def _wrap_op(self, fname: str, orig: Callable[..., Any], spec: tuple[Any, ...]) -> Callable[..., Any]:
        """The traced `orig` (torch.distributed's `fname`; `spec` its SPECS row): the lean wrapper
        (hotpath.py) for all_reduce and its kin, else the general one (`_general_wrapper`)."""
        pos = positions(orig)
        traced = self._general_wrapper(fname, orig, spec, pos)
        traced.__ncclscope_orig__ = orig   # type: ignore[attr-defined]
        if covers(fname, spec, pos, OWN_SEQ):   # all_reduce and its kin: the lean wrapper (hotpath.py)
            return make_fast(self, orig, spec, pos, traced)
        return traced

    def _general_wrapper(self, fname: str, orig: Callable[..., Any], spec: tuple[Any, ...],
                         pos: dict[str, int]) -> Callable[..., Any]:
        """The wrapper of any op of SPECS; what it reads is resolved once, here, into the closure's locals."""
        op_name, kind, in_arg, in_list, peer_arg, gpeer_arg, p2p_dir, always_async = spec
        obj_list = fname in OBJECT_LISTS
        in_arg = OBJECT_LISTS.get(fname, in_arg)
        i_in, i_group, i_async, i_op, i_peer, i_tag, own_seq, a2a, rooted = _arg_layout(fname, spec, pos)
        begin, groups, inflight, sites, p2p_shift, timeout_ms = self.hot_refs()
        monotonic = time.monotonic
        Tensor = torch.Tensor
        nan_check = self.nan_check_for(op_name)   # reducing ops: their input's finiteness (nancheck.py)
        counted = bool(p2p_dir) or own_seq        # gloo's group counter counts p2p ops, and a barrier's (_count_p2p)

        @functools.wraps(orig)
        def traced(*args: Any, **kwargs: Any) -> Any:
            if tls.depth:
                return orig(*args, **kwargs)
            n = len(args)
            pg = args[i_group] if 0 <= i_group < n else kwargs.get("group")
            g = groups.get(pg if pg is not None else self._world_pg)
            if g is None and (g := self._group_of(pg)) is None:   # no group of this rank: no row to write
                self._not_member(pg, op_name)
                return orig(*args, **kwargs)
            if self._groups_dirty:
                self.write_groups()
            t = (args[i_in] if 0 <= i_in < n else kwargs.get(in_arg)) if in_arg else None
            given = t
            if obj_list:
                sizes, dtype, nbytes = object_list_meta(t)
                t = None
            elif in_list:
                sizes, dtype, nbytes = list_meta(t)
                t = t[0] if isinstance(t, (list, tuple)) and t and isinstance(t[0], Tensor) else None
            elif isinstance(t, Tensor):
                sizes, dtype, nbytes = tensor_meta(t)
            else:
                sizes, dtype, nbytes = NO_META
                t = None
            peer, tag, seq, p2p_seq, reduce_op, label = -1, -1, -1, -1, "", g.name
            if peer_arg:
                p = args[i_peer] if 0 <= i_peer < n else kwargs.get(peer_arg)
                peer = int(p) if p is not None else _group_peer(g, kwargs.get(gpeer_arg))
            if p2p_dir:
                tag = int((args[i_tag] if 0 <= i_tag < n else kwargs.get("tag", 0)) or 0) if i_tag >= 0 else 0
                key = (p2p_dir, peer)
                p2p_seq = self._p2p_seq[key] = self._p2p_seq.get(key, 0) + 1
            elif own_seq:                # numbered on a channel of its own (opspec.OWN_SEQ says why)
                label = g.name + S.BARRIER_CHANNEL
                seq = self._next_own_seq(label)
            else:
                try:
                    seq = (pg or self._world_pg)._get_sequence_number_for_group() + 1 - p2p_shift.get(g.name, 0)
                except (AttributeError, RuntimeError):
                    seq = self._next_own_seq(g.name)
            if i_op >= 0 and (rop := (args[i_op] if i_op < n else kwargs.get("op"))) is not None:
                try:
                    reduce_op = REDUCE_NAMES.get(int(rop), str(rop))
                except (TypeError, ValueError):
                    reduce_op = str(rop)
            if rooted and peer >= 0:   # the root is part of what every member must agree on
                reduce_op = f"{reduce_op}, root {peer}" if reduce_op else f"root {peer}"
            if a2a == "single":
                sizes += a2a_splits(t, arg(args, kwargs, pos, "output"), arg(args, kwargs, pos, "input_split_sizes"),
                                    arg(args, kwargs, pos, "output_split_sizes"), len(g.ranks))
            elif a2a:
                sizes += a2a_list_splits(given, arg(args, kwargs, pos, "output_tensor_list"), len(g.ranks))
            is_async = always_async or bool(args[i_async] if 0 <= i_async < n else kwargs.get("async_op", False))
            site = call_site()
            if nan_check and given is not None and self._nan_live:   # before the reduction spreads it
                self.check_input(given, op_name, label, seq, reduce_op, site)
            # positional, in Recorder.begin's order: keyword matching is a tenth of this path's cost
            op_id = begin(kind, op_name, label, seq, p2p_seq, peer, tag, nbytes, dtype, sizes, reduce_op,
                          timeout_ms, site)
            inflight[op_id] = (now := monotonic(), op_name, label, seq if seq >= 0 else p2p_seq)
            self._last_activity = now
            if (key := (site, label, op_name)) not in sites:
                self._new_site(key)
            self.ops += 1
            tls.depth = 1
            before = self._pg_seq(pg) if counted else 0
            try:
                out = orig(*args, **kwargs)
            except BaseException as exc:
                tls.depth = 0
                self._failed(op_id, exc)
                raise
            finally:
                if counted:
                    self._count_p2p(g.name, pg, before)
            tls.depth = 0
            self.settle(out, op_id, is_async, t)
            return out
        return traced

    def _not_member(self, pg: Any, op_name: str) -> None:
        """A call on a group this rank has no record of. On torch's NON_GROUP_MEMBER torch returns at
        once (with a warning): the call communicates nothing, and the group the rank's peers wait on
        never sees it. Worth a row of its own (the call site is still the user's line: `call_site`
        skips ncclscope's frames)."""
        if pg is c10d.GroupMember.NON_GROUP_MEMBER:
            self.rec.instant(S.KIND_MARKER, op_name, NOT_MEMBER_NOTE, S.STATUS_NOT_MEMBER, call_site())

    def _next_own_seq(self, name: str) -> int:
        """The next sequence number of group `name` counted here, for an op its backend does not count
        (OWN_SEQ: the analyzer aligns them apart, index/instances.py) or a process group without a counter."""
        seq = self._own_seq[name] = self._own_seq.get(name, 0) + 1
        return seq

    def _wrap_batch(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        rec = self.rec

        @functools.wraps(orig)
        def batch_isend_irecv(p2p_op_list: Any) -> Any:
            if tls.depth:
                return orig(p2p_op_list)
            begun = []
            site = call_site()
            cuda = False
            for p in p2p_op_list:
                fn = getattr(p.op, "__ncclscope_orig__", p.op)
                name = getattr(fn, "__name__", "isend")
                direction = "recv" if "recv" in name else "send"
                g = self._group_of(getattr(p, "group", None))
                peer = int(getattr(p, "peer", -1) if getattr(p, "peer", None) is not None else -1)
                key = (direction, peer)
                pseq = self._p2p_seq.get(key, 0) + 1
                self._p2p_seq[key] = pseq
                if isinstance(p.tensor, torch.Tensor):
                    sizes, dtype, nbytes = tensor_meta(p.tensor)
                    cuda = cuda or p.tensor.is_cuda
                else:
                    sizes, dtype, nbytes = NO_META
                op_id = rec.begin(S.KIND_P2P, "irecv" if direction == "recv" else "isend",
                                  group="" if g is None else g.name, p2p_seq=pseq, peer=peer,
                                  tag=int(getattr(p, "tag", 0) or 0), nbytes=nbytes, dtype=dtype, sizes=sizes,
                                  timeout_ms=int(self.timeout_s * 1000) if self.timeout_s else -1, call_site=site)
                self._inflight[op_id] = (time.monotonic(), name, "" if g is None else g.name, pseq)
                begun.append(op_id)
                key = (site, "" if g is None else g.name, name)
                if key not in self._sites:
                    self._new_site(key)
            self.ops += len(begun)
            tls.depth = 1
            pgs = {}
            for p in p2p_op_list:
                g = self._group_of(getattr(p, "group", None))
                if g is not None:
                    pgs[g.name] = (getattr(p, "group", None), self._pg_seq(getattr(p, "group", None)))
            try:
                works = orig(p2p_op_list)
            except BaseException as exc:
                tls.depth = 0
                for op_id in begun:
                    self._failed(op_id, exc, evidence=op_id == begun[-1])
                raise
            finally:
                for name, (pg, before) in pgs.items():
                    self._count_p2p(name, pg, before)
            tls.depth = 0
            works_list = list(works or [])
            for i, op_id in enumerate(begun):
                if i < len(works_list) and len(works_list) == len(begun):
                    self._on_complete(works_list[i], op_id, cuda)
                elif works_list:
                    self._on_complete(works_list[-1], op_id, cuda)
                else:
                    self._inflight.pop(op_id, None)
                    rec.end(op_id, S.STATUS_OK)
            return works
        return batch_isend_irecv

    def _pg_seq(self, pg: Any) -> int:
        try:
            return int((pg or self._world_pg)._get_sequence_number_for_group())
        except (AttributeError, RuntimeError, TypeError):
            return -1

    def _count_p2p(self, name: str, pg: Any, before: int) -> None:
        """gloo's group counter also counts p2p ops, and the sends and receives of a monitored_barrier (NCCL's
        does not; Flight Recorder's collective_seq_id never does): remember how far they moved it, so
        collectives keep FR's numbering (without this, rank 0, which receives from and answers every member
        of the barrier, numbered the collectives after it ahead of its peers)."""
        if before >= 0:
            after = self._pg_seq(pg)
            if after > before:
                self._p2p_shift[name] = self._p2p_shift.get(name, 0) + (after - before)

    def _new_site(self, key: tuple[str, str, str]) -> None:
        """First op from this (call site, group, op): make the rows so far durable before it is issued.

        The op most likely to kill the process (gloo SIGABRTs a rank whose
        collective does not match its peers') is a call the job has not made
        before, and the flusher's 200 ms interval is longer than such a job
        lives after it. So, once per distinct call site: a Flight Recorder
        snapshot and a synchronous flush (a few ms, a handful of times per job)."""
        self._sites.add(key)
        self.dump_fr()
        try:
            self.rec.flush()
        except Exception:
            pass

    def _on_complete(self, work: Any, op_id: int, cuda: bool = False) -> None:
        """End row when an async op completes: the Work's future, else the poller.

        On a CUDA tensor the future is no help (NCCL marks it complete when the
        kernels are enqueued, not when they finish): the poller asks
        `work.is_completed()`, which queries the work's CUDA events, and `wait()`
        (which on NCCL only makes the stream wait) does not end the row."""
        fut = None
        if not cuda:
            try:
                fut = work.get_future()
            except (RuntimeError, AttributeError, NotImplementedError):
                fut = None
        if fut is not None:
            def done(f: Any, op_id: int = op_id) -> None:
                self._inflight.pop(op_id, None)
                try:
                    f.value()
                    self.rec.end(op_id, S.STATUS_OK)
                except Exception as exc:   # the user sees it through wait(); we only record it
                    self.rec.end(op_id, S.STATUS_ERROR, text_of(exc))
            try:
                fut.add_done_callback(done)
                return
            except RuntimeError:
                pass
        self.patch_wait()   # before the script can wait on it
        with self._pending_lock:
            self._pending[id(work)] = (work, op_id)
            if cuda:
                self._gpu_works.add(id(work))

    def _failed(self, op_id: int, exc: BaseException, evidence: bool = True) -> None:
        self._inflight.pop(op_id, None)
        text = text_of(exc)
        low = text.lower()
        status = S.STATUS_TIMEOUT if ("timed out" in low or "timeout" in low) else S.STATUS_ERROR
        self.rec.end(op_id, status, text)
        if evidence:
            self.evidence(f"{status} in op {op_id}: {text[:200]}", stacks=status == S.STATUS_TIMEOUT)

    def _wrap_wait(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        """Work.wait for the works the tracer has no future for: the end row at the
        wait, with its outcome (a timed-out gloo send is 'completed' too). A CUDA
        work's row is left to the poller (its GPU completion), unless wait raised."""
        pending, waiting, lock, gpu_works = self._pending, self._waiting, self._pending_lock, self._gpu_works

        @functools.wraps(orig)
        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            key = id(work)
            if key not in pending:
                return orig(work, *args, **kwargs)
            waiting.add(key)
            try:
                out = orig(work, *args, **kwargs)
            except BaseException as exc:
                with lock:
                    entry = pending.pop(key, None)
                    gpu_works.discard(key)
                waiting.discard(key)
                if entry is not None:
                    self._failed(entry[1], exc)
                raise
            if key in gpu_works:
                waiting.discard(key)
                return out
            with lock:
                entry = pending.pop(key, None)
            waiting.discard(key)
            if entry is not None:
                self._inflight.pop(entry[1], None)
                self.rec.end(entry[1], S.STATUS_OK)
            return out
        return wait
