"""Ranks that never ended while their peers finished: stuck outside communication at the end of the job.

    from ncclscope.hang.outlived import outlived_roots
    outlived_roots(ix, roots)      # [] unless some ranks finished and the launcher had to stop the others

Every rank runs the same program. When some ranks ran it to its end (exit 0) and the others were
still running when the launcher stopped the job, with no op in flight anywhere, nobody waited on
anybody: the wait-for graph has no root and the verdict read OK. But the job did not end; the ranks
the launcher stopped hung after their last op, in the user's compute, I/O or a wait of their own,
and no collective ties them to a peer (seed 20261213 #14: rank 2 sleeps in its last step, after its
last collective; its four peers exit 0; `ncclscope run` stopped it 150 s later). They are the root
(`stuck_in_compute`); where they were comes from the last stack dump they left (the tracer's own
dump when no op or step came for --timeout-s, the launcher's SIGTERM).

Silent when any rank failed or was killed (those speak for themselves), when no rank finished (a
deadline or an operator stopped the whole job: nothing tells the ranks apart), on traces that record
no process ends (Flight Recorder dumps, profiler traces), and when something else found an error.
"""
from __future__ import annotations

from ncclscope.findings import Evidence, Finding
from ncclscope.hang.wording import duration, last_stack_place
from ncclscope.index.labels import rank_label
from ncclscope.index.views import IndexLike, as_index


def outlived_roots(source: IndexLike, roots: list[Finding] | None = None) -> list[Finding]:
    """One `stuck_in_compute` error naming the ranks the launcher stopped after their peers finished."""
    if any(f.severity == "error" for f in roots or []):
        return []
    ix = as_index(source)
    trace = ix.trace
    present = [r for r, info in trace.ranks.items() if info.present]
    state = {r: trace.ranks[r].state for r in present}
    finished = sorted(r for r, s in state.items() if s == "finished")
    stopped = sorted(r for r, s in state.items() if s == "stopped")
    if not finished or not stopped or len(finished) + len(stopped) != len(present) or len(ix.blocking):
        return []
    st = ix.rank_states
    end = int(trace.end_ns)
    t0 = ix.start_ns
    first = stopped[0]
    row = st.loc[first]
    last_end = int(max(row.last_op_end_ns, row.last_op_start_ns))
    frame, place, where = last_stack_place(trace, first, last_end, end, t0) if last_end >= 0 else ("", "", None)
    idle = duration(end - last_end) if last_end >= 0 else ""
    who = rank_label(trace, stopped)
    verb = "was" if len(stopped) == 1 else "were"
    title = (f"{who} never ended: {rank_label(trace, finished)} finished (exit 0), and {who} {verb} still running "
             f"when the launcher stopped the job, in no communication op"
             + (f" for {idle} after {'its' if len(stopped) == 1 else 'their'} last op" if idle else "")
             + (f" ({row.last_op})" if row.last_op else ""))
    if where is not None:
        whose = "its" if len(stopped) == 1 else f"rank {first}'s"
        title += f"; {whose} {place}"
    ev = []
    for r in stopped[:8]:
        s = st.loc[r]
        ev.append(Evidence(rank=int(r), note=f"stopped by the launcher; last op: {s.last_op or 'none'}",
                           op_name=str(s.last_op), time_ns=int(s.last_op_start_ns)))
    if where is not None:
        ev.append(where)
    ev += [Evidence(rank=int(r), note="finished (exit 0)") for r in finished[:4]]
    return [Finding(kind="stuck_in_compute", severity="error", title=title, ranks=stopped, evidence=ev,
                    involved=sorted(present), data={"finished": finished, "stopped": stopped, "call_site": frame})]
