"""`wrong_group` from calls on a process group the calling rank is not a member of.

torch makes such a call a no-op: `dist.all_reduce(x, group=evens)` on an odd
rank warns and returns at once, communicating nothing. It is the classic
slip of code that builds per-stage or per-replica groups with `new_group` on
every rank and then picks the wrong handle on one of them: the group the rank
should have used never sees its call, and its members wait for it. The
tracer (`ncclscope run`) writes a marker row for each such call
(status `not_member`, with the user's call site), so the analyzer does not
have to guess the skip from timing.

One finding per (rank, op, call site). It is an error that can head the
verdict when the rank is a missing participant of an unfinished instance on
the group its own other calls from that site went to (the call it made
instead); otherwise it is information: some code calls collectives on every
rank with every group on purpose, and a healthy run must stay quiet.
"""
from __future__ import annotations

from dataclasses import replace

from ncclscope import schema as S
from ncclscope.findings import Cause, CauseBasis, Evidence, Finding, InstanceRef, WaitSummary, WrongCall
from ncclscope.index.views import IndexLike, as_index
from ncclscope.index.labels import rank_label
from ncclscope.hang.wording import duration, wait_ns, wait_seconds

MAX_FINDINGS = 16
# The JSON order of the finding's `data` (its cause's claims among them), as earlier releases wrote it.
NONMEMBER_LAYOUT = ("call_site", "basis", "wrong_group", "calls", "step", "wrong_ns", "process_group", "seq",
                    "partner_deaths")


def find_nonmember_calls(source: IndexLike) -> list[Finding]:
    """The `not_member` marker rows, one finding per (rank, op, call site), hang-explaining ones first."""
    ix = as_index(source)
    ev = ix.trace.marks
    if not len(ev) or "status" not in ev.columns:
        return []
    hit = (ev["status"] == S.STATUS_NOT_MEMBER).to_numpy()     # on the categorical: no string per event
    if not hit.any():
        return []
    rows = ev[hit]
    calls = (rows.assign(op_name=rows["op_name"].astype(str), call_site=rows["call_site"].astype(str))
             .groupby(["rank", "op_name", "call_site"], sort=True)
             .agg(first_ns=("t_ns", "min"), n=("t_ns", "size"), step=("step", "min")).reset_index())
    out = [_finding(ix, c) for c in calls.head(MAX_FINDINGS).itertuples(index=False)]
    return sorted(out, key=lambda f: (f.severity != "error", f.ranks))


def _meant_group(ix, rank: int, op: str, site: str) -> tuple[str, str]:
    """(group, basis): the group the rank's own calls of `op` from `site` went to most often ("own"); when it
    has none (every call from there was the wrong one), the group of its peers' calls from the same site that
    it is a member of, one it is missing from first ("peers"); ("", "") when neither says."""
    coll = ix.coll
    here = coll[(coll["call_site"] == site).to_numpy() & (coll["op_name"] == op).to_numpy()]
    mine = here[here["rank"].to_numpy() == rank]
    if len(mine):
        return str(mine["process_group"].astype(str).value_counts().index[0]), "own"
    groups = [g for g in here["process_group"].astype(str).unique() if rank in ix.members.get(g, ())]
    if not groups:
        return "", ""
    missing = ix.missing
    absent = set(missing.loc[missing["rank"].to_numpy() == rank, "process_group"].astype(str)) if len(missing) else set()
    return sorted(groups, key=lambda g: (g not in absent, g))[0], "peers"


def _finding(ix, c) -> Finding:
    trace = ix.trace
    rank, op, site = int(c.rank), str(c.op_name), str(c.call_site)
    usual, basis = _meant_group(ix, rank, op, site)
    where = f" at {site}" if site else ""
    title = (f"{rank_label(trace, [rank])} called {op}{where} on a process group it is not a member of, "
             f"so torch returned without communicating" + (f" ({int(c.n)} calls)" if c.n > 1 else ""))
    data = {"call_site": site, "calls": int(c.n), "step": int(c.step)}
    cause = Cause(basis=CauseBasis.NOT_MEMBER, wrong=WrongCall("", None, int(c.first_ns)))
    evidence = [Evidence(rank=rank, note=f"{op}{where}: not a member of the group passed; a no-op",
                         op_name=op, time_ns=int(c.first_ns))]
    missing = ix.missing
    miss = missing[(missing["rank"].to_numpy() == rank) & (missing["process_group"] == usual).to_numpy()] \
        if usual and len(missing) else missing.iloc[0:0]
    if usual:
        title += (f"; its other {op} calls there went to {ix.label(usual)}" if basis == "own" else
                  f"; its peers' calls there go to {ix.label(usual)}, a group it is in")
        data["process_group"] = usual
    seq = int(miss["seq"].min()) if len(miss) else _shifted(ix, rank, op, site, usual, int(c.first_ns))
    if seq < 0:
        return Finding(kind="wrong_group", severity="info", title=title, ranks=[rank], evidence=evidence,
                       data=data, cause=cause, layout=NONMEMBER_LAYOUT)
    coll = ix.coll
    waiting = coll[(coll["process_group"] == usual).to_numpy() & (coll["collective_seq_id"].to_numpy() == seq)
                   & (coll["rank"].to_numpy() != rank) & (coll["status"].astype(str) != "ok").to_numpy()]
    waiting = waiting.sort_values("rank")
    since = wait_ns(ix.end_ns, waiting["start_ns"].min()) if len(waiting) else None
    if len(waiting):
        title += (f", whose {op} #{seq} {rank_label(trace, waiting['rank'])} "
                  f"{'is' if len(waiting) == 1 else 'are'} waiting in"
                  + (f" since {duration(since)}" if duration(since) else ""))
    evidence += [Evidence(rank=int(w.rank), note=f"in {usual} #{seq}: {w.status}, waiting for rank {rank}",
                          op_name=str(w.op_name), process_group=usual, seq=seq, op_id=int(w.op_id),
                          time_ns=int(w.start_ns)) for w in waiting.head(8).itertuples(index=False)]
    # members left waiting in that instance that then died (killed by the launcher, aborted by gloo) died of it
    data["seq"] = seq
    cause = replace(cause, partner_deaths=tuple(int(r) for r in waiting["rank"].unique()
                                                if int(r) in trace.ranks and trace.ranks[int(r)].died))
    wait_s = wait_seconds(ix.end_ns, waiting["start_ns"].min()) if len(waiting) else None
    return Finding(kind="wrong_group", severity="error", title=title, ranks=[rank], evidence=evidence,
                   instance=InstanceRef(usual, seq),
                   wait=WaitSummary(waiting_ranks=tuple(int(x) for x in waiting["rank"]),
                                    wait_s=wait_s), data=data, cause=cause, layout=NONMEMBER_LAYOUT)


def _shifted(ix, rank: int, op: str, site: str, usual: str, after_ns: int) -> int:
    """The instance of `usual` where the rank's next call, after its no-op one, met its peers' call from the
    site it left out: the rank posted #k there from another line (its sequence shifted by the call that
    never reached the group), k unfinished, some other member's #k being `op` from `site`. -1 otherwise.
    (seed 20261213 #235: rank 1's all_reduce from line 47 went to a group it is not in; its next call on its
    rep group, an all_gather from line 55, met rank 0's all_reduce from line 47 and both hung: a 1 vs 1 tie
    the mismatch vote could not break.)"""
    if not usual:
        return -1
    coll = ix.coll
    mine = coll[(coll["rank"].to_numpy() == rank) & (coll["process_group"] == usual).to_numpy()
                & (coll["start_ns"].to_numpy() > after_ns)]
    if not len(mine):
        return -1
    nxt = mine.sort_values("collective_seq_id").iloc[0]
    if str(nxt["status"]) == S.STATUS_OK or (str(nxt["call_site"]) == site and str(nxt["op_name"]) == op):
        return -1
    k = int(nxt["collective_seq_id"])
    peers = coll[(coll["process_group"] == usual).to_numpy() & (coll["collective_seq_id"].to_numpy() == k)
                 & (coll["rank"].to_numpy() != rank)]
    met = peers[(peers["call_site"].astype(str) == site).to_numpy() & (peers["op_name"].astype(str) == op).to_numpy()]
    return k if len(met) else -1
