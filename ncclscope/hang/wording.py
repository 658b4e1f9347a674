"""The wording of the wait-for findings: how a wait, an op and its waiters are written.

Every hang finding says who the root is, who waits on it, since when and in
which op ("ranks 0,1,2 waiting since 6.0 s in all_reduce #9 on dp1[1,3]"),
and carries the same typed payload: the instances the waiters are blocked in,
every rank in the story, the wait summary and the roots' stack. Those are
written here once, for all the finding builders in waitfor.py.

Durations are said only where the input holds them (`wait_ns`, `since`): a
Flight Recorder dump without `time_created_ns` reads as start -1 (a zeroed one
as 0), and a dump taken as the op was issued ends where the op starts; those
waits are written with no "since" at all ("ranks 0,1 waiting in all_reduce #3
on dp0"), never as "0.0 s". A rank that left nothing behind is described by
what the input kind would have left (rank_states.missing_reason): a trace
directory, a Flight Recorder dump, a profiler trace.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

import pandas as pd

from ncclscope import schema as S
from ncclscope.findings import Evidence, InstanceRef, WaitSummary
from ncclscope.index.labels import NS, group_label, rank_label, seconds
from ncclscope.index.stack_excerpts import stack_for, user_frame

if TYPE_CHECKING:
    from ncclscope.load.trace import Trace
    from ncclscope.index.views import TraceIndex
    from ncclscope.index.wait_edges import WaitEdges

MAX_EVIDENCE = 40
MIN_SAID_NS = 1_000_000           # a wait under 1 ms is no duration a person can act on: none is said
MS_BELOW_NS = NS // 20            # under 0.05 s "0.0 s" would be said: milliseconds instead

def wait_since(end_ns: object, starts: pd.Series) -> int | None:
    """ns from the earliest of `starts` to `end_ns`; None when there is no usable time (no start, or an
    end that is not after it: a dump with no timestamps)."""
    return wait_ns(end_ns, starts.min()) if len(starts) else None


def wait_ns(end_ns: object, start_ns: object) -> int | None:
    """ns from `start_ns` to `end_ns`; None where the input holds no usable time for it: no start
    (a dump entry without a timestamp reads -1, a zeroed one 0, a missing value NaN) or an end
    that is not after it (every time in the dump is the same)."""
    try:
        start, end = int(start_ns), int(end_ns)         # type: ignore[call-overload]
    except (TypeError, ValueError):                     # None, NaN
        return None
    if start <= 0 or end <= start:
        return None
    return end - start


def duration(ns: int | None) -> str:
    """"6.0 s", "26 ms"; "" where there is no duration to say (no time, or under 1 ms)."""
    if ns is None or ns < MIN_SAID_NS:
        return ""
    return f"{ns / 1e6:.0f} ms" if ns < MS_BELOW_NS else seconds(ns)


def since(end_ns: object, start_ns: object, lead: str = " since ") -> str:
    """" since 6.0 s" (`lead` + the duration), or "" where the input gives no duration."""
    d = duration(wait_ns(end_ns, start_ns))
    return f"{lead}{d}" if d else ""


def wait_seconds(end_ns: object, start_ns: object) -> float | None:
    """`WaitSummary.wait_s`: the wait in seconds, None exactly where no duration is said."""
    ns = wait_ns(end_ns, start_ns)
    return round(ns / NS, 3) if ns is not None and ns >= MIN_SAID_NS else None


@dataclass
class WaitContext:
    """What every finding builder reads: the index, the rank states and the wait-for edges."""

    ix: TraceIndex
    edges: WaitEdges        # expanded per question: `edges.select(waiters=..., targets=..., group=...)`

    @property
    def trace(self) -> Trace:
        return self.ix.trace

    @property
    def members(self) -> dict[str, list[int]]:
        return self.ix.members

    @property
    def st(self) -> pd.DataFrame:
        return self.ix.rank_states

    @property
    def blocking(self) -> pd.DataFrame:
        return self.ix.blocking

    @property
    def coll(self) -> pd.DataFrame:
        return self.ix.coll

    @property
    def end(self) -> int:
        return self.ix.end_ns


def op_desc(ctx: WaitContext, row: object) -> str:
    """"all_reduce #9 on dp1[1,3]" or "recv #4 from rank 3"."""
    kind = getattr(row, "kind", getattr(row, "via", ""))
    if kind == S.KIND_COLLECTIVE:
        g = str(row.process_group)
        seq = getattr(row, "collective_seq_id", getattr(row, "seq", -1))
        return f"{row.op_name} #{int(seq)} on {group_label(g, ctx.members.get(g))}"
    seq = getattr(row, "p2p_seq_id", getattr(row, "seq", -1))
    prep = "from" if str(row.op_name).lower().endswith("recv") else "to"
    return f"{row.op_name} #{int(seq)} {prep} rank {int(row.peer)}"


def at_site(row: object) -> str:
    """" at train.py:30" where the op's row records the user's call site, else "": where a rank went instead
    is the line a user opens."""
    site = str(getattr(row, "call_site", "") or "")
    return f" at {site}" if site and site != "nan" else ""


def waiting_summary(ctx: WaitContext, waiters: set[int], roots: Iterable[int]) -> tuple[str, int, list[int]]:
    """("ranks 0,1,2 waiting since 6.0 s in all_reduce #9 on dp1[1,3]", start_ns, direct waiters)."""
    if not waiters:
        return "", -1, []
    roots = set(roots)
    b = ctx.blocking[ctx.blocking["rank"].isin(waiters)]
    start = int(b["start_ns"].min()) if len(b) else -1
    direct = ctx.edges.select(waiters=waiters, targets=roots)
    ops = []
    for row in direct.drop_duplicates(["op_name", "process_group", "seq", "via"]).itertuples(index=False):
        if row.via == S.KIND_COLLECTIVE:
            ops.append(op_desc(ctx, row))
        else:
            ops.append(f"{row.op_name} #{int(row.seq)} {'from' if str(row.op_name).endswith('recv') else 'to'} it")
    text = f"{rank_label(ctx.trace, waiters)} waiting" + since(ctx.end, start)
    n_direct = int(direct["waiter"].nunique())
    where = ", ".join(ops[:2]) + (f" and {len(ops) - 2} more ops" if len(ops) > 2 else "")
    if len(ops) == 1 and "call_site" in b.columns:   # the line they wait at: in SPMD code, the line the root missed
        sites = {str(x) for x in b.loc[b["rank"].isin(direct["waiter"]), "call_site"].astype(str)} - {"", "nan"}
        if len(sites) == 1:
            where += f" at {sites.pop()}"
    if ops and 2 * n_direct < len(waiters):
        # Most wait behind the direct waiters (a world barrier behind one group): say both.
        rest = b[~b["rank"].isin(direct["waiter"])].drop_duplicates("rank")
        behind = ""
        if len(rest):
            keys = ["kind", "op_name", "process_group", "collective_seq_id", "p2p_seq_id", "peer"]
            top = rest.groupby(keys, sort=False).size().sort_values(ascending=False, kind="stable")
            row = pd.Series(dict(zip(keys, top.index[0])))
            behind = f", the rest behind them (most in {op_desc(ctx, row)})"
        text += f", {n_direct} of them in {where}{behind}"
    elif ops:
        text += " in " + where
    return text, start, sorted(int(w) for w in direct["waiter"].unique())


def waiter_evidence(ctx: WaitContext, waiters: set[int], direct: list[int], roots: Iterable[int]) -> list[Evidence]:
    roots = set(roots)
    b = ctx.blocking[ctx.blocking["rank"].isin(waiters)]
    b = b.assign(direct=~b["rank"].isin(direct)).sort_values(["direct", "start_ns", "rank"])
    b = b.drop_duplicates("rank", keep="first").head(MAX_EVIDENCE)
    mine = ctx.edges.select(waiters=b["rank"].tolist())      # only the waiters shown
    targets = mine.groupby("waiter")["target"].agg(lambda s: sorted(set(int(x) for x in s)))
    ev = []
    for row in b.itertuples(index=False):
        on = targets.get(int(row.rank), [])
        who = ",".join(map(str, on[:8])) + ("..." if len(on) > 8 else "")
        note = f"{row.status}, waiting{since(ctx.end, row.start_ns)}" + (f" on rank {who}" if who else "")
        if int(row.rank) not in direct:
            note += " (indirectly)"
        ev.append(op_evidence(row, note))
    return ev


def last_stack_place(trace: "Trace", r: int, lo_ns: int, hi_ns: int, t0: int) -> tuple[str, str, Evidence | None]:
    """Where rank `r`'s latest stack dump inside [lo_ns, hi_ns] has its main thread in the user's code:
    (frame, "last stack dump (at T) has it at FRAME" for a title, its evidence); ("", "", None) when none."""
    frame, dumped = user_frame(trace, r, lo_ns, hi_ns, latest=True)
    if not frame:
        return "", "", None
    at = seconds(dumped - t0)
    return (frame, f"last stack dump (at {at}) has it at {frame}",
            Evidence(rank=int(r), note=f"main thread at {frame} (stack dump at {at})", time_ns=dumped))


def last_op_evidence(ctx: WaitContext, r: int, note: str | None = None) -> Evidence:
    """Rank `r`'s last op from its end state (`note` replaces the "last op: ..." text)."""
    row = ctx.st.loc[r]
    return Evidence(rank=int(r), note=note if note is not None else
                    f"last op: {row.last_op} ({row.last_op_status or 'n/a'})",
                    op_name=str(row.last_op), time_ns=int(row.last_op_start_ns))


def op_evidence(row: object, note: str) -> Evidence:
    kind = getattr(row, "kind", "")
    seq = int(row.collective_seq_id) if kind == S.KIND_COLLECTIVE else int(getattr(row, "p2p_seq_id", -1))
    return Evidence(rank=int(row.rank), note=note, op_name=str(row.op_name), process_group=str(row.process_group),
                    seq=seq, op_id=int(row.op_id), time_ns=int(row.start_ns), peer=int(row.peer))


def involved(ctx: WaitContext, ranks: Iterable[int]) -> dict[str, list]:
    b = ctx.blocking[ctx.blocking["rank"].isin(list(ranks))]
    c = b[b["kind"] == S.KIND_COLLECTIVE]
    p = b[b["kind"] == S.KIND_P2P]
    return {"instances": sorted({(str(g), int(k)) for g, k in zip(c["process_group"], c["collective_seq_id"])}),
            "p2p": sorted({(int(r), str(o), int(q), int(s)) for r, o, q, s in
                           zip(p["rank"], p["op_name"], p["peer"], p["p2p_seq_id"])})}


def payload(ctx: WaitContext, roots: list[int], waiters: set[int], direct: list[int], start: int, summary: str,
            instance: tuple[str, int] | None = None, **extra: object) -> dict[str, Any]:
    """The typed fields every wait-for finding carries, as keyword arguments of `Finding`.

    `data` keeps the analysis-specific extras (root ranks, the p2p ops in the story, `extra`)."""
    inv = involved(ctx, set(roots) | waiters)
    data = {"root_ranks": sorted(roots), "p2p": [list(x) for x in inv["p2p"]], **extra}
    return {
        "data": data,
        "instance": InstanceRef(str(instance[0]), int(instance[1])) if instance is not None else None,
        "instances": [InstanceRef(g, k) for g, k in inv["instances"]],
        "involved": sorted(set(roots) | set(int(w) for w in waiters)),
        "wait": WaitSummary(text=summary, waiting_ranks=tuple(sorted(int(w) for w in waiters)),
                            direct_waiters=tuple(direct),
                            wait_s=wait_seconds(ctx.end, start)),
        "stack": stack_for(ctx.trace, roots),
    }


def sort_key(waiters: set[int], start: int, last_ns: int = 2**62) -> tuple:
    """Roots with the most waiters first, then the earliest wait; between deaths alike in both, the rank whose
    last sign of life (`last_ns`) came first: the first to die is the first deviation."""
    return (-len(waiters), start if start >= 0 else 2**62, last_ns)


def edge_desc(ctx: WaitContext, e: pd.Series) -> str:
    if e["via"] == S.KIND_COLLECTIVE:
        g = str(e["process_group"])
        return f"{e['op_name']} #{int(e['seq'])} on {group_label(g, ctx.members.get(g))}"
    prep = "from" if str(e["op_name"]).endswith("recv") else "to"
    return f"{e['op_name']} #{int(e['seq'])} {prep} rank {int(e['peer'])}"


def wanted_desc(ctx: WaitContext, e: pd.Series) -> str:
    """What the target of edge `e` never posted, from its side."""
    if e["via"] == S.KIND_COLLECTIVE:
        return edge_desc(ctx, e)
    other = "send" if str(e["op_name"]).endswith("recv") else "recv"
    return f"the {other} matching rank {int(e['waiter'])}'s {e['op_name']} #{int(e['seq'])}"


TIMED_OUT = re.compile(r"timed out|timeout", re.I)   # an end message of a rank's own timeout (gloo, NCCL watchdog)


def timed_out_ranks(states: pd.DataFrame) -> set[int]:
    """The ranks (rank-indexed `rank_states`) whose process ended on their own timeout: they waited that
    long for something that never came, so their end is a consequence of what they waited on."""
    if "end_message" not in states.columns:
        return set()
    return {int(r) for r, m in zip(states.index, states["end_message"].astype(str)) if TIMED_OUT.search(m)}
