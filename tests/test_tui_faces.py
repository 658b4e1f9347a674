"""The TUI's defects fixed under issue 14, Pilot-driven: trace strings shown verbatim (never markup), visible
filters, help / palette / footer / focus order, sparklines, timeline and metrics with tensor parallelism,
unreadable input, stacks, p2p, names, plurals and a missing loss. Run directories and helpers: tui_runs.py.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from conftest import cli_in_process, run_cli
from tui_runs import (LiveRank, SAMPLES, live_op, make_app, run, verdict_text, wait_ready, wait_until)


pytestmark = pytest.mark.timeout(180)


# ---- issue 14.4: trace strings are text, never markup -----------------------------------------
EVIL = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] [/bold] [red]x [link=http://e]y"


def _evil_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make the composer return markup-looking text everywhere a trace string goes."""
    from dataclasses import replace
    import ncclscope.verdict as analysis
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
            assert verdict_text(app) == EVIL
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
    from ncclscope.load.trace import load
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
    from ncclscope.load.trace import load
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
        tui = run_cli("tui", str(d), timeout=60)              # the real entry point, in its own process
        analyze = cli_in_process(["analyze", str(d)])        # the same `main` here (never imports torch)
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
        lr.append([live_op(0, "begin", 0.0, 1), live_op(0, "end", 0.1, 1, "ok")])
    ranks[0].append([live_op(1, "begin", 0.2, 2)])               # rank 0 posted #2 a moment ago; rank 1 not yet

    async def go() -> None:
        app = make_app(root, follow=True, poll_s=0.1)
        async with app.run_test(size=(80, 24)) as pilot:
            await wait_ready(pilot)
            assert app.run_model.live
            verdict = verdict_text(app)
            assert not verdict.startswith(("HANG", "STUCK", "DEADLOCK")), verdict
            assert "within its history" in app.live_note
            assert "0.0 s" not in verdict
            before = app.updates
            # 30 s later rank 0 is still waiting (the watchdog's suspect marker): now it is a hang
            ranks[0].append([{**live_op(1, "instant", 30.0, 2, "suspect"), "kind": "marker"}])
            await wait_until(pilot, lambda: app.updates > before and verdict_text(app).startswith("HANG"),
                             what="hang verdict")
            assert app.live_note == ""
    try:
        run(go())
    finally:
        for lr in ranks:
            lr.close()
