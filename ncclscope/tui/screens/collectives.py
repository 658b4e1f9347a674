"""Collectives: for one process group, who arrived at which collective and who never did.

Collectives pair by per-group sequence number, so the natural picture of a
collective hang is a sequence x member matrix: every member has a ✓ up to
some #k, then the waiters show T (timed out) or … (in flight) and the culprit
shows — (never arrived). Below it, point-to-point pairs matched by
(src, dst, tag, p2p sequence), unmatched ones first: a recv nobody sends is
how pipeline schedules hang.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd
from rich.text import Text
from textual.app import ComposeResult
from textual.containers import Horizontal, Vertical
from textual.widgets import DataTable, OptionList, Static
from textual.widgets.option_list import Option

from ncclscope.index.labels import fmt_ranks
from ncclscope.tui.frame import plain
from ncclscope.tui.presenters import CollMatrix, P2PRow
from ncclscope.load.trace import Trace
from ncclscope.tui.widgets.tables import GroupList

MAX_SEQS = 200
MAX_P2P = 500
# The runtime's clock alignment (runtime/telemetry.py measure_clock_offsets) is a ping-pong of traced
# send/recv on the world group with this tag, before step 0: bookkeeping, not the job's p2p traffic.
CLOCK_SYNC_TAG = 7
CLOCK_SYNC_GROUP = "world"
CELL = {"ok": ("✓", "green"), "inflight": ("…", "yellow"), "suspect": ("?", "bold yellow"),
        "timeout": ("T", "bold red"), "error": ("E", "bold red"), "missing": ("—", "bold white on red")}


def group_list(trace: Trace) -> list[tuple[str, int, bool]]:
    """(group, number of collectives, incomplete?) for groups with collectives; incomplete first."""
    ops = trace.ops
    if not len(ops):
        return []
    coll = ops[(ops["kind"] == "collective").to_numpy() & (ops["collective_seq_id"] >= 0).to_numpy()]
    if not len(coll):
        return []
    df = pd.DataFrame({"g": plain(coll["process_group"]), "seq": coll["collective_seq_id"].to_numpy(),
                       "rank": coll["rank"].to_numpy(), "ok": (plain(coll["status"]) == "ok").to_numpy()})
    df = df[df["g"] != ""]
    members = trace.group_members()
    size = df["g"].map(lambda g: len(members.get(g, ())) or 1)
    inst = df.assign(size=size).groupby(["g", "seq"]).agg(n=("rank", "nunique"), ok=("ok", "all"),
                                                          size=("size", "first"))
    inst["bad"] = ~inst["ok"] | (inst["n"] < inst["size"])
    per = inst.groupby(level="g").agg(n_seq=("n", "size"), bad=("bad", "any"))
    per = per.sort_values(["bad", "n_seq"], ascending=[False, False], kind="stable")
    return [(str(g), int(r.n_seq), bool(r.bad)) for g, r in per.iterrows()]


def build_matrix(trace: Trace, group: str) -> CollMatrix:
    """Seq x member status matrix of `group` (the latest MAX_SEQS instances)."""
    ops = trace.ops
    mask = (ops["kind"] == "collective").to_numpy() & (plain(ops["process_group"]) == group).to_numpy()
    coll = ops.loc[mask & (ops["collective_seq_id"] >= 0).to_numpy(),
                   ["rank", "op_id", "collective_seq_id", "op_name", "status"]]
    members = list(trace.group_members().get(group) or sorted(int(r) for r in coll["rank"].unique()))
    seqs = sorted(int(s) for s in coll["collective_seq_id"].unique())
    hidden = max(0, len(seqs) - MAX_SEQS)
    seqs = seqs[hidden:]
    coll = coll[coll["collective_seq_id"].isin(seqs)].assign(status=lambda d: plain(d["status"]),
                                                              op_name=lambda d: plain(d["op_name"]))
    ev = trace.events
    sus = ev[(ev["status"] == "suspect").to_numpy()][["rank", "op_id"]].assign(sus=True)
    if len(sus):
        coll = coll.merge(sus.drop_duplicates(), on=["rank", "op_id"], how="left")
        coll["status"] = np.where(coll["sus"].eq(True) & (coll["status"] == "inflight"), "suspect", coll["status"])
    last = coll.drop_duplicates(["collective_seq_id", "rank"], keep="last")
    grid = last.pivot(index="collective_seq_id", columns="rank", values="status").reindex(
        index=seqs, columns=members).fillna("missing")
    names = (coll.groupby(["collective_seq_id", "op_name"]).size().reset_index(name="n")
                 .sort_values("n", ascending=False).drop_duplicates("collective_seq_id")
                 .set_index("collective_seq_id")["op_name"].reindex(seqs).fillna(""))
    cells = grid.to_numpy(dtype=object)
    bad = np.flatnonzero((cells != "ok").any(axis=1)) if len(cells) else np.array([], dtype=int)
    return CollMatrix(group=group, members=members, seqs=seqs, ops=[str(x) for x in names],
                        cells=[list(map(str, row)) for row in cells], first_bad=int(bad[0]) if len(bad) else -1,
                        hidden=hidden)


def clock_sync_mask(pairs: pd.DataFrame) -> pd.Series:
    """Pairs that are the clock-sync ping-pong (world group, its tag, no step on either side)."""
    step = pairs["send_step"].fillna(pairs["recv_step"]).fillna(-1)
    rstep = pairs["recv_step"].fillna(pairs["send_step"]).fillna(-1)
    group = pairs["send_process_group"].astype(object).where(pairs["send_process_group"].notna(),
                                                              pairs["recv_process_group"]).astype(str)
    return (pairs["tag"] == CLOCK_SYNC_TAG) & (step < 0) & (rstep < 0) & (group == CLOCK_SYNC_GROUP)


def build_p2p(trace: Trace, tables: dict[str, Any] | None = None) -> tuple[list[P2PRow], int]:
    """Send/recv pairs, unmatched and unfinished first (from the diagnosis when it has them), without the
    clock-sync pings; returns (rows, number of clock-sync pairs hidden)."""
    pairs = (tables or {}).get("p2p_pairs")
    if pairs is None:
        try:
            try:
                from ncclscope.index.p2p_pairs import match_p2p, p2p_ops
            except ImportError:      # before the pairing moved out of p2p.py
                from ncclscope.hang.p2p import match_p2p, p2p_ops
            pairs = match_p2p(p2p_ops(trace.ops)) if len(trace.ops) else None
        except Exception:   # the p2p analysis is optional for this view
            pairs = None
    if pairs is None or not len(pairs):
        return [], 0
    sync = clock_sync_mask(pairs).to_numpy()
    pairs = pairs[~sync]
    if not len(pairs):
        return [], int(sync.sum())
    send = pairs["send_status"].astype(object).where(pairs["send_status"].notna(), "—").astype(str)
    recv = pairs["recv_status"].astype(object).where(pairs["recv_status"].notna(), "—").astype(str)
    rank = (pairs["state"] != "matched").astype(int) * 2 + ((send != "ok") | (recv != "ok")).astype(int)
    order = pairs.assign(_r=rank.to_numpy(), send=send, recv=recv).sort_values(
        ["_r", "src", "dst", "seq"], ascending=[False, True, True, True], kind="stable").head(MAX_P2P)
    step = order["send_step"].fillna(order["recv_step"]).fillna(-1).astype(int)
    mb = order["send_microbatch"].fillna(order["recv_microbatch"]).fillna(-1).astype(int)
    where = ("step " + step.astype(str)).where(step >= 0, "") + (" mb " + mb.astype(str)).where(mb >= 0, "")
    return [P2PRow(src=int(r.src), dst=int(r.dst), tag=int(r.tag), seq=int(r.seq), send=r.send, recv=r.recv,
                     state=str(r.state), where=w) for r, w in zip(order.itertuples(index=False), where)], int(sync.sum())


class CollectivesView(Vertical):
    """Group list | seq x member matrix; p2p pairs below."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.group = ""
        self.matrix: CollMatrix | None = None
        self._groups: list[tuple[str, int, bool]] = []
        self._filter = ""

    def compose(self) -> ComposeResult:
        with Horizontal(id="co-top"):
            yield GroupList(id="co-groups")
            with Vertical(id="co-right"):
                yield Static(id="co-title")
                yield DataTable(id="co-matrix", cursor_type="row")
        yield DataTable(id="co-p2p", cursor_type="row")

    def show(self, trace: Trace, preferred: str, tables: dict[str, Any] | None) -> None:
        """(Re)build the view; keeps the chosen group unless it vanished."""
        self._trace = trace
        self._groups = group_list(trace)
        names = [g for g, _, _ in self._groups]
        if self.group not in names:
            self.group = preferred if preferred in names else (names[0] if names else "")
        self._fill_groups()
        self._show_group()
        self._fill_p2p(*build_p2p(trace, tables))

    def _shown_groups(self) -> list[tuple[str, int, bool]]:
        return [(g, n, bad) for g, n, bad in self._groups if not self._filter or self._filter in g.lower()]

    def _fill_groups(self) -> None:
        ol = self.query_one("#co-groups", OptionList)
        ol.clear_options()
        shown = self._shown_groups()
        ol.add_options([Option(Text.assemble((("! " if bad else "  ")), (g, "bold red" if bad else ""),
                                             (f" {n}", "dim")), id=g) for g, n, bad in shown])
        for i, (g, _, _) in enumerate(shown):
            if g == self.group:
                ol.highlighted = i
        ol.border_title = "groups"

    def _show_group(self) -> None:
        table = self.query_one("#co-matrix", DataTable)
        table.clear(columns=True)
        title = self.query_one("#co-title", Static)
        if not self.group:
            title.update(Text(f"no group matches the filter {self._filter!r}" if self._filter and self._groups
                              else "no collectives recorded"))
            self.matrix = None
            return
        mx = build_matrix(self._trace, self.group)
        self.matrix = mx
        missing = sum(row.count("missing") for row in mx.cells)
        t = Text()
        t.append(f"{self.group}", style="bold")
        t.append(f" [{fmt_ranks(mx.members)}] · {len(mx.seqs)} collective{'s' if len(mx.seqs) != 1 else ''}")
        if mx.first_bad >= 0:
            k = mx.seqs[mx.first_bad]
            absent = [m for m, c in zip(mx.members, mx.cells[mx.first_bad]) if c == "missing"]
            t.append(f" · first incomplete #{k}", style="bold red")
            if absent:
                t.append(f": never arrived: rank {fmt_ranks(absent)}", style="bold red")
        elif missing == 0:
            t.append(" · all complete", style="green")
        title.update(t)
        table.add_column("#", key="seq", width=5)
        table.add_column("op", key="op", width=max([len(o) for o in mx.ops] + [6]))
        for m in mx.members[:256]:
            table.add_column(f"r{m}", key=f"r{m}")
        for seq, op, row in zip(mx.seqs, mx.ops, mx.cells):
            cells = [Text(CELL[c][0] if c in CELL else c[:1], style=CELL.get(c, ("", ""))[1]) for c in row[:256]]
            table.add_row(str(seq), Text(op), *cells, key=str(seq))
        if mx.seqs:
            table.move_cursor(row=mx.first_bad if mx.first_bad >= 0 else len(mx.seqs) - 1)

    def _fill_p2p(self, rows: list[P2PRow], sync: int = 0) -> None:
        table = self.query_one("#co-p2p", DataTable)
        table.clear(columns=True)
        for label in ("src→dst", "tag", "seq", "send", "recv", "state", "where"):
            table.add_column(label, key=label)
        style = {"matched": "green", "send_only": "bold red", "recv_only": "bold red"}
        for r in rows:
            table.add_row(f"{r.src}→{r.dst}", r.tag, r.seq, Text(r.send, style=CELL.get(r.send, ("", ""))[1]),
                          Text(r.recv, style=CELL.get(r.recv, ("", ""))[1]),
                          Text(r.state, style=style.get(r.state, "")), r.where)
        bad = sum(1 for r in rows if r.state != "matched")
        table.border_title = ((f"p2p pairs: {len(rows)}" + (f", {bad} unmatched" if bad else "")) if rows
                              else "p2p: none recorded") + (f" ({sync} clock-sync pings hidden)" if sync else "")

    def on_option_list_option_selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        self.group = str(event.option.id)
        self._show_group()

    def on_option_list_option_highlighted(self, event: OptionList.OptionHighlighted) -> None:
        event.stop()
        if str(event.option.id) != self.group:
            self.group = str(event.option.id)
            self._show_group()

    def set_filter(self, text: str) -> None:
        """Narrow the group list, and show the first matching group's matrix when the one on show is hidden."""
        self._filter = text.strip().lower()
        names = [g for g, _, _ in self._shown_groups()]
        if self.group not in names:
            self.group = names[0] if names else ""
            if hasattr(self, "_trace"):
                self._show_group()
        self._fill_groups()
