"""Overview: run config, mesh, steps reached, end reason, the verdict and the findings.

The first screen a person sees, so it answers "what happened and whom do I
look at" in the top four lines; the findings table below is focused, with the
headline first, and Enter on a finding jumps to its root-cause rank (its ops
with the evidence op highlighted, and its stack).
"""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.message import Message
from textual.widgets import DataTable, Label, ProgressBar, Static

from ncclscope.tui.stacks import hide_own_frames
from ncclscope.tui.widgets.tables import OpenTable

from ncclscope.index.labels import fmt_ranks
from ncclscope.tui.presenters import FindingView, RunModel

SEVERITY_MARK = {"error": "E", "warning": "W", "info": "i"}


class OverviewView(Vertical):
    """Verdict + findings; posts `FindingChosen` on Enter."""

    class FindingChosen(Message):
        def __init__(self, finding: FindingView) -> None:
            super().__init__()
            self.finding = finding

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.model: RunModel | None = None
        self._shown: list[FindingView] = []
        self._filter = ""

    def compose(self) -> ComposeResult:
        with Horizontal(id="ov-loading"):
            yield Label("loading…", id="ov-loading-label")
            yield ProgressBar(total=None, show_eta=False, id="ov-progress")
        yield Static(id="ov-info")
        yield Static(id="ov-verdict")
        yield Static(id="ov-live")
        table: DataTable = OpenTable(id="ov-findings", cursor_type="row", zebra_stripes=False)
        table.add_column("sev", width=3, key="sev")
        table.add_column("kind", width=19, key="kind")
        table.add_column("ranks", width=5, key="ranks")
        table.add_column("finding", key="title")
        yield table
        with VerticalScroll(id="ov-detail-box"):
            yield Static(id="ov-detail")

    # ---- progress --------------------------------------------------------
    def set_progress(self, text: str, done: float | None, total: float | None) -> None:
        """Show the loading line; `text == ""` hides it (loading finished)."""
        box = self.query_one("#ov-loading")
        box.display = bool(text)
        if text:
            self.query_one("#ov-loading-label", Label).update(Text(text))
            self.query_one("#ov-progress", ProgressBar).update(total=total, progress=done or 0)

    # ---- data ------------------------------------------------------------
    def show_model(self, model: RunModel, live_note: str = "") -> None:
        """Every trace-derived string goes in as a `Text`: a gloo error with `[/path]` in it is not markup."""
        self.model = model
        info = Text(no_wrap=False)
        info.append("run ", style="dim")
        info.append(model.name, style="bold")
        info.append("  " + model.mesh_line + "\n")
        info.append("config ", style="dim")
        info.append(model.config_line + "\n")
        info.append(model.steps_line + " · " + model.end_line)
        if model.warnings:
            info.append(f"\n{len(model.warnings)} trace warning{'s' if len(model.warnings) != 1 else ''}: ",
                        style="dim")
            info.append(model.warnings[0], style="dim italic")
        self.query_one("#ov-info", Static).update(info)
        verdict = self.query_one("#ov-verdict", Static)
        verdict.update(Text(model.verdict))
        live = self.query_one("#ov-live", Static)
        live.display = bool(live_note)
        live.update(Text(live_note, style="dim italic"))
        for level in ("error", "warning", "ok", "pending", "info"):
            verdict.set_class(model.verdict_level == level, f"-{level}")
        self._fill_table()

    def _fill_table(self) -> None:
        table = self.query_one("#ov-findings", DataTable)
        keep = table.cursor_row if table.row_count else 0
        table.clear()
        f = self._filter
        self._shown = [x for x in (self.model.findings if self.model else [])
                       if not f or f in f"{x.kind} {x.title} {x.severity}".lower()]
        for fv in self._shown:
            sev = Text(SEVERITY_MARK.get(fv.severity, "?"), style=f"bold {_sev_color(fv.severity)}")
            kind = fv.kind + ("" if fv.role != "supporting" else " ·")
            table.add_row(sev, Text(kind), Text(fmt_ranks(fv.ranks) or "-"), Text(fv.title, no_wrap=True),
                          key=str(fv.index))
        total = len(self.model.findings) if self.model else 0
        table.border_title = f"findings: {len(self._shown)} of {total} shown (filter)" if f else ""
        if self._shown:
            table.move_cursor(row=min(keep, len(self._shown) - 1))
            self._show_detail(self._shown[table.cursor_row])
        else:
            empty = "no findings" if self.model and self.model.stage == "ready" else ""
            if f:
                empty = f"no finding matches the filter ({total} hidden; Esc clears it)"
            self.query_one("#ov-detail", Static).update(Text(empty))

    def set_filter(self, text: str) -> None:
        self._filter = text.strip().lower()
        self._fill_table()

    def _show_detail(self, fv: FindingView) -> None:
        t = Text()
        t.append(f"{fv.kind} ", style=f"bold {_sev_color(fv.severity)}")
        if fv.role:
            t.append(f"({fv.role}) ", style="dim")
        t.append(fv.title + "\n")
        if fv.ranks:
            t.append("root cause: ", style="dim")
            t.append(f"rank {fmt_ranks(fv.ranks)}", style="bold")
            t.append("  (Enter: open its ops and stack)\n", style="dim")
        for ev in fv.evidence[:12]:
            t.append("  • " + ev.describe() + "\n")
        if len(fv.evidence) > 12:
            t.append(f"  … {len(fv.evidence) - 12} more evidence rows\n", style="dim")
        if fv.stack:
            t.append("stack:\n", style="dim")
            t.append(hide_own_frames(fv.stack) + "\n")
        self.query_one("#ov-detail", Static).update(t)

    @property
    def current(self) -> FindingView | None:
        table = self.query_one("#ov-findings", DataTable)
        if not self._shown or not table.row_count:
            return None
        return self._shown[min(table.cursor_row, len(self._shown) - 1)]

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        if event.data_table.id == "ov-findings" and self.current is not None:
            self._show_detail(self.current)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if event.data_table.id == "ov-findings" and self.current is not None:
            event.stop()
            self.post_message(self.FindingChosen(self.current))


def _sev_color(severity: str) -> str:
    return {"error": "red", "warning": "yellow"}.get(severity, "cyan")
