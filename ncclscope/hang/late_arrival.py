"""A rank that reached a collective only after a peer had given up waiting for it.

The wait-for graph sees the end of such a job as two dead ranks: the one that
timed out inside the collective ("Timed out waiting 3000ms") and the one the
launcher stopped afterwards. Neither waits on the other, because by the end
every member had posted the instance. The order of arrival says who caused it:
the waiter began the instance at t, its timeout was T, and the late rank began
it after t + T — it kept the group waiting past the timeout while it was
somewhere else (a sleep, a data-loader stall, a long host-side step), so it is
the root and the timeout is its consequence.

The rule fires only when

- a member ended with a timeout (its op status, or its rank's end message), in
  an instance every member eventually began (an absent member is a skip, which
  the census and the wait-for graph already explain);
- another member began that instance after the waiter gave up (begin + the
  op's own timeout_ms, else the waiter's last event);
- the late member was in no traced op when the waiter gave up: its previous op
  had ended (a Flight Recorder completion inferred from a later op counts as
  ended when its instance ended on the other members), so the gap was its own.

When the late rank's stacks.txt holds a dump taken inside the gap, the verdict
names the user's frame it was in (the first frame outside torch, ncclscope and
the interpreter's own machinery).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ncclscope.findings import Cause, CauseBasis, Evidence, Finding, InstanceRef, WaitSummary
from ncclscope.index.views import TraceIndex
from ncclscope.load.fr_merge import INFERRED
from ncclscope.index.labels import rank_label
from ncclscope.index.stack_excerpts import user_frame
from ncclscope.hang.wording import timed_out_ranks


def find_late_arrivals(ix: TraceIndex) -> list[Finding]:
    """`stuck_in_compute` findings for ranks that arrived after a member's timeout (module docstring)."""
    coll, trace = ix.coll, ix.trace
    if not len(coll):
        return []
    states = ix.rank_states                              # indexed by rank
    timed_out = timed_out_ranks(states)
    waiters = coll[(coll["status"].isin(["timeout"]))
                   | (coll["rank"].isin(timed_out) & coll["status"].isin(["inflight", "error"]))]
    if not len(waiters):
        return []
    ops = trace.ops
    timeouts = ops.set_index(["rank", "op_id"])["timeout_ms"] if "timeout_ms" in ops else None
    findings: list[Finding] = []
    seen: set[tuple[str, int]] = set()
    for w in waiters.sort_values("start_ns").itertuples(index=False):
        key = (str(w.process_group), int(w.collective_seq_id))
        if key in seen or key[1] < 0:
            continue
        seen.add(key)
        rows = coll[(coll["process_group"] == key[0]) & (coll["collective_seq_id"] == key[1])]
        members = set(ix.members.get(key[0], []))
        if not members:
            continue
        gave_up = _gave_up_ns(w, states, timeouts)
        if gave_up <= int(w.start_ns):
            continue
        late = rows[rows["start_ns"] > gave_up].sort_values("start_ns")
        late = late[np.array([_idle_at(ix, int(r.rank), int(r.start_ns), gave_up)
                              for r in late.itertuples(index=False)], dtype=bool)]
        absent = sorted(members - {int(r) for r in rows["rank"]})
        never = [r for r in absent if _stalled_then_stopped(ix, states, r, gave_up, int(w.start_ns))]
        if len(never) != len(absent) or (not len(late) and not never):
            continue          # a member that went elsewhere or died first: a skip or a death, other rules
        findings.append(_finding(ix, key, w, late, rows, gave_up, never))
    return findings


def _stalled_then_stopped(ix: TraceIndex, states: pd.DataFrame, rank: int, gave_up_ns: int,
                          waited_from_ns: int = -1) -> bool:
    """A member that never began the instance, yet was alive and in no op when the waiter gave up, and
    issued nothing afterwards (the launcher stopped it): it was stalled outside collectives.

    Not a member that spent most of the wait blocked in another collective or p2p that then failed
    (it went elsewhere: a skip, other rules), even if its own timeout ended that op a moment before
    the waiter's did."""
    if rank not in states.index:
        return False
    if waited_from_ns >= 0 and gave_up_ns > waited_from_ns:
        ops = ix.trace.ops
        comm = ops[(ops["rank"] == rank) & (ops["kind"] != "compute") & (ops["start_ns"] < gave_up_ns)
                   & ops["status"].isin(["timeout", "error"])]
        blocked = (np.minimum(comm["end_ns"], gave_up_ns) - np.maximum(comm["start_ns"], waited_from_ns)).clip(lower=0)
        if len(comm) and float(blocked.max()) >= 0.5 * (gave_up_ns - waited_from_ns):
            return False
    st = states.loc[rank]
    last = max(_int(st.get("last_event_ns")), _int(st.get("last_hb_ns")))
    if last <= gave_up_ns:
        return False                                      # dead before the timeout: a death, not a stall
    ops = ix.trace.ops
    later = ops[(ops["rank"] == rank) & (ops["start_ns"] > gave_up_ns) & (ops["kind"] != "compute")]
    if len(later):
        return False                                      # it went on to other ops: a skip
    return _idle_at(ix, rank, gave_up_ns + 1, gave_up_ns)


def _gave_up_ns(w: object, states: pd.DataFrame, timeouts: pd.Series | None) -> int:
    """When the waiter stopped waiting: its begin plus the op's own timeout, else its last event."""
    t_ms = -1
    if timeouts is not None:
        try:
            t_ms = int(timeouts.loc[(int(w.rank), int(w.op_id))])
        except (KeyError, TypeError, ValueError):
            t_ms = -1
    if t_ms > 0:
        return int(w.start_ns) + t_ms * 1_000_000
    return _int(states["last_event_ns"].get(int(w.rank), -1)) if "last_event_ns" in states else -1


def _int(v: object) -> int:
    """-1 for a missing or NaN time (a rank that wrote no event or heartbeat)."""
    try:
        return int(v) if v is not None and pd.notna(v) else -1
    except (TypeError, ValueError):
        return -1


def _idle_at(ix: TraceIndex, rank: int, arrived_ns: int, gave_up_ns: int) -> bool:
    """Was `rank` in no traced op at `gave_up_ns` (its previous op over, the next not begun)?"""
    ops = ix.trace.ops
    mine = ops[(ops["rank"] == rank) & (ops["start_ns"] < arrived_ns)]
    if not len(mine):
        return True
    prev = mine.loc[mine["start_ns"].idxmax()]
    end = int(prev["end_ns"])
    unsure = end < 0 or INFERRED in str(prev.get("message", ""))
    if unsure and int(prev.get("collective_seq_id", -1)) >= 0 and str(prev.get("kind", "")) == "collective":
        # A collective ends together on its members: when every other member completed it, so did this
        # rank (Flight Recorder often leaves a gloo work 'started' that the job did complete)
        coll = ix.coll
        peers = coll[(coll["process_group"] == prev["process_group"])
                     & (coll["collective_seq_id"] == prev["collective_seq_id"]) & (coll["rank"] != rank)]
        if len(peers) and (peers["status"] == "ok").all() and (peers["end_ns"] >= 0).all():
            end = int(peers["end_ns"].max())
    if end < 0:
        return False                                    # still in it: blocked elsewhere, not idle
    return end <= gave_up_ns


def _finding(ix: TraceIndex, key: tuple[str, int], w: object, late: pd.DataFrame, rows: pd.DataFrame,
             gave_up: int, never: list[int]) -> Finding:
    trace = ix.trace
    g, k = key
    lr = sorted({int(r) for r in late["rank"]} | set(never))
    wr = int(w.rank)
    waited = (gave_up - int(w.start_ns)) / 1e9
    op, label = str(w.op_name), ix.label(g)
    who = lr[0]
    arrived = int(late["start_ns"].min()) if who not in never else ix.end_ns
    mine = trace.ops[(trace.ops["rank"] == who) & (trace.ops["start_ns"] < min(arrived, gave_up + 1))]
    since = int(mine["end_ns"].clip(lower=0).max()) if len(mine) else int(w.start_ns)
    frame, dumped = user_frame(trace, who, min(since, int(w.start_ns)), arrived)
    where = (f"; it was outside any collective, at {frame}"
             + (f" ({(dumped - int(w.start_ns)) / 1e9:.1f} s into the wait)" if dumped >= 0 else "")
             if frame else "; it was in no traced op in between")
    if who in never:
        title = (f"{rank_label(trace, lr)} never reached {op} #{k} on {label}: {rank_label(trace, [wr])} "
                 f"gave up waiting for it after {waited:.1f} s (timeout){where}")
    else:
        after = (arrived - int(w.start_ns)) / 1e9
        title = (f"{rank_label(trace, lr)} reached {op} #{k} on {label} {after:.1f} s after "
                 f"{rank_label(trace, [wr])}, which gave up after {waited:.1f} s (timeout){where}")
    ev = [Evidence(rank=int(r.rank), note=f"began {op} #{k} {(int(r.start_ns) - int(w.start_ns)) / 1e9:.1f} s after "
                                          f"rank {wr}, after it had timed out", op_name=op, process_group=g, seq=k,
                   op_id=int(r.op_id), time_ns=int(r.start_ns)) for r in late.itertuples(index=False)]
    ev += [Evidence(rank=r, note=f"never began {op} #{k}; alive and in no op when rank {wr} timed out",
                    op_name=op, process_group=g, seq=k) for r in never]
    ev.append(Evidence(rank=wr, note=f"waited in {op} #{k} from {w.call_site or 'an unknown site'}, timed out "
                                     f"after {waited:.1f} s", op_name=op, process_group=g, seq=k,
                       op_id=int(w.op_id), time_ns=int(w.start_ns)))
    on_time = sorted(int(r) for r in rows[rows["start_ns"] <= gave_up]["rank"])
    wait = WaitSummary(text=f"{rank_label(trace, on_time)} waited {waited:.1f} s in {op} #{k} on {label} and "
                            "timed out", waiting_ranks=tuple(on_time), direct_waiters=(wr,), wait_s=waited)
    return Finding(kind="stuck_in_compute", severity="error", title=title, ranks=lr, evidence=ev,
                   instance=InstanceRef(g, k), instances=[InstanceRef(g, k)], involved=sorted(set(lr) | set(on_time)),
                   wait=wait, data={"late_by_s": round((arrived - int(w.start_ns)) / 1e9, 3) if who not in never else None,
                                    "never_arrived": never, "waiter_timeout_s": round(waited, 3),
                                    "call_site": frame},
                   cause=Cause(basis=CauseBasis.LATE_ARRIVAL))
