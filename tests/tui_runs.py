"""Run directories and Pilot helpers shared by the TUI tests (test_tui.py, test_tui_faces.py).

The hand-built runs are written through the runtime's own `Recorder` with a fake clock, so every time, pid
and host in them is fixed (a snapshot must not change from run to run).
"""
from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pytest

from ncclscope import schema as S


# ---- run directories -------------------------------------------------------
NS = 1_000_000_000
T0 = 1_700_000_000 * NS
MS = 1_000_000
F_NS, B_NS, P2P_NS, AR_NS, OPT_NS = 10 * MS, 20 * MS, 1 * MS, 5 * MS, 3 * MS
TIMEOUT_NS = 5 * NS
STEP_GAP_NS = 500 * MS
ORDER = {0: ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "B3"],      # 1F1B, p=2, m=4
         1: ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3"]}

STACK_TEMPLATE = """
=== ncclscope rank {rank}: {reason} at {t} ns ===
Thread 0x00007f0000000002 (most recent call first):
  File "/opt/venv/lib/python3.11/threading.py", line 331 in wait
  File "/work/main/runtime/recorder.py", line 261 in _run
  File "/opt/venv/lib/python3.11/threading.py", line 1045 in _bootstrap_inner

Current thread 0x00007f0000000001 (most recent call first):
{frames}
  File "/work/main/runtime/train.py", line 145 in run_rank
  File "/work/main/runtime/launch.py", line 60 in _child
"""
FRAMES = {
    "stuck": ('  File "/work/main/runtime/model.py", line 88 in _route_tokens\n'
              '  File "/work/main/runtime/model.py", line 131 in backward_hook\n'
              '  File "/work/main/runtime/pipeline/executor.py", line 77 in backward_step'),
    "send": ('  File "/work/main/runtime/comm.py", line 211 in _finish\n'
             '  File "/work/main/runtime/comm.py", line 301 in send\n'
             '  File "/work/main/runtime/pipeline/executor.py", line 52 in send_forward'),
    "all_reduce": ('  File "/work/main/runtime/comm.py", line 211 in _finish\n'
                   '  File "/work/main/runtime/comm.py", line 259 in all_reduce\n'
                   '  File "/work/main/runtime/parallel/data.py", line 55 in all_reduce'),
}


class FakeClock:
    """Stands in for the `time` module inside recorder.py: time_ns() is ours, the rest is real."""

    def __init__(self) -> None:
        self.now = T0

    def time_ns(self) -> int:
        return self.now

    monotonic = staticmethod(time.monotonic)
    perf_counter = staticmethod(time.perf_counter)
    sleep = staticmethod(time.sleep)


def _schedule(step_start: int, hang: bool) -> dict[int, list[tuple[str, int, int, int, bool]]]:
    """Per stage: (kind, microbatch, start, end, finished) of recv/fwd/send/bwd spans, dependency-timed.

    Stage 0: F_i = forward, send act; B_i = recv grad, backward. Stage 1: F_i =
    recv act, forward; B_i = backward, send grad. With `hang`, stage 1 never
    ends B1 and stage 0's send of activation 2 never completes."""
    act_sent: dict[int, int] = {}
    grad_sent: dict[int, int] = {}
    free = {0: step_start, 1: step_start}
    idx = {0: 0, 1: 0}
    out: dict[int, list[tuple[str, int, int, int, bool]]] = {0: [], 1: []}
    stuck = {0: False, 1: False}
    progress = True
    while progress:
        progress = False
        for st in (0, 1):
            if idx[st] >= len(ORDER[st]) or stuck[st]:
                continue
            a = ORDER[st][idx[st]]
            fb, mb = a[0], int(a[1:])
            t = free[st]
            if st == 0 and fb == "F":
                out[0].append(("forward", mb, t, t + F_NS, True))
                t += F_NS
                if hang and mb == 2:
                    out[0].append(("send", mb, t, t + TIMEOUT_NS, False))
                    stuck[0] = True
                    free[0] = t + TIMEOUT_NS
                    idx[0] += 1
                    progress = True
                    continue
                out[0].append(("send", mb, t, t + P2P_NS, True))
                act_sent[mb] = t + P2P_NS
                t += P2P_NS
            elif st == 0:
                if mb not in grad_sent:
                    continue
                r0 = t
                t = max(t, grad_sent[mb])
                out[0].append(("recv", mb, r0, t + P2P_NS, True))
                t += P2P_NS
                out[0].append(("backward", mb, t, t + B_NS, True))
                t += B_NS
            elif fb == "F":
                if mb not in act_sent:
                    continue
                r0 = t
                t = max(t, act_sent[mb])
                out[1].append(("recv", mb, r0, t + P2P_NS, True))
                t += P2P_NS
                out[1].append(("forward", mb, t, t + F_NS, True))
                t += F_NS
            else:
                if hang and mb == 1:
                    out[1].append(("backward", mb, t, -1, False))
                    stuck[1] = True
                    idx[1] += 1
                    progress = True
                    continue
                out[1].append(("backward", mb, t, t + B_NS, True))
                t += B_NS
                out[1].append(("send", mb, t, t + P2P_NS, True))
                grad_sent[mb] = t + P2P_NS
                t += P2P_NS
            free[st] = t
            idx[st] += 1
            progress = True
    out[0].append(("_free", -1, free[0], free[0], True))
    out[1].append(("_free", -1, free[1], free[1], True))
    return out


def write_pp_hung(root: Path, steps: int = 3) -> Path:
    """The hung pp 2 x dp 2 run described in the module docstring; returns `root`."""
    from ncclscope.runtime import recorder as R

    root.mkdir(parents=True, exist_ok=True)
    clock = FakeClock()
    saved = R.time, R._time_ns
    R.time = clock  # type: ignore[assignment]
    R._time_ns = clock.time_ns      # the rows' clock on the hot path (bound once at import)
    try:
        return _write_pp(root, steps, clock, R)
    finally:
        R.time, R._time_ns = saved


def _write_pp(root: Path, steps: int, clock: FakeClock, R: Any) -> Path:
    world, pp, dp = 4, 2, 2
    groups = [("world", "world", [0, 1, 2, 3]), ("dp0", "dp", [0, 1]), ("dp1", "dp", [2, 3]),
              ("pp0", "pp", [0, 2]), ("pp1", "pp", [1, 3])]
    recs = {r: R.Recorder(root, r, world, flush_interval_s=3600.0) for r in range(world)}
    for r, rec in recs.items():
        rec.write_meta(host="node0", pid=1000 + r, started_ns=T0, coords={"tp": 0, "cp": 0, "dp": r % dp,
                                                                           "pp": r // dp, "ep": 0},
                       groups=[{"name": n, "kind": k, "ranks": m, "creation_order": i, "backend": "gloo"}
                               for i, (n, k, m) in enumerate(groups)])
    events: list[tuple[int, int, Callable[[], None]]] = []   # (time, order, action)
    seq = [0]

    def at(t: int, fn: Callable[[], None]) -> None:
        seq[0] += 1
        events.append((t, seq[0], fn))

    def span(r: int, kind: str, name: str, t0: int, t1: int, status: str, step: int, mb: int, stage: int,
             **kw: Any) -> None:
        holder: dict[str, int] = {}

        def begin() -> None:
            ctx = recs[r].context
            ctx.step, ctx.microbatch, ctx.stage = step, mb, stage
            holder["id"] = recs[r].begin(kind, name, timeout_ms=TIMEOUT_NS // MS, **kw)
        at(t0, begin)
        if t1 >= 0:
            at(t1, lambda: recs[r].end(holder["id"], status,
                                       "" if status == "ok" else f"{name} timed out after 5 s"))

    p2p_seq: dict[tuple[int, int, str], int] = {}
    end_of: dict[int, int] = {}
    step_start = T0 + 100 * MS
    for step in range(steps):
        hang = step == steps - 1
        for d in range(dp):
            sched = _schedule(step_start + d * 2 * MS, hang and d == 0)
            for stage in (0, 1):
                r = stage * dp + d
                peer = (1 - stage) * dp + d
                for kind, mb, t0, t1, ok in sched[stage]:
                    if kind == "_free":
                        end_of[r] = t0
                        continue
                    if kind in ("send", "recv"):
                        key = (r, peer, kind)
                        p2p_seq[key] = p2p_seq.get(key, 0) + 1
                        span(r, "p2p", kind, t0, t1, "ok" if ok else "timeout", step, mb, stage,
                             group=f"pp{d}", p2p_seq=p2p_seq[key], peer=peer, tag=0, nbytes=4096,
                             dtype="float32", sizes="[[2,16,32]]", call_site=f"runtime/pipeline/executor.py:5{2 if kind == 'send' else 9}")
                    else:
                        span(r, "compute", kind, t0, t1 if ok else -1, "ok", step, mb, stage)
        for r in range(world):
            if hang and r in (0, 2):
                continue
            g, t = f"dp{r // dp}", end_of[r]
            seqn = step + 1
            done = t + AR_NS if not hang else t + TIMEOUT_NS
            span(r, "collective", "all_reduce", t, done, "ok" if not hang else "timeout", step, -1, r // dp,
                 group=g, seq=seqn, nbytes=65536, dtype="float32", sizes="[[16384]]", reduce_op="sum",
                 call_site="runtime/parallel/data.py:55")
            if not hang:
                span(r, "compute", "optimizer", done, done + OPT_NS, "ok", step, -1, r // dp)
                loss = 5.5 - 0.25 * step if r // dp == 1 else float("nan")
                at(done + OPT_NS, lambda r=r, step=step, loss=loss, t=done: recs[r].metric(
                    step=step, step_time_s=0.12, loss=loss, grad_norm_local=2.0 + 0.1 * r - 0.2 * step,
                    grad_norm_global=3.0 - 0.2 * step, param_checksum=100.0 + 10 * (r // dp) + step,
                    memory_bytes=300 * 2**20, tokens=256))
        step_start = max(end_of.values()) + STEP_GAP_NS
    t_fail = max(t for t, _, _ in events)
    t_end = t_fail + 1 * NS
    for r in range(world):
        for t in range(T0, (t_end if r == 2 else t_fail) + 1, NS):
            at(t, lambda r=r: recs[r].instant("marker", S.HEARTBEAT))
    for t, _, fn in sorted(events, key=lambda e: (e[0], e[1])):
        clock.now = t
        fn()
    for r, rec in recs.items():
        clock.now = t_end if r == 2 else t_fail
        rec.close("ok" if r == 2 else "error", "" if r == 2 else f"rank {r}: op timed out after 5 s")
        if r == 2:   # SIGTERMed by the launcher: no end record
            rec.meta.pop("end", None)
            rec.write_meta()
        what = {0: "send", 1: "all_reduce", 2: "stuck", 3: "all_reduce"}[r]
        reason = "SIGUSR1 from the launcher" if r == 2 else f"{what} timed out"
        (root / S.rank_dir_name(r) / S.STACKS_FILE).write_text(
            STACK_TEMPLATE.format(rank=r, reason=reason, t=t_end, frames=FRAMES[what]))
    run = {"schema": S.SCHEMA_VERSION, "launcher": "local", "world_size": world,
           "config": {"tp": 1, "pp": pp, "dp": dp, "cp": 1, "ep": 1, "schedule": "1f1b", "microbatches": 4,
                      "steps": steps, "timeout_s": 5.0, "inject": []},
           "end_reason": "rank_failed", "duration_s": (t_end - T0) / NS,
           "ranks": {str(r): {"exitcode": None if r == 2 else 3, "signal": "SIGTERM" if r == 2 else None,
                              "pid": 1000 + r, "stopped_by_launcher": r == 2} for r in range(world)}}
    (root / S.RUN_JSON).write_text(json.dumps(run, indent=1))
    return root


def write_big(root: Path, world: int = 1024, steps: int = 4, hung: int = 5) -> Path:
    """A large DP-style run (tp 8 x dp 16 x pp 8) written with plain pyarrow; rank `hung` never ends its
    last all_reduce."""
    root.mkdir(parents=True, exist_ok=True)
    n = steps * 3
    kinds = np.tile(np.array(["compute", "compute", "collective"], dtype=object), steps)
    names = np.tile(np.array(["forward", "backward", "all_reduce"], dtype=object), steps)
    step = np.repeat(np.arange(steps), 3)
    seq = np.where(kinds == "collective", step + 1, -1)
    start = T0 + np.arange(n) * 100 * MS
    for r in range(world):
        d = root / S.rank_dir_name(r)
        d.mkdir(exist_ok=True)
        keep = np.ones(n, bool)
        if r == hung:
            keep[-1] = False
        cols = {"rank": np.r_[np.full(n, r), np.full(keep.sum(), r)],
                "op_id": np.r_[np.arange(n), np.arange(n)[keep]],
                "phase": np.r_[np.full(n, "begin", dtype=object), np.full(keep.sum(), "end", dtype=object)],
                "time_ns": np.r_[start, start[keep] + 50 * MS],
                "kind": np.r_[kinds, kinds[keep]], "op_name": np.r_[names, names[keep]],
                "process_group": np.r_[np.where(kinds == "collective", "world", ""),
                                       np.where(kinds[keep] == "collective", "world", "")],
                "collective_seq_id": np.r_[seq, seq[keep]], "step": np.r_[step, step[keep]],
                "status": np.r_[np.full(n, "", dtype=object), np.full(keep.sum(), "ok", dtype=object)]}
        arrays = []
        for name, typ in S.EVENT_FIELDS:
            v = cols.get(name)
            if v is None:
                v = np.full(len(cols["rank"]), "" if pa.types.is_string(typ) else -1,
                            dtype=object if pa.types.is_string(typ) else np.int64)
            arrays.append(pa.array(v, type=typ) if pa.types.is_string(typ) else pa.array(v.astype(np.int64)).cast(typ))
        with pa.OSFile(str(d / S.EVENTS_FILE), "wb") as f:
            w = pa.ipc.new_stream(f, S.EVENTS_SCHEMA)
            w.write_batch(pa.RecordBatch.from_arrays(arrays, schema=S.EVENTS_SCHEMA))
            w.close()
        (d / S.RANK_JSON).write_text(json.dumps({
            "rank": r, "world_size": world, "coords": {"tp": r % 8, "cp": 0, "dp": (r // 8) % 16, "pp": r // 128},
            "groups": [{"name": "world", "kind": "world", "ranks": list(range(world)), "creation_order": 0}],
            **({} if r == hung else {"end": {"status": "error", "message": "timeout"}})}))
    (root / S.RUN_JSON).write_text(json.dumps({
        "world_size": world, "end_reason": "deadline",
        "config": {"tp": 8, "dp": 16, "pp": 8, "cp": 1, "ep": 1, "steps": steps, "schedule": "1f1b",
                   "microbatches": 8, "timeout_s": 60.0},
        "ranks": {str(r): {"exitcode": 3 if r != hung else None, "signal": "SIGTERM" if r == hung else None,
                           "stopped_by_launcher": r == hung} for r in range(world)}}))
    return root


def make_app(path: Path, **kw: Any):
    from ncclscope.tui.app import NcclscopeApp
    return NcclscopeApp(path, **kw)


async def wait_until(pilot: Any, cond: Callable[[], bool], timeout: float = 60.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what or cond}")
        await pilot.pause(0.05)
    await pilot.pause()


async def wait_ready(pilot: Any) -> None:
    app = pilot.app
    await wait_until(pilot, lambda: app.run_model is not None and app.run_model.stage == "ready", what="ready")


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def diagnosis_roots(path: Path) -> list[int]:
    """The root ranks every face marks: the composer's."""
    from ncclscope.verdict import run as compose
    from ncclscope.load.trace import load
    return compose(load(path)).root_ranks


SAMPLES = Path(__file__).resolve().parent.parent / "sample_traces"


def verdict_text(app: Any) -> str:
    content = app.query_one("#ov-verdict").content
    return content.plain if hasattr(content, "plain") else str(content)


# ---- --follow: a rank's events.arrows written batch by batch --------------------------------
class LiveRank:
    """Appends event batches to a rank's events.arrows the way the recorder's flusher does."""

    def __init__(self, root: Path, rank: int, world: int) -> None:
        d = root / S.rank_dir_name(rank)
        d.mkdir(parents=True)
        (d / S.RANK_JSON).write_text(json.dumps({"rank": rank, "world_size": world, "coords": {"dp": rank},
                                                 "groups": [{"name": "dp0", "kind": "dp",
                                                             "ranks": list(range(world)), "creation_order": 0}]}))
        self.rank, self.fh = rank, open(d / S.EVENTS_FILE, "wb")
        self.writer = pa.ipc.new_stream(self.fh, S.EVENTS_SCHEMA)

    def append(self, rows: list[dict[str, Any]]) -> None:
        cols = {name: [r.get(name, "" if pa.types.is_string(t) else -1) for r in rows] for name, t in S.EVENT_FIELDS}
        cols["rank"] = [self.rank] * len(rows)
        self.writer.write_batch(pa.RecordBatch.from_pydict(cols, schema=S.EVENTS_SCHEMA))
        self.fh.flush()

    def close(self) -> None:
        self.writer.close()
        self.fh.close()


def live_op(op_id: int, phase: str, t: float, seq: int, status: str = "") -> dict[str, Any]:
    return {"op_id": op_id, "phase": phase, "time_ns": T0 + int(t * NS), "kind": "collective",
            "op_name": "all_reduce", "process_group": "dp0", "collective_seq_id": seq, "step": seq - 1,
            "status": status}
