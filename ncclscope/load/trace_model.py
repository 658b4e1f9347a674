"""The loaded trace's types: what is known of each rank (`RankInfo`) and the tables of a run (`Trace`).

Split out of trace.py (the run-directory loader) so that the loader stays one idea; every reader of any
format (load/foreign/, the engine's merge) builds these. `load.trace` re-exports both names.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from ncclscope import schema as S
from ncclscope.load.groupviews import GroupViews
from ncclscope.load.opsjoin import marks_of
from ncclscope.load.run_info import RunInfo


@dataclass
class RankInfo:
    """What is known about one rank, from rank.json and run.json."""

    rank: int
    present: bool = False                  # its directory exists
    host: str = ""
    pid: int = -1
    device: str = ""
    clock_offset_ns: int = 0               # add to local time to get rank 0's time
    clock_uncertainty_ns: int = 0
    host_cpus: int = 0                     # cores the rank's process could use (0: not recorded)
    coords: dict[str, int] = field(default_factory=dict)   # tp/cp/dp/pp/ep index
    end_status: str = ""                   # rank.json "end": ok | error | "" (never ended)
    end_message: str = ""
    exitcode: int | None = None            # from run.json (launcher); None if unknown
    signal: str | None = None              # e.g. "SIGKILL" when killed by a signal
    stopped_by_launcher: bool = False      # still running when the launcher ended the job
    call_sites: dict[str, tuple[str, int]] = field(default_factory=dict)   # site -> (function, def line): rank.json
    cwd: str = ""                          # the process's working directory (relative call sites are in it)
    group_sites: dict[str, str] = field(default_factory=dict)   # group -> the line that created it (usertrace)
    group_ids: dict[str, int] = field(default_factory=dict)     # group -> its FR pg_id here (docs/ingest.md)

    @property
    def died(self) -> bool:
        """A signal or an error ended the process (state killed or failed), not the launcher's stop."""
        return self.state in ("killed", "failed")

    @property
    def state(self) -> str:
        """finished | failed | killed | stopped | unknown | missing: how the process ended.

        "stopped" means the rank was still alive (hung or waiting) when the
        launcher (or torchrun's agent, or a scheduler's SIGTERM) ended the job;
        "killed" means a signal ended it first."""
        if not self.present:
            return "missing"
        if self.signal and not self.stopped_by_launcher:
            return "killed"
        terminated = self.end_status == "error" and self.end_message == S.END_TERMINATED
        if self.stopped_by_launcher or terminated:
            # SIGTERM's evidence path ended it: the job was being stopped (after another rank's
            # failure, or by a scheduler), which is not a failure of this rank's own
            return "failed" if self.end_status == "error" and not terminated else "stopped"
        if self.exitcode is not None and self.exitcode != 0:
            return "failed"
        if self.end_status == "ok" or self.exitcode == 0:
            return "finished"
        if self.end_status == "error":
            return "failed"
        return "unknown"


@dataclass
class Trace:
    path: Path
    run: RunInfo                   # run.json (or what a foreign reader synthesized), typed: load/run_info.py
    world_size: int
    ranks: dict[int, RankInfo]
    events: pd.DataFrame
    ops: pd.DataFrame
    metrics: pd.DataFrame
    samples: pd.DataFrame
    groups: pd.DataFrame
    stacks: dict[int, str]
    warnings: list[str]
    group_views: "GroupViews | None" = None
    # an engine's driver keeps no begin/end rows and no samples (docs/scale.md): `events` then holds the
    # marks only, `samples` nothing, and (start_ns, end_ns) come with them; None: computed from the tables
    bounds_ns: tuple[int, int] | None = None
    rank_last_ns: "pd.Series | None" = None       # rank -> its last event's aligned time
    ops_only: bool = False
    # per-rank halves of analyses an engine's workers computed where they read the ranks ("utilization":
    # perf.utilization.UtilParts); an analysis without one here computes it from the tables
    partials: dict[str, Any] = field(default_factory=dict)

    @property
    def marks(self) -> pd.DataFrame:
        """The event rows that are neither an op's begin nor its end (instants: heartbeats, markers, dump
        times), index 0..n-1. Every analysis reads these, never `events`, so that a driver that holds the ops
        and the marks only (`ops_only`) answers as one holding every event."""
        if self.ops_only:
            return self.events
        key = (id(self.events), len(self.events))
        cached = self.__dict__.get("_marks")
        if cached is None or cached[0] != key:
            cached = self.__dict__["_marks"] = (key, marks_of(self.events))
        return cached[1]

    def last_event_ns(self) -> pd.Series:
        """Rank (int64 index) -> the aligned time of its last event of any kind; ranks without one absent."""
        if self.rank_last_ns is not None:
            return self.rank_last_ns
        ev = self.events
        last = ev.groupby("rank", observed=True)["t_ns"].max() if len(ev) else pd.Series(dtype="int64")
        last.index = last.index.astype("int64")
        return last

    @property
    def start_ns(self) -> int:
        """Earliest aligned time of any event (0 with none)."""
        if self.bounds_ns is not None:
            return self.bounds_ns[0]
        return int(self.events["t_ns"].min()) if len(self.events) else 0

    @property
    def present_ranks(self) -> list[int]:
        return sorted(r for r, info in self.ranks.items() if info.present)

    @property
    def end_ns(self) -> int:
        """Latest aligned time seen anywhere in the trace (the 'now' of a post-mortem)."""
        if self.bounds_ns is not None:
            return self.bounds_ns[1]
        t = int(self.events["t_ns"].max()) if len(self.events) else 0
        if len(self.samples):
            t = max(t, int(self.samples["time_ns"].max()))
        return t

    def group_members(self) -> dict[str, list[int]]:
        """Group name -> member ranks, taking the view most ranks agree on."""
        if self.group_views is not None:
            return self.group_views.majority()
        views = GroupViews()
        views.add_rows(self.groups.to_dict("records"))
        return views.majority()

    def last_heartbeat_ns(self) -> dict[int, int]:
        hb = self.marks[self.marks["op_name"] == S.HEARTBEAT]
        return {int(r): int(t) for r, t in hb.groupby("rank", observed=True)["t_ns"].max().items()}
