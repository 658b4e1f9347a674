"""Rank states at the end of the trace: what each rank was doing when the job stopped.

Each rank's blocking op at the end (its unfinished comm ops posted after its
last completed one; a timeout/error end counts as unfinished: that is where
it was waiting when it gave up) says whom it waits on (waitgraph.py). A rank
with no blocking op is computing (an inflight compute span, or heartbeats to
the end), finished, idle, or dead: missing directory, heartbeats stopped long
before the end while others' continued, killed/failed without being blocked in
comm itself. Ranks the launcher stopped at the end are not deaths; a rank a
signal killed first is, whatever its heartbeats. A rank with no data from an
input that records a sample of ranks (profiler traces: one or two of a
128-rank job is the norm) is *untraced*: no evidence of anything, so neither
dead nor a root.

`end_states(trace)` is what the index stores: blocking ops of the live ranks,
computing spans, and one row per rank (`role`: dead / untraced / blocked /
computing / finished / idle, with the reason a dead rank is dead). Vectorised:
merges and groupbys over the ops; per-rank Python only for the few dead ranks'
sentences.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from ncclscope import schema as S
from ncclscope.load.opsjoin import STATUS_INFLIGHT
from ncclscope.index.labels import NS, plain_str, seconds, trace_start_ns
from ncclscope.index.stack_excerpts import user_frame

if TYPE_CHECKING:
    from ncclscope.load.trace import Trace

STALE_FLOOR_NS = 3 * NS          # heartbeats older than this (and 5 intervals) before the end = stopped


STALE_INTERVALS = 5


MAX_BLOCKING_PER_RANK = 8        # most recent unfinished comm ops considered per rank


FAILED = (S.STATUS_TIMEOUT, S.STATUS_ERROR)


COMM_KINDS = (S.KIND_COLLECTIVE, S.KIND_P2P)


BLOCK_COLUMNS = ["rank", "op_id", "kind", "op_name", "process_group", "collective_seq_id", "p2p_seq_id", "peer",
                 "tag", "status", "start_ns", "end_ns", "step", "microbatch", "stage", "call_site"]



def _plain_frame(df: pd.DataFrame) -> pd.DataFrame:
    out = df.copy()
    for c in ("kind", "op_name", "process_group", "status", "call_site"):
        out[c] = plain_str(out[c])
    for c in ("rank", "peer", "tag", "step", "microbatch", "stage"):
        out[c] = out[c].astype("int64")
    return out


def unfinished_ops(ops: pd.DataFrame) -> pd.DataFrame:
    """Comm and compute ops that did not end ok (inflight, timeout, error), as plain columns."""
    kind, status = ops["kind"], ops["status"]
    mask = kind.isin(COMM_KINDS + (S.KIND_COMPUTE,)).to_numpy() & (status != S.STATUS_OK).to_numpy()
    return _plain_frame(ops.loc[mask, BLOCK_COLUMNS]).sort_values(["rank", "start_ns", "op_id"], kind="stable")


def blocking_ops(ops: pd.DataFrame, unfinished: pd.DataFrame | None = None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Each rank's blocking comm ops at the end, and the ranks that are computing instead.

    A rank is *computing* when its latest-started unfinished op is an inflight
    compute span (async isend/irecv it posted before may still be open). Else
    its blocking ops are the unfinished comm ops posted after its last comm
    op that completed ok (a batch like isend+irecv counts whole); with none
    of those, any inflight comm op it still waits on (an irecv posted early
    and waited on now). Returns (blocking, computing), one row per op.
    """
    unf = unfinished_ops(ops) if unfinished is None else unfinished
    latest = unf.drop_duplicates("rank", keep="last")
    computing = latest[(latest["kind"] == S.KIND_COMPUTE) & (latest["status"] == STATUS_INFLIGHT)]
    comm_mask = ops["kind"].isin(COMM_KINDS).to_numpy() & (ops["status"] == S.STATUS_OK).to_numpy()
    ok = pd.DataFrame({"rank": ops["rank"].to_numpy()[comm_mask].astype(np.int64),
                       "start": ops["start_ns"].to_numpy()[comm_mask], "end": ops["end_ns"].to_numpy()[comm_mask]},
                      copy=False).groupby("rank")
    last_ok, last_ok_start = ok["end"].max(), ok["start"].max()
    comm = unf[unf["kind"].isin(COMM_KINDS) & ~unf["rank"].isin(computing["rank"])]
    lok = comm["rank"].map(last_ok).fillna(-1).to_numpy()
    frontier = comm[comm["start_ns"].to_numpy() >= lok]
    # No op after the last completed one: an op still open (an irecv posted early, waited on now), or one
    # posted with the last completed op in one batch (isend done, its irecv timed out: what it waited in)
    batch = comm["start_ns"].to_numpy() >= comm["rank"].map(last_ok_start).fillna(-1).to_numpy()
    rest = comm[~comm["rank"].isin(frontier["rank"]) & ((comm["status"] == STATUS_INFLIGHT).to_numpy() | batch)]
    blocking = pd.concat([frontier, rest]).sort_values(["rank", "start_ns", "op_id"], kind="stable")
    # Bounded: a batch is a handful of ops; a trace with no end rows at all must not explode the graph.
    blocking = blocking.groupby("rank", sort=False).tail(MAX_BLOCKING_PER_RANK)
    return blocking.reset_index(drop=True), computing.reset_index(drop=True)


def _last_rows(ops: pd.DataFrame, mask: np.ndarray) -> pd.DataFrame:
    """Each rank's last row among `mask` (ops are sorted by rank, start): no copy of the whole table."""
    idx = np.flatnonzero(mask)
    if not len(idx):
        return ops.iloc[0:0]
    ranks = ops["rank"].to_numpy()[idx]
    last = idx[np.r_[ranks[1:] != ranks[:-1], True]]
    return ops.iloc[last]


def _heartbeats(trace: Trace) -> tuple[pd.DataFrame, int]:
    """Per-rank last heartbeat and whether it stopped early; returns (table, stale threshold ns)."""
    ev = trace.marks
    hb = ev[(ev["op_name"] == S.HEARTBEAT).to_numpy()]
    if not len(hb):
        return pd.DataFrame(columns=["last_hb_ns"]), STALE_FLOOR_NS
    agg = hb.groupby("rank", observed=True)["t_ns"].agg(["min", "max", "count"])
    multi = agg[agg["count"] >= 2]
    interval = float(((multi["max"] - multi["min"]) / (multi["count"] - 1)).median()) if len(multi) else 0.0
    threshold = int(max(STALE_FLOOR_NS, STALE_INTERVALS * interval))
    out = agg[["max"]].rename(columns={"max": "last_hb_ns"})
    out.index = out.index.astype("int64")
    return out, threshold


def rank_states(trace: Trace, ops: pd.DataFrame, blocking: pd.DataFrame, computing: pd.DataFrame,
                unfinished: pd.DataFrame) -> pd.DataFrame:
    """One row per rank: how it ended and what it was doing (dead / blocked / computing / idle)."""
    end = trace.end_ns
    ranks = pd.Index(range(trace.world_size), name="rank")
    info = trace.ranks
    st = pd.DataFrame(index=ranks)
    st["state"] = [info[r].state if r in info else "missing" for r in ranks]
    st["signal"] = [(info[r].signal or "") if r in info else "" for r in ranks]
    st["exitcode"] = [info[r].exitcode if r in info and info[r].exitcode is not None else np.nan for r in ranks]
    st["end_message"] = [info[r].end_message if r in info else "" for r in ranks]
    st["end_status"] = [info[r].end_status if r in info else "" for r in ranks]

    hb, threshold = _heartbeats(trace)
    last_event = trace.last_event_ns()
    st["last_event_ns"] = last_event.reindex(ranks).fillna(-1).astype("int64")
    st["last_hb_ns"] = (hb["last_hb_ns"].reindex(ranks) if len(hb) else pd.Series(np.nan, index=ranks))
    have_hb = len(hb) > 0
    sign_of_life = st["last_hb_ns"].fillna(st["last_event_ns"].where(st["last_event_ns"] >= 0))
    lag = end - sign_of_life
    alive = have_hb & st["last_hb_ns"].notna() & (lag <= threshold)
    st["hb_alive"] = alive
    st["hb_stale"] = have_hb & ~alive & ~st["state"].isin(["missing", "finished"]) & bool(alive.any())
    st["stale_threshold_ns"] = threshold

    st["blocked"] = ranks.isin(blocking["rank"].unique())
    st["fail_block"] = ranks.isin(blocking.loc[blocking["status"].isin(FAILED), "rank"].unique())
    comp = computing.set_index("rank")
    st["computing_op"] = comp["op_name"].reindex(ranks).fillna("")
    st["computing_start_ns"] = comp["start_ns"].reindex(ranks).fillna(-1).astype("int64")
    st["computing_step"] = comp["step"].reindex(ranks).fillna(-1).astype("int64")
    latest = unfinished.drop_duplicates("rank", keep="last").set_index("rank")
    crashed = latest[(latest["kind"] == S.KIND_COMPUTE) & latest["status"].isin(FAILED)]
    st["compute_error"] = ranks.isin(crashed.index)

    last = _last_rows(ops, ~(ops["kind"] == S.KIND_MARKER).to_numpy()).set_index("rank")
    last.index = last.index.astype("int64")
    st["last_op"] = plain_str(last["op_name"]).reindex(ranks).fillna("") if len(last) else ""
    st["last_op_status"] = plain_str(last["status"]).reindex(ranks).fillna("") if len(last) else ""
    st["last_op_start_ns"] = last["start_ns"].reindex(ranks).fillna(-1).astype("int64") if len(last) else -1
    st["last_op_end_ns"] = last["end_ns"].reindex(ranks).fillna(-1).astype("int64") if len(last) else -1
    steps = ops.groupby("rank", observed=True)["step"].max() if len(ops) else pd.Series(dtype="int64")
    steps.index = steps.index.astype("int64")
    st["last_step"] = steps.reindex(ranks).fillna(-1).astype("int64")

    st["untraced"] = untraced(trace, st)
    dead = _dead(st, ranks, blocking)
    st["dead"] = dead
    # Heartbeats to the end say a rank was alive, not that it was working: one that then ended of itself
    # (exit 0) had finished its script and was only winding down (destroy_process_group, exit handlers).
    st["computing"] = ~dead & ~st["blocked"] & ((st["computing_op"] != "")
                                                | (st["hb_alive"] & (st["state"] != "finished")))
    st["role"] = np.select([st["dead"], st["untraced"], st["blocked"], st["computing"], st["state"] == "finished"],
                           ["dead", "untraced", "blocked", "computing", "finished"], "idle")
    st["dead_reason"] = ""
    if st["dead"].any():
        st.loc[st["dead"], "dead_reason"] = [_dead_reason(trace, r, row) for r, row in st[st["dead"]].iterrows()]
    return st


# end messages that say the rank failed because a peer went away or did not answer, not of its own error
PEER_ERROR = (r"(?i)connection (?:closed|reset|refused)|(?:closed|reset) by peer|broken pipe|remote (?:process|peer)"
              r"|communicator was aborted|timed? ?out|timeout|terminated by SIGTERM")


def own_error(message: str) -> bool:
    """An end message that says the rank failed of its own error (an exception of its own, os._exit), not a
    peer's (a timeout, a closed socket, an abort): PEER_ERROR does not match it."""
    msg = str(message or "").strip()
    return bool(msg) and re.search(PEER_ERROR, msg) is None


_MISSING = {
    "flight_recorder": "left no Flight Recorder dump (it died before its dump was written, or the file is gone)",
}
# Inputs where recording only some ranks is how they are made (a profiler trace per rank costs GBs, so jobs
# profile a sample): a rank without a file there was not traced, which says nothing about how it ended.
SAMPLED_SOURCES = frozenset({"torch_profiler"})


def untraced(trace: Trace, st: pd.DataFrame) -> pd.Series:
    """Ranks with no data from an input that records a sample of ranks: not dead, not waited on, unknown."""
    return (st["state"] == "missing") & (trace.run.source in SAMPLED_SOURCES)
_MISSING_DEFAULT = "left no trace directory (it died before writing, or its files are gone)"


def _dead(st: pd.DataFrame, ranks: pd.Index, blocking: pd.DataFrame) -> pd.Series:
    """Which ranks are dead: missing (not merely untraced), silent, or ended of their own failure (not a
    peer's); the rules in order."""
    missing = (st["state"] == "missing") & ~st["untraced"]
    killed_or_failed = st["state"].isin(["killed", "failed"])
    not_blocked = ~st["blocked"] & (st["computing_op"] == "")
    dead = missing.copy()
    dead |= ~st["fail_block"] & st["hb_stale"]
    dead |= ~st["fail_block"] & (st["state"] == "failed") & not_blocked
    # A process that ended of its own error cannot still be blocked: an op it left without an end row (a
    # Flight Recorder entry of DDP's or FSDP's, an async op it never waited for) is where that error found
    # it (DDP's parameter check raising on one rank). A failure that says a peer went away ("connection
    # closed by peer", a timeout) is a consequence, and that rank stays blocked on the one it waits for.
    own_error = (st["end_message"].astype(str).str.strip() != "") & ~st["end_message"].astype(str).str.contains(
        PEER_ERROR, regex=True)
    dead |= (~st["fail_block"] & (st["state"] == "failed") & st["blocked"] & own_error
             & ranks.isin(blocking.loc[blocking["status"] == STATUS_INFLIGHT, "rank"].unique()))
    # The same for an op that raised it: the rank's last op failed with the error the process died of
    # (gloo rejecting an all_gather output list one short), not with a peer's timeout or closed socket.
    dead |= (st["fail_block"] & (st["state"] == "failed") & own_error
             & st["last_op_status"].isin(list(FAILED)))
    # A process that exited non-zero by itself and left no end record at all (os._exit, an extension's
    # exit) blames no peer: an op it left without an end row is where it exited (the end row was queued,
    # never flushed), not a wait. A consequence of a peer's failure leaves its error in the end record.
    # (only where the evidence writes end records at all: some other rank has one)
    silent_exit = (st["state"] == "failed") & (st["end_status"] == "") & (st["end_message"].astype(str) == "") \
        & bool((st["end_status"] != "").any())
    dead |= ~st["fail_block"] & silent_exit
    # "killed" already excludes the launcher's own end-of-job kills (state "stopped"):
    # a signal that ended a rank before the launcher did is a death, heartbeats or not.
    dead |= ~st["fail_block"] & (st["state"] == "killed")
    dead |= ~st["fail_block"] & st["compute_error"] & killed_or_failed
    return dead


def missing_reason(trace: Trace) -> str:
    """Why a rank with no data is dead, in the words of the input kind (`trace.run.source`)."""
    return _MISSING.get(trace.run.source, _MISSING_DEFAULT)


def _dead_reason(trace: Trace, r: int, row: pd.Series) -> str:
    """"was killed (SIGKILL) at step 4; last sign of life at 4.0 s (8.0 s before the end)"."""
    t0 = trace_start_ns(trace)
    if row.state == "missing":
        return missing_reason(trace)       # "left no trace directory" / "left no Flight Recorder dump" / ...
    at_step = f" at step {int(row.last_step)}" if row.last_step >= 0 else ""
    life = ""
    if row.hb_stale:
        t = row.last_hb_ns if not pd.isna(row.last_hb_ns) else row.last_event_ns
        what = "heartbeating" if not pd.isna(row.last_hb_ns) else "writing events"
        if t is None or pd.isna(t) or int(t) < 0:
            life = "before writing any event"
        else:
            life = f"{what} at {seconds(int(t) - t0)} ({seconds(trace.end_ns - int(t))} before the end)"
    if row.signal:
        head = f"was killed ({row.signal}){at_step}"
    elif row.state == "failed":
        code = "" if pd.isna(row.exitcode) else f"exit code {int(row.exitcode)}"
        msg = str(row.end_message).strip().splitlines()[0][:120] if str(row.end_message).strip() else ""
        head = "failed" + (f" ({code}{': ' if code and msg else ''}{msg})" if code or msg else "") + at_step
        if msg:   # where its error was raised: the user's frame of the dump its exception left
            frame, _ = user_frame(trace, r, -1, trace.end_ns, latest=True)
            verb = "called" if msg.startswith("os._exit(") else "raised"   # usertrace evidence.watch_exit
            head += f", {verb} at {frame}" if frame else ""
    elif life:
        return f"stopped {life}{at_step.replace(' at ', ', last at ')}"
    else:
        head = f"is gone (state {row.state}){at_step}"
    return f"{head}; stopped {life}" if life else head



@dataclass
class EndStates:
    """How every rank ended: its blocking comm ops (live ranks only), compute spans, and role."""

    blocking: pd.DataFrame        # BLOCK_COLUMNS, one row per blocking op of a live, unfinished rank
    computing: pd.DataFrame       # the inflight compute span of each computing rank
    unfinished: pd.DataFrame      # every comm/compute op that did not end ok
    states: pd.DataFrame          # indexed by rank: role, dead, dead_reason, last_op, ... (see rank_states)


def end_states(trace: Trace) -> EndStates:
    """Blocking ops and rank states, with the rules that decide who waits on whom.

    A rank that exited normally waits on nothing, whatever async op it left
    open; a dead rank's open ops are not waits either (it is the end of a chain).
    """
    ops = trace.ops
    unf = unfinished_ops(ops)
    blocking, computing = blocking_ops(ops, unf)
    finished = [r for r, info in trace.ranks.items() if info.state == "finished"]
    blocking = blocking[~blocking["rank"].isin(finished)]
    computing = computing[~computing["rank"].isin(finished)]
    st = rank_states(trace, ops, blocking, computing, unf)
    dead = st["dead"]
    blocking = blocking[~blocking["rank"].map(dead).fillna(False).astype(bool)].reset_index(drop=True)
    return EndStates(blocking=blocking, computing=computing.reset_index(drop=True), unfinished=unf, states=st)
