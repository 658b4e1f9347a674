"""`ncclscope tui RUN [--follow]`: from the verdict to the guilty rank's stack in a few keys.

    python -m ncclscope tui runs/hung            # post-mortem
    python -m ncclscope tui runs/live --follow   # a job still writing its trace

Layout: tabs for Overview (verdict, findings), Ranks (mesh grid), Rank
(ops, stack, metrics of one rank), Collectives (seq x member matrix, p2p
pairs), Timeline (one step as a text Gantt) and Metrics (loss / grad norm
sparklines). Loading runs in a thread worker in stages, each shown as soon as
it is ready: run.json alone (the grid from exit codes, in milliseconds), the
loaded trace, then `ncclscope.verdict.run(trace)`: the one composer whose
verdict line, findings and root ranks every face shows verbatim. The UI thread
only renders presenter dataclasses (`model.py`), so it never freezes.

`?` / F1 lists every key, Ctrl+P opens the command palette, `/` filters the
tab on show (the filter stays visible under the tab until Esc clears it).

This module is the app's frame (tabs, applying models, navigation); the staged
loading worker is `loading.py`, the per-tab filter `filtering.py`, the tab
table `tabs.py`.
"""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterable

from textual.app import App, ComposeResult, SystemCommand
from textual.binding import Binding
from textual.screen import Screen
from textual.widgets import Footer, Header, Input, Static, TabbedContent, TabPane, Tabs

from ncclscope.tui.presenters import RunModel
from ncclscope.tui.filtering import FilterMixin
from ncclscope.tui.help import HelpScreen
from ncclscope.tui.loading import EXIT_UNREADABLE, LoadingMixin
from ncclscope.tui.screens.collectives import CollectivesView
from ncclscope.tui.screens.metrics import MetricsView
from ncclscope.tui.screens.overview import OverviewView
from ncclscope.tui.screens.rank import RankView, build_rank_detail
from ncclscope.tui.screens.ranks import RanksView
from ncclscope.tui.screens.timeline import TimelineView
from ncclscope.tui.tabs import FOCUS, TAB_TITLES, TABS, VIEWS
from ncclscope.tui.widgets.rank_grid import RankGrid


class NcclscopeApp(LoadingMixin, FilterMixin, App[None]):
    """The TUI. `follow=True` keeps polling the run directory for appended rows; `trace` skips loading."""

    CSS_PATH = "app.tcss"
    TITLE = "ncclscope"
    ENABLE_COMMAND_PALETTE = True            # Ctrl+P; its footer entry is hidden (12 of 80 columns)
    BINDINGS = [
        Binding("o", "show_tab('overview')", "Overview", show=False),
        Binding("g", "show_tab('grid')", "Ranks", show=False),
        Binding("r", "show_tab('rank')", "Rank", show=False),
        Binding("c", "show_tab('colls')", "Collectives", show=False),
        Binding("t", "show_tab('timeline')", "Timeline", show=False),
        Binding("m", "show_tab('metrics')", "Metrics", show=False),
        Binding("question_mark,f1", "help", "Help", key_display="?"),
        Binding("slash", "filter", "Filter"),
        Binding("escape", "clear_filter", "Clear filter", show=False),
        Binding("s", "stack", "Stack"),
        Binding("left_square_bracket", "step(-1)", "Prev", key_display="["),
        Binding("right_square_bracket", "step(1)", "Next", key_display="]"),
        Binding("tab", "app.focus_next", "Focus", key_display="⇥", priority=True),
        Binding("shift+tab", "app.focus_previous", "Focus back", show=False, priority=True),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(self, path: str | Path, follow: bool = False, poll_s: float = 1.0, trace: Any = None) -> None:
        super().__init__()
        self.path = Path(path)
        self.follow = follow
        self.poll_s = poll_s
        self.trace: Any = None
        self.analysis: Any = None            # ncclscope.verdict.run(trace)
        self._given = trace                  # a trace loaded before the app started (run_tui, tests)
        self.run_model: RunModel | None = None
        self.rank = -1                       # rank shown in the Rank tab
        self._focus_op = -1
        self._stale: set[str] = set(TABS)    # tabs whose data changed since they were last shown
        self._stop = threading.Event()
        self._want_focus = ""                # widget to focus once the tab switch lands
        self.filters: dict[str, str] = {t: "" for t in TABS}   # per tab; shown under it while set
        self.error = ""                      # why the run could not be opened (printed after exit)
        self.live_note = ""                  # --follow: why a hang verdict is held back
        self.updates = 0                     # models applied (tests wait on it)
        self.timings: dict[str, float] = {}  # seconds from start to each stage's model on screen
        self._t0 = time.monotonic()
        self.sub_title = self.path.name

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False, icon="")
        with TabbedContent(initial="overview", id="tabs"):
            ids = {"overview": "ov", "grid": "rg", "rank": "rk", "colls": "co", "timeline": "tl", "metrics": "mx"}
            for tab in TABS:
                key, title = TAB_TITLES[tab]
                with TabPane(f"[b]{key}[/b] {title}", id=tab):
                    yield VIEWS[tab](id=ids[tab])
        yield Static(id="filter-label")
        yield Input(placeholder="filter (Enter to keep, Esc to clear)", id="filter")
        yield Footer(compact=True, show_command_palette=False)

    def on_mount(self) -> None:
        self.query_one("#filter", Input).display = False
        self.query_one("#filter-label").display = False
        self.query_one(TabbedContent).query_one(Tabs).can_focus = False   # Tab cycles within the tab on show
        self.query_one("#ov-findings").focus()
        self.load()

    def on_unmount(self) -> None:
        self._stop.set()

    def get_system_commands(self, screen: Screen) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        for tab in TABS:
            key, title = TAB_TITLES[tab]
            yield SystemCommand(f"Show {title}", f"switch to the {title} tab (key {key})",
                                lambda tab=tab: self.action_show_tab(tab))
        yield SystemCommand("Help", "every key of this TUI (? or F1)", self.action_help)
        yield SystemCommand("Clear filter", "clear the filter of the tab on show (Esc)", self.action_clear_filter)

    # ---- applying a model (UI thread) ------------------------------------
    def apply(self, model: RunModel, trace: Any, analysis: Any = None) -> None:
        self.run_model = model
        if trace is not None:
            self.trace, self.analysis = trace, analysis
        overview = self.query_one(OverviewView)
        overview.show_model(model, self.live_note)
        if model.stage == "ready":
            overview.set_progress("", None, None)
        self.query_one(RanksView).show_model(model)
        if self.rank < 0 and model.root_ranks:
            self.rank = model.root_ranks[0]
            self.query_one(RanksView).focus_rank(self.rank)
        self._stale = set(TABS) - {"overview", "grid"}
        self._refresh_active()
        self._show_filter_label()
        self.updates += 1
        self.timings.setdefault(model.stage, time.monotonic() - self._t0)

    def _refresh_active(self) -> None:
        """Rebuild the detail view on screen (the others when they are next shown)."""
        active = self.query_one(TabbedContent).active
        if active not in self._stale or self.trace is None or self.run_model is None:
            return
        self._stale.discard(active)
        findings = list(getattr(self.analysis, "findings", []) or [])
        if active == "rank" and self.rank >= 0:
            states = {c.rank: c.state for c in self.run_model.grid.cells}
            detail = build_rank_detail(self.trace, self.rank, findings, states, self.run_model.root_ranks)
            self.query_one(RankView).show(detail, self._focus_op)
        elif active == "colls":
            head = next((f.group for f in self.run_model.findings if f.group), "")
            tables = getattr(getattr(self.analysis, "diagnosis", None), "tables", None)
            self.query_one(CollectivesView).show(self.trace, head, tables)
        elif active == "timeline":
            self.query_one(TimelineView).show(self.trace)
        elif active == "metrics":
            self.query_one(MetricsView).show(self.trace, getattr(self.analysis, "perf", None))

    def on_tabbed_content_tab_activated(self, event: TabbedContent.TabActivated) -> None:
        """Tab switched (key, click): rebuild its view if stale and focus its main widget."""
        self._refresh_active()
        self._show_filter_label()
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
        self._close_filter_box()
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

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen(self.BINDINGS))


def _has_rank_dirs(path: Path) -> bool:
    try:
        return any(p.name.startswith("rank-") and p.is_dir() for p in path.iterdir())
    except OSError:
        return False


def run_tui(path: str | Path, follow: bool = False, poll_s: float = 1.0, trace: Any = None) -> int:
    """Entry point for `ncclscope tui`; returns the process exit code. `trace`: already loaded (the CLI
    reads a large input on the engine's workers first, with its progress lines, then opens the app on it).

    2 (with the one-line error `ncclscope analyze` prints) when the directory
    cannot be read; non-zero when the app dies of an exception."""
    path = Path(path)
    if trace is None and not follow and not _has_rank_dirs(path):
        # not a ncclscope run directory: a foreign trace (Flight Recorder, profiler), or nothing readable
        from ncclscope.load.foreign import load_any
        from ncclscope.load.trace import TraceError
        try:
            trace = load_any(path)
        except TraceError as exc:
            print(f"ncclscope: {exc}", file=sys.stderr)
            return EXIT_UNREADABLE
    app = NcclscopeApp(path, follow=follow, poll_s=poll_s, trace=trace)
    app.run()
    if app.error:
        print(f"ncclscope: {app.error}", file=sys.stderr)
    code = app.return_code
    return 0 if code is None else int(code)
