"""The index: every derived view of a trace the analyses share, built once per trace.

    from ncclscope.load.trace import load
    from ncclscope.index.views import index_of
    trace = load("runs/b")
    ix = index_of(trace)                 # the same object on every call for this trace
    ix.group("dp1").members              # (1, 3, 5, 7); a wrong name raises IndexLookupError saying which exist
    ix.members["dp1"]                    # [1, 3, 5, 7]: name -> members, for vectorised merges
    ix.instances                         # one row per (group, seq): began / finished / first start
    ix.rank_state(5).role                # dead | blocked | computing | finished | idle
    ix.blocking                          # each live rank's blocking comm ops at the end

One flow, each stage once: load (tables) -> index (this) -> questions
(collectives, groups, p2p, wait-for graph; each reads the index) ->
`verdict.run` (the verdict). Before the index, each question re-derived the
collective table, membership and max-seq table, and `diagnose` threaded them
through by hand; now a view is computed the first time a question asks for it
(a `cached_property`) and reused by every later one, performance analyses
included (`stragglers.group_table` reads the membership here).

Views (typed where a face or test reads one item; DataFrames where the
questions merge over all of them):

- groups: `GroupInfo` per group, voted over the distinct recorded views
  (membership.py: never a ranks x groups expansion), plus groups seen in
  use but never recorded; `members`, `kinds`, `member_table`;
- collectives: `coll` (the collective rows), `instances`, `max_seq`, `missing`
  (absent members of unfinished instances);
- p2p: `p2p` (the p2p rows), `p2p_pairs` (sends outer-joined with recvs);
- ranks: `end` (`EndStates`: blocking ops, computing spans, rank states),
  `rank_state(r)` -> `RankState`;
- steps: `step_windows` (rank, step, first start, last end, ops) and `step_window(r, s)`.

The index is cached on the trace object and rebuilt only when the trace's
tables are replaced (each `--follow` poll builds a new Trace and seeds its index with the views it
extended from the last poll's: `seed_index`, tui/follow_index.py). It
holds the trace weakly: caching it on the trace makes no reference cycle, so
a dropped trace's tables are freed at once.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING, Union

import numpy as np
import pandas as pd

from ncclscope import schema as S
from ncclscope.index.dump_gaps import dump_gaps
from ncclscope.index.instances import collective_ops, instance_table, max_seq_table, member_table, missing_participants
from ncclscope.index.labels import fmt_ranks, group_label, trace_start_ns
from ncclscope.index.membership import GroupInfo, group_view_table, recorded_groups, used_groups
from ncclscope.index.p2p_pairs import match_p2p, p2p_ops
from ncclscope.index.rank_states import EndStates, end_states
from ncclscope.load.heap import trim

if TYPE_CHECKING:
    from ncclscope.load.trace import Trace

_ATTR = "_ncclscope_index"
MAX_NAMES = 12                 # names listed in an error sentence
BIG_OPS = 1_000_000            # ops from which freed heap is handed back to the OS after a stage


def release_heap(trace: "Trace | None") -> None:
    """Give the heap a big stage freed back to the OS (glibc keeps freed blocks of a few MB, so the working
    copies of one analysis would stay in the resident set under the next one's). A no-op on small traces."""
    ops = getattr(trace, "ops", None)
    if ops is not None and len(ops) >= BIG_OPS:
        trim()


ROW_VIEWS = ("coll", "p2p", "p2p_pairs")   # the index's views with a row per op: the hang questions' working set


def release_views(trace: "Trace | None", names: tuple[str, ...] = ROW_VIEWS) -> None:
    """Drop the index's per-op views of a big trace once the hang questions are done with them, so that they
    do not sit under every later analysis (on 10 M events: coll, p2p and p2p_pairs are ~0.6 GB). A dropped
    view is rebuilt, the same, on its next use. A no-op on small traces (rebuilding is not worth it there)."""
    ops = getattr(trace, "ops", None)
    store = getattr(trace, "__dict__", None) or {}
    ix = store.get(_ATTR)
    if ix is None or ops is None or len(ops) < BIG_OPS:
        return
    for name in names:
        ix.__dict__.pop(name, None)
    trim()


class IndexLookupError(LookupError):
    """Something asked of the index is not in this trace; the message says what is there instead."""


@dataclass(frozen=True)
class RankState:
    """How one rank ended (one row of `TraceIndex.rank_states`)."""

    rank: int
    role: str                  # dead | blocked | computing | finished | idle
    state: str                 # RankInfo.state: finished | failed | killed | stopped | unknown | missing
    dead_reason: str           # "" unless role is dead
    last_op: str
    last_step: int
    blocking: tuple[str, ...]  # "all_reduce #5 on dp0", one per blocking op (empty unless blocked)


@dataclass(frozen=True)
class StepWindow:
    """The span of one rank's ops in one training step."""

    rank: int
    step: int
    start_ns: int
    end_ns: int                # -1 when an op of the step never ended
    n_ops: int


def _names(names: list[str]) -> str:
    shown = ", ".join(names[:MAX_NAMES])
    return shown + (f", ... ({len(names)} in all)" if len(names) > MAX_NAMES else "")


class TraceIndex:
    """Derived views of one trace, each computed on first use and kept (see the module docstring)."""

    def __init__(self, trace: Trace) -> None:
        try:
            self._trace = weakref.ref(trace)
        except TypeError:                      # a trace type without weakref support: hold it
            self._trace = lambda: trace
        self._key = _fingerprint(trace)

    @property
    def trace(self) -> Trace:
        trace = self._trace()
        if trace is None:
            raise IndexLookupError("the trace this index was built from is gone: keep the Trace while using its index")
        return trace

    # ---- times ---------------------------------------------------------------
    @cached_property
    def end_ns(self) -> int:
        """The 'now' of the post-mortem: the latest aligned time in the trace."""
        return self.trace.end_ns

    @cached_property
    def start_ns(self) -> int:
        return trace_start_ns(self.trace)

    # ---- groups --------------------------------------------------------------
    @cached_property
    def recorded(self) -> dict[str, GroupInfo]:
        """The groups some rank recorded, voted over the distinct views."""
        return recorded_groups(self.trace)

    @cached_property
    def groups(self) -> dict[str, GroupInfo]:
        """Every group: recorded ones, then ones collectives used that no rank recorded."""
        kinds = {n: g.kind for n, g in self.recorded.items()}
        used = used_groups(self.coll, set(self.recorded), kinds)
        for name in [n for n in used if S.barrier_group(n) in self.recorded]:
            used[name] = replace(self.recorded[S.barrier_group(name)], name=name)     # a channel of that group
        return {**self.recorded, **used}

    @cached_property
    def members(self) -> dict[str, list[int]]:
        """Group name -> sorted member ranks (the majority view, else the ranks seen using it)."""
        return {n: list(g.members) for n, g in self.groups.items()}

    @cached_property
    def recorded_members(self) -> dict[str, list[int]]:
        return {n: list(g.members) for n, g in self.recorded.items()}

    @cached_property
    def kinds(self) -> dict[str, str]:
        """Group name -> kind most holders recorded (unrecorded groups: the name without digits)."""
        return {n: g.kind for n, g in self.groups.items()}

    @cached_property
    def member_table(self) -> pd.DataFrame:
        """Long form of `members`: process_group, member, n_members (one row per membership)."""
        return member_table(self.members)

    @cached_property
    def group_table(self) -> pd.DataFrame:
        """One row per recorded group: process_group, group_kind, size, members (a list), in recorded order.

        The performance analyses' view of membership (stragglers.group_table); read-only."""
        g = self.recorded
        return pd.DataFrame({"process_group": pd.Series(list(g), dtype=object),
                             "group_kind": pd.Series([i.kind for i in g.values()], dtype=object),
                             "size": pd.Series([i.size for i in g.values()], dtype="int64"),
                             "members": pd.Series([list(i.members) for i in g.values()], dtype=object)})

    @cached_property
    def view_table(self) -> pd.DataFrame:
        """Each rank's recorded view of each group (for the checks that name odd ranks)."""
        return group_view_table(self.trace)

    def group(self, name: str) -> GroupInfo:
        """The group called `name`; IndexLookupError naming the groups there are otherwise."""
        g = self.groups.get(name)
        if g is None:
            names = sorted(self.groups)
            there = f"groups are {_names(names)}" if names else "it records no process groups"
            raise IndexLookupError(f"no process group {name!r} in this trace: {there}")
        return g

    def label(self, name: str) -> str:
        """"dp1[1,3,5,7]": the group's name with its members (the name alone for an unknown group)."""
        return group_label(name, self.members.get(name))

    # ---- collectives ---------------------------------------------------------
    @cached_property
    def coll(self) -> pd.DataFrame:
        """The collective ops (int64 rank/seq, `gid` group code; string columns as sorted categoricals, except
        `process_group`: instances.collective_ops), sorted by rank, start."""
        out = collective_ops(self.trace.ops)
        release_heap(self.trace)
        return out

    @cached_property
    def instances(self) -> pd.DataFrame:
        """One row per (process_group, seq): n_began, n_ok, n_notok, first/last start."""
        return instance_table(self.coll)

    @cached_property
    def max_seq(self) -> pd.DataFrame:
        """(process_group, rank) -> max_seq, the highest collective_seq_id the rank began."""
        return max_seq_table(self.coll)

    @cached_property
    def missing(self) -> pd.DataFrame:
        """Members that never began an unfinished instance others began (who those others wait on)."""
        return missing_participants(self.coll, self.members, self.instances, self.max_seq)

    def instance(self, group: str, seq: int) -> pd.Series:
        """The instance row of the `seq`-th collective on `group`; IndexLookupError says what exists."""
        self.group(group)
        inst = self.instances
        hit = inst[(inst["process_group"] == group) & (inst["seq"] == int(seq))]
        if not len(hit):
            seqs = inst.loc[inst["process_group"] == group, "seq"]
            there = (f"{group} has #{int(seqs.min())}-#{int(seqs.max())}" if len(seqs)
                     else f"no rank began a collective on {group}")
            raise IndexLookupError(f"no collective #{int(seq)} on {group} in this trace: {there}")
        return hit.iloc[0]

    # ---- p2p -----------------------------------------------------------------
    @cached_property
    def p2p(self) -> pd.DataFrame:
        """The p2p ops with direction, src, dst, seq (string columns categorical)."""
        out = p2p_ops(self.trace.ops)
        release_heap(self.trace)
        return out

    @cached_property
    def p2p_pairs(self) -> pd.DataFrame:
        """Sends outer-joined with recvs on (src, dst, tag, seq), with `state` matched / send_only / recv_only."""
        out = match_p2p(self.p2p)
        release_heap(self.trace)
        return out

    # ---- ranks ---------------------------------------------------------------
    @cached_property
    def dump_gaps(self) -> pd.DataFrame | None:
        """Flight Recorder dumps: per present rank, how long it sat outside any collective before its dump
        (index/dump_gaps.py); None when the dumps cannot say it for every rank. Three questions read it."""
        return dump_gaps(self)

    @cached_property
    def end(self) -> EndStates:
        """Blocking ops, computing spans and rank states at the end of the trace."""
        return end_states(self.trace)

    @property
    def blocking(self) -> pd.DataFrame:
        return self.end.blocking

    @property
    def rank_states(self) -> pd.DataFrame:
        """Indexed by rank (0 .. world_size-1): role, dead, dead_reason, last_op, last_step, ..."""
        return self.end.states

    def rank_state(self, rank: int) -> RankState:
        """How `rank` ended; IndexLookupError naming the ranks there are otherwise."""
        st = self.rank_states
        if rank not in st.index:
            ws = self.trace.world_size
            there = f"ranks are {fmt_ranks(range(ws))} (world size {ws})" if ws else "it holds no ranks"
            raise IndexLookupError(f"no rank {rank} in this trace: {there}")
        row = st.loc[rank]
        b = self.blocking[self.blocking["rank"] == rank]
        ops = tuple(f"{r.op_name} #{int(r.collective_seq_id if r.kind == 'collective' else r.p2p_seq_id)}"
                    + (f" on {r.process_group}" if r.kind == "collective" else f" peer {int(r.peer)}")
                    for r in b.itertuples(index=False))
        return RankState(rank=int(rank), role=str(row["role"]), state=str(row["state"]),
                         dead_reason=str(row["dead_reason"]), last_op=str(row["last_op"]),
                         last_step=int(row["last_step"]), blocking=ops)

    # ---- steps ---------------------------------------------------------------
    @cached_property
    def step_windows(self) -> pd.DataFrame:
        """One row per (rank, step >= 0): start_ns (first op), end_ns (last end, -1 if one never ended), n_ops."""
        ops = self.trace.ops
        cols = ["rank", "step", "start_ns", "end_ns", "n_ops"]
        sel = (ops["step"].to_numpy() >= 0) & (ops["kind"] != "marker").to_numpy()
        if not sel.any():
            return pd.DataFrame(columns=cols)
        df = pd.DataFrame({"rank": ops["rank"].to_numpy(np.int64)[sel], "step": ops["step"].to_numpy(np.int64)[sel],
                           "start": ops["start_ns"].to_numpy()[sel], "end": ops["end_ns"].to_numpy()[sel]})
        agg = df.groupby(["rank", "step"], sort=True).agg(start_ns=("start", "min"), end_ns=("end", "max"),
                                                          open=("end", "min"), n_ops=("start", "size"))
        agg["end_ns"] = np.where(agg["open"] < 0, -1, agg["end_ns"])
        return agg.reset_index()[cols]

    def step_window(self, rank: int, step: int) -> StepWindow:
        """The span of `rank`'s ops in `step`; IndexLookupError saying which steps it recorded."""
        sw = self.step_windows
        mine = sw[sw["rank"] == rank]
        hit = mine[mine["step"] == step]
        if not len(hit):
            if not len(mine):
                self.rank_state(rank)          # an unknown rank says so
                raise IndexLookupError(f"rank {rank} recorded no ops in any training step")
            steps = mine["step"]
            raise IndexLookupError(f"rank {rank} recorded no ops in step {step}: its steps are "
                                   f"{int(steps.min())}-{int(steps.max())}")
        r = hit.iloc[0]
        return StepWindow(rank=int(rank), step=int(step), start_ns=int(r["start_ns"]), end_ns=int(r["end_ns"]),
                          n_ops=int(r["n_ops"]))


def _fingerprint(trace: Trace) -> tuple:
    """The identity of the tables an index was built from: replaced tables mean a new index."""
    return (id(trace.ops), len(trace.ops), id(trace.events), id(trace.groups), id(trace.group_views),
            trace.world_size)


def index_of(trace: Trace) -> TraceIndex:
    """The trace's index, built on the first call and returned as the same object after that."""
    store = getattr(trace, "__dict__", None)
    if store is None:                          # nowhere to keep it: the caller keeps the index
        return TraceIndex(trace)
    ix = store.get(_ATTR)
    if ix is None or ix._key != _fingerprint(trace):
        ix = TraceIndex(trace)
        store[_ATTR] = ix
    return ix


def seed_index(trace: Trace, views: dict) -> TraceIndex:
    """The trace's index with some views already filled in (`--follow` extends them from the last poll's:
    tui/follow_index.py); the others are computed on first use as usual. Only `cached_property` views."""
    ix = index_of(trace)
    for name, value in views.items():
        if not isinstance(getattr(TraceIndex, name, None), cached_property):
            raise IndexLookupError(f"{name!r} is not a view of the index")
        ix.__dict__[name] = value
    return ix


IndexLike = Union[TraceIndex, "Trace"]


def as_index(source: IndexLike) -> TraceIndex:
    """The index itself, or the index of a trace (so a question accepts either)."""
    return source if isinstance(source, TraceIndex) else index_of(source)
