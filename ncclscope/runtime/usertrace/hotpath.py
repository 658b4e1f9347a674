"""The fast wrapper of the collectives a training loop calls most: one tensor in, no root, no peer.

    all_reduce, all_gather, all_gather_into_tensor (+ _single, _base),
    reduce_scatter_tensor (+ _single, _base)

Why a second wrapper: on a tiny all_reduce the general one (`OpsMixin._wrap_op`)
spent 4.1 us of Python on top of the call (recorder excluded; 2-core dev box,
around a no-op), much of it in branches for fields these ops never have (peer,
tag, p2p counters, lists, splits, roots) and in function calls (call site,
tensor metadata, the new-site check); this one spends 2.7 us. What is left is
mostly the group's sequence number (a pybind call that releases the GIL: ~0.2 us
in a loop, ~1 us in situ), the thread-local depth flag, the call-site and
metadata cache hits and the in-flight entry the watch thread reads (on a reducing
op, the input's finiteness check of nancheck.py adds ~3 us until the rank's first
non-finite input, then one attribute test). It reads only the
arguments these ops take, walks the frames for the call site (callsite.py: the
user's line and its user callers, so it cannot be cached on the caller alone;
~0.5 us) and tests the site set for a new one (a miss: the first-call flush of
`OpsMixin._new_site`), and passes
everything else to the general wrapper, which it calls unchanged for a call it
does not cover: a group not yet known (it registers it, or writes the
non-member marker), a group table to write first. Same rows, same values:
tests/test_run_hotpath.py checks the two wrappers write identical rows.
"""
from __future__ import annotations

import functools
import time
from typing import Any, Callable

import torch

from ncclscope import schema as S

from ncclscope.runtime import comm_site
from ncclscope.runtime.comm_site import tensor_meta
from ncclscope.runtime.usertrace import callsite
from ncclscope.runtime.usertrace.nancheck import small_kind
from ncclscope.runtime.usertrace.opspec import NO_META, REDUCE_NAMES, tls


def covers(fname: str, spec: tuple[Any, ...], pos: dict[str, int], own_seq: frozenset[str]) -> bool:
    """Whether `make_fast` can wrap this op: a collective on one tensor, rooted at no rank, counted by
    the group's own sequence number, whose tensor, group and async_op arguments have positions."""
    op_name, kind, in_arg, in_list, peer_arg, _gpeer, p2p_dir, always_async = spec
    return (kind == S.KIND_COLLECTIVE and bool(in_arg) and not in_list and not peer_arg and not p2p_dir
            and not always_async and fname not in own_seq and fname != "all_to_all_single"
            and min(pos.get(in_arg, -1), pos.get("group", -1), pos.get("async_op", -1)) >= 0)


def make_fast(tracer: Any, orig: Callable[..., Any], spec: tuple[Any, ...], pos: dict[str, int],
              general: Callable[..., Any]) -> Callable[..., Any]:
    """The wrapper for an op `covers` accepts; `general` is the general wrapper of the same op."""
    op_name, kind, in_arg = spec[0], spec[1], spec[2]
    i_in, i_group, i_async, i_op = pos[in_arg], pos["group"], pos["async_op"], pos.get("op", -1)
    has_op = i_op >= 0
    begin, groups, inflight, sites, p2p_shift, timeout_ms = tracer.hot_refs()
    own_seq, settle = tracer._own_seq, tracer.settle
    nan_check, check_input = tracer.nan_check_for(op_name), tracer.check_input   # nancheck.py: reducing ops
    small: dict[tuple[Any, Any], bool] = {}   # (shape, dtype) -> summed as Python floats (nancheck.small_kind)
    monotonic, call_site, Tensor = time.monotonic, callsite.call_site, torch.Tensor
    meta_cache = comm_site.META_CACHE

    @functools.wraps(orig)
    def traced(*args: Any, **kwargs: Any) -> Any:
        if tls.depth:
            return orig(*args, **kwargs)
        n = len(args)
        if kwargs:
            pg = args[i_group] if i_group < n else kwargs.get("group")
            t = args[i_in] if i_in < n else kwargs.get(in_arg)
            rop = (args[i_op] if i_op < n else kwargs.get("op")) if has_op else None
            is_async = args[i_async] if i_async < n else kwargs.get("async_op", False)
        else:
            pg = args[i_group] if i_group < n else None
            t = args[i_in] if i_in < n else None
            rop = args[i_op] if has_op and i_op < n else None
            is_async = args[i_async] if i_async < n else False
        wpg = pg if pg is not None else tracer._world_pg
        g = groups.get(wpg)
        if g is None or tracer._groups_dirty:
            return general(*args, **kwargs)     # registers the group / writes the table: the rare path
        if isinstance(t, Tensor):
            meta = meta_cache.get((t.shape, t.dtype))   # tensor_meta's own cache, without the call
            sizes, dtype, nbytes = meta if meta is not None else tensor_meta(t)
        else:
            sizes, dtype, nbytes = NO_META
            t = None
        name = g.name
        try:
            seq = wpg._get_sequence_number_for_group() + 1 - p2p_shift.get(name, 0)
        except (AttributeError, RuntimeError):
            seq = own_seq.get(name, 0) + 1
            own_seq[name] = seq
        reduce_op = ""
        if rop is not None:
            try:
                reduce_op = REDUCE_NAMES.get(int(rop), str(rop))
            except (TypeError, ValueError):
                reduce_op = str(rop)
        site = call_site()
        if nan_check and t is not None and tracer._nan_live:   # the input, before the reduction spreads it
            is_small = small.get((t.shape, t.dtype))
            if is_small is None:
                is_small = small[(t.shape, t.dtype)] = small_kind(t.shape, t.dtype)
            if is_small and t.is_cpu:   # healthy and small: one tolist and a sum, no call
                v = t.tolist()
                s = sum(v) if v.__class__ is list else v
                if s - s != 0.0:
                    check_input(t, op_name, name, seq, reduce_op, site)
            else:
                check_input(t, op_name, name, seq, reduce_op, site)
        op_id = begin(kind, op_name, name, seq, -1, -1, -1, nbytes, dtype, sizes, reduce_op, timeout_ms, site)
        inflight[op_id] = (now := monotonic(), op_name, name, seq if seq >= 0 else -1)
        tracer._last_activity = now
        key = (site, name, op_name)
        if key not in sites:
            tracer._new_site(key)   # after the begin row: that row is made durable too
        tracer.ops += 1
        tls.depth = 1
        try:
            out = orig(*args, **kwargs)
        except BaseException as exc:
            tls.depth = 0
            tracer._failed(op_id, exc)
            raise
        tls.depth = 0
        settle(out, op_id, is_async, t)
        return out
    traced.__ncclscope_orig__ = orig   # type: ignore[attr-defined]
    traced.__ncclscope_general__ = general   # type: ignore[attr-defined]  (tests compare the two)
    return traced
