"""The TUI: Pilot-driven tests on real run directories, snapshots of the main screens, --follow.

Real runs come from the runtime (`ncclscope train` with fault drills: a hung
pipeline run, a wrong-group run, a healthy run), made once per session. The
snapshots use a hand-built hung pipeline run written through the runtime's
own `Recorder` with a fake clock, so every time, pid and host in it is fixed
(a snapshot must not change from run to run). Update snapshots with
`python -m pytest tests/test_tui.py --snapshot-update` after checking them.
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

from conftest import run_cli
from ncclscope import schema as S

pytestmark = pytest.mark.timeout(180)


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


# ---- fixtures ------------------------------------------------------------------
@pytest.fixture(scope="session")
def pp_hung(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Hand-built, deterministic hung pipeline run (snapshots use it)."""
    return write_pp_hung(tmp_path_factory.mktemp("tui") / "pp_hung")


def _train(tmp_path_factory: pytest.TempPathFactory, name: str, *args: str) -> Path:
    out = tmp_path_factory.mktemp("tui") / name
    res = run_cli("train", *args, "--out", str(out), timeout=150)
    if not (out / S.RUN_JSON).exists():
        pytest.skip(f"ncclscope train {' '.join(args)} made no run directory (rc {res.returncode}): "
                    f"{res.stderr[-400:]}")
    return out


@pytest.fixture(scope="session")
def real_healthy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _train(tmp_path_factory, "healthy", "--dp", "2", "--steps", "3")


@pytest.fixture(scope="session")
def real_wrong_group(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _train(tmp_path_factory, "wrong_group", "--dp", "2", "--steps", "3", "--timeout-s", "2",
                  "--inject", "wrong_group:rank=1,step=1,use=world")


@pytest.fixture(scope="session")
def real_pp_hung(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real pipeline run (pp 2, 1F1B, 4 microbatches) whose stage-1 rank hangs in compute."""
    return _train(tmp_path_factory, "pp_hung_real", "--pp", "2", "--microbatches", "4", "--steps", "2",
                  "--timeout-s", "2", "--inject", "hang:rank=1,step=1")


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
    from ncclscope.analysis import run as compose
    from ncclscope.trace import load
    return compose(load(path)).root_ranks


# ---- presenters (no terminal) ------------------------------------------------------
def test_model_of_hung_pipeline(pp_hung: Path) -> None:
    from ncclscope.analysis import run as compose
    from ncclscope.trace import load
    from ncclscope.tui.model import build_run_model
    trace = load(pp_hung)
    a = compose(trace)
    m = build_run_model(trace, a)
    assert m.verdict == a.verdict and m.root_ranks == a.root_ranks
    assert m.root_ranks == [2]
    assert {c.rank: c.state for c in m.grid.cells} == {0: "timeout", 1: "timeout", 2: "stuck", 3: "timeout"}
    assert (m.grid.rows, m.grid.cols, m.grid.compact) == (4, 1, False)
    assert m.grid.row_labels == ["pp0 dp0", "pp0 dp1", "pp1 dp0", "pp1 dp1"]
    assert m.findings[0].jump_rank == 2 and m.verdict.startswith("STUCK IN COMPUTE")


def test_timeline_and_collectives_presenters(pp_hung: Path) -> None:
    from ncclscope.trace import load
    from ncclscope.tui.screens.collectives import build_matrix, build_p2p
    from ncclscope.tui.screens.timeline import build_timeline, default_step
    trace = load(pp_hung)
    assert default_step(trace) == 2
    tl = build_timeline(trace, 2)
    assert set(tl.code) == {"F", "B", "P", "C"} and tl.full_t1 > tl.t1   # zoomed on the schedule
    assert tl.open_[(tl.rank_idx == 2) & (tl.code == "B")].any()         # rank 2's backward never ended
    mx = build_matrix(trace, "dp0")
    assert mx.seqs == [1, 2, 3] and mx.cells[2] == ["missing", "timeout"] and mx.first_bad == 2
    p2p, _ = build_p2p(trace)
    assert (p2p[0].src, p2p[0].dst, p2p[0].state, p2p[0].recv) == (0, 2, "send_only", "—")


def test_metrics_presenter_marks_divergence(pp_hung: Path) -> None:
    import pandas as pd
    from types import SimpleNamespace
    from ncclscope.trace import load
    from ncclscope.tui.screens.metrics import build_metrics
    trace = load(pp_hung)
    dev = pd.DataFrame({"rank": [3], "step": [1], "metric": ["param_checksum"], "value": [1.0], "reference": [2.0]})
    perf = SimpleNamespace(divergence=SimpleNamespace(deviations=dev, nonfinite=pd.DataFrame(), findings=[]))
    mm = build_metrics(trace, perf)
    assert mm.steps == [0, 1] and [r.bad_steps for r in mm.rows] == [[], [], [], [1]]
    assert np.isnan(mm.rows[0].last_loss) and mm.rows[3].last_loss == pytest.approx(5.25)


def test_stream_tail_skips_torn_batch_until_complete(tmp_path: Path) -> None:
    from ncclscope.tui.follow import StreamTail
    sink = pa.BufferOutputStream()
    w = pa.ipc.new_stream(sink, S.METRICS_SCHEMA)
    sizes = []
    for step in range(3):
        w.write_table(_metric_rows(step))
        sizes.append(sink.tell())
    data = sink.getvalue().to_pybytes()
    path = tmp_path / S.METRICS_FILE
    path.write_bytes(data[: sizes[1] + 40])                # two batches and a torn third
    tail = StreamTail(path, S.METRICS_SCHEMA)
    assert tail.poll() == 4 and tail.pending == 40          # rows of the two complete batches
    assert tail.poll() == 0                                 # still torn: nothing new, no error
    path.write_bytes(data)                                  # the writer finished the batch
    assert tail.poll() == 2 and tail.pending == 0
    assert tail.table([]).column("step").to_pylist() == [0, 0, 1, 1, 2, 2]


def _metric_rows(step: int) -> pa.Table:
    cols = {f.name: pa.nulls(2, f.type) for f in S.METRICS_SCHEMA}
    cols["rank"] = pa.array([0, 0], pa.int32())
    cols["step"] = pa.array([step, step], pa.int32())
    return pa.Table.from_pydict(cols, schema=S.METRICS_SCHEMA)


def test_follower_reads_what_load_reads(pp_hung: Path) -> None:
    import pandas as pd
    from ncclscope.trace import load
    from ncclscope.tui.follow import Follower
    f = Follower(pp_hung)
    assert f.poll() and not f.poll()                        # second poll: nothing new
    a, b = load(pp_hung), f.trace()
    pd.testing.assert_frame_equal(a.ops, b.ops)
    pd.testing.assert_frame_equal(a.metrics, b.metrics)
    assert {r: i.state for r, i in a.ranks.items()} == {r: i.state for r, i in b.ranks.items()}
    assert a.stacks == b.stacks and f.ended


# ---- Pilot: real run directories -------------------------------------------------------
def _grid_roots(app: Any) -> list[int]:
    from ncclscope.tui.widgets.rank_grid import RankGrid
    grid = app.query_one(RankGrid).grid
    return sorted(c.rank for c in grid.cells if c.root)


def test_real_hung_pipeline_root_rank_and_stack(real_pp_hung: Path) -> None:
    expected = diagnosis_roots(real_pp_hung)
    assert expected == [1], "the stuck stage-1 rank is the root cause"

    async def go() -> None:
        app = make_app(real_pp_hung)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_ready(pilot)
            assert _grid_roots(app) == [1]
            assert app.run_model.findings[0].kind == "stuck_in_compute"
            await pilot.press("enter")                      # Enter on the headline finding
            await wait_until(pilot, lambda: app.query_one("#tabs").active == "rank", what="rank tab")
            detail = app.query_one("#rk").detail
            assert detail.rank == 1 and detail.root and detail.state == "stuck"
            assert "Current thread" in detail.stack or "Thread" in detail.stack
            await pilot.press("t")
            tl = app.query_one("#tl").model
            assert tl.step == 1 and "F" in set(tl.code)
    run(go())


def test_real_wrong_group_highlight_and_missing_member(real_wrong_group: Path) -> None:
    roots = diagnosis_roots(real_wrong_group)
    assert 1 in roots

    async def go() -> None:
        app = make_app(real_wrong_group)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_ready(pilot)
            assert _grid_roots(app) == roots
            await pilot.press("c")
            view = app.query_one("#co")
            await wait_until(pilot, lambda: view.matrix is not None, what="matrix")
            if view.group != "dp0":
                view.group = "dp0"
                view._show_group()
            mx = view.matrix
            k = mx.seqs[mx.first_bad]
            assert k == 2 and dict(zip(mx.members, mx.cells[mx.first_bad])) == {0: "timeout", 1: "missing"}
            title = str(app.query_one("#co-title").render())
            assert "never arrived: rank 1" in title
            await pilot.press("g", "enter")                 # grid: the cursor starts on a root rank
            await wait_until(pilot, lambda: app.query_one("#tabs").active == "rank", what="rank tab")
            assert app.query_one("#rk").detail.rank in roots
    run(go())


def test_real_healthy_run(real_healthy: Path) -> None:
    async def go() -> None:
        app = make_app(real_healthy)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_ready(pilot)
            assert app.run_model.verdict.startswith("OK")
            assert _grid_roots(app) == []
            assert {c.state for c in app.run_model.grid.cells} == {"finished"}
            await pilot.press("c")
            view = app.query_one("#co")
            await wait_until(pilot, lambda: view.matrix is not None, what="matrix")
            assert view.matrix.first_bad == -1
            await pilot.press("m")
            mm = app.query_one("#mx").model
            assert mm.steps == [0, 1, 2] and not any(r.bad_steps for r in mm.rows)
            await pilot.press("slash", "1")                 # filter the metrics rows to rank 1
            await pilot.pause()
            assert app.query_one("#mx-table").row_count == 1
            await pilot.press("escape", "q")
    run(go())


# ---- Pilot: hand-built pipeline hang, navigation -----------------------------------------
def test_finding_to_stack_in_two_keys(pp_hung: Path) -> None:
    async def go() -> None:
        app = make_app(pp_hung)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_ready(pilot)
            await pilot.press("enter")
            await wait_until(pilot, lambda: app.query_one("#tabs").active == "rank", what="rank tab")
            rk = app.query_one("#rk")
            assert rk.detail.rank == 2 and "_route_tokens" in rk.detail.stack
            assert rk.detail.ops[0].status == "suspect" and rk.detail.ops[0].text == "backward mb 1"
            await pilot.press("s")
            await pilot.pause()
            assert app.focused is app.query_one("#rk-stack-box")
            await pilot.press("right_square_bracket")       # next rank
            await pilot.pause()
            assert rk.detail.rank == 3
            await pilot.press("g")                          # mouse: click a cell, double-click opens it
            await pilot.click("#rg-grid", offset=(9, 1))    # row "pp0 dp1", rank 1
            await pilot.pause()
            assert "rank 1 pp0 dp1" in str(app.query_one("#rg-cell").render())
            await pilot.double_click("#rg-grid", offset=(9, 0))
            await wait_until(pilot, lambda: app.query_one("#tabs").active == "rank", what="rank tab")
            assert rk.detail.rank == 0
    run(go())


# ---- --follow ---------------------------------------------------------------------------
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


def _op(op_id: int, phase: str, t: float, seq: int, status: str = "") -> dict[str, Any]:
    return {"op_id": op_id, "phase": phase, "time_ns": T0 + int(t * NS), "kind": "collective",
            "op_name": "all_reduce", "process_group": "dp0", "collective_seq_id": seq, "step": seq - 1,
            "status": status}


def test_follow_shows_appended_rows_and_suspect(tmp_path: Path) -> None:
    root = tmp_path / "live"
    ranks = [LiveRank(root, r, 2) for r in range(2)]
    for lr in ranks:
        lr.append([_op(0, "begin", 0.0, 1), _op(0, "end", 0.1, 1, "ok")])

    async def go() -> None:
        app = make_app(root, follow=True, poll_s=0.1)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_ready(pilot)
            assert app.run_model.live and app.trace is not None and len(app.trace.ops) == 2
            assert {c.state for c in app.run_model.grid.cells} == {"running"}
            app.open_rank(1)
            await pilot.pause()
            before = app.updates
            ranks[0].append([_op(1, "begin", 1.0, 2), _op(1, "end", 1.1, 2, "ok")])
            ranks[1].append([_op(1, "begin", 1.0, 2),
                             {**_op(1, "instant", 4.0, 2, "suspect"), "kind": "marker"}])
            with open(root / S.rank_dir_name(1) / S.EVENTS_FILE, "ab") as fh:
                fh.write(b"\xff\xff\xff\xff\x40\x00")          # a torn batch: must be ignored, not crash
            await wait_until(pilot, lambda: app.updates > before and len(app.trace.ops) == 4, what="new rows")
            await pilot.pause(0.3)
            cells = {c.rank: c.state for c in app.run_model.grid.cells}
            assert cells == {0: "running", 1: "suspect"}
            rk = app.query_one("#rk")
            assert rk.detail.rank == 1 and rk.detail.ops[0].status == "suspect"
            assert "SUSPECT" in rk.detail.inflight
    try:
        run(go())
    finally:
        for lr in ranks:
            lr.close()


# ---- scale -------------------------------------------------------------------------------
def test_1024_ranks_first_screen_fast(tmp_path: Path) -> None:
    """The first screen (config, mesh, the grid coloured from run.json) is on screen within 2 s of start;
    the trace, the verdict and the root-cause rank follow as the worker finishes each stage."""
    root = write_big(tmp_path / "big", world=1024)

    async def go() -> dict[str, float]:
        app = make_app(root)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_until(pilot, lambda: app.run_model is not None, timeout=30, what="first screen")
            grid = app.run_model.grid
            assert grid.compact and len(grid.cells) == 1024 and grid.rows == 16
            await wait_until(pilot, lambda: app.run_model.stage in ("diagnosed", "ready"), timeout=150,
                             what="diagnosis")
            assert 5 in app.run_model.root_ranks
            await pilot.press("g")
            assert "rank 5" in str(app.query_one("#rg-cell").render())   # the cursor starts on the root
        return app.timings

    timings = run(go())
    print("1024 ranks, seconds to each stage:", {k: round(v, 2) for k, v in timings.items()})
    assert timings["preliminary"] < 2.0


# ---- snapshots (hand-built run: deterministic) -------------------------------------------
@pytest.mark.parametrize("keys", [(), ("g",), ("enter",), ("c",), ("t",), ("m",)],
                         ids=["overview", "grid", "rank", "collectives", "timeline", "metrics"])
def test_snapshot(snap_compare: Any, pp_hung: Path, keys: tuple[str, ...]) -> None:
    assert snap_compare(make_app(pp_hung), press=keys, terminal_size=(80, 24), run_before=wait_ready)


# ---- one verdict: the composer's (issue 11) ------------------------------------------------
SAMPLES = Path(__file__).resolve().parent.parent / "sample_traces"


def _verdict_text(app: Any) -> str:
    content = app.query_one("#ov-verdict").content
    return content.plain if hasattr(content, "plain") else str(content)


def test_tui_verdict_is_the_composers_on_every_sample() -> None:
    """For every sample run, the overview's verdict line and the grid's root marks are run(load(dir))'s."""
    from ncclscope.analysis import run as compose
    from ncclscope.trace import load
    dirs = sorted(d for d in SAMPLES.iterdir() if (d / S.RUN_JSON).exists())
    assert len(dirs) >= 8

    async def go(d: Path) -> tuple[str, list[int], dict[str, str]]:
        app = make_app(d)
        stages: dict[str, str] = {}
        apply = app.apply

        def record(model, trace, analysis=None):     # the verdict line each stage put on screen
            apply(model, trace, analysis)
            stages[model.stage] = _verdict_text(app)
        app.apply = record
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_ready(pilot)
            return _verdict_text(app), _grid_roots(app), stages

    hung = 0
    for d in dirs:
        a = compose(load(d))
        shown, roots, stages = run(go(d))
        assert shown == a.verdict, d.name
        assert roots == a.root_ranks, d.name
        # a hang's verdict is on screen before the performance analyses end, and it is the final one
        found_hang = a.diagnosis is not None and not a.diagnosis.ok
        assert ("diagnosed" in stages) == found_hang, (d.name, stages)
        if found_hang:
            hung += 1
            assert stages["diagnosed"] == a.verdict, d.name
    assert hung >= 2


def test_straggler_root_rank_is_marked_in_grid_and_rank_view() -> None:
    """Issue 14.9: the straggler run's root rank gets the * in the grid and ROOT CAUSE in its rank view."""
    async def go() -> None:
        app = make_app(SAMPLES / "straggler")
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_ready(pilot)
            assert _verdict_text(app).startswith("STRAGGLER") and _grid_roots(app) == [1]
            await pilot.press("g")
            assert "*1" in str(app.query_one("#rg-grid").render())
            assert "root cause: 1" in str(app.query_one("#rg-summary").render())
            await pilot.press("enter")
            await wait_until(pilot, lambda: app.query_one("#tabs").active == "rank", what="rank tab")
            assert app.query_one("#rk").detail.root and app.query_one("#rk").detail.rank == 1
    run(go())


# ---- issue 14.4: trace strings are text, never markup -----------------------------------------
EVIL = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] [/bold] [red]x [link=http://e]y"


def _evil_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the composer return markup-looking text everywhere a trace string goes."""
    from dataclasses import replace
    import ncclscope.analysis as analysis
    from ncclscope.findings import Evidence
    real = analysis.run

    def evil(trace: Any, **kw: Any) -> Any:
        trace.stacks = {r: s + f'\n  File "{EVIL}", line 1 in [/bold]\n' for r, s in trace.stacks.items()}
        trace.ops["op_name"] = trace.ops["op_name"].astype(str).replace("backward", "[/bold]bwd")
        a = real(trace, **kw)
        f0 = replace(a.findings[0], title=EVIL, stack=EVIL,
                     evidence=[Evidence(rank=2, note="[red]x", op_name="[/bold]op", process_group="[link=x]g")])
        return replace(a, verdict=EVIL, findings=[f0] + a.findings[1:])
    monkeypatch.setattr(analysis, "run", evil)


def test_markup_in_verdict_stack_and_op_names_is_shown_verbatim(pp_hung: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _evil_run(monkeypatch)

    async def go() -> None:
        app = make_app(pp_hung)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_ready(pilot)
            assert _verdict_text(app) == EVIL
            assert EVIL in app.query_one("#ov-detail").content.plain
            await pilot.press("enter")
            await wait_until(pilot, lambda: app.query_one("#tabs").active == "rank", what="rank tab")
            rk = app.query_one("#rk")
            assert EVIL in rk.detail.stack and any(o.text.startswith("[/bold]bwd") for o in rk.detail.ops)
            for key in ("t", "c", "m", "g", "o"):
                await pilot.press(key)
                await pilot.pause()
        assert app.return_code in (None, 0)
    run(go())


def test_app_death_exits_non_zero(pp_hung: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An exception inside the app ends `ncclscope tui` with a non-zero status, not 0."""
    from textual.app import App
    from ncclscope.tui import app as tui_app
    from ncclscope.tui.screens.overview import OverviewView

    def boom(self: Any, *a: Any, **k: Any) -> None:
        raise ValueError("a bug in a view")
    monkeypatch.setattr(OverviewView, "show_model", boom)
    monkeypatch.setattr(tui_app.NcclscopeApp, "run", lambda self, **kw: App.run(self, headless=True))
    assert tui_app.run_tui(pp_hung) != 0


# ---- issue 14.5: filters are visible, Esc clears them ------------------------------------------
def test_filter_always_visible_and_esc_clears_it(pp_hung: Path) -> None:
    async def go() -> None:
        app = make_app(pp_hung)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_ready(pilot)
            table = app.query_one("#ov-findings")
            total = len(app.run_model.findings)
            label = app.query_one("#filter-label")
            await pilot.press("o", "slash", *"unmatched", "enter")
            await pilot.pause()
            assert table.row_count < total
            assert label.display and "unmatched" in label.content.plain and "Esc" in label.content.plain
            await pilot.press("g")                          # another tab: no filter there, no label
            await pilot.pause()
            assert not label.display
            await pilot.press("escape", "o")                # Esc on the grid leaves the overview's filter ...
            await pilot.pause()
            assert table.row_count < total and label.display   # ... which is still shown with its label
            await pilot.press("escape")                     # Esc on the overview clears it
            await pilot.pause()
            assert table.row_count == total and not label.display and app.filters["overview"] == ""
            # Collectives: the filter narrows the group list and the matrix follows it
            await pilot.press("c")
            view = app.query_one("#co")
            await wait_until(pilot, lambda: view.matrix is not None, what="matrix")
            assert view.matrix.group == "dp0"
            await pilot.press("slash", *"dp1", "enter")
            await pilot.pause()
            assert view.matrix.group == "dp1" and label.display
            await pilot.press("escape")
            await pilot.pause()
            assert not label.display and app.query_one("#co-groups").option_count == len(view._groups)
    run(go())


# ---- issue 14.6: help, command palette, footer, focus order ----------------------------------------
def test_help_palette_footer_and_focus_order(pp_hung: Path) -> None:
    from textual.command import CommandPalette
    from ncclscope.tui.help import HelpScreen

    async def go() -> None:
        app = make_app(pp_hung)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_ready(pilot)
            footer = {b.key for _, b, _, _ in [v for v in app.screen.active_bindings.values()]
                      if b.show}
            assert {"enter", "s", "left_square_bracket", "right_square_bracket", "tab", "slash", "q"} <= footer
            await pilot.press("question_mark")
            await pilot.pause()
            assert isinstance(app.screen, HelpScreen)
            keys = {k for _, k, _ in app.screen.rows}
            assert {"o", "g", "r", "c", "t", "m", "? F1", "/", "Esc", "s", "[", "]", "Tab", "Shift+Tab", "Enter",
                    "Ctrl+P", "q"} <= keys
            await pilot.press("escape")
            await pilot.pause()
            assert not isinstance(app.screen, HelpScreen)
            await pilot.press("f1")
            await pilot.pause()
            assert isinstance(app.screen, HelpScreen)
            await pilot.press("escape", "ctrl+p")
            await pilot.pause()
            assert isinstance(app.screen, CommandPalette)
            await pilot.press("escape")
            await pilot.pause()
            await pilot.press("c")
            await wait_until(pilot, lambda: app.query_one("#co").matrix is not None, what="matrix")
            order = [app.focused.id]
            for _ in range(3):
                await pilot.press("tab")
                await pilot.pause()
                order.append(app.focused.id)
            assert order == ["co-matrix", "co-p2p", "co-groups", "co-matrix"]   # layout order, within the tab
    run(go())


# ---- issue 14.7: sparklines follow the pane and the data ---------------------------------------------
def _spiky_trace(steps: int = 80, spike_step: int = 40, factor: float = 21.9) -> Any:
    import pandas as pd
    from ncclscope.trace import load
    trace = load(SAMPLES / "healthy")
    base = trace.metrics.iloc[0]
    rows = []
    for r in sorted(trace.ranks):
        for s in range(steps):
            g = 1.5 * (factor if (r == 1 and s == spike_step) else 1.0)
            rows.append({**base.to_dict(), "rank": r, "step": s, "loss": 5.0 - s * 0.01, "grad_norm_local": g,
                         "grad_norm_global": g})
    trace.metrics = pd.DataFrame(rows).astype(trace.metrics.dtypes.to_dict())
    return trace


def test_metrics_sparklines_follow_pane_width_and_spike() -> None:
    trace = _spiky_trace()

    async def go(size: tuple[int, int]) -> str:
        app = make_app(SAMPLES / "healthy", trace=trace)
        async with app.run_test(size=size) as pilot:
            await wait_ready(pilot)
            await pilot.press("m")
            await pilot.pause()
            row = app.query_one("#mx-table").get_row_at(1)          # rank 1
            return row[3].plain                                     # its grad-norm sparkline

    wide, narrow = run(go((120, 35))), run(go((80, 24)))
    assert len(wide) > len(narrow) >= 8 and len(wide) > 16           # the width follows the pane
    for line in (wide, narrow):
        assert "█" in line and set(line) - {"█"} == {"▁"}             # the 21.9x spike is there, not flat
        at = line.index("█") / len(line)
        assert 0.4 <= at <= 0.55                                    # where it happened: step 40 of 80


# ---- issue 14.8: timeline and metrics with tensor parallelism -----------------------------------------
def _tp_trace() -> Any:
    from trace_builder import TraceBuilder
    tp, dp, pp = 2, 2, 2
    world = tp * dp * pp
    coords = {r: {"tp": r % tp, "dp": (r // tp) % dp, "pp": r // (tp * dp), "cp": 0} for r in range(world)}
    groups = {f"tp{i}": [2 * i, 2 * i + 1] for i in range(world // tp)}
    b = TraceBuilder(world, groups=groups, coords=coords)
    b.run["config"] = {"tp": tp, "dp": dp, "pp": pp, "cp": 1, "ep": 1, "schedule": "1f1b", "microbatches": 4,
                       "steps": 1}
    seqs = {r: 0 for r in range(world)}
    for r in range(world):
        t = 0.0
        for phase, dur in (("forward", 0.010), ("backward", 0.020)):
            for mb in range(4):
                b.compute(r, phase, start=t, end=t + dur, step=0, microbatch=mb)
                for k in range(3):                                   # tp all-reduces inside the compute
                    seqs[r] += 1
                    s0 = t + dur * (k + 1) / 4
                    b.collective(r, f"tp{r // tp}", seqs[r], start=s0, end=s0 + dur / 10, step=0, microbatch=mb)
                t += dur + 0.001
    trace = b.build()
    import pandas as pd
    from ncclscope.trace import load
    proto = load(SAMPLES / "healthy").metrics
    trace.metrics = pd.DataFrame([{**proto.iloc[0].to_dict(), "rank": r, "step": 0} for r in range(world)]
                                 ).astype(proto.dtypes.to_dict())
    return trace


def test_timeline_with_tp_shows_compute_and_every_coordinate() -> None:
    from ncclscope.tui.screens.metrics import build_metrics
    from ncclscope.tui.screens.timeline import build_timeline
    trace = _tp_trace()
    tl = build_timeline(trace, 0)
    assert len(set(tl.labels)) == len(tl.labels) and "tp1" in tl.labels[1] and "dp0" in tl.labels[1]
    labels = [r.label for r in build_metrics(trace).rows]
    assert len(set(labels)) == len(labels) and "tp1" in labels[1]

    async def go() -> list[str]:
        app = make_app(Path("tp-run"), trace=trace)
        async with app.run_test(size=(120, 35)) as pilot:
            await wait_ready(pilot)
            await pilot.press("t")
            await pilot.pause()
            return app.query_one("#tl-body").content.plain.splitlines()

    lines = go_lines = run(go())
    rank0 = next(line for line in go_lines if line.split()[0] == "0")
    chart = rank0.split("│")[1]
    assert "F0" in chart and "B3" in chart and "0000" in chart        # 1F1B letters and microbatch digits
    assert not set(chart) & {"c", "C"}                               # tp collectives do not hide the compute
    assert len(lines) >= 8


# ---- issue 14.10: refuse unreadable input; stacks, p2p, names, plurals, missing loss -------------------
def test_tui_refuses_unreadable_directory_like_analyze(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "notes.bin").write_bytes(b"\x00\xffgarbage" * 50)
    for d in (empty, junk):
        tui = run_cli("tui", str(d), timeout=60)
        analyze = run_cli("analyze", str(d), timeout=60)
        assert tui.returncode == 2 == analyze.returncode
        assert tui.stderr.strip() == analyze.stderr.strip() and tui.stderr.count("\n") == 1


def test_rank_and_collectives_views_of_hung_pipeline_sample() -> None:
    async def go() -> None:
        app = make_app(SAMPLES / "hung-pipeline")
        async with app.run_test(size=(120, 35)) as pilot:
            await wait_ready(pilot)
            await pilot.press("r")                                  # root rank 0 (stage 0, no loss)
            await wait_until(pilot, lambda: app.query_one("#rk").detail is not None, what="rank detail")
            rk = app.query_one("#rk")
            frames = [ln for ln in rk.detail.stack.splitlines() if ln.strip().startswith("File ")][:3]
            assert frames and not any(f in ln for ln in frames for f in (" dump_stacks", " _finish", " _run"))
            assert "recorder frames hidden" in rk.detail.stack and frames[0].endswith(" recv")
            assert "loss –" in rk.detail.metrics[0] and "nan" not in rk.detail.metrics[0]
            ops = app.query_one("#rk-ops")
            op_col = list(ops.columns.values())[0]
            assert op_col.width >= max(len(o.text) for o in rk.detail.ops)
            await pilot.press("c")
            view = app.query_one("#co")
            await wait_until(pilot, lambda: view.matrix is not None, what="matrix")
            title = app.query_one("#co-title").content.plain
            assert "1 collective ·" in title and "collectives" not in title
            p2p = app.query_one("#co-p2p")
            tags = [p2p.get_row_at(i) for i in range(p2p.row_count)]
            assert not any(str(row[1]) == "7" and row[6] == "" for row in tags)   # no clock-sync pings
            assert "clock-sync pings hidden" in str(p2p.border_title)
            mx = app.query_one("#co-matrix")
            assert list(mx.columns.values())[1].width >= max(len(o) for o in view.matrix.ops)
    run(go())


# ---- issue 12: --follow holds a hang verdict until the wait outlives the op's history ----------------
def test_follow_does_not_call_a_hang_within_the_ops_history(tmp_path: Path) -> None:
    root = tmp_path / "live"
    ranks = [LiveRank(root, r, 2) for r in range(2)]
    for lr in ranks:
        lr.append([_op(0, "begin", 0.0, 1), _op(0, "end", 0.1, 1, "ok")])
    ranks[0].append([_op(1, "begin", 0.2, 2)])               # rank 0 posted #2 a moment ago; rank 1 not yet

    async def go() -> None:
        app = make_app(root, follow=True, poll_s=0.1)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_ready(pilot)
            assert app.run_model.live
            verdict = _verdict_text(app)
            assert not verdict.startswith(("HANG", "STUCK", "DEADLOCK")), verdict
            assert "within its history" in app.live_note
            assert "0.0 s" not in verdict
            before = app.updates
            # 30 s later rank 0 is still waiting (the watchdog's suspect marker): now it is a hang
            ranks[0].append([{**_op(1, "instant", 30.0, 2, "suspect"), "kind": "marker"}])
            await wait_until(pilot, lambda: app.updates > before and _verdict_text(app).startswith("HANG"),
                             what="hang verdict")
            assert app.live_note == ""
    try:
        run(go())
    finally:
        for lr in ranks:
            lr.close()
