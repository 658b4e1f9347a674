"""The Trace of a followed run, built from the last poll's plus the appended batches (`--follow`).

`Follower.trace()` with `incremental=True` hands its state here. Per poll:

1. each rank's newly read batches (StreamTail.take_fresh) are converted and
   kept by table (follow_tables.LiveTable); a recreated file resets that rank;
2. the new events rows extend each rank's begin/end join (follow_ops.LiveOps):
   only new rows and still-open ops are looked at;
3. the frames (`events`, `metrics`, `samples`) are one concatenation per column
   in rank order, the times aligned with each rank's clock offset as `assemble`
   does, and `ops` is taken from `events` by the join's row numbers;
4. the index views that merge (follow_index.py) are extended from the last
   poll's and seeded into the new trace's index (`index.seed_index`).

The result equals `trace.assemble` over everything read (tests/test_follow_incremental.py).
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from ncclscope import schema as S
from ncclscope.index.views import seed_index
from ncclscope.load.columns import aligned_times, fill_ints, force_rank
from ncclscope.load.groupviews import GroupViews
from ncclscope.load.trace import RankInfo, Trace
from ncclscope.tui.follow_index import IndexState, extend
from ncclscope.tui.follow_ops import LiveOps, phase_codes
from ncclscope.tui.follow_tables import LiveTable

TABLES = (S.EVENTS_FILE, S.METRICS_FILE, S.SAMPLES_FILE)


class LiveTrace:
    """What the follower keeps between polls: converted tables, ops joins, index views."""

    def __init__(self) -> None:
        self.tables = {name: LiveTable(S.TABLE_SCHEMAS[name]) for name in TABLES}
        self.ops = LiveOps()
        self.index: IndexState | None = None
        self.generations: dict[tuple[int, str], int] = {}
        self.conform_warnings: dict[str, list[str]] = {}
        self.offsets: dict[int, int] = {}
        self.timings: dict[str, Any] = {}

    def build(self, follower: Any, world: int, infos: dict[int, RankInfo], views: GroupViews,
              stacks: dict[int, str], warnings: list[str]) -> Trace:
        """This poll's Trace; `follower` is the `follow.Follower` (its `ranks`' stream tails, `root`, `run`)."""
        t0 = time.perf_counter()
        reset = False
        deltas: dict[str, dict[int, list]] = {name: {} for name in TABLES}
        for r, rk in sorted(follower.ranks.items()):
            for name in TABLES:
                tail = rk.tails[name]
                seen = self.generations.get((r, name))
                if seen is not None and seen != tail.generation:     # the file was recreated: start over
                    self.tables[name].reset(r)
                    if name == S.EVENTS_FILE:
                        self.ops.reset(r)
                    reset = True
                self.generations[(r, name)] = tail.generation
                mine = self.conform_warnings.setdefault(str(tail.path), [])
                fresh = tail.take_fresh(mine)
                if fresh:
                    deltas[name][r] = [(force_rank(t, r), lengths) for t, lengths in fresh]
                warnings += mine
        new_events = self.tables[S.EVENTS_FILE].append(deltas[S.EVENTS_FILE])
        begin, end = phase_codes(self.tables[S.EVENTS_FILE].conv.cats["phase"])
        self.ops.begin_poll()
        for r, (first, cols) in new_events.items():
            self.ops.update(r, first, cols["phase"], cols["op_id"], cols["time_ns"], begin, end)
        self.ops.end_poll()
        for name in (S.METRICS_FILE, S.SAMPLES_FILE):
            self.tables[name].append(deltas[name])
        t1 = time.perf_counter()

        ranks = sorted(follower.ranks)
        offsets = {r: int(info.clock_offset_ns) for r, info in infos.items()}
        live = self.tables[S.EVENTS_FILE]
        events = fill_ints(live.frame(ranks), S.EVENTS_SCHEMA)
        events["t_ns"] = aligned_times(events["time_ns"].to_numpy(), events["rank"].to_numpy(), offsets)
        metrics = fill_ints(self.tables[S.METRICS_FILE].frame(ranks), S.METRICS_SCHEMA)
        samples = fill_ints(self.tables[S.SAMPLES_FILE].frame(ranks), S.SAMPLES_SCHEMA)
        if len(samples):
            samples["time_ns"] = aligned_times(samples["time_ns"].to_numpy(), samples["rank"].to_numpy(), offsets)
        if len(metrics):
            metrics["time_ns"] = aligned_times(metrics["time_ns"].to_numpy(), metrics["rank"].to_numpy(), offsets)
        bases, at = {}, 0
        for r in ranks:
            n = live.rows(r)
            if n:
                bases[r] = at
                at += n
        ops, uid = self.ops.ops_frame(events, bases)
        trace = Trace(group_views=views, path=Path(follower.root), run=follower.run, world_size=world,
                      ranks=dict(sorted(infos.items())), events=events, ops=ops, metrics=metrics, samples=samples,
                      groups=views.table(), stacks=stacks or {}, warnings=warnings)
        t2 = time.perf_counter()

        # a rank's clock offset moves all its times: only ranks with rows already read matter
        same_clock = all(offsets.get(r, 0) == off for r, off in self.offsets.items())
        mergeable = not reset and same_clock and self.ops.ordered
        self.offsets = {r: offsets.get(r, 0) for r in bases}
        self.index = extend(self.index, ops, uid, self.ops.changed, mergeable)
        seed_index(trace, self.index.views)
        t3 = time.perf_counter()
        self.timings = {"read_s": t1 - t0, "tables_s": t2 - t1, "index_s": t3 - t2, "full_index": self.index.full,
                        "why_full": self.index.reason,
                        "changed_ops": int(len(self.ops.changed)), "ops": int(len(ops))}
        return trace

