"""What the wait-for graph cannot answer on its own, asked by diagnose (`fr_roots`).

`stopped_roots`: every rank stopped with no op in flight, yet the job had
  more to do: groups were created that no collective ever used (pg_config
  lists them), or, in a Flight Recorder dump whose pg_config is empty (gloo),
  every rank's dump was written longer after its last op than that op's own
  collective timeout (`timeout_ms`): each rank sat outside any collective for
  longer than a collective may take, and something then dumped it (a watchdog,
  a signal, the launcher). Nothing waits on anybody, so the graph finds no
  root and the verdict would read OK; it must say what is known instead
  (`no_op_in_flight`, "STOPPED"): where the ranks stopped, that no collective
  was in flight, and what that leaves (the job hung or died outside
  collectives, for example in group creation). A dump taken right after the
  last op (a healthy job dumped on demand) has neither and stays OK.

`resolve_by_history` (ties and lone records decided by each rank's own history) lives in history_ties.py.
"""
from __future__ import annotations

from typing import Any

import pandas as pd

from ncclscope import schema as S
from ncclscope.findings import Evidence, Finding
from ncclscope.index.rank_states import own_error
from ncclscope.index.views import IndexLike, as_index
from ncclscope.index.labels import fmt_ranks, rank_label
from ncclscope.hang.group_order import in_group_creation
from ncclscope.hang.behind import left_behind
from ncclscope.hang.dump_idle import ended_early
from ncclscope.index.dump_gaps import PACE_FACTOR, PACE_MIN_OPS, dump_times_known, p2p_unrecorded
from ncclscope.hang.outlived import outlived_roots
from ncclscope.hang.history_ties import resolve_by_history
from ncclscope.hang.wording import duration


def fr_roots(source: IndexLike, roots: list[Finding], others: list[Finding]) -> tuple[list[Finding], list[Finding]]:
    """(roots, others) for `diagnose.combine`, with what this module knows folded in:

    - ties and lone records decided by history (`resolve_by_history`);
    - a group-creation disagreement (ranks' views of a group's members differ, or one rank created its
      groups in another order: group_order.py) about ranks the wait-for roots involve, or with a root rank
      stuck inside group creation (`in_group_creation`), comes first:
      groups built differently pair the wrong processes, and the hang or deadlock that follows is its
      consequence (filed under it as supporting); with no wait-for root, the first error heads;
    - the stopped job (`stopped_roots`) when nothing else is known, else the ranks the launcher had to stop
      after their peers finished (`outlived.outlived_roots`).
    """
    others = resolve_by_history(source, others)
    involved = {r for f in roots for r in f.involved_ranks}
    creating = in_group_creation(as_index(source).trace, roots)
    views = [f for f in others if f.kind == "group_mismatch" and f.severity == "error"
             and f.data.get("attribute") in ("members", "creation_order") and (set(f.ranks) & involved or creating)]
    if views:
        head = views[0]
        return [head], [f for f in others if f is not head] + roots
    known = roots + others
    return roots + (stopped_roots(source, known) or outlived_roots(source, known)), others


# --------------------------------------------------------------------------
# All ranks stopped, nothing in flight
# --------------------------------------------------------------------------
def stopped_roots(source: IndexLike, roots: list[Finding] | None = None) -> list[Finding]:
    """A `no_op_in_flight` error when every rank stopped with nothing in flight before using the groups it made."""
    ix = as_index(source)
    if any(f.severity == "error" for f in roots or []):      # something specific is known: it speaks
        return []
    trace, coll = ix.trace, ix.coll
    present = [r for r, info in trace.ranks.items() if info.present]
    if not present or len(present) < len(trace.ranks):
        return []
    if all(trace.ranks[r].state == "finished" for r in present):   # a job that ended cleanly did not stop
        return []
    if failed_alone(trace, present):        # it died at that rank: the dead rank speaks, not a hang
        return []
    if len(ix.blocking) or (len(coll) and (coll["status"].astype(str) != S.STATUS_OK).any()):
        return []
    used = set(coll["process_group"].astype(str)) if len(coll) else set()
    p2p = ix.p2p
    if len(p2p):                                   # a group used for send/recv (CP's ring) was used
        used |= set(p2p["process_group"].astype(str))
    unused = sorted((n for n, g in ix.recorded.items() if g.kind != "world" and g.size >= 2 and n not in used),
                    key=lambda n: (len(n), n))
    if not unused and trace.run.source == "flight_recorder":
        seen = set(coll["rank"].astype(int)) | (set(p2p["rank"].astype(int)) if len(p2p) else set())
        empty = [r for r in present if r not in seen]
        if empty:
            return [_empty_dumps(ix, present, empty)]
    idle = None if unused else ix.dump_gaps
    if (not unused and idle is None and trace.run.source == "flight_recorder" and p2p_unrecorded(ix)
            and not dump_times_known(trace)):
        return [_times_unknown(ix, present)]
    if not unused and (idle is None or not idle["idle"].any()):
        return []
    split = _split(ix, idle, present)
    if isinstance(split, list):
        return split
    stopped, others, went, later_stop = split
    where = _last_ops(ix, stopped)
    example = _where_else(ix, stopped)
    if others:
        head = (f"{rank_label(trace, stopped)} stopped after {where}, no collective in flight, while "
                f"{rank_label(trace, others)} went on to collectives on {went}{later_stop}: the stopped ranks hung or died "
                f"outside collectives, {example}")
    else:
        head = (f"all ranks stopped after {where}, no collective in flight: the job hung or died outside "
                f"collectives, {example}")
    if unused:
        shown = ", ".join(ix.label(n) for n in unused[:6]) + (f" and {len(unused) - 6} more" if len(unused) > 6 else "")
        title = (f"{head} ({len(unused)} process group{'s' if len(unused) != 1 else ''} {shown} "
                 f"{'were' if len(unused) != 1 else 'was'} created but no collective ever ran on "
                 f"{'them' if len(unused) != 1 else 'it'})")
    else:
        sub = idle.loc[stopped]
        lo, hi, tmo = int(sub["gap"].min()), int(sub["gap"].max()), int(sub["tmo"].max())
        span = duration(lo) if duration(lo) == duration(hi) else f"{duration(lo)} to {duration(hi)}"
        whose = "every rank's" if not others else ("its" if len(stopped) == 1 else "their")
        its = 'its' if not others or len(stopped) == 1 else 'their'
        past_tmo = bool((sub["gap"] > sub["tmo"]).all())
        why = (f"longer than {its} {duration(tmo)} collective timeout" if past_tmo else
               f"over {PACE_FACTOR} times {its} longest interval between two ops "
               f"({duration(int(sub['pace'].max()))})")
        title = (f"{head} ({whose} Flight Recorder dump{'s were' if others and len(stopped) > 1 else ' was'} "
                 f"written {span} after {its} last op, {why})")
    ev = _stopped_evidence(coll, stopped, others, idle)
    data = {"unused_groups": unused, "stopped_after": where}
    if idle is not None:
        sub = idle.loc[stopped]
        data["idle_before_dump_s"] = [round(int(sub["gap"].min()) / 1e9, 3), round(int(sub["gap"].max()) / 1e9, 3)]
        data["went_on"] = others
    return [Finding(kind="no_op_in_flight", severity="error", title=title, ranks=sorted(int(r) for r in stopped),
                    evidence=ev[:60], involved=sorted(int(r) for r in present), data=data)]


def _times_unknown(ix: Any, present: list[int]) -> Finding:
    """Every rank stopped with nothing in flight, and the dumps' file times are not when they were written
    (copied files: scp, a bucket, kubectl cp keep none): whether the ranks sat idle past their timeout
    (hung outside collectives) or were dumped on demand after a clean end, the dumps cannot say. On gloo
    (asked only there: its dumps record no send/recv, so a rank outside every recorded op may be blocked in
    one) dumps are written on a timeout far more often than on demand, so the job is not called healthy;
    nobody is blamed, and it is a warning, not an error (seed 20261230 #58 and #166, dumps copied without
    their times: "OK"). NCCL records send/recv: there a dump with nothing in flight stays OK."""
    where = _last_ops(ix, present)
    title = (f"all ranks stopped after {where}, no collective in flight, and when their Flight Recorder dumps "
             f"were written is unknown (the files' times are not those of their writing: copied?): the job may "
             f"have hung or died outside collectives, {_where_else(ix, present)}, or have been dumped on "
             f"demand after it ended; the dumps cannot say which (analyze the files where torch wrote them, or "
             f"copied with their times kept: `cp -p`, `scp -p`, `rsync -t`)")
    ev = _stopped_evidence(ix.coll, present, [], None)
    return Finding(kind="no_op_in_flight", severity="warning", title=title, ranks=sorted(int(r) for r in present),
                   evidence=ev[:60], involved=sorted(int(r) for r in present),
                   data={"unused_groups": [], "stopped_after": where, "dump_times_unknown": True})


def failed_alone(trace: Any, present: list[int]) -> bool:
    """Did some rank fail of its own error (an exception of its own code, not a peer's timeout or closed
    socket: rank_states.PEER_ERROR) while every other rank finished or was stopped by the launcher (torchrun
    ends a job's other workers when one fails)? Then nothing hung outside collectives: the job died at that
    rank, after its last collective (seed 20261222 #142: an assertion in the last iteration's compute; the
    other rank, in destroy_process_group, was stopped for it). A timeout's exception is no such failure: a
    rank that gave up waiting in group creation is the hang's victim."""
    own = [r for r in present if trace.ranks[r].state == "failed" and own_error(trace.ranks[r].end_message)]
    return bool(own) and all(trace.ranks[r].state == "finished" or trace.ranks[r].stopped_by_launcher
                             for r in present if r not in own)


def _split(ix: Any, idle: pd.DataFrame | None, present: list[int]
           ) -> "tuple[list[int], list[int], str, str] | list[Finding]":
    """(ranks that stopped, ranks that went on, the groups they went on to, how the latter ended) for
    `stopped_roots`, or its answer outright (`ended_early`'s finding, or nothing) where the split says so."""
    coll = ix.coll
    stopped, others, later_stop = list(present), [], ""
    if idle is not None and not idle["idle"].all():
        # some ranks sat idle past their timeout while the others went on: the others' last ops must all
        # come after the stopped ranks' (they passed where the stopped ones stopped), else nothing is said
        stopped = sorted(int(r) for r in idle.index[idle["idle"]])
        others = sorted(int(r) for r in idle.index[~idle["idle"]])
        if int(idle.loc[others, "t"].min()) <= int(idle.loc[stopped, "t"].max()):
            early = ended_early(ix, idle, _last_ops(ix, present))
            return [early] if early is not None else []
    elif idle is not None:
        # every rank idle: those the others went past stopped first (behind.left_behind)
        stopped, others = left_behind(coll, present)
        stopped = stopped or list(present)
        later_stop = " and stopped there later (nothing in flight either)" if others else ""
    if not others:
        return stopped, others, "", later_stop
    t_stop = int(idle.loc[stopped, "t"].max())          # others come only from `idle`
    later = coll[coll["rank"].isin(others).to_numpy() & (coll["start_ns"] > t_stop).to_numpy()]
    gs = sorted(set(later["process_group"].astype(str)), key=lambda n: (len(n), n))
    went = ", ".join(gs[:6]) + (f" and {len(gs) - 6} more" if len(gs) > 6 else "")
    return stopped, others, went, later_stop


def _where_else(ix: Any, stopped: list[int]) -> str:
    """Where ranks outside every collective may be: a rank that ran its loop (PACE_MIN_OPS ops or more) on a
    backend that records no send/recv (gloo) most likely waits in one; a rank that stopped after its
    set-up ops, in the creation of the groups its loop uses."""
    coll = ix.coll
    n = coll[coll["rank"].isin(stopped).to_numpy()].groupby("rank").size() if len(coll) else None
    if n is not None and len(n) and int(n.min()) >= PACE_MIN_OPS and p2p_unrecorded(ix):
        return "for example in a send/recv (gloo records none), in compute, or in group creation"
    return "for example in group creation"


def _empty_dumps(ix: Any, present: list[int], empty: list[int]) -> Finding:
    """Flight Recorder dumps, nothing in flight, and some (or all) ranks' dumps hold no op: those ranks
    stopped before their first recorded collective (process-group creation, a rendezvous, the first
    compute) while the rest, if any, completed theirs and stopped too. A dump is written when something
    went wrong or was asked for; such a set shows nothing healthy, and no one rank to blame on its own."""
    trace = ix.trace
    n = len(present)
    if len(empty) == n:
        head = f"all ranks stopped before their first recorded collective: every one of the {n} Flight " \
               f"Recorder dumps holds no op"
    else:
        went = sorted(r for r in present if r not in empty)
        head = (f"{rank_label(trace, empty)} stopped before {'its' if len(empty) == 1 else 'their'} first recorded "
                f"collective (no op in {'its' if len(empty) == 1 else 'their'} Flight Recorder dump"
                f"{'' if len(empty) == 1 else 's'}) while {rank_label(trace, went)} stopped after "
                f"{_last_ops(ix, went)}")
    title = (f"{head}, nothing in flight: the job hung or died before those ranks communicated, for example "
             f"in process-group creation (the dumps cannot say which rank)")
    ev = [Evidence(rank=int(r), note="Flight Recorder dump holds no entry") for r in empty[:60]]
    return Finding(kind="no_op_in_flight", severity="error", title=title, ranks=sorted(int(r) for r in present),
                   evidence=ev, involved=sorted(int(r) for r in present),
                   data={"unused_groups": [], "stopped_after": "recording nothing"})


def _stopped_evidence(coll: pd.DataFrame, stopped: list[int], others: list[int],
                      idle: pd.DataFrame | None) -> list[Evidence]:
    """The stopped ranks' last ops (or that they recorded none), then the last ops of the ranks that went on."""
    ev = []
    mine = coll[coll["rank"].isin(stopped).to_numpy()] if len(coll) else coll
    last = mine.sort_values(["rank", "start_ns"]).drop_duplicates("rank", keep="last") if len(mine) else mine
    for r in last.itertuples(index=False):
        gap = f"; its dump came {duration(int(idle.at[int(r.rank), 'gap']))} later" if idle is not None else ""
        ev.append(Evidence(rank=int(r.rank), note=f"last op {r.op_name} #{int(r.collective_seq_id)} on "
                                                  f"{r.process_group}: {r.status}; nothing after it{gap}",
                           op_name=str(r.op_name), process_group=str(r.process_group), seq=int(r.collective_seq_id),
                           op_id=int(r.op_id), time_ns=int(r.start_ns)))
    for r in sorted(set(stopped) - set(int(x) for x in last["rank"]) if len(last) else stopped):
        ev.append(Evidence(rank=int(r), note="recorded no collective"))
    if others:
        on = coll[coll["rank"].isin(others).to_numpy()].sort_values(["rank", "start_ns"])
        for r in on.drop_duplicates("rank", keep="last").head(8).itertuples(index=False):
            sat = idle is not None and bool(idle.at[int(r.rank), "idle"])
            then = (f"stopped there too, its dump came {duration(int(idle.at[int(r.rank), 'gap']))} later" if sat
                    else "dumped right after it")
            ev.append(Evidence(rank=int(r.rank), note=f"went on: last op {r.op_name} #{int(r.collective_seq_id)} "
                                                      f"on {r.process_group}: {r.status}, {then}",
                               op_name=str(r.op_name), process_group=str(r.process_group),
                               seq=int(r.collective_seq_id), op_id=int(r.op_id), time_ns=int(r.start_ns)))
    return ev


def _last_ops(ix, present: list[int]) -> str:
    """"broadcast #1 on default_pg" when every rank's last op is the same instance, else a short list."""
    coll = ix.coll
    coll = coll[coll["rank"].isin(present).to_numpy()] if len(coll) else coll
    if not len(coll):
        return "recording nothing"
    last = coll.sort_values(["rank", "start_ns"]).drop_duplicates("rank", keep="last")
    keys = last.groupby(["op_name", "process_group", "collective_seq_id"], sort=False)["rank"].agg(list)
    parts = [f"{op} #{int(k)} on {g}" + ("" if len(keys) == 1 else f" (ranks {fmt_ranks(rs)})")
             for (op, g, k), rs in keys.items()]
    missing = sorted(set(present) - set(int(r) for r in last["rank"]))
    if missing:
        parts.append(f"nothing ({rank_label(ix.trace, missing)})")
    return "; ".join(parts[:4]) + (" ..." if len(parts) > 4 else "")
