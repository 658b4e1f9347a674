"""`ncclscope tui RUN [--follow]`: from the verdict to the guilty rank's stack in a few keys.

    python -m ncclscope tui runs/hung            # post-mortem
    python -m ncclscope tui runs/live --follow   # a job still writing its trace

Layout: tabs for Overview (verdict, findings), Ranks (mesh grid), Rank
(ops, stack, metrics of one rank), Collectives (seq x member matrix, p2p
pairs), Timeline (one step as a text Gantt) and Metrics (loss / grad norm
sparklines). Loading runs in a thread worker in stages, each shown as soon as
it is ready: run.json alone (the grid from exit codes, in milliseconds), the
loaded trace, the diagnosis, the performance analyses. The UI thread only
renders presenter dataclasses (`model.py`), so it never freezes.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from textual import work
from textual.app import App, ComposeResult
from textual.binding import Binding
from textual.widgets import Footer, Header, Input, TabbedContent, TabPane
from textual.worker import get_current_worker

from . import model as M
from ..findings import Finding, sort_findings
from .screens.collectives import CollectivesView
from .screens.metrics import MetricsView
from .screens.overview import OverviewView
from .screens.rank import RankView, build_rank_detail
from .screens.ranks import RanksView
from .screens.timeline import TimelineView
from .widgets.rank_grid import RankGrid

TABS = ("overview", "grid", "rank", "colls", "timeline", "metrics")
FOCUS = {"overview": "#ov-findings", "grid": "#rg-grid", "rank": "#rk-ops", "colls": "#co-matrix",
         "timeline": "#tl-box", "metrics": "#mx-table"}


def run_analyses(trace: Any) -> tuple[Any, str]:
    """diagnose(trace), or (None, why) when the analysis is missing or fails: the views still work."""
    try:
        from ..analysis.diagnose import diagnose
    except ImportError as exc:
        return None, f"diagnosis unavailable ({exc})"
    try:
        return diagnose(trace), ""
    except Exception as exc:  # an analysis bug must not take the debugger down with it
        return None, f"diagnosis failed: {type(exc).__name__}: {exc}"


def run_performance(trace: Any) -> tuple[Any, list[Finding]]:
    """analyze_performance(trace) and its findings; (None, []) when missing or failing."""
    try:
        from ..analysis.performance import analyze_performance
    except ImportError:
        return None, []
    try:
        result = analyze_performance(trace)
    except Exception:  # performance is a bonus on a hung job: never fatal
        return None, []
    found = result if isinstance(result, list) else getattr(result, "findings", [])
    return result, sort_findings([f for f in found if isinstance(f, Finding)])


class NcclscopeApp(App[None]):
    """The TUI. `follow=True` keeps polling the run directory for appended rows."""

    CSS_PATH = "app.tcss"
    TITLE = "ncclscope"
    ENABLE_COMMAND_PALETTE = False           # its footer entry costs 12 of 80 columns
    BINDINGS = [
        Binding("o", "show_tab('overview')", "Overview"),
        Binding("g", "show_tab('grid')", "Ranks"),
        Binding("r", "show_tab('rank')", "Rank"),
        Binding("c", "show_tab('colls')", "Colls"),
        Binding("t", "show_tab('timeline')", "Timeline"),
        Binding("m", "show_tab('metrics')", "Metrics"),
        Binding("slash", "filter", "Filter"),
        Binding("escape", "clear_filter", "Clear", show=False),
        Binding("left_square_bracket", "step(-1)", "Prev", show=False),
        Binding("right_square_bracket", "step(1)", "Next", show=False),
        Binding("s", "stack", "Stack", show=False),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, path: str | Path, follow: bool = False, poll_s: float = 1.0) -> None:
        super().__init__()
        self.path = Path(path)
        self.follow = follow
        self.poll_s = poll_s
        self.trace: Any = None
        self.diagnosis: Any = None
        self.perf: Any = None                # analysis.performance result
        self.run_model: M.RunModel | None = None
        self.rank = -1                       # rank shown in the Rank tab
        self._focus_op = -1
        self._stale: set[str] = set(TABS)    # tabs whose data changed since they were last shown
        self._stop = threading.Event()
        self._want_focus = ""                # widget to focus once the tab switch lands
        self.updates = 0                     # models applied (tests wait on it)
        self.timings: dict[str, float] = {}  # seconds from start to each stage's model on screen
        self._t0 = time.monotonic()
        self.sub_title = self.path.name

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="")
        with TabbedContent(initial="overview", id="tabs"):
            with TabPane("Overview", id="overview"):
                yield OverviewView(id="ov")
            with TabPane("Ranks", id="grid"):
                yield RanksView(id="rg")
            with TabPane("Rank", id="rank"):
                yield RankView(id="rk")
            with TabPane("Collectives", id="colls"):
                yield CollectivesView(id="co")
            with TabPane("Timeline", id="timeline"):
                yield TimelineView(id="tl")
            with TabPane("Metrics", id="metrics"):
                yield MetricsView(id="mx")
        yield Input(placeholder="filter (Enter to keep, Esc to clear)", id="filter")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one("#filter", Input).display = False
        self.query_one("#ov-findings").focus()
        self.load()

    def on_unmount(self) -> None:
        self._stop.set()

    # ---- loading (thread worker) ----------------------------------------
    @work(thread=True, exclusive=True, group="load")
    def load(self) -> None:
        """Stages, each applied as soon as it is ready; then, with --follow, poll for appended rows."""
        worker = get_current_worker()
        progress = self._progress_cb()
        run = _read_run(self.path)
        if run.get("world_size"):
            self._ui(self.apply, M.preliminary_model(self.path, run), None)
            self._stop.wait(0.15)   # let the UI thread paint the first screen before loading takes the GIL
        from ..trace import TraceError, load as load_trace
        follower = None
        try:
            if self.follow:
                from .follow import Follower
                follower = Follower(self.path)
                progress("reading rank files", 0, None)
                follower.poll(progress=lambda i, n: progress(f"reading rank files {i}/{n}", i, n))
                trace = follower.trace()
            else:
                progress(f"loading trace ({run.get('world_size', '?')} ranks)", 1, 4)
                trace = load_trace(self.path)
        except TraceError as exc:
            self._ui(self._fail, str(exc))
            if follower is None:
                return
            trace = None
        except Exception as exc:  # a reader bug: say so instead of taking the terminal down
            self._ui(self._fail, f"{type(exc).__name__}: {exc}")
            return
        while trace is None and not self._stop.wait(self.poll_s):   # --follow before the first rank dir
            try:
                follower.poll()
                trace = follower.trace()
            except TraceError:
                continue
        if trace is None or worker.is_cancelled:
            return
        live = follower is not None and not follower.ended
        self._ui(self.apply, M.build_run_model(trace, None, live=live, stage="loaded"), trace)
        progress("diagnosing", 2, 4)
        self._analyse(trace, live, with_perf=not live, progress=progress)
        progress("", None, None)
        while follower is not None and not self._stop.wait(self.poll_s) and not worker.is_cancelled:
            try:
                if follower.poll():
                    self._analyse(follower.trace(), not follower.ended, with_perf=follower.ended)
            except Exception as exc:  # keep following: the next poll may read a complete file
                self._ui(self._set_progress, f"follow: {type(exc).__name__}: {str(exc)[:60]}", None, None)

    def _analyse(self, trace: Any, live: bool, with_perf: bool, progress: Any = None) -> None:
        diagnosis, why = run_analyses(trace)
        model = M.build_run_model(trace, diagnosis, live=live, stage="diagnosed")
        if diagnosis is None:
            model.verdict, model.verdict_level = why, "warning"
        self._ui(self.apply, model, trace, diagnosis)
        if with_perf:
            if progress is not None:
                progress("performance analyses", 3, 4)
            perf, found = run_performance(trace)
            model = M.build_run_model(trace, diagnosis, found, live=live, stage="ready")
            if diagnosis is None:
                model.verdict, model.verdict_level = why, "warning"
        else:
            perf, model = None, replace(model, stage="ready")   # a new object: the UI holds the old one
        self._ui(self.apply, model, trace, diagnosis, perf)

    def _ui(self, fn: Any, *args: Any) -> None:
        """call_from_thread that tolerates the app having quit meanwhile."""
        if self._stop.is_set():
            return
        try:
            self.call_from_thread(fn, *args)
        except RuntimeError:   # the app exited between the check and the call
            self._stop.set()

    def _progress_cb(self) -> Any:
        def progress(text: str, done: float | None, total: float | None) -> None:
            self._ui(self._set_progress, text, done, total)
        return progress

    def _set_progress(self, text: str, done: float | None, total: float | None) -> None:
        self.query_one(OverviewView).set_progress(text, done, total)

    def _fail(self, message: str) -> None:
        ov = self.query_one(OverviewView)
        ov.set_progress("", None, None)
        ov.query_one("#ov-verdict").update(f"cannot open {self.path}: {message}")

    # ---- applying a model (UI thread) ------------------------------------
    def apply(self, model: M.RunModel, trace: Any, diagnosis: Any = None, perf: Any = None) -> None:
        self.run_model = model
        if trace is not None:
            self.trace, self.diagnosis, self.perf = trace, diagnosis, perf
        overview = self.query_one(OverviewView)
        overview.show_model(model)
        if model.stage == "ready":
            overview.set_progress("", None, None)
        self.query_one(RanksView).show_model(model)
        if self.rank < 0 and model.root_ranks:
            self.rank = model.root_ranks[0]
            self.query_one(RanksView).focus_rank(self.rank)
        self._stale = set(TABS) - {"overview", "grid"}
        self._refresh_active()
        self.updates += 1
        self.timings.setdefault(model.stage, time.monotonic() - self._t0)

    def _refresh_active(self) -> None:
        """Rebuild the detail view on screen (the others when they are next shown)."""
        active = self.query_one(TabbedContent).active
        if active not in self._stale or self.trace is None or self.run_model is None:
            return
        self._stale.discard(active)
        if active == "rank" and self.rank >= 0:
            states = {c.rank: c.state for c in self.run_model.grid.cells}
            findings = list(getattr(self.diagnosis, "findings", []) or [])
            detail = build_rank_detail(self.trace, self.rank, findings, states, self.run_model.root_ranks)
            self.query_one(RankView).show(detail, self._focus_op)
        elif active == "colls":
            head = next((f.group for f in self.run_model.findings if f.group), "")
            self.query_one(CollectivesView).show(self.trace, head, getattr(self.diagnosis, "tables", None))
        elif active == "timeline":
            self.query_one(TimelineView).show(self.trace)
        elif active == "metrics":
            self.query_one(MetricsView).show(self.trace, self.perf)

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        """Tab switched (key, click): rebuild its view if stale and focus its main widget."""
        self._refresh_active()
        self._focus_main(self._want_focus or FOCUS[event.tabbed_content.active])
        self._want_focus = ""

    def _focus_main(self, selector: str) -> None:
        try:
            self.query_one(selector).focus()
        except Exception:   # not mounted yet (very early key press)
            pass

    # ---- navigation --------------------------------------------------------
    def open_rank(self, rank: int, op_id: int = -1) -> None:
        self.rank, self._focus_op = rank, op_id
        self._stale.add("rank")
        self.query_one(RanksView).focus_rank(rank)
        self.action_show_tab("rank")

    def on_overview_view_finding_chosen(self, event: OverviewView.FindingChosen) -> None:
        self.open_rank(event.finding.jump_rank, event.finding.jump_op)

    def on_rank_grid_selected(self, event: RankGrid.Selected) -> None:
        self.open_rank(event.rank)

    def action_show_tab(self, tab: str, focus: str = "") -> None:
        """Switch tab; focus follows in on_tabbed_content_tab_activated (after the switch, never racing it)."""
        tabs = self.query_one(TabbedContent)
        if tabs.active != tab:
            self._want_focus = focus
            tabs.active = tab
        else:
            self._refresh_active()
            self._focus_main(focus or FOCUS[tab])

    def action_step(self, delta: int) -> None:
        """[ / ]: previous / next step in the timeline, previous / next rank in the rank view."""
        active = self.query_one(TabbedContent).active
        if active == "timeline":
            self.query_one(TimelineView).change_step(delta)
        elif active == "rank" and self.trace is not None:
            self.open_rank(max(0, min(self.trace.world_size - 1, self.rank + delta)))

    def action_stack(self) -> None:
        """s: the stack of the rank on show."""
        if self.rank >= 0:
            self.action_show_tab("rank", focus="#rk-stack-box")

    # ---- filter ----------------------------------------------------------
    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.display = True
        self.screen.set_focus(box)   # now, not after a refresh: keys typed right after "/" are the filter

    def action_clear_filter(self) -> None:
        box = self.query_one("#filter", Input)
        if box.display or box.value:
            box.value = ""
            box.display = False
            self._apply_filter("")
            self.action_show_tab(self.query_one(TabbedContent).active)

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "filter":
            self._apply_filter(event.value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "filter":
            event.input.display = bool(event.value)
            self.action_show_tab(self.query_one(TabbedContent).active)

    def _apply_filter(self, text: str) -> None:
        view = {"overview": OverviewView, "grid": RanksView, "rank": RankView, "colls": CollectivesView,
                "timeline": TimelineView, "metrics": MetricsView}[self.query_one(TabbedContent).active]
        self.query_one(view).set_filter(text)  # type: ignore[attr-defined]


def _read_run(path: Path) -> dict[str, Any]:
    try:
        data = json.loads((path / "run.json").read_text(errors="replace"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def run_tui(path: str | Path, follow: bool = False, poll_s: float = 1.0) -> int:
    """Entry point for `ncclscope tui`; returns the process exit code."""
    if not Path(path).is_dir() and not follow:
        import sys
        print(f"ncclscope: {path}: not a run directory", file=sys.stderr)
        return 2
    NcclscopeApp(path, follow=follow, poll_s=poll_s).run()
    return 0
