"""The rank grid: one cell per rank laid out by the mesh, coloured by state.

Why a custom widget and not a DataTable: a grid of 1,024 cells must render as
one Rich `Text` (one pass, no per-cell widgets), cells need their own colours
from the stylesheet (component classes `rankgrid--<state>` in app.tcss), and
the root-cause rank must stand out wherever it sits. Arrow keys / hjkl move,
Enter (or a click) opens the rank.

Mesh layout: rows are pp x dp, columns tp x cp (Megatron order, tp fastest).
Large worlds get a compact grid: one character per rank, 64 a row.
"""
from __future__ import annotations

from rich.style import Style
from rich.text import Text
from textual.binding import Binding
from textual.events import Click
from textual.message import Message
from textual.reactive import reactive
from textual.widget import Widget

from ncclscope.tui.presenters import GLYPH, STATE_LABEL, STATES, GridModel, RankCell

ROOT_MARK = "*"


class RankGrid(Widget, can_focus=True):
    """Renders a `GridModel`; posts `Highlighted` when the cursor moves and `Selected` on Enter."""

    COMPONENT_CLASSES = {f"rankgrid--{s}" for s in STATES} | {
        "rankgrid--root", "rankgrid--cursor", "rankgrid--dim", "rankgrid--label"}
    BINDINGS = [
        Binding("up,k", "move(0,-1)", "Up", show=False),
        Binding("down,j", "move(0,1)", "Down", show=False),
        Binding("left,h", "move(-1,0)", "Left", show=False),
        Binding("right,l", "move(1,0)", "Right", show=False),
        Binding("enter", "open", "Open rank", key_display="⏎"),
    ]

    cursor: reactive[int] = reactive(0)

    class Highlighted(Message):
        def __init__(self, cell: RankCell) -> None:
            super().__init__()
            self.cell = cell

    class Selected(Message):
        def __init__(self, rank: int) -> None:
            super().__init__()
            self.rank = rank

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.grid: GridModel | None = None
        self._at: dict[tuple[int, int], int] = {}   # (row, col) -> index into cells
        self._filter = ""
        self._placed = False      # cursor was put on a root-cause rank (or moved by the user)

    # ---- data ------------------------------------------------------------
    def set_grid(self, grid: GridModel) -> None:
        """Show a new grid, keeping the cursor on the same rank."""
        old = self.current.rank if self.current is not None else None
        self.grid = grid
        self._at = {(c.row, c.col): i for i, c in enumerate(grid.cells)}
        if old is not None and old < len(grid.cells) and self._placed:
            self.cursor = old
        else:
            self._placed = any(c.root for c in grid.cells)
            roots = [i for i, c in enumerate(grid.cells) if c.root]
            self.cursor = roots[0] if roots else 0
        self.refresh(layout=True)
        if self.current is not None:
            self.post_message(self.Highlighted(self.current))

    def focus_rank(self, rank: int) -> None:
        if self.grid is not None and 0 <= rank < len(self.grid.cells):
            self.cursor = rank

    @property
    def current(self) -> RankCell | None:
        if self.grid is None or not self.grid.cells:
            return None
        return self.grid.cells[min(self.cursor, len(self.grid.cells) - 1)]

    def set_filter(self, text: str) -> None:
        """Dim the cells that do not match (rank number, state, or coordinate like "pp1")."""
        self._filter = text.strip().lower()
        hits = [i for i, c in enumerate(self.grid.cells) if self._match(c)] if self.grid else []
        if self._filter and hits and self.cursor not in hits:
            self.cursor = hits[0]
        self.refresh()

    def _match(self, cell: RankCell) -> bool:
        f = self._filter
        if not f:
            return True
        if f.isdigit():
            return cell.rank == int(f)
        hay = f"{cell.state} {STATE_LABEL[cell.state]} {cell.coords} {cell.note} {'root' if cell.root else ''}"
        return all(word in hay.lower() for word in f.split())

    # ---- geometry ----------------------------------------------------------
    def _label_w(self) -> int:
        g = self.grid
        return (max((len(s) for s in g.row_labels), default=0) + 1) if g else 0

    def _cell_w(self) -> int:
        g = self.grid
        if g is None or g.compact:
            return 1
        return len(str(max(len(g.cells) - 1, 0))) + 3    # mark, rank, glyph, gap

    def _header_lines(self) -> int:
        return 1 if self.grid is not None and any(self.grid.col_labels) else 0

    def get_content_width(self, container, viewport) -> int:  # type: ignore[override]
        g = self.grid
        return self._label_w() + (g.cols * self._cell_w() if g else 10)

    def get_content_height(self, container, viewport, width: int) -> int:  # type: ignore[override]
        return (self.grid.rows if self.grid else 1) + self._header_lines()

    # ---- rendering ---------------------------------------------------------
    def _style(self, name: str) -> Style:
        return self.get_component_rich_style(f"rankgrid--{name}", partial=True)

    def render(self) -> Text:
        g = self.grid
        if g is None:
            return Text("loading ranks…")
        lw, cw = self._label_w(), self._cell_w()
        digits = max(cw - 3, 1)
        out = Text(no_wrap=True, overflow="crop")
        label_style = self._style("label")
        if self._header_lines():
            out.append(" " * lw)
            for lab in g.col_labels:
                out.append(f"{lab:^{cw - 1}.{cw - 1}} ", style=label_style)
            out.append("\n")
        styles = {s: self._style(s) for s in STATES}
        root_style, cursor_style, dim = self._style("root"), self._style("cursor"), self._style("dim")
        cur = self.cursor
        focused = self.has_focus
        for row in range(g.rows):
            out.append(f"{g.row_labels[row]:<{lw}}" if row < len(g.row_labels) else " " * lw, style=label_style)
            for col in range(g.cols):
                i = self._at.get((row, col))
                if i is None:
                    out.append(" " * cw)
                    continue
                c = g.cells[i]
                style = styles[c.state]
                if c.root:
                    style = style + root_style
                if self._filter and not self._match(c):
                    style = dim
                if i == cur:
                    style = style + cursor_style if focused else style + Style(underline=True)
                if g.compact:
                    out.append(ROOT_MARK if c.root else (GLYPH[c.state].strip() or "·"), style=style)
                else:
                    mark = ROOT_MARK if c.root else " "
                    out.append(f"{mark}{c.rank:>{digits}}{GLYPH[c.state]}", style=style)
                    out.append(" ")
            if row < g.rows - 1:
                out.append("\n")
        return out

    def legend(self) -> Text:
        """Coloured key of the states (used by the grid screen under the grid)."""
        t = Text(no_wrap=True, overflow="ellipsis")
        for s in STATES:
            if s == "unknown":
                continue
            t.append(f" {GLYPH[s]} ", style=self._style(s))
            t.append(f"{STATE_LABEL[s]} ")
        t.append(f" {ROOT_MARK} ", style=self._style("root"))
        t.append("root cause")
        return t

    # ---- interaction -------------------------------------------------------
    def watch_cursor(self, old: int, new: int) -> None:
        if self.current is not None:
            self.post_message(self.Highlighted(self.current))
        self.refresh()

    def on_focus(self) -> None:
        self.refresh()

    def on_blur(self) -> None:
        self.refresh()

    def action_move(self, dx: int, dy: int) -> None:
        c = self.current
        g = self.grid
        if c is None or g is None:
            return
        row, col = c.row + dy, c.col + dx
        self._placed = True
        if (row, col) in self._at:
            self.cursor = self._at[(row, col)]
        elif g.compact and dx:
            self.cursor = max(0, min(len(g.cells) - 1, self.cursor + dx))

    def action_open(self) -> None:
        if self.current is not None:
            self.post_message(self.Selected(self.current.rank))

    def on_click(self, event: Click) -> None:
        if self.grid is None:
            return
        row = event.y - self._header_lines()
        col = (event.x - self._label_w()) // self._cell_w()
        i = self._at.get((row, col))
        if i is None:
            return
        self.cursor = i
        self._placed = True
        if event.chain >= 2:
            self.action_open()
