"""Rank grid screen: every rank at a glance, laid out by the mesh.

The grid answers "is it one rank, one pipeline stage, one dp replica?" at a
glance: a hang in pp stage 1 is a coloured row, a dead node a block. The
line under it describes the rank under the cursor; Enter opens it.
"""
from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import ScrollableContainer, Vertical
from textual.widgets import Static

from ncclscope.tui.presenters import STATE_LABEL, STATES, RunModel
from ncclscope.tui.widgets.rank_grid import RankGrid


class RanksView(Vertical):
    def compose(self) -> ComposeResult:
        yield Static(id="rg-summary")
        with ScrollableContainer(id="rg-box"):
            yield RankGrid(id="rg-grid")
        yield Static(id="rg-cell")
        yield Static(id="rg-legend")

    def show_model(self, model: RunModel) -> None:
        grid = self.query_one(RankGrid)
        grid.set_grid(model.grid)
        counts = model.grid.counts
        t = Text()
        t.append(f"{model.world_size} ranks", style="bold")
        t.append(" · " + ", ".join(f"{counts[s]} {STATE_LABEL[s]}" for s in reversed(STATES) if counts.get(s)))
        if model.root_ranks:
            t.append(" · root cause: ", style="dim")
            t.append(", ".join(map(str, model.root_ranks[:8])), style="bold")
        self.query_one("#rg-summary", Static).update(t)
        self.query_one("#rg-legend", Static).update(grid.legend())

    def on_rank_grid_highlighted(self, event: RankGrid.Highlighted) -> None:
        c = event.cell
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append(f"rank {c.rank}", style="bold")
        if c.coords:
            t.append(f" {c.coords}")
        t.append(f" · {STATE_LABEL[c.state]}")
        if c.root:
            t.append(" · ROOT CAUSE", style="bold red")
        if c.note:
            t.append(f" · {c.note}", style="dim")
        self.query_one("#rg-cell", Static).update(t)

    def set_filter(self, text: str) -> None:
        self.query_one(RankGrid).set_filter(text)

    def focus_rank(self, rank: int) -> None:
        self.query_one(RankGrid).focus_rank(rank)
