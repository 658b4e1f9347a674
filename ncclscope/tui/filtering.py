"""The per-tab filter of the TUI: `/` opens the box, typing filters the tab on
show, Enter keeps the filter (shown under the tab while set), Esc clears it.
A mixin of `NcclscopeApp`, which provides `filters` and `_focus_main`.
"""
from __future__ import annotations

from rich.text import Text
from textual.widgets import Input, Static, TabbedContent

from ncclscope.tui.tabs import FOCUS, VIEWS


class FilterMixin:
    """One filter per tab; always visible while set."""

    @property
    def active_tab(self) -> str:
        return self.query_one(TabbedContent).active

    def action_filter(self) -> None:
        box = self.query_one("#filter", Input)
        box.value = self.filters[self.active_tab]
        box.display = True
        self.query_one("#filter-label").display = False
        self.screen.set_focus(box)   # now, not after a refresh: keys typed right after "/" are the filter

    def action_clear_filter(self) -> None:
        """Esc: close the filter box and clear the filter of the tab on show."""
        box = self.query_one("#filter", Input)
        tab = self.active_tab
        if not (box.display or self.filters[tab]):
            return
        self.filters[tab] = ""
        self._apply_filter(tab, "")
        self._close_filter_box()
        self._show_filter_label()
        self._focus_main(FOCUS[tab])

    def _close_filter_box(self) -> None:
        box = self.query_one("#filter", Input)
        if box.display:
            box.display = False
            self._show_filter_label()

    def _show_filter_label(self) -> None:
        text = self.filters[self.active_tab]
        label = self.query_one("#filter-label", Static)
        editing = self.query_one("#filter", Input).display
        label.display = bool(text) and not editing
        if text:
            t = Text(no_wrap=True, overflow="ellipsis")
            t.append(" filter: ", style="bold")
            t.append(text, style="bold reverse")
            t.append("  (Esc clears, / edits)", style="dim")
            label.update(t)

    def on_input_changed(self, event: Input.Changed) -> None:
        if event.input.id == "filter" and event.input.display:
            self.filters[self.active_tab] = event.value.strip()
            self._apply_filter(self.active_tab, event.value)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        if event.input.id == "filter":
            event.input.display = False
            self._show_filter_label()
            self._focus_main(FOCUS[self.active_tab])

    def _apply_filter(self, tab: str, text: str) -> None:
        self.query_one(VIEWS[tab]).set_filter(text)  # type: ignore[attr-defined]
