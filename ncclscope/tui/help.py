"""`?` / F1: every key of the TUI, read from the bindings themselves (so the list cannot go stale).

The app hands its own BINDINGS to `HelpScreen` (this module never imports `app.py`, which imports
it); the widgets' bindings are read from their classes here.
"""
from __future__ import annotations

from typing import Any, Iterable

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from ncclscope.tui.widgets.rank_grid import RankGrid
from ncclscope.tui.widgets.tables import GroupList, OpenTable

# Keys the widgets handle without a binding of ours (Textual's own, or the mouse).
EXTRA = [
    ("Everywhere", "Ctrl+P", "command palette (switch tab, help, clear filter, theme, quit)"),
    ("Tables", "↑ ↓ PgUp PgDn Home End", "move the cursor"),
    ("Mouse", "click / double-click", "select a tab, a row or a rank; a double-click on a rank opens it"),
]


def _key(b: Binding) -> str:
    names = {"question_mark": "?", "slash": "/", "escape": "Esc", "left_square_bracket": "[",
             "right_square_bracket": "]", "shift+tab": "Shift+Tab", "tab": "Tab", "enter": "Enter", "f1": "F1", "up": "↑", "down": "↓", "left": "←",
             "right": "→"}
    return " ".join(names.get(k, k) for k in b.key.split(","))


def binding_rows(app_bindings: Iterable[Any]) -> list[tuple[str, str, str]]:
    """(where, keys, what) for every binding of the app (`app_bindings`: its BINDINGS) and its widgets."""
    rows: list[tuple[str, str, str]] = []
    sources: Iterable[tuple[str, Iterable[Any]]] = (
        ("Everywhere", app_bindings), ("Overview findings", OpenTable.BINDINGS),
        ("Ranks grid", RankGrid.BINDINGS), ("Collectives groups", GroupList.BINDINGS))
    for where, bindings in sources:
        for b in bindings:
            b = b if isinstance(b, Binding) else Binding(*b)
            what = b.description or b.action
            if where == "Everywhere" and b.action.startswith("show_tab"):
                what = f"{b.description} tab"
            if b.action.startswith("step"):
                what = f"{b.description}: step in Timeline, rank in Rank"
            rows.append((where, _key(b), what))
    return rows + EXTRA


class HelpScreen(ModalScreen[None]):
    """A scrollable list of every key; Esc, q or ? closes it."""

    BINDINGS = [Binding("escape,q,question_mark,f1", "dismiss", "Close help")]
    DEFAULT_CSS = """
    HelpScreen { align: center middle; }
    #help-box { width: 90%; max-width: 96; height: 90%; border: round $accent; background: $surface; padding: 0 1; }
    """

    def __init__(self, app_bindings: Iterable[Any]) -> None:
        """`app_bindings`: the app's BINDINGS (listed under "Everywhere")."""
        super().__init__()
        self.rows = binding_rows(app_bindings)

    def compose(self) -> ComposeResult:
        table = Table(box=None, show_header=True, header_style="bold", expand=True, pad_edge=False)
        table.add_column("where", style="dim", no_wrap=True)
        table.add_column("key", style="bold", no_wrap=True)
        table.add_column("does")
        for where, key, what in self.rows:
            table.add_row(Text(where), Text(key), Text(what))
        with VerticalScroll(id="help-box"):
            yield Static(Text("ncclscope tui: keys (Esc closes)\n", style="bold"), id="help-title")
            yield Static(table, id="help-table")

    def on_mount(self) -> None:
        self.query_one("#help-box").border_title = "help"
