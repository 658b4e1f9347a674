"""How long each rank sat outside any collective before its Flight Recorder dump was written.

A dump holds no "the job is stuck" flag. What it holds is time: every entry's
creation time, and (the loader's dump marker) when the file was written. A
rank whose dump came long after its last op sat outside every collective
(in compute, in a send/recv gloo does not record, in group creation) until
something dumped it. Two yardsticks say "long":

- the op's own collective timeout: no collective may take longer, so a rank
  idle past it was not between two ops of a running loop;
- the rank's own pace, on dumps that record no send/recv (gloo: a rank
  outside every recorded op may be blocked in one; NCCL records p2p, so a
  rank outside every NCCL op was outside communication, as a healthy job in
  its evaluation or checkpoint is): the longest interval between two
  consecutive ops of its record. A training loop repeats itself; a rank idle `PACE_FACTOR` times
  longer than any interval it ever showed, and at least `IDLE_FLOOR_NS`
  (a process's exit and the dump itself take up to ~0.1 s), left its
  routine. This needs `PACE_MIN_OPS` (3) recorded ops: a pace read from one or
  two ops says nothing; two intervals do (with four needed, a 3-rank job whose
  ranks each held three all_reduces, dumped 0.9 s after the last when the
  launcher stopped them, read OK: seed 20261219 #194).

A healthy job dumped on demand or at its end is dumped within one of its own
intervals; measured on 160 healthy random programs (seeds 20261209-10) the
largest gap was 0.14 s, against 1.5-12 s for the failed jobs whose dumps the
timeout yardstick alone read as OK (docs/benchmarks.md). The floor is 0.5 s:
on 128 more healthy programs (seeds 20261216-18) the largest gap was 0.07 s,
while a rank the launcher stopped after a peer failed was dumped 0.7-1.0 s
after its last op (torchrun's SIGTERM), and with a 1 s floor two such jobs
read OK (seed 20261217 #366, seed 20261218 #117).

The table is one index view (`TraceIndex.dump_gaps`), built once per trace for every question that reads
it (`hang/stopped.py`, `hang/death_first.py`, `hang/same_stop.py`); what a question concludes from it is
the question's (`hang/dump_idle.ended_early`).
"""
from __future__ import annotations

from typing import Any

import pandas as pd

from ncclscope import schema as S
from ncclscope.load.foreign.fr_extras import DUMP_MARKER   # one row per dump, at its file time

PACE_FACTOR = 10
IDLE_FLOOR_NS = 500_000_000
PACE_MIN_OPS = 3


def dump_gaps(ix: Any) -> pd.DataFrame | None:
    """Per present rank (index, ascending): `t` its last collective's time, `dumped` its dump's time, `gap`
    ns between them, `tmo` that op's timeout in ns, `pace` its longest interval between two consecutive recorded ops
    (-1 with fewer than PACE_MIN_OPS), `idle` the gap outlived the timeout or the pace (module docstring).
    None where that cannot be said for every rank: no dump markers (not a dump, or file times not trusted),
    a rank without a marker or a collective, no usable time (wording.wait_ns), no timeout."""
    present = sorted(int(r) for r in ix.trace.present_ranks)
    ev, coll = ix.trace.marks, ix.coll
    if not len(ev) or not len(coll) or "timeout_ms" not in ix.trace.ops.columns:
        return None
    marks = _dump_marks(ev)
    if not len(marks):
        return None
    dumped = marks.groupby("rank", observed=True)["t_ns"].max()
    dumped.index = dumped.index.astype("int64")
    ops = ix.trace.ops
    ops = ops[(ops["kind"].astype(str) == S.KIND_COLLECTIVE).to_numpy()]
    last = ops.assign(t=ops[["start_ns", "end_ns"]].max(axis=1)).sort_values(["rank", "t"])
    last = last.drop_duplicates("rank", keep="last").set_index("rank")
    last.index = last.index.astype("int64")
    per = pd.DataFrame({"dumped": dumped, "t": last["t"], "start": last["start_ns"],
                        "tmo": last["timeout_ms"] * 1_000_000}).reindex(present)
    if per.isna().any(axis=None):                  # a rank without a marker or without a collective
        return None
    per = per.astype("int64")
    # gloo's end times are inferred from the other members' arrival (the loader), which can fall a few ms
    # after this rank's own dump: the op ended by the dump on this rank, so its end is clamped to the dump.
    # A dump before the op's own creation on the rank is a file time not to trust: nothing is said.
    per["t"] = per["t"].where(per["t"] <= per["dumped"], per["dumped"])
    per["gap"] = per["dumped"] - per["t"]
    if not ((per["start"] > 0) & (per["tmo"] > 0) & (per["dumped"] >= per["start"])).all():
        return None
    per["pace"] = _pace(ix.trace.ops).reindex(per.index).fillna(-1).astype("int64")
    by_pace = (per["pace"] >= 0) & (per["gap"] > IDLE_FLOOR_NS) & (per["gap"] > PACE_FACTOR * per["pace"])
    per["idle"] = (per["gap"] > per["tmo"]) | (by_pace & p2p_unrecorded(ix))
    return per


def _dump_marks(ev: pd.DataFrame) -> pd.DataFrame:
    """The marker rows of the dumps whose file time the loader trusted (fr_extras.dump_markers)."""
    return ev[(ev["op_name"].astype(str) == DUMP_MARKER).to_numpy()] if len(ev) else ev


def dump_times_known(trace: Any) -> bool:
    """Does every present rank's dump carry its write time (a trusted file time: a dump marker)? A copied
    file's does not (hang/stopped._times_unknown)."""
    marked = set(_dump_marks(trace.marks)["rank"].astype(int)) if len(trace.marks) else set()
    return {int(r) for r in trace.present_ranks} <= marked


def p2p_unrecorded(ix: Any) -> bool:
    """True where every group's backend is gloo, whose Flight Recorder records no send/recv: a rank outside
    every recorded op may be blocked in one. NCCL records p2p too, so there nothing in flight means the
    rank was outside communication (compute, an evaluation, a checkpoint), which a healthy job does."""
    groups = ix.trace.groups
    if not len(groups) or "backend" not in groups.columns:
        return False
    return set(groups["backend"].astype(str)) == {"gloo"}


def _pace(ops: pd.DataFrame) -> pd.Series:
    """Per rank: the longest interval between two consecutive recorded ops' start times, for ranks with at
    least PACE_MIN_OPS ops (collectives and p2p, where the dump records p2p)."""
    ops = ops[ops["kind"].astype(str).isin((S.KIND_COLLECTIVE, S.KIND_P2P)).to_numpy() & (ops["start_ns"] > 0)]
    if not len(ops):
        return pd.Series(dtype="int64")
    t = ops[["rank", "start_ns"]].astype("int64").sort_values(["rank", "start_ns"])
    by_rank = t.groupby("rank")["start_ns"]
    t = t.assign(step=by_rank.diff())[(by_rank.transform("size") >= PACE_MIN_OPS).to_numpy()]
    return t.groupby("rank")["step"].max().dropna().astype("int64")
