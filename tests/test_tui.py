"""The TUI: Pilot-driven tests on real run directories, snapshots of the main screens, --follow.

Real runs come from the runtime (`ncclscope train` with fault drills: a hung
pipeline run, a wrong-group run, a healthy run), made once per session. The
snapshots use a hand-built hung pipeline run written through the runtime's
own `Recorder` with a fake clock, so every time, pid and host in it is fixed
(a snapshot must not change from run to run); the builders and Pilot helpers
are in tui_runs.py, the issue-14 defect tests in test_tui_faces.py. Update snapshots with
`python -m pytest tests/test_tui.py --snapshot-update` after checking them.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from tui_runs import (LiveRank, SAMPLES, diagnosis_roots, live_op, make_app, run, verdict_text, wait_ready,
                      wait_until, write_big)
from ncclscope import schema as S

pytestmark = pytest.mark.timeout(180)


# ---- real runs from the runtime, once per session -------------------------------------------
# `ncclscope train` in a fork of the suite's warm zygote (conftest): torch is not imported again for each.
def _train(zygote: Any, tmp_path_factory: pytest.TempPathFactory, name: str, *args: str) -> Path:
    out = tmp_path_factory.mktemp("tui") / name
    res = zygote.cli(f"tui-{name}", ["train", *args, "--out", str(out)], timeout=150)
    if not (out / S.RUN_JSON).exists():
        pytest.skip(f"ncclscope train {' '.join(args)} made no run directory (rc {res.returncode}): "
                    f"{res.stderr[-400:]}")
    return out


@pytest.fixture(scope="session")
def real_healthy(healthy_dp2: Path) -> Path:
    """`ncclscope train --dp 2 --steps 3` (conftest's shared run: the TUI only reads it)."""
    return healthy_dp2


@pytest.fixture(scope="session")
def real_wrong_group(zygote: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _train(zygote, tmp_path_factory, "wrong_group", "--dp", "2", "--steps", "3", "--timeout-s", "2",
                  "--inject", "wrong_group:rank=1,step=1,use=world")


@pytest.fixture(scope="session")
def real_pp_hung(zygote: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real pipeline run (pp 2, 1F1B, 4 microbatches) whose stage-1 rank hangs in compute."""
    return _train(zygote, tmp_path_factory, "pp_hung_real", "--pp", "2", "--microbatches", "4", "--steps", "2",
                  "--timeout-s", "2", "--inject", "hang:rank=1,step=1")


# ---- presenters (no terminal) ------------------------------------------------------
def test_model_of_hung_pipeline(pp_hung: Path) -> None:
    from ncclscope.verdict import run as compose
    from ncclscope.load.trace import load
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
    from ncclscope.load.trace import load
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
    from ncclscope.load.trace import load
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
    from ncclscope.load.trace import load
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
def test_follow_shows_appended_rows_and_suspect(tmp_path: Path) -> None:
    root = tmp_path / "live"
    ranks = [LiveRank(root, r, 2) for r in range(2)]
    for lr in ranks:
        lr.append([live_op(0, "begin", 0.0, 1), live_op(0, "end", 0.1, 1, "ok")])

    async def go() -> None:
        app = make_app(root, follow=True, poll_s=0.1)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_ready(pilot)
            assert app.run_model.live and app.trace is not None and len(app.trace.ops) == 2
            assert {c.state for c in app.run_model.grid.cells} == {"running"}
            app.open_rank(1)
            await pilot.pause()
            before = app.updates
            ranks[0].append([live_op(1, "begin", 1.0, 2), live_op(1, "end", 1.1, 2, "ok")])
            ranks[1].append([live_op(1, "begin", 1.0, 2),
                             {**live_op(1, "instant", 4.0, 2, "suspect"), "kind": "marker"}])
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
def test_tui_verdict_is_the_composers_on_every_sample(composed: Any) -> None:
    """For every sample run, the overview's verdict line and the grid's root marks are run(load(dir))'s
    (computed once per session: conftest's `composed`)."""
    dirs = sorted(d for d in SAMPLES.iterdir() if (d / S.RUN_JSON).exists())
    assert len(dirs) >= 8

    async def go(d: Path) -> tuple[str, list[int], dict[str, str]]:
        app = make_app(d)
        stages: dict[str, str] = {}
        apply = app.apply

        def record(model, trace, analysis=None):     # the verdict line each stage put on screen
            apply(model, trace, analysis)
            stages[model.stage] = verdict_text(app)
        app.apply = record
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_ready(pilot)
            return verdict_text(app), _grid_roots(app), stages

    hung = 0
    for d in dirs:
        a = composed(d)
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
            assert verdict_text(app).startswith("STRAGGLER") and _grid_roots(app) == [1]
            await pilot.press("g")
            assert "*1" in str(app.query_one("#rg-grid").render())
            assert "root cause: 1" in str(app.query_one("#rg-summary").render())
            await pilot.press("enter")
            await wait_until(pilot, lambda: app.query_one("#tabs").active == "rank", what="rank tab")
            assert app.query_one("#rk").detail.root and app.query_one("#rk").detail.rank == 1
    run(go())


