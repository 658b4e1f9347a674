"""Hand-build a `Trace` for tests, without a run directory or torch.

Analyses take a `Trace`; writing Arrow files to build one per test case is
slow and hides the case in boilerplate. `TraceBuilder` lets a test state a
scenario op by op, in seconds, and produces exactly what `ncclscope.load.trace.load`
would (begin/end rows in `schema.EVENTS_SCHEMA`, group views as in rank.json,
RankInfo per rank), through the same `ncclscope.load.trace.assemble`:

    b = TraceBuilder(4, groups={"dp0": [0, 1], "dp1": [2, 3]})
    b.collective(0, "dp0", 1, start=1.0, end=1.1)          # ok
    b.collective(1, "dp0", 1, start=1.0)                   # inflight: no end row
    b.p2p(2, "send", peer=3, seq=1, start=2.0, end=2.5, status="timeout")
    b.compute(3, "backward", start=2.0)                    # still computing
    b.heartbeats(3, 0.0, 10.0)                             # one per second
    b.rank_state(1, signal="SIGKILL")
    trace = b.build()

Times are seconds from the builder's origin (`t0_ns`). An op with `end=None`
has no end row (status "inflight" after loading) whatever `status` says.

Large synthetic traces should not go through per-op calls: build the event
columns with numpy and pass them to `add_events` (missing columns get the
schema's defaults: -1 for integers, "" for strings).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

import numpy as np
import pandas as pd
import pyarrow as pa

from ncclscope import schema as S
from ncclscope.load.trace import RankInfo, RunInfo, Tables, Trace, assemble

NS = 1_000_000_000
REDUCING_OPS = frozenset({"all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor"})
_INT_DEFAULT = -1


def _default(dtype: pa.DataType) -> Any:
    return _INT_DEFAULT if pa.types.is_integer(dtype) else ""


def events_table(columns: Mapping[str, Any] | pd.DataFrame) -> pa.Table:
    """Arrow table in EVENTS_SCHEMA from whatever columns are given.

    Accepts a DataFrame or a mapping of column name -> array/list/scalar
    (scalars are broadcast). Missing columns and nulls are filled with the
    schema defaults (-1 for integers, "" for strings).
    """
    df = columns if isinstance(columns, pd.DataFrame) else pd.DataFrame(dict(columns))
    n = len(df)
    arrays = []
    for name, dtype in S.EVENT_FIELDS:
        if name not in df.columns:
            value = pa.array(np.full(n, -1, dtype=np.int64)).cast(dtype) if pa.types.is_integer(dtype) \
                else pa.array(np.full(n, "", dtype=object), type=dtype)
        elif pa.types.is_integer(dtype):
            value = pa.array(df[name].fillna(-1).to_numpy(dtype=np.int64)).cast(dtype)
        elif isinstance(df[name].dtype, pd.CategoricalDtype):     # fast path for big synthetic traces
            value = pa.Array.from_pandas(df[name]).cast(dtype).fill_null("")
        else:
            value = pa.Array.from_pandas(df[name].astype("str").fillna(""), type=dtype)
        arrays.append(value)
    return pa.Table.from_arrays(arrays, schema=S.EVENTS_SCHEMA)


class TraceBuilder:
    """Collects ops, heartbeats, group views and rank end states; `build()` makes the Trace.

    `groups` maps group name -> member ranks; every present rank gets the same
    view (creation order = position in the dict) unless `group_view` overrides
    it. `group_kinds` maps name -> kind; by default the kind is the name
    without trailing digits when that is a known kind ("dp1" -> "dp"), else
    "custom".
    """

    def __init__(self, world_size: int, groups: Mapping[str, list[int]] | None = None,
                 group_kinds: Mapping[str, str] | None = None, t0_ns: int = 1_700_000_000 * NS,
                 coords: Mapping[int, Mapping[str, int]] | None = None) -> None:
        self.world_size = world_size
        self.groups: dict[str, list[int]] = {k: list(v) for k, v in (groups or {}).items()}
        self.group_kinds = dict(group_kinds or {})
        self.t0_ns = t0_ns
        self._rows: list[dict[str, Any]] = []
        self._tables: list[pa.Table] = []
        self._next_op = [0] * world_size
        self._ranks = {r: RankInfo(rank=r, present=True, coords=dict((coords or {}).get(r, {})))
                       for r in range(world_size)}
        self._views: dict[tuple[int, str], dict[str, Any]] = {}
        self._stacks: dict[int, str] = {}
        self.run: dict[str, Any] = {"world_size": world_size}

    # ---- helpers -----------------------------------------------------------
    def ns(self, seconds: float) -> int:
        """Builder seconds -> absolute ns (the `time_ns` column)."""
        return self.t0_ns + int(round(seconds * NS))

    def _op_id(self, rank: int) -> int:
        self._next_op[rank] += 1
        return self._next_op[rank]

    def _op(self, rank: int, kind: str, op_name: str, start: float, end: float | None,
            status: str, **fields: Any) -> int:
        op_id = self._op_id(rank)
        base = {"rank": rank, "op_id": op_id, "kind": kind, "op_name": op_name, **fields}
        self._rows.append({**base, "phase": S.PHASE_BEGIN, "time_ns": self.ns(start), "status": ""})
        if end is not None and status != "inflight":
            self._rows.append({**base, "phase": S.PHASE_END, "time_ns": self.ns(end), "status": status,
                               "message": fields.get("message", "")})
        return op_id

    # ---- ops ---------------------------------------------------------------
    def collective(self, rank: int, group: str, seq: int, op: str = "all_reduce", start: float = 0.0,
                   end: float | None = None, status: str = "ok", sizes: str = "[[4]]",
                   dtype: str = "float32", reduce_op: str | None = None, call_site: str = "train.py:10",
                   step: int = 0, microbatch: int = -1, stage: int = -1, nbytes: int = 16,
                   peer: int = -1, message: str = "", timeout_ms: int = 10_000) -> int:
        """One collective op; returns its op_id. `end=None` leaves it inflight.

        `reduce_op` defaults to "sum" for reducing ops (all_reduce, reduce,
        reduce_scatter*) and "" for the others.
        """
        if reduce_op is None:
            reduce_op = "sum" if op in REDUCING_OPS else ""
        return self._op(rank, S.KIND_COLLECTIVE, op, start, end, status, process_group=group,
                        collective_seq_id=seq, input_sizes=sizes, input_dtypes=dtype, reduce_op=reduce_op,
                        call_site=call_site, step=step, microbatch=microbatch, stage=stage, bytes=nbytes,
                        peer=peer, message=message, timeout_ms=timeout_ms)

    def p2p(self, rank: int, op: str, peer: int, seq: int, start: float = 0.0, end: float | None = None,
            status: str = "ok", tag: int = 0, group: str = "", sizes: str = "[[4]]", dtype: str = "float32",
            call_site: str = "pipeline.py:20", step: int = 0, microbatch: int = -1, stage: int = -1,
            nbytes: int = 16, message: str = "", timeout_ms: int = 10_000) -> int:
        """One send/recv/isend/irecv with `peer` (global rank) and per-peer sequence `seq`."""
        return self._op(rank, S.KIND_P2P, op, start, end, status, process_group=group, p2p_seq_id=seq,
                        peer=peer, tag=tag, input_sizes=sizes, input_dtypes=dtype, call_site=call_site,
                        step=step, microbatch=microbatch, stage=stage, bytes=nbytes, message=message,
                        timeout_ms=timeout_ms)

    def compute(self, rank: int, name: str, start: float = 0.0, end: float | None = None,
                status: str = "ok", step: int = 0, microbatch: int = -1, stage: int = -1) -> int:
        """A compute span (forward, backward, optimizer...); `end=None` = still computing."""
        return self._op(rank, S.KIND_COMPUTE, name, start, end, status, step=step, microbatch=microbatch,
                        stage=stage)

    def marker(self, rank: int, name: str, t: float, message: str = "", step: int = -1) -> None:
        self._rows.append({"rank": rank, "op_id": self._op_id(rank), "phase": S.PHASE_INSTANT,
                           "time_ns": self.ns(t), "kind": S.KIND_MARKER, "op_name": name,
                           "message": message, "step": step})

    def heartbeat(self, rank: int, t: float) -> None:
        self.marker(rank, S.HEARTBEAT, t)

    def heartbeats(self, rank: int, start: float, stop: float, every: float = 1.0) -> None:
        """Heartbeats at start, start+every, ... up to and including stop."""
        for t in np.arange(start, stop + every / 2, every):
            self.heartbeat(rank, float(t))

    def add_events(self, columns: Mapping[str, Any] | pd.DataFrame) -> None:
        """Append raw event rows (vectorised path for big traces); see `events_table`."""
        self._tables.append(events_table(columns))

    # ---- ranks, groups, stacks ---------------------------------------------
    def rank_state(self, rank: int, exitcode: int | None = None, signal: str | None = None,
                   present: bool = True, end_status: str = "", end_message: str = "",
                   coords: Mapping[str, int] | None = None, stopped_by_launcher: bool = False) -> None:
        """How the rank ended. `present=False` = its directory is missing (its events are dropped);
        `stopped_by_launcher` = the launcher signalled it at the end of the job (not a death)."""
        info = self._ranks[rank]
        info.present, info.exitcode, info.signal = present, exitcode, signal
        info.stopped_by_launcher = stopped_by_launcher
        info.end_status, info.end_message = end_status, end_message
        if coords is not None:
            info.coords = dict(coords)

    def coords(self, rank: int, **coords: int) -> None:
        self._ranks[rank].coords = dict(coords)

    def group_view(self, rank: int, name: str, ranks: list[int], creation_order: int | None = None,
                   kind: str | None = None) -> None:
        """Override what `rank` recorded for group `name` (for group_mismatch cases)."""
        self._views[(rank, name)] = {"ranks": list(ranks), "creation_order": creation_order, "kind": kind}

    def stacks(self, rank: int, text: str) -> None:
        self._stacks[rank] = text

    def _kind(self, name: str) -> str:
        if name in self.group_kinds:
            return self.group_kinds[name]
        base = name.rstrip("0123456789")
        return base if base in S.GROUP_KINDS else "custom"

    def _group_rows(self) -> list[dict[str, Any]]:
        rows = []
        for r, info in self._ranks.items():
            if not info.present:
                continue
            names = list(self.groups) + [n for (vr, n) in self._views if vr == r and n not in self.groups]
            for order, name in enumerate(names):
                view = self._views.get((r, name), {})
                rows.append({
                    "rank": r, "process_group": name,
                    "group_kind": view.get("kind") or self._kind(name),
                    "ranks": list(view.get("ranks", self.groups.get(name, []))),
                    "creation_order": view["creation_order"] if view.get("creation_order") is not None else order,
                    "backend": "gloo",
                })
        return rows

    def build(self) -> Trace:
        """Assemble the Trace exactly as the loader would."""
        tables = list(self._tables)
        if self._rows:
            tables.append(events_table(pd.DataFrame(self._rows)))
        present = np.array([info.present for _, info in sorted(self._ranks.items())])
        kept = []
        for t in tables:
            ranks = t.column("rank").to_numpy()
            mask = present[np.clip(ranks, 0, self.world_size - 1)] & (ranks >= 0) & (ranks < self.world_size)
            kept.append(t.filter(pa.array(mask)))
        run = dict(self.run)
        run["ranks"] = {str(r): {"exitcode": i.exitcode, "signal": i.signal} for r, i in self._ranks.items()}
        ranks = {r: RankInfo(**vars(i)) for r, i in self._ranks.items()}
        stacks = {r: s for r, s in self._stacks.items() if ranks[r].present}
        return assemble(Path("<built>"), RunInfo.from_dict(run), self.world_size, ranks,
                        Tables(events=kept, group_rows=self._group_rows(), stacks=stacks, warnings=[]))
