"""DataTable / OptionList with their Enter key in the footer (Textual hides it by default)."""
from __future__ import annotations

from typing import ClassVar

from textual.binding import Binding, BindingType
from textual.widgets import DataTable, OptionList


class OpenTable(DataTable):
    """The findings table: Enter opens the finding's root-cause rank."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("enter", "select_cursor", "Open rank", key_display="⏎")]


class GroupList(OptionList):
    """The collectives' group list: Enter (or moving the cursor) shows the group's matrix."""

    BINDINGS: ClassVar[list[BindingType]] = [Binding("enter", "select", "Show group", key_display="⏎")]
