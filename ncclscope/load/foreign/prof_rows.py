"""Profiler traces: one rank's interesting events -> rows in the events schema.

Numbers from the trace go through `safe_io.to_float` / `to_int` and are
bounded (a ts of 1e308 or a message of 10**30 elements is junk, not an
OverflowError).
"""
from __future__ import annotations

import functools
import json
import re
from typing import Any, Callable, Iterator

import numpy as np
import pandas as pd
import pyarrow as pa

from ncclscope.load import safe_io
from ncclscope import schema as S
from ncclscope.load.foreign.prof_links import PARAM_COMMS, CpuOp, Launches, cpu_op, link_kernels
from ncclscope.load.foreign.prof_read import C10D_P2P, STEP_RE, UNKNOWN_GROUP, microbatch_of
from ncclscope.load.foreign.vocab import (NCCL_KERNEL_TYPES, P2P_OPS, REDUCING_OPS, GroupNamer, dtype_itemsize,
                                          events_table, normalize_dtype, normalize_op, parse_ranks)

# --------------------------------------------------------------------------
# One rank
# --------------------------------------------------------------------------
_KERNEL_RE = re.compile(r"^nccl(?:Dev)?Kernel_([A-Za-z]+)")
_KERNEL_OPS = {"AllReduce": "all_reduce", "AllGather": "all_gather", "ReduceScatter": "reduce_scatter",
               "Broadcast": "broadcast", "Reduce": "reduce", "SendRecv": "sendrecv", "Send": "send",
               "Recv": "recv", "AllToAll": "all_to_all", "Generic": "nccl_generic"}
_REDOPS = {"sum": "sum", "prod": "product", "max": "max", "min": "min", "avg": "avg", "premulsum": "premul_sum",
           "sumpostdiv": "sum"}
# a type token is a whole "_"-separated part of the name (int8_t and __nv_bfloat16 hold "_" themselves)
_KERNEL_TYPE_RE = re.compile("_(" + "|".join(sorted(map(re.escape, NCCL_KERNEL_TYPES), key=len, reverse=True))
                             + ")(?=_|$)")


@functools.lru_cache(maxsize=4096)
def kernel_info(name: str) -> tuple[str, str, str]:
    """(op, reduce_op, dtype) from an NCCL kernel name, e.g.
    ncclDevKernel_AllReduce_Sum_f32_RING_LL -> all_reduce, sum, float32 and
    ncclKernel_AllReduce_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*) -> all_reduce, sum, int8.
    Only the name before its parameter list is read, and the reduce op and dtype only of reducing kernels:
    NCCL compiles the copying ones (all_gather, broadcast, sendrecv) once, for bytes."""
    head = name.split("(", 1)[0]
    m = _KERNEL_RE.match(head)
    if not m:
        return "nccl_kernel", "", ""
    op = _KERNEL_OPS.get(m.group(1), normalize_op(m.group(1)))
    if op not in REDUCING_OPS:
        return op, "", ""
    redop = next((_REDOPS[t.lower()] for t in head[m.end():].split("_") if t.lower() in _REDOPS), "")
    typed = _KERNEL_TYPE_RE.search(head, m.end())
    return op, redop, NCCL_KERNEL_TYPES[typed.group(1)] if typed else ""


def to_number(v: Any, default: float = -1.0) -> float:
    """A finite float with |x| <= 1e18 from a trace field, else `default`."""
    return safe_io.to_float(v, default, 1e18)


_NS_LIMIT = 2**62


def _clamp(x: int, lo: int = -_NS_LIMIT, hi: int = _NS_LIMIT) -> int:
    return lo if x < lo else hi if x > hi else x


def _dims_bytes(dims: Any, types: Any) -> tuple[str, str, int]:
    """(input_sizes JSON, dtype, bytes) from the profiler's "Input Dims"/"Input type"."""
    shapes = [d for d in dims if isinstance(d, list) and all(isinstance(x, int) for x in d)] if isinstance(dims, list) else []
    tys = [normalize_dtype(t) for t in types if isinstance(t, str) and t] if isinstance(types, list) else []
    tys = [t for t in tys if dtype_itemsize(t)]
    total = 0
    for i, shp in enumerate(shapes):
        n = 1
        for x in shp:
            n = min(n * max(x, 0), _NS_LIMIT)
        total = min(total + (n * dtype_itemsize(tys[min(i, len(tys) - 1)]) if tys else 0), _NS_LIMIT)
    return json.dumps(shapes), ",".join(dict.fromkeys(tys)), total


def rank_rows(header: dict[str, Any], events: Iterator[dict[str, Any]], base_ns: int,
              launches: Launches | None = None) -> dict[str, Any]:
    """Pull the rows of one rank's trace out of its interesting events; NCCL kernels are read through
    the CPU ops that launched them (prof_links.py). `window` is the (first, last) ns of those events."""
    comm: list[dict[str, Any]] = []
    steps: list[tuple[int, int, int, bool]] = []          # (start_ns, end_ns, step, on_gpu)
    mbs: list[tuple[int, int, str, int, int, bool]] = []  # (start, end, op, microbatch, stage, on_gpu)
    p2p_calls: list[tuple[Any, int, str, int, int]] = []  # (tid, ts_ns, direction, peer, tag)
    launchers: list[CpuOp] = []                           # c10d calls, record_param_comms, nccl:* annotations
    lo, hi = _NS_LIMIT, -_NS_LIMIT
    pid: Any = None

    def ns(ts: Any) -> int:
        return _clamp(base_ns + int(round(to_number(ts, 0.0) * 1000.0)))

    for ev in events:
        cat, name = str(ev.get("cat", "")), str(ev.get("name", ""))
        args = ev.get("args") if isinstance(ev.get("args"), dict) else {}
        t0 = ns(ev.get("ts"))
        t1 = _clamp(t0 + int(round(max(to_number(ev.get("dur"), 0.0), 0.0) * 1000.0)))
        lo, hi = min(lo, t0), max(hi, t1)
        if cat == "kernel":
            comm.append({"src": "kernel", "name": name, "args": args, "start": t0, "end": t1, "tid": ev.get("tid")})
            continue
        if cat == "cpu_op":
            launchers.append(cpu_op(ev, args, t0, t1))
            if name in C10D_P2P:
                p2p_calls.append((ev.get("tid"), t0, C10D_P2P[name], *_peer_and_tag(args)))
                pid = pid if pid is not None else ev.get("pid")
            continue
        gpu = cat == "gpu_user_annotation"
        m = STEP_RE.match(name)
        if m:
            steps.append((t0, t1, safe_io.to_int(m.group(1), -1, 0, 2**31 - 1), gpu))
            if not gpu:
                pid = pid if pid is not None else ev.get("pid")
            continue
        if name.startswith(("gloo:", "nccl:")):
            if name.startswith("gloo:") and not gpu:
                comm.append({"src": "gloo", "name": name, "args": args, "start": t0, "end": t1, "tid": ev.get("tid")})
            elif not gpu:
                launchers.append(cpu_op(ev, args, t0, t1))
            continue
        mb = microbatch_of(name)
        if mb is not None:
            mbs.append((t0, t1, mb[0], mb[1], mb[2], gpu))
    return {"comm": _comm_rows(comm, launchers, launches, ns), "steps": steps, "mbs": mbs, "p2p_calls": p2p_calls,
            "pid": pid, "window": (lo, hi) if lo <= hi else None}


def _comm_rows(comm: list[dict[str, Any]], launchers: list[CpuOp], launches: Launches | None,
               ns: Callable[[Any], int]) -> list[dict[str, Any]]:
    """A rank's communication ops from one source: its NCCL kernels (read through their launchers) where it
    has any, else its gloo annotations, else (a GPU trace of CPU activity only) its record_param_comms ops."""
    kernels = [c for c in comm if c["src"] == "kernel"]
    if kernels:
        return link_kernels(kernels, launchers, launches, ns)
    if comm:
        return comm
    return [{"src": "param", "name": o.name, "args": o.args, "start": o.start, "end": o.end, "tid": o.tid}
            for o in launchers if o.name == PARAM_COMMS]


def _peer_and_tag(args: dict[str, Any]) -> tuple[int, int]:
    """(peer, tag) of a c10d::send / recv_ call from its "Concrete Inputs" (record_shapes)."""
    conc = args.get("Concrete Inputs") if isinstance(args.get("Concrete Inputs"), list) else []
    peer = int(to_number(conc[2], -1)) if len(conc) > 2 else -1
    tag = int(to_number(conc[3], 0)) if len(conc) > 3 else 0
    return peer, tag


def _containing(starts: np.ndarray, spans: list[tuple[int, int, Any]]) -> np.ndarray:
    """Index into `spans` (sorted, non-overlapping start/end/...) of the span holding each start, or -1."""
    if not spans or not len(starts):
        return np.full(len(starts), -1, np.int64)
    s0 = np.array([s[0] for s in spans], np.int64)
    s1 = np.array([s[1] for s in spans], np.int64)
    i = np.searchsorted(s0, starts, side="right") - 1
    ok = (i >= 0) & (starts < s1[np.clip(i, 0, None)])
    return np.where(ok, i, -1)


_COMM_COLUMNS = ("kind", "op_name", "process_group", "explicit_seq", "peer", "tag", "bytes", "input_dtypes",
                 "input_sizes", "reduce_op", "start", "end", "gpu")


class _GlooCalls:
    """The c10d send/recv calls of one rank, by time: a gloo p2p annotation's peer and tag come from the
    call that issued it (same thread, just before), mapped to global ranks through the group's members."""

    def __init__(self, rows: dict[str, Any], gloo_group: Any) -> None:
        self.calls = sorted(rows["p2p_calls"], key=lambda c: c[1])
        self.call_t = np.array([c[1] for c in self.calls], np.int64)
        self.members = sorted(gloo_group[2]) if gloo_group is not None and gloo_group[2] else None

    def peer_and_tag(self, c: dict[str, Any], op: str, rank: int, world: int) -> tuple[int, int]:
        peer, tag = -1, 0
        calls = self.calls
        i = int(np.searchsorted(self.call_t, c["start"], side="right")) - 1
        # the c10d call that issued it, on the same thread, just before
        while i >= 0 and calls[i][0] != c["tid"]:
            i -= 1
        if i >= 0 and calls[i][2] == ("send" if op.endswith("send") else "recv"):
            peer, tag = calls[i][3], calls[i][4]
            if self.members and 0 <= peer < len(self.members):
                peer = self.members[peer]
        if peer < 0 and world == 2:
            peer = 1 - rank
        return peer, tag


def _gloo_row(c: dict[str, Any], rank: int, world: int, group: str, calls: _GlooCalls) -> tuple[Any, ...]:
    """A `gloo:*` annotation as (op, group, seq, peer, tag, bytes, dtype, sizes, reduce op, gpu)."""
    a = c["args"]
    op = normalize_op(c["name"])
    sizes, dtype, nbytes = _dims_bytes(a.get("Input Dims"), a.get("Input type"))
    peer, tag = calls.peer_and_tag(c, op, rank, world) if op in P2P_OPS else (-1, -1)
    return op, group, -1, peer, tag, nbytes, dtype, sizes, "", False


def _nccl_row(c: dict[str, Any], rank: int, namer: GroupNamer, labels: dict[tuple[str, str, str], str],
              views: list[tuple[str, str, tuple[int, ...] | None, str]]) -> tuple[Any, ...]:
    """An NCCL kernel (or record_param_comms op) as `_gloo_row`'s tuple: op, dtype and size from its args
    (else from the kernel's name), its group from the args' pg name (else the rank's only group)."""
    a = c["args"]
    k_op, redop, k_dtype = kernel_info(c["name"]) if c["src"] == "kernel" else ("", "", "")
    op = normalize_op(a.get("Collective name")) if a.get("Collective name") else k_op
    dtype = normalize_dtype(a.get("dtype")) if a.get("dtype") else k_dtype
    nel = to_number(a.get("In msg nelems"), -1)
    nbytes = _clamp(int(nel * dtype_itemsize(dtype)), 0) if nel >= 0 else 0
    sizes = json.dumps([[int(nel)]]) if nel >= 0 else "[]"
    if "Process Group Name" in a:
        key = (str(a.get("Process Group Name", "")), str(a.get("Process Group Description", "")),
               str(a.get("Process Group Ranks")))
        group = labels.get(key)
        if group is None:
            group = labels[key] = namer(key[0], key[1], parse_ranks(a.get("Process Group Ranks")))
    elif len(views) == 1:
        group = namer(views[0][0], views[0][1], views[0][2])
    else:
        group = UNKNOWN_GROUP
    seq = int(to_number(a.get("Seq"), -1))
    members = parse_ranks(a.get("Process Group Ranks"))
    peer, tag = -1, -1
    if op in P2P_OPS:
        tag = 0
        raw = a.get("Dst Rank") if op.endswith("send") else a.get("Src Rank")
        peer = int(to_number(raw, -1))
        if members and 0 <= peer < len(members) and rank in members and members != tuple(range(len(members))):
            peer = members[peer]
        if peer < 0 and members and len(members) == 2 and rank in members:
            peer = members[0] if members[1] == rank else members[1]
    return op, group, seq, peer, tag, nbytes, dtype, sizes, redop, c["src"] == "kernel"


def _comm_frame(rank: int, rows: dict[str, Any], namer: GroupNamer, gloo_group: Any, world: int,
                views: list[tuple[str, str, tuple[int, ...] | None, str]], mbs: list[Any]) -> pd.DataFrame:
    """One row per comm op, then one per microbatch annotation (compute), in start order, with op ids."""
    cols: dict[str, list[Any]] = {k: [] for k in _COMM_COLUMNS}
    calls = _GlooCalls(rows, gloo_group)
    gloo_label = namer(*gloo_group) if gloo_group is not None else UNKNOWN_GROUP
    labels: dict[tuple[str, str, str], str] = {}
    for c in rows["comm"]:
        row = (_gloo_row(c, rank, world, gloo_label, calls) if c["src"] == "gloo"
               else _nccl_row(c, rank, namer, labels, views))
        op = row[0]
        for k, v in zip(_COMM_COLUMNS, (S.KIND_P2P if op in P2P_OPS else S.KIND_COLLECTIVE,) + row[:-1]
                        + (c["start"], c["end"], row[-1])):
            cols[k].append(v)
    for t0, t1, op, mb, stage, gpu in mbs:
        for k, v in zip(_COMM_COLUMNS, (S.KIND_COMPUTE, op, "", -1, -1, -1, 0, "", "", "", t0, t1, gpu)):
            cols[k].append(v)
    df = pd.DataFrame(cols)
    if len(df):
        df = df.sort_values(["start", "end"], kind="stable").reset_index(drop=True)
        df["op_id"] = np.arange(1, len(df) + 1)
    return df


def _sequences(df: pd.DataFrame) -> tuple[np.ndarray, np.ndarray]:
    """(collective_seq_id, p2p_seq_id): per group in start order where the trace gives none; per
    (direction, peer) for p2p."""
    n = len(df)
    is_coll = (df["kind"] == S.KIND_COLLECTIVE).to_numpy()
    seq = df["explicit_seq"].to_numpy().copy()
    counted = df[is_coll].groupby("process_group", sort=False).cumcount().to_numpy() + 1
    cseq = np.full(n, -1, np.int64)
    cseq[is_coll] = np.where(seq[is_coll] >= 0, seq[is_coll], counted)
    is_p2p = (df["kind"] == S.KIND_P2P).to_numpy()
    pseq = np.full(n, -1, np.int64)
    if is_p2p.any():
        sub = df[is_p2p]
        direction = np.where(sub["op_name"].str.endswith("send"), "send", "recv")
        pseq[is_p2p] = sub.assign(_d=direction).groupby(["_d", "peer"], sort=False).cumcount().to_numpy() + 1
    return cseq, pseq


def _containment(df: pd.DataFrame, steps: list[Any], mbs: list[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(step, microbatch, stage) of each row: those of the ProfilerStep / microbatch span holding its start."""
    n = len(df)
    starts = df["start"].to_numpy()
    gpu = df["gpu"].to_numpy()
    step = np.full(n, -1, np.int64)
    cpu_steps = sorted((s for s in steps if not s[3]), key=lambda s: s[0])
    gpu_steps = sorted((s for s in steps if s[3]), key=lambda s: s[0]) or cpu_steps
    for spans, mask in ((cpu_steps, ~gpu), (gpu_steps, gpu)):
        idx = _containing(starts[mask], spans)
        step[mask] = np.where(idx >= 0, np.array([s[2] for s in spans] or [-1])[np.clip(idx, 0, None)], -1)
    microbatch = np.full(n, -1, np.int64)
    stage = np.full(n, -1, np.int64)
    spans_mb = sorted(((m[0], m[1], m[3], m[4]) for m in mbs), key=lambda s: s[0])
    if spans_mb:
        idx = _containing(starts, spans_mb)
        mb_arr = np.array([s[2] for s in spans_mb])
        st_arr = np.array([s[3] for s in spans_mb])
        microbatch = np.where(idx >= 0, mb_arr[np.clip(idx, 0, None)], -1)
        stage = np.where(idx >= 0, st_arr[np.clip(idx, 0, None)], -1)
    return step, microbatch, stage


def comm_table(rank: int, rows: dict[str, Any], namer: GroupNamer, gloo_group: Any, world: int,
               views: list[tuple[str, str, tuple[int, ...] | None, str]]) -> pa.Table:
    """One rank's begin and end rows (events schema): its comm ops, and compute rows from its microbatch
    annotations (the CPU ones; the GPU copies only where there are no CPU ones)."""
    mbs = [m for m in rows["mbs"] if not m[5]] or [m for m in rows["mbs"] if m[5]]
    df = _comm_frame(rank, rows, namer, gloo_group, world, views, mbs)
    n = len(df)
    if n == 0:
        return S.EVENTS_SCHEMA.empty_table()
    cseq, pseq = _sequences(df)
    step, microbatch, stage = _containment(df, rows["steps"], mbs)
    cols_out = {
        "rank": rank, "op_id": df["op_id"].to_numpy(), "kind": df["kind"].to_numpy(object),
        "op_name": df["op_name"].to_numpy(object), "process_group": df["process_group"].to_numpy(object),
        "collective_seq_id": cseq, "p2p_seq_id": pseq, "peer": df["peer"].to_numpy(), "tag": df["tag"].to_numpy(),
        "bytes": df["bytes"].to_numpy(), "input_dtypes": df["input_dtypes"].to_numpy(object),
        "input_sizes": df["input_sizes"].to_numpy(object), "reduce_op": df["reduce_op"].to_numpy(object),
        "step": step, "microbatch": microbatch, "stage": stage,
    }
    begin = events_table({**cols_out, "phase": S.PHASE_BEGIN, "time_ns": df["start"].to_numpy()}, n)
    end = events_table({**cols_out, "phase": S.PHASE_END, "time_ns": df["end"].to_numpy(), "status": S.STATUS_OK}, n)
    return pa.concat_tables([begin, end])


def metrics_table(rank: int, steps: list[tuple[int, int, int, bool]]) -> pa.Table:
    cpu = sorted((s for s in steps if not s[3]), key=lambda s: s[0]) or sorted(steps, key=lambda s: s[0])
    n = len(cpu)
    if n == 0:
        return S.METRICS_SCHEMA.empty_table()
    nan = np.full(n, np.nan)
    cols = {
        "rank": pa.array(np.full(n, rank, np.int32)), "step": pa.array(np.array([s[2] for s in cpu], np.int32)),
        "time_ns": pa.array(np.array([s[0] for s in cpu], np.int64)),
        "step_time_s": pa.array(np.array([(s[1] - s[0]) / 1e9 for s in cpu], np.float64)),
        "loss": pa.array(nan), "grad_norm_local": pa.array(nan), "grad_norm_global": pa.array(nan),
        "grad_norm_reduced": pa.array(nan),
        "param_checksum": pa.array(nan), "memory_bytes": pa.array(np.full(n, -1, np.int64)),
        "tokens": pa.array(np.full(n, -1, np.int64)), "expert_load": pa.array([[]] * n, pa.list_(pa.int64())),
        "dropped_tokens": pa.array(np.full(n, -1, np.int64)), "extra": pa.array(['{"source": "ProfilerStep"}'] * n),
    }
    return pa.Table.from_arrays([cols[name] for name in S.METRIC_COLUMNS], schema=S.METRICS_SCHEMA)
