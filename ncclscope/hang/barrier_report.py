"""Ranks that never reached a monitored barrier, named by the barrier itself.

`dist.monitored_barrier` (gloo) is torch's own hang detector: rank 0 waits for every member, each with the
barrier's timeout, and raises "[Rank 0]: Rank 2 failed to pass monitoredBarrier in 5000 ms" (with
`wait_all_ranks=True`, "Ranks 1, 2 failed to pass ..."); the members that did arrive then raise "Rank 1
successfully reached monitoredBarrier, but received errors while waiting for send/recv from rank 0". The
reporter's death (it raises) and the members stuck behind it are the consequence; the ranks it names never
arrived, wherever they were instead (past a barrier they skipped, in the next step's collective, in a long
compute): the first deviation. The tracer records the barrier without a sequence number (gloo's collective
counter has no place for it that peers could align on), so no instance question sees the barrier: its report
is the evidence. `verdict.diagnose` promotes the finding over the reporter's death (`Cause.basis` BARRIER).
"""
from __future__ import annotations

import re

from ncclscope import schema as S
from ncclscope.findings import Cause, CauseBasis, Evidence, Finding, FindingKind
from ncclscope.index.labels import rank_label
from ncclscope.index.views import TraceIndex
from ncclscope.load.opsjoin import STATUS_INFLIGHT

REPORT = re.compile(r"Ranks? ([0-9][0-9, ]*) failed to pass monitoredBarrier in ([0-9]+) ms")
LAYOUT = ("call_site", "step", "reporter", "barrier_site", "basis", "before_death")


def barrier_reports(ix: TraceIndex) -> list[Finding]:
    """One finding per monitored barrier report in the trace (an op's error message, or a rank's last words),
    naming the ranks it says never arrived."""
    trace = ix.trace
    ops = trace.ops
    # reporter -> (message, barrier's call site, step, when it reported: its failed op's end, else its last event)
    reports: dict[int, tuple[str, str, int, int]] = {}
    if len(ops) and "message" in ops.columns:
        # compared as they are (a categorical's codes at scale), never converted to strings row by row
        barrier = (ops["op_name"] == "monitored_barrier").to_numpy(dtype=bool, na_value=False)
        bad = ops[barrier & (ops["status"] == S.STATUS_ERROR).to_numpy(dtype=bool, na_value=False)] \
            if barrier.any() else ops.iloc[0:0]
        for r in bad.itertuples(index=False):
            if REPORT.search(str(r.message)):
                reports.setdefault(int(r.rank), (str(r.message), str(r.call_site), int(r.step), int(r.end_ns)))
    for rank, info in trace.ranks.items():
        if rank not in reports and REPORT.search(info.end_message or ""):
            reports[rank] = (str(info.end_message), "", -1, -1)
    if not reports:
        return []
    last = trace.last_event_ns()
    reports = {r: (m, s, k, at if at >= 0 else int(last.get(r, -1))) for r, (m, s, k, at) in reports.items()}
    out = []
    for reporter, (message, site, step, at) in sorted(reports.items()):
        m = REPORT.search(message)
        assert m is not None
        named = sorted({int(x) for x in re.findall(r"[0-9]+", m.group(1))} & set(trace.ranks) - {reporter})
        # a named rank that had died before the report (its own error, a signal) died first: that death is the
        # deviation, and the barrier only noticed it
        named = [r for r in named if not (trace.ranks[r].died and 0 <= int(last.get(r, -1)) < at)]
        if named:
            out.append(_finding(ix, reporter, named, message[m.start():m.end()], site, step, int(m.group(2))))
    return out


def _finding(ix: TraceIndex, reporter: int, named: list[int], report: str, site: str, step: int,
             timeout_ms: int) -> Finding:
    trace = ix.trace
    ops = trace.ops
    who = rank_label(trace, named)
    where = f" at {site}" if site else ""
    title = (f"{who} never reached the monitored_barrier{where}: rank {reporter}'s barrier gave up on "
             f"{'it' if len(named) == 1 else 'them'} after {timeout_ms / 1000:g} s (\"{report}\")")
    ev = [Evidence(rank=reporter, note=f"monitored_barrier reported: {report}", op_name="monitored_barrier")]
    instead, call_site = "", site
    for r in named:
        mine = ops[(ops["rank"] == r).to_numpy()]
        if not len(mine):
            continue
        last = mine.iloc[-1]
        state = "in" if str(last["status"]) in (STATUS_INFLIGHT, S.STATUS_ERROR) else "last in"
        seq = int(last["collective_seq_id"])
        op = f"{last['op_name']}" + (f" #{seq}" if seq >= 0 else "") + (
            f" on {ix.label(str(last['process_group']))}" if str(last["process_group"]) else "")
        ev.append(Evidence(rank=r, note=f"{state} {op} at {last['call_site']} instead", op_name=str(last["op_name"]),
                           process_group=str(last["process_group"]), seq=seq, op_id=int(last["op_id"]),
                           time_ns=int(last["start_ns"])))
        if not instead:     # where the first of them was instead: the line that tells its path apart
            instead, call_site = f"; rank {r} was {state} {op} at {last['call_site']}", str(last["call_site"])
    return Finding(kind=FindingKind.HANG, severity="error", title=title + instead, ranks=named, evidence=ev,
                   involved=sorted(set(named) | {reporter}),
                   data={"call_site": call_site, "step": step, "reporter": reporter, "barrier_site": site},
                   cause=Cause(basis=CauseBasis.BARRIER, before_death=True), layout=LAYOUT)
