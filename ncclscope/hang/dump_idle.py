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

`ended_early` is the one shape this table answers on its own: some ranks'
dumps were written right after their last op, and before every idle rank's
dump, and they got no further than the idle ranks did. They ended (their
program returned, or left its loop) while their peers sat outside any
collective. Every rank runs the same program, so the smaller side is the one
that left it: a few that ended while most waited ended early (seed 20261210
#89: one rank's data ran out); a few that sat idle while most ended stopped
short of the end (seed 20261209 #245: a pair deadlocked in its last step's
send/recv while four ranks finished).
"""
from __future__ import annotations

from typing import Any

import pandas as pd

from ncclscope import schema as S
from ncclscope.findings import Evidence, Finding
from ncclscope.index.labels import rank_label
from ncclscope.hang.wording import duration
from ncclscope.load.foreign.fr_extras import DUMP_MARKER   # one row per dump, at its file time

PACE_FACTOR = 10
IDLE_FLOOR_NS = 500_000_000
PACE_MIN_OPS = 3


def idle_before_dump(ix: Any, present: list[int]) -> pd.DataFrame | None:
    """Per present rank (index): `t` its last collective's time, `dumped` its dump's time, `gap` ns between
    them, `tmo` that op's timeout in ns, `pace` its longest interval between two consecutive recorded ops
    (-1 with fewer than PACE_MIN_OPS), `idle` the gap outlived the timeout or the pace (module docstring).
    None where that cannot be said for every rank: no dump markers (not a dump, or file times not trusted),
    a rank without a marker or a collective, no usable time (wording.wait_ns), no timeout."""
    ev, coll = ix.trace.events, ix.coll
    if not len(ev) or not len(coll) or "timeout_ms" not in ix.trace.ops.columns:
        return None
    marks = ev[(ev["op_name"].astype(str) == DUMP_MARKER).to_numpy()]
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


def ended_early(ix: Any, idle: pd.DataFrame, last_ops: str) -> Finding | None:
    """Where some ranks were dumped right after their last op, before every idle rank's dump, having got no
    further than the idle ranks (module docstring): the smaller side left the course the others kept. A
    few ranks that ended while most waited ended early: a `hang` rooted at them. A few that sat idle while
    most ended stopped: a `no_op_in_flight` rooted at them. As many of each: nothing says which side
    deviated, and every rank is named. One idle rank alone, idle past its last op's own timeout, whatever
    the split: `stuck_in_compute` on it. No rank was left running to pair with it, a send/recv with a
    peer that exited fails at once (measured: gloo raises `Connection closed by peer` some 20 ms
    after the peer's exit), and any op
    it was in would have timed out (seed 20261213 #14 and #206: a rank sleeping after its last collective
    while its peers finished, 134 s and 145 s). Within the timeout it may be inside the op whose failure
    ended the others, until the launcher stops it (seed 20261209 #337: 1.5 s after its peer raised in an
    all_to_all). None for any other split."""
    idle_r = sorted(int(r) for r in idle.index[idle["idle"]])
    ended = sorted(int(r) for r in idle.index[~idle["idle"]])
    if not idle_r or not ended:
        return None
    if int(idle.loc[ended, "t"].max()) > int(idle.loc[idle_r, "t"].max()):
        return None                                   # they went further: the idle ranks stopped first
    if int(idle.loc[ended, "dumped"].max()) >= int(idle.loc[idle_r, "dumped"].min()):
        return None                                   # not dumped before the waiters: no order to read
    trace = ix.trace
    sub = idle.loc[idle_r]
    lo, hi = int(sub["gap"].min()), int(sub["gap"].max())
    span = duration(lo) if duration(lo) == duration(hi) else f"{duration(lo)} to {duration(hi)}"
    one, lone = len(ended) == 1, len(idle_r) == 1
    ended_txt = (f"{rank_label(trace, ended)} ended right after {last_ops} ({'its' if one else 'their'} Flight "
                 f"Recorder dump{'' if one else 's'} {'was' if one else 'were'} written then)")
    idle_txt = (f"{rank_label(trace, idle_r)} sat {span} outside any collective after the same point and "
                f"{'was' if lone else 'were'} dumped later")
    if lone and int(idle.at[idle_r[0], "gap"]) > int(idle.at[idle_r[0], "tmo"]):
        kind, roots = "stuck_in_compute", idle_r
        title = (f"{rank_label(trace, idle_r)} never ended: {ended_txt}, while {idle_txt}. Alone, it cannot have "
                 f"been waiting on a send/recv (a peer's exit fails a pending send/recv at once): it was stuck "
                 f"outside communication, in compute, I/O or a wait of its own")
    elif len(ended) < len(idle_r):
        kind, roots = "hang", ended
        title = (f"{ended_txt}, while {idle_txt}: they wait on {'it' if one else 'them'} in something the dumps "
                 f"do not record (a send/recv: gloo records none), or {'it' if one else 'they'} left "
                 f"{'its' if one else 'their'} loop early")
    elif len(idle_r) < len(ended):
        kind, roots = "no_op_in_flight", idle_r
        title = (f"{rank_label(trace, idle_r)} stopped after {last_ops} and sat {span} outside any collective "
                 f"before {'its dump' if lone else 'their dumps'}, while {rank_label(trace, ended)} ended right "
                 f"after it ({'its dump was' if one else 'their dumps were'} written then): "
                 f"{'it' if lone else 'they'} stopped where the rest of the job ended, outside collectives (in a "
                 f"send/recv, which gloo does not record, or in compute)")
    else:
        kind, roots = "no_op_in_flight", sorted(ended + idle_r)
        title = (f"{ended_txt}, while {idle_txt}: as many ranks ended as stopped, and nothing recorded says "
                 f"which side left the program's course")
    ev = [Evidence(rank=r, note=f"dumped {duration(int(idle.at[r, 'gap']))} after its last op, "
                                f"before every idle rank's dump") for r in ended[:30]]
    ev += [Evidence(rank=r, note=f"sat {duration(int(idle.at[r, 'gap']))} outside any collective before its dump "
                                 f"(its longest interval between two ops: "
                                 f"{duration(int(idle.at[r, 'pace'])) if int(idle.at[r, 'pace']) >= 0 else 'unknown'})")
           for r in idle_r[:30]]
    data = {"ended": ended, "waiting": idle_r, "stopped_after": last_ops,
            "idle_before_dump_s": [round(lo / 1e9, 3), round(hi / 1e9, 3)]}
    return Finding(kind=kind, severity="error", title=title, ranks=roots, evidence=ev,
                   involved=sorted(int(r) for r in idle.index), data=data)
