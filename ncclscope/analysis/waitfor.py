"""The wait-for graph: who waits on whom at the end of the trace, across groups and p2p.

When a job hangs, most ranks sit in some collective or recv and each of them
timed out or was killed; the one that matters is usually *not* blocked where
the others are. Each rank's blocking op at the end (its unfinished comm ops
posted after its last completed one; a timeout/error end counts as unfinished:
that is where it was waiting when it gave up) says whom it waits on:

- a collective (g, k) on rank a waits on every member b of g that never began
  (g, k) (b's highest seq on g < k), and on a member that began it but died
  inside it;
- a recv from q waits on q unless q posted the matching send (src, dst, tag,
  p2p_seq_id); a send to q likewise needs q's recv; a dead q that posted
  but never finished is waited on too.

Dead ranks (missing directory, heartbeats stopped long before the end while
others' continued, killed/failed without being blocked in comm themselves)
wait on nobody. Then the graph is classified by its strongly connected
components and what each waiting chain ends at:

- a cycle                          -> `deadlock`, or `hang` when a rank on the
                                      cycle deviated first: it skipped (or added)
                                      a collective in an earlier step, so its
                                      later ones on that group paired one
                                      instance off (step census, see
                                      collectives.step_census_deviations), or it
                                      skipped an instance a strict majority of its
                                      group entered and went on to a collective
                                      on another group;
- a dead rank                      -> `dead_rank`;
- a live rank in no comm op        -> `stuck_in_compute` (inflight compute span,
                                      or heartbeats to the end), else `hang`;
- ranks blocked in an op that every counterpart posted -> `hang` (stalled op:
  a mismatch or the transport; `diagnose` names the deviant when the
  collective analysis finds one).

Chains are followed across groups and p2p (a waits on b in dp, b on c via
p2p, c is dead: the root is c). Vectorised: blocking ops, edges and rank states
are pandas merges; only the graph walk is Python, over ranks, not events.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

import numpy as np
import pandas as pd

from .. import schema as S
from ..findings import Evidence, Finding
from ..trace import STATUS_INFLIGHT
from .collectives import collective_ops, max_seq_table, plain_str, step_census_deviations
from .groups import fmt_ranks, group_label, member_table, membership, rank_label, seconds, trace_start_ns
from .p2p import KEY, direction, p2p_ops

if TYPE_CHECKING:
    from ..trace import Trace

NS = 1_000_000_000
STALE_FLOOR_NS = 3 * NS          # heartbeats older than this (and 5 intervals) before the end = stopped
STALE_INTERVALS = 5
MAX_EVIDENCE = 40
MAX_BLOCKING_PER_RANK = 8        # most recent unfinished comm ops considered per rank
MAX_ROOTS_PER_ROLE = 4           # more chain ends of one kind are reported as one finding
MAX_HOPS = 4                     # cycle hops spelled out in a deadlock title
FAILED = (S.STATUS_TIMEOUT, S.STATUS_ERROR)
COMM_KINDS = (S.KIND_COLLECTIVE, S.KIND_P2P)

BLOCK_COLUMNS = ["rank", "op_id", "kind", "op_name", "process_group", "collective_seq_id", "p2p_seq_id", "peer",
                 "tag", "status", "start_ns", "end_ns", "step", "microbatch", "stage", "call_site"]


# --------------------------------------------------------------------------
# Blocking ops and rank states
# --------------------------------------------------------------------------
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
    last_ok = (pd.DataFrame({"rank": ops["rank"].to_numpy()[comm_mask].astype(np.int64),
                             "end": ops["end_ns"].to_numpy()[comm_mask]}).groupby("rank")["end"].max())
    comm = unf[unf["kind"].isin(COMM_KINDS) & ~unf["rank"].isin(computing["rank"])]
    lok = comm["rank"].map(last_ok).fillna(-1).to_numpy()
    frontier = comm[comm["start_ns"].to_numpy() >= lok]
    rest = comm[~comm["rank"].isin(frontier["rank"]) & (comm["status"] == STATUS_INFLIGHT)]
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
    ev = trace.events
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

    hb, threshold = _heartbeats(trace)
    ev = trace.events
    last_event = ev.groupby("rank", observed=True)["t_ns"].max() if len(ev) else pd.Series(dtype="int64")
    last_event.index = last_event.index.astype("int64")
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

    missing = st["state"] == "missing"
    killed_or_failed = st["state"].isin(["killed", "failed"])
    not_blocked = ~st["blocked"] & (st["computing_op"] == "")
    dead = missing.copy()
    dead |= ~st["fail_block"] & st["hb_stale"]
    dead |= ~st["fail_block"] & (st["state"] == "failed") & not_blocked
    # "killed" already excludes the launcher's own end-of-job kills (state "stopped"):
    # a signal that ended a rank before the launcher did is a death, heartbeats or not.
    dead |= ~st["fail_block"] & (st["state"] == "killed")
    dead |= ~st["fail_block"] & st["compute_error"] & killed_or_failed
    st["dead"] = dead
    st["computing"] = ~dead & ~st["blocked"] & ((st["computing_op"] != "") | st["hb_alive"])
    st["role"] = np.select([st["dead"], st["blocked"], st["computing"], st["state"] == "finished"],
                           ["dead", "blocked", "computing", "finished"], "idle")
    st["dead_reason"] = ""
    if st["dead"].any():
        st.loc[st["dead"], "dead_reason"] = [_dead_reason(trace, r, row) for r, row in st[st["dead"]].iterrows()]
    return st


def _dead_reason(trace: Trace, r: int, row: pd.Series) -> str:
    """"was killed (SIGKILL) at step 4; last sign of life at 4.0 s (8.0 s before the end)"."""
    t0 = trace_start_ns(trace)
    if row.state == "missing":
        return "left no trace directory (it died before writing, or its files are gone)"
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
    elif life:
        return f"stopped {life}{at_step.replace(' at ', ', last at ')}"
    else:
        head = f"is gone (state {row.state}){at_step}"
    return f"{head}; stopped {life}" if life else head


# --------------------------------------------------------------------------
# Edges
# --------------------------------------------------------------------------
EDGE_COLUMNS = ["waiter", "target", "via", "op_name", "process_group", "seq", "peer", "tag", "op_id", "start_ns",
                "status", "reason", "n_began", "n_members"]


def collective_edges(blocking: pd.DataFrame, coll: pd.DataFrame, members: dict[str, list[int]],
                     dead: pd.Series, max_seq: pd.DataFrame | None = None) -> pd.DataFrame:
    """Edges from ranks blocked in a collective to members that did not begin it (or died in it)."""
    b = blocking[blocking["kind"] == S.KIND_COLLECTIVE]
    if not len(b):
        return pd.DataFrame(columns=EDGE_COLUMNS)
    b = b.rename(columns={"rank": "waiter", "collective_seq_id": "seq"})
    e = b[["waiter", "process_group", "seq", "op_name", "op_id", "start_ns", "status", "peer", "tag"]].merge(
        member_table(members), on="process_group")
    ms = (max_seq_table(coll) if max_seq is None else max_seq).rename(columns={"rank": "member"})
    e = e.merge(ms, on=["process_group", "member"], how="left")
    e["max_seq"] = e["max_seq"].fillna(0).astype("int64")
    e["began"] = (e["max_seq"] >= e["seq"]) | (e["member"] == e["waiter"])
    e["n_began"] = e.groupby(["waiter", "op_id"])["began"].transform("sum").astype("int64")
    e = e[e["member"] != e["waiter"]]
    e["member_dead"] = e["member"].map(dead).fillna(True).astype(bool)
    e["reason"] = np.where(e["began"], "", "not begun")
    died = e[e["began"] & e["member_dead"]]
    if len(died):
        stat = coll.loc[coll["rank"].isin(died["member"].unique()).to_numpy(),
                        ["process_group", "collective_seq_id", "rank", "status"]].rename(
            columns={"collective_seq_id": "seq", "rank": "member", "status": "member_status"})
        died = died.merge(stat, on=["process_group", "seq", "member"], how="left")
        died = died[died["member_status"].fillna("") != S.STATUS_OK].assign(reason="died in it")
        e = pd.concat([e[~e["began"]], died.drop(columns="member_status")], ignore_index=True)
    else:
        e = e[~e["began"]]
    e = e.rename(columns={"member": "target"}).assign(via=S.KIND_COLLECTIVE)
    return e[EDGE_COLUMNS].reset_index(drop=True)


def p2p_edges(blocking: pd.DataFrame, p2p: pd.DataFrame, dead: pd.Series) -> pd.DataFrame:
    """Edges from ranks blocked in send/recv to the peer that did not post the counterpart (or died in it)."""
    b = blocking[blocking["kind"] == S.KIND_P2P].copy()
    if not len(b):
        return pd.DataFrame(columns=EDGE_COLUMNS)
    b["direction"] = direction(b["op_name"])
    b = b[b["direction"] != ""]
    is_send = b["direction"] == "send"
    b = b.assign(src=np.where(is_send, b["rank"], b["peer"]), dst=np.where(is_send, b["peer"], b["rank"]),
                 seq=b["p2p_seq_id"].astype("int64"), tag=b["tag"].astype("int64"),
                 want=np.where(is_send, "recv", "send"))
    # Only the few counterparts the blocked ops need (the p2p table may hold millions of rows).
    near = p2p["src"].isin(b["src"].unique()).to_numpy() & p2p["dst"].isin(b["dst"].unique()).to_numpy()
    other = p2p.loc[near, KEY + ["direction", "status"]]
    other = pd.DataFrame({**{k: other[k].to_numpy(np.int64) for k in KEY},
                          "want": other["direction"].astype(str).to_numpy(),
                          "other_status": other["status"].astype(object).to_numpy()})
    other = other.drop_duplicates(KEY + ["want"])
    e = b.merge(other, on=KEY + ["want"], how="left")
    posted = e["other_status"].notna()
    peer_dead = e["peer"].map(dead).fillna(True).astype(bool)
    e["reason"] = np.where(~posted, "not posted", "died in it")
    e = e[~posted | (peer_dead & (e["other_status"].fillna("").astype(str) != S.STATUS_OK))]
    e = e.rename(columns={"rank": "waiter"}).assign(target=e["peer"].astype("int64"), via=S.KIND_P2P,
                                                     n_began=-1, n_members=2)
    return e[EDGE_COLUMNS].reset_index(drop=True)


# --------------------------------------------------------------------------
# Graph
# --------------------------------------------------------------------------
def strongly_connected(nodes: Iterable[int], adj: dict[int, list[int]]) -> list[list[int]]:
    """Tarjan's SCCs, iterative; emitted sinks first (reverse topological order)."""
    index: dict[int, int] = {}
    low: dict[int, int] = {}
    on_stack: set[int] = set()
    stack: list[int] = []
    out: list[list[int]] = []
    counter = 0
    for root in nodes:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter
                counter += 1
                stack.append(v)
                on_stack.add(v)
            succ = adj.get(v, [])
            recurse = False
            while i < len(succ):
                w = succ[i]
                i += 1
                if w not in index:
                    work.append((v, i))
                    work.append((w, 0))
                    recurse = True
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            if recurse:
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                out.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return out


def _find_cycle(comp: list[int], adj: dict[int, list[int]]) -> list[int]:
    """One concrete cycle inside a strongly connected component, starting at its lowest rank."""
    members = set(comp)
    path, seen = [comp[0]], {comp[0]: 0}
    v = comp[0]
    while True:
        nxt = next(w for w in adj.get(v, []) if w in members)
        if nxt in seen:
            return path[seen[nxt]:]
        seen[nxt] = len(path)
        path.append(nxt)
        v = nxt


@dataclass
class WaitReport:
    findings: list[Finding] = field(default_factory=list)
    edges: pd.DataFrame = field(default_factory=pd.DataFrame)     # waiter -> target, with the op
    blocking: pd.DataFrame = field(default_factory=pd.DataFrame)  # each rank's blocking ops
    ranks: pd.DataFrame = field(default_factory=pd.DataFrame)     # per-rank role: dead/blocked/computing/...
    cycles: list[list[int]] = field(default_factory=list)


@dataclass
class _Ctx:
    trace: Trace
    members: dict[str, list[int]]
    st: pd.DataFrame
    edges: pd.DataFrame
    blocking: pd.DataFrame
    coll: pd.DataFrame
    end: int


def analyze_waits(trace: Trace, coll: pd.DataFrame | None = None, p2p: pd.DataFrame | None = None,
                  members: dict[str, list[int]] | None = None, max_seq: pd.DataFrame | None = None) -> WaitReport:
    """Build the wait-for graph and turn each root cause into one finding."""
    ops = trace.ops
    coll = collective_ops(ops) if coll is None else coll
    p2p = p2p_ops(ops) if p2p is None else p2p
    members = membership(trace, coll) if members is None else members
    unf = unfinished_ops(ops)
    blocking, computing = blocking_ops(ops, unf)
    # A rank that exited normally waits on nothing, whatever async op it left open.
    finished = [r for r, info in trace.ranks.items() if info.state == "finished"]
    blocking = blocking[~blocking["rank"].isin(finished)]
    computing = computing[~computing["rank"].isin(finished)]
    st = rank_states(trace, ops, blocking, computing, unf)
    dead = st["dead"]
    blocking = blocking[~blocking["rank"].map(dead).fillna(False).astype(bool)].reset_index(drop=True)
    edges = pd.concat([collective_edges(blocking, coll, members, dead, max_seq), p2p_edges(blocking, p2p, dead)],
                      ignore_index=True)
    edges = edges[~edges["waiter"].map(dead).fillna(False).astype(bool)
                  & edges["target"].between(0, trace.world_size - 1)]
    edges = edges.sort_values(["start_ns", "waiter", "target"], kind="stable").reset_index(drop=True)
    ctx = _Ctx(trace, members, st, edges, blocking, coll, trace.end_ns)
    findings, cycles = _classify(ctx)
    return WaitReport(findings=findings, edges=edges, blocking=blocking, ranks=st.reset_index(), cycles=cycles)


def _classify(ctx: _Ctx) -> tuple[list[Finding], list[list[int]]]:
    pairs = ctx.edges[["waiter", "target"]].drop_duplicates().to_numpy()
    adj: dict[int, list[int]] = {}
    for w, t in pairs:
        adj.setdefault(int(w), []).append(int(t))
    blocked = [int(r) for r in ctx.blocking["rank"].unique()]
    nodes = sorted(set(blocked) | {int(t) for t in ctx.edges["target"]})
    comps = strongly_connected(nodes, adj)
    comp_of = {v: i for i, c in enumerate(comps) for v in c}
    succ: list[set[int]] = [set() for _ in comps]
    for w, t in pairs:
        a, b = comp_of[int(w)], comp_of[int(t)]
        if a != b:
            succ[a].add(b)
    terminal = [len(c) > 1 or not succ[i] for i, c in enumerate(comps)]
    reach: list[frozenset[int]] = []
    for i in range(len(comps)):   # sinks first, so successors are done
        acc = {i} if terminal[i] else set()
        for s in succ[i]:
            acc |= reach[s]
        reach.append(frozenset(acc))
    waiters_of: dict[int, set[int]] = {i: set() for i in range(len(comps)) if terminal[i]}
    for v in adj:
        for c in reach[comp_of[v]]:
            if v not in comps[c]:
                waiters_of[c].add(v)

    findings: list[tuple[tuple, Finding]] = []
    cycles: list[list[int]] = []
    stalled: list[int] = []
    endpoints: dict[str, list[tuple[int, set[int]]]] = {}
    for c, ws in waiters_of.items():
        comp = comps[c]
        if len(comp) > 1:
            cycle = _find_cycle(comp, adj)
            cycles.append(cycle)
            findings.append(_cycle_finding(ctx, comp, cycle, ws))
            continue
        r = comp[0]
        role = ctx.st.at[r, "role"] if r in ctx.st.index else "dead"
        if role == "blocked":
            stalled.append(r)
        elif ws:
            endpoints.setdefault(role, []).append((r, ws))
    for role, items in endpoints.items():
        if len(items) <= MAX_ROOTS_PER_ROLE:
            findings += [_endpoint_finding(ctx, r, role, ws) for r, ws in items]
        else:   # a node failure kills 8 ranks at once: one finding, not 8
            findings.append(_endpoint_group_finding(ctx, items, role))
    findings += _stalled_findings(ctx, stalled, comps, comp_of, waiters_of)
    findings.sort(key=lambda kf: kf[0])
    out = [f for _, f in findings]
    named = {r for f in out for r in f.ranks}
    quiet = _unwaited_dead(ctx, named)
    return out + ([quiet] if quiet else []), cycles


def _unwaited_dead(ctx: _Ctx, named: set[int]) -> Finding | None:
    """Ranks that died (killed, failed, missing) with nobody waiting on them: context, a warning."""
    st = ctx.st
    quiet = st[st["dead"] & st["state"].isin(["killed", "failed", "missing"]) & ~st.index.isin(list(named))]
    if not len(quiet):
        return None
    ranks = [int(r) for r in quiet.index]
    ev = []
    for r, row in quiet.head(MAX_EVIDENCE).iterrows():
        ev.append(Evidence(rank=int(r), note=row.dead_reason, op_name=str(row.last_op),
                           time_ns=int(row.last_op_start_ns)))
    them = "it" if len(ranks) == 1 else "them"
    title = f"{rank_label(ctx.trace, ranks)} ended with no rank waiting on {them}: {ev[0].note}"
    if len(ranks) > 1:
        title += " (first of them)"
    return Finding(kind="dead_rank", severity="warning", title=title, ranks=ranks, evidence=ev,
                   data={"root_ranks": ranks, "waiting_ranks": [], "unwaited": True})


# --------------------------------------------------------------------------
# Findings
# --------------------------------------------------------------------------
def _op_desc(ctx: _Ctx, row: object) -> str:
    """"all_reduce #9 on dp1[1,3]" or "recv #4 from rank 3"."""
    kind = getattr(row, "kind", getattr(row, "via", ""))
    if kind == S.KIND_COLLECTIVE:
        g = str(row.process_group)
        seq = getattr(row, "collective_seq_id", getattr(row, "seq", -1))
        return f"{row.op_name} #{int(seq)} on {group_label(g, ctx.members.get(g))}"
    seq = getattr(row, "p2p_seq_id", getattr(row, "seq", -1))
    prep = "from" if str(row.op_name).lower().endswith("recv") else "to"
    return f"{row.op_name} #{int(seq)} {prep} rank {int(row.peer)}"


def _waiting_summary(ctx: _Ctx, waiters: set[int], roots: Iterable[int]) -> tuple[str, int, list[int]]:
    """("ranks 0,1,2 waiting since 6.0 s in all_reduce #9 on dp1[1,3]", start_ns, direct waiters)."""
    if not waiters:
        return "", -1, []
    roots = set(roots)
    b = ctx.blocking[ctx.blocking["rank"].isin(waiters)]
    start = int(b["start_ns"].min()) if len(b) else -1
    direct = ctx.edges[ctx.edges["target"].isin(roots) & ctx.edges["waiter"].isin(waiters)]
    ops = []
    for row in direct.drop_duplicates(["op_name", "process_group", "seq", "via"]).itertuples(index=False):
        if row.via == S.KIND_COLLECTIVE:
            ops.append(_op_desc(ctx, row))
        else:
            ops.append(f"{row.op_name} #{int(row.seq)} {'from' if str(row.op_name).endswith('recv') else 'to'} it")
    text = f"{rank_label(ctx.trace, waiters)} waiting"
    if start >= 0:
        text += f" since {seconds(ctx.end - start)}"
    n_direct = int(direct["waiter"].nunique())
    where = ", ".join(ops[:2]) + (f" and {len(ops) - 2} more ops" if len(ops) > 2 else "")
    if ops and 2 * n_direct < len(waiters):
        # Most wait behind the direct waiters (a world barrier behind one group): say both.
        rest = b[~b["rank"].isin(direct["waiter"])].drop_duplicates("rank")
        behind = ""
        if len(rest):
            keys = ["kind", "op_name", "process_group", "collective_seq_id", "p2p_seq_id", "peer"]
            top = rest.groupby(keys, sort=False).size().sort_values(ascending=False, kind="stable")
            row = pd.Series(dict(zip(keys, top.index[0])))
            behind = f", the rest behind them (most in {_op_desc(ctx, row)})"
        text += f", {n_direct} of them in {where}{behind}"
    elif ops:
        text += " in " + where
    return text, start, sorted(int(w) for w in direct["waiter"].unique())


def _waiter_evidence(ctx: _Ctx, waiters: set[int], direct: list[int], roots: Iterable[int]) -> list[Evidence]:
    roots = set(roots)
    b = ctx.blocking[ctx.blocking["rank"].isin(waiters)]
    b = b.assign(direct=~b["rank"].isin(direct)).sort_values(["direct", "start_ns", "rank"])
    b = b.drop_duplicates("rank", keep="first")
    targets = ctx.edges.groupby("waiter")["target"].agg(lambda s: sorted(set(int(x) for x in s)))
    ev = []
    for row in b.head(MAX_EVIDENCE).itertuples(index=False):
        on = targets.get(int(row.rank), [])
        who = ",".join(map(str, on[:8])) + ("..." if len(on) > 8 else "")
        note = f"{row.status}, waiting since {seconds(ctx.end - int(row.start_ns))}" + (f" on rank {who}" if who else "")
        if int(row.rank) not in direct:
            note += " (indirectly)"
        ev.append(_ev(row, note))
    return ev


def _ev(row: object, note: str) -> Evidence:
    kind = getattr(row, "kind", "")
    seq = int(row.collective_seq_id) if kind == S.KIND_COLLECTIVE else int(getattr(row, "p2p_seq_id", -1))
    return Evidence(rank=int(row.rank), note=note, op_name=str(row.op_name), process_group=str(row.process_group),
                    seq=seq, op_id=int(row.op_id), time_ns=int(row.start_ns), peer=int(row.peer))


def _involved(ctx: _Ctx, ranks: Iterable[int]) -> dict[str, list]:
    b = ctx.blocking[ctx.blocking["rank"].isin(list(ranks))]
    c = b[b["kind"] == S.KIND_COLLECTIVE]
    p = b[b["kind"] == S.KIND_P2P]
    return {"instances": sorted({(str(g), int(k)) for g, k in zip(c["process_group"], c["collective_seq_id"])}),
            "p2p": sorted({(int(r), str(o), int(q), int(s)) for r, o, q, s in
                           zip(p["rank"], p["op_name"], p["peer"], p["p2p_seq_id"])})}


def _data(ctx: _Ctx, roots: list[int], waiters: set[int], direct: list[int], start: int, summary: str,
          **extra: object) -> dict:
    inv = _involved(ctx, set(roots) | waiters)
    data = {"root_ranks": sorted(roots), "waiting_ranks": sorted(int(w) for w in waiters),
            "direct_waiters": direct, "wait_s": round((ctx.end - start) / NS, 3) if start >= 0 else None,
            "wait_summary": summary, "instances": [list(x) for x in inv["instances"]],
            "p2p": [list(x) for x in inv["p2p"]], "involved": sorted(set(roots) | set(int(w) for w in waiters))}
    stack = stack_for(ctx.trace, roots)
    if stack:
        data["stack"] = stack
    data.update(extra)
    return data


def _sort_key(waiters: set[int], start: int) -> tuple:
    return (-len(waiters), start if start >= 0 else 2**62)


def _cycle_finding(ctx: _Ctx, comp: list[int], cycle: list[int], waiters: set[int]) -> tuple[tuple, Finding]:
    inside = ctx.edges[ctx.edges["waiter"].isin(comp) & ctx.edges["target"].isin(comp)]
    outside = set(waiters) - set(comp)
    shift = _shift_suspects(ctx, comp, inside)
    if shift is not None:
        return _shift_finding(ctx, comp, cycle, waiters | set(comp), shift)
    skip = _skip_suspects(ctx, inside)
    if skip is not None:
        return _skip_finding(ctx, comp, cycle, waiters | set(comp), skip)
    steps = []
    for a, b in zip(cycle, cycle[1:] + cycle[:1]):
        e = inside[(inside["waiter"] == a) & (inside["target"] == b)].iloc[0]
        steps.append((a, b, e))
    if all(e["via"] == S.KIND_P2P for _, _, e in steps) and len({str(e["op_name"]) for _, _, e in steps}) == 1:
        op = str(steps[0][2]["op_name"])
        seqs = sorted({int(e["seq"]) for _, _, e in steps})
        prep = "from" if op.endswith("recv") else "to"
        both = "both" if len(cycle) == 2 else "all"
        title = (f"{rank_label(ctx.trace, cycle)} {both} blocked in {op} {prep} each other "
                 f"(p2p seq {','.join(map(str, seqs))})")
    else:
        hops = "; ".join(f"rank {a} in {_edge_desc(ctx, e)} waits on rank {b}" for a, b, e in steps[:MAX_HOPS])
        if len(steps) > MAX_HOPS:
            hops += f"; ... {len(steps) - MAX_HOPS} more hops back to rank {cycle[0]}"
        title = f"{rank_label(ctx.trace, comp)} wait on each other in a cycle: {hops}"
    summary, start, direct = _waiting_summary(ctx, outside, comp) if outside else ("", -1, [])
    b = ctx.blocking[ctx.blocking["rank"].isin(comp)]
    start_all = int(b["start_ns"].min()) if len(b) else start
    title += f"; blocked for {seconds(ctx.end - start_all)}" if start_all >= 0 else ""
    if summary:
        title += f"; {summary}"
    ev = [Evidence(rank=int(a), note=f"{e['status']}, waits on rank {b} ({e['reason']}) since "
                                     f"{seconds(ctx.end - int(e['start_ns']))}",
                   op_name=str(e["op_name"]), process_group=str(e["process_group"]), seq=int(e["seq"]),
                   op_id=int(e["op_id"]), time_ns=int(e["start_ns"]), peer=int(e["peer"]))
          for a, b, e in steps[:MAX_EVIDENCE]]
    ev += _waiter_evidence(ctx, outside, direct, comp)
    data = _data(ctx, comp, outside, direct, start_all, summary, cycle=cycle)
    return _sort_key(waiters | set(comp), start_all), Finding(
        kind="deadlock", severity="error", title=title, ranks=sorted(comp), evidence=ev, data=data)


def _edge_desc(ctx: _Ctx, e: pd.Series) -> str:
    if e["via"] == S.KIND_COLLECTIVE:
        g = str(e["process_group"])
        return f"{e['op_name']} #{int(e['seq'])} on {group_label(g, ctx.members.get(g))}"
    prep = "from" if str(e["op_name"]).endswith("recv") else "to"
    return f"{e['op_name']} #{int(e['seq'])} {prep} rank {int(e['peer'])}"


def _wanted_desc(ctx: _Ctx, e: pd.Series) -> str:
    """What the target of edge `e` never posted, from its side."""
    if e["via"] == S.KIND_COLLECTIVE:
        return _edge_desc(ctx, e)
    other = "send" if str(e["op_name"]).endswith("recv") else "recv"
    return f"the {other} matching rank {int(e['waiter'])}'s {e['op_name']} #{int(e['seq'])}"


def _skip_suspects(ctx: _Ctx, inside: pd.DataFrame) -> pd.DataFrame | None:
    """Cycle edges into a rank that skipped an instance a strict majority entered, and went on elsewhere."""
    e = inside[(inside["via"] == S.KIND_COLLECTIVE) & (inside["reason"] == "not begun")
               & (2 * inside["n_began"] > inside["n_members"])]
    if not len(e):
        return None
    bc = ctx.blocking[ctx.blocking["kind"] == S.KIND_COLLECTIVE][["rank", "process_group"]]
    elsewhere = e.merge(bc.rename(columns={"rank": "target", "process_group": "target_group"}), on="target")
    elsewhere = elsewhere[elsewhere["target_group"] != elsewhere["process_group"]]
    if not len(elsewhere):
        return None
    first = elsewhere.sort_values("start_ns").iloc[0]
    same = elsewhere[(elsewhere["process_group"] == first["process_group"]) & (elsewhere["seq"] == first["seq"])]
    return same


def _shift_suspects(ctx: _Ctx, comp: list[int], inside: pd.DataFrame) -> pd.DataFrame | None:
    """Cycle members that skipped (or added) a collective in an earlier step: the cycle is the
    consequence of the sequence shift, and the first of them deviated first."""
    groups = set(inside.loc[inside["via"] == S.KIND_COLLECTIVE, "process_group"].astype(str))
    b = ctx.blocking[ctx.blocking["rank"].isin(comp) & (ctx.blocking["kind"] == S.KIND_COLLECTIVE)]
    groups |= set(b["process_group"].astype(str))
    if not groups:
        return None
    cen = step_census_deviations(ctx.coll, ctx.members, sorted(groups))
    cen = cen[cen["rank"].isin(comp)]
    if not len(cen):
        return None
    first = cen.iloc[0]
    return cen[(cen["process_group"] == first["process_group"]) & (cen["step"] == first["step"])
               & (cen["call_site"] == first["call_site"])]


def _shift_finding(ctx: _Ctx, comp: list[int], cycle: list[int], involved: set[int],
                   shift: pd.DataFrame) -> tuple[tuple, Finding]:
    roots = sorted(int(r) for r in shift["rank"].unique())
    e = shift.iloc[0]
    g, step, site, op = str(e["process_group"]), int(e["step"]), str(e["call_site"]), str(e["op_name"])
    glabel = group_label(g, ctx.members.get(g))
    waiters = set(involved) - set(roots)
    rb = ctx.blocking[ctx.blocking["rank"].isin(roots)]
    went = ", ".join(_op_desc(ctx, r) for r in rb.drop_duplicates("rank").head(2).itertuples(index=False))
    summary, start, direct = _waiting_summary(ctx, waiters, roots)
    ref = list(e["ref_ranks"])
    seq = (f"#{int(e['ref_seq'])} for rank{'s' if len(ref) > 1 else ''} {fmt_ranks(ref)}"
           if int(e["ref_seq"]) >= 0 and ref else "")
    n = abs(int(e["count"]) - int(e["expected"]))
    off = "one instance" if n == 1 else f"{n} instances"
    if e["direction"] == "skipped":
        what = f"skipped {op} on {glabel} at step {step} ({site}" + (f", {seq})" if seq else ")")
    else:
        what = f"issued an extra {op} on {glabel} at step {step} ({site})"
    title = f"{rank_label(ctx.trace, roots)} {what}: its later {op}s on {g} paired {off} off"
    title += f", and it went on to {went}" if went else ""
    if summary:
        title += f"; {summary}"
    # The instance the cycle is blocked on in g (where the shift surfaced), for supporting findings.
    on_g = ctx.edges[(ctx.edges["process_group"] == g) & ctx.edges["waiter"].isin(list(involved))]
    blocked_k = int(on_g["seq"].min()) if len(on_g) else int(e["ref_seq"])
    ev = []
    for r in shift.itertuples(index=False):
        ref = "the other members" if r.basis == "majority" else "its other steps"
        ev.append(Evidence(rank=int(r.rank), note=f"{r.direction}: issued {int(r.count)} {op} from {site} on {g} at "
                                                  f"step {step}; {ref} issued {int(r.expected)}",
                           op_name=op, process_group=g, seq=int(r.ref_seq)))
    ev += [_ev(r, f"{r.status}: blocked here since {seconds(ctx.end - int(r.start_ns))}")
           for r in rb.itertuples(index=False)]
    ev += _waiter_evidence(ctx, waiters, direct, roots)
    data = _data(ctx, roots, waiters, direct, start, summary, cycle=cycle, skipped=[g, int(e["ref_seq"])],
                 shift={"process_group": g, "step": step, "call_site": site, "direction": str(e["direction"]),
                        "count": int(e["count"]), "expected": int(e["expected"]), "basis": str(e["basis"])},
                 instance=[g, blocked_k], process_group=g, seq=blocked_k)
    return _sort_key(involved, start), Finding(kind="hang", severity="error", title=title, ranks=roots,
                                               evidence=ev[:MAX_EVIDENCE * 2], data=data)


def _skip_finding(ctx: _Ctx, comp: list[int], cycle: list[int], involved: set[int],
                  skip: pd.DataFrame) -> tuple[tuple, Finding]:
    roots = sorted(int(t) for t in skip["target"].unique())
    e = skip.iloc[0]
    g, k = str(e["process_group"]), int(e["seq"])
    waiters = set(involved) - set(roots)
    rb = ctx.blocking[ctx.blocking["rank"].isin(roots)]
    went = ", ".join(_op_desc(ctx, r) for r in rb.drop_duplicates("rank").head(2).itertuples(index=False))
    summary, start, direct = _waiting_summary(ctx, waiters, roots)
    title = (f"{rank_label(ctx.trace, roots)} never posted {e['op_name']} #{k} on {group_label(g, ctx.members.get(g))} "
             f"({int(e['n_began'])} of {int(e['n_members'])} members did) and went on to {went}")
    if summary:
        title += f"; {summary}"
    ev = [_ev(r, f"{r.status}: blocked here instead of {g} #{k}, since {seconds(ctx.end - int(r.start_ns))}")
          for r in rb.itertuples(index=False)]
    ev += _waiter_evidence(ctx, waiters, direct, roots)
    data = _data(ctx, roots, waiters, direct, start, summary, cycle=cycle, skipped=[g, k],
                 instance=[g, k], process_group=g, seq=k)
    return _sort_key(involved, start), Finding(kind="hang", severity="error", title=title, ranks=roots,
                                               evidence=ev, data=data)


def _endpoint_finding(ctx: _Ctx, r: int, role: str, waiters: set[int]) -> tuple[tuple, Finding]:
    """A chain ends at a rank that waits on nobody: dead, computing, finished or idle."""
    row = ctx.st.loc[r]
    summary, start, direct = _waiting_summary(ctx, waiters, [r])
    who = rank_label(ctx.trace, [r])
    t0 = trace_start_ns(ctx.trace)
    into = ctx.edges[ctx.edges["target"] == r]
    wanted = _wanted_desc(ctx, into.iloc[0]) if len(into) else "its next op"
    ev: list[Evidence] = []
    last = Evidence(rank=r, note=f"last op: {row.last_op} ({row.last_op_status or 'n/a'})",
                    op_name=str(row.last_op), time_ns=int(row.last_op_start_ns))
    if role == "dead":
        kind, title = "dead_rank", f"{who} {row.dead_reason}"
        if row.last_op:
            ev.append(last)
        if not pd.isna(row.last_hb_ns):
            ev.append(Evidence(rank=r, note=f"last heartbeat at {seconds(int(row.last_hb_ns) - t0)}",
                               op_name=S.HEARTBEAT, time_ns=int(row.last_hb_ns)))
        if not ev:
            ev.append(Evidence(rank=r, note=row.dead_reason))
    elif role == "computing":
        kind = "stuck_in_compute"
        if row.computing_op:
            step = f" (step {int(row.computing_step)})" if row.computing_step >= 0 else ""
            title = (f"{who} has been in {row.computing_op} for "
                     f"{seconds(ctx.end - int(row.computing_start_ns))}{step} and never posted {wanted}")
            ev.append(Evidence(rank=r, note=f"inflight since {seconds(int(row.computing_start_ns) - t0)}",
                               op_name=str(row.computing_op), time_ns=int(row.computing_start_ns)))
        else:
            title = (f"{who} is alive (heartbeats to the end) but in no communication op and never posted "
                     f"{wanted}; its last op was {row.last_op or 'none'}")
            ev.append(last)
    else:
        kind = "hang"
        if role == "finished":
            title = f"{who} finished (exit 0) without posting {wanted}"
        else:
            title = (f"{who} never posted {wanted} and is in no communication op "
                     f"(state {row.state}; last op {row.last_op or 'none'} {row.last_op_status})")
        ev.append(last)
    if summary:
        title += f"; {summary}"
    ev += _waiter_evidence(ctx, waiters, direct, [r])
    data = _data(ctx, [r], waiters, direct, start, summary, rank_role=role)
    return _sort_key(waiters, start), Finding(kind=kind, severity="error", title=title, ranks=[r], evidence=ev,
                                              data=data)


def _endpoint_group_finding(ctx: _Ctx, items: list[tuple[int, set[int]]], role: str) -> tuple[tuple, Finding]:
    """Many chain ends of one kind (e.g. all ranks of a lost node) as one finding."""
    items = sorted(items)
    roots = [r for r, _ in items]
    waiters = set().union(*(ws for _, ws in items)) - set(roots)
    _, first = _endpoint_finding(ctx, items[0][0], role, items[0][1])
    summary, start, direct = _waiting_summary(ctx, waiters, roots)
    what = {"dead": "are dead", "computing": "are stuck in compute",
            "finished": "finished without posting what others wait for"}.get(role, "are in no communication op")
    lead = first.title.split("; ")[0]
    title = f"{rank_label(ctx.trace, roots)} {what} (first: {lead})" + (f"; {summary}" if summary else "")
    ev = [e for e in first.evidence if e.rank == roots[0]]
    for r in roots[1:MAX_EVIDENCE]:
        row = ctx.st.loc[r]
        note = row.dead_reason if role == "dead" else f"last op: {row.last_op} ({row.last_op_status or 'n/a'})"
        ev.append(Evidence(rank=r, note=note, op_name=str(row.last_op), time_ns=int(row.last_op_start_ns)))
    ev += _waiter_evidence(ctx, waiters, direct, roots)
    kind = {"dead": "dead_rank", "computing": "stuck_in_compute"}.get(role, "hang")
    data = _data(ctx, roots, waiters, direct, start, summary, rank_role=role)
    return _sort_key(waiters | set(roots), start), Finding(kind=kind, severity="error", title=title, ranks=roots,
                                                           evidence=ev[:MAX_EVIDENCE * 2], data=data)


def _stalled_findings(ctx: _Ctx, stalled: list[int], comps: list[list[int]], comp_of: dict[int, int],
                      waiters_of: dict[int, set[int]]) -> list[tuple[tuple, Finding]]:
    """Ranks blocked in an op every counterpart posted: one `hang` per stalled op."""
    if not stalled:
        return []
    b = ctx.blocking[ctx.blocking["rank"].isin(stalled)].drop_duplicates("rank", keep="last")
    is_coll = b["kind"] == S.KIND_COLLECTIVE
    is_send = direction(b["op_name"]) == "send"
    src = np.where(is_send, b["rank"], b["peer"])
    dst = np.where(is_send, b["peer"], b["rank"])
    unit = np.where(is_coll, "c:" + b["process_group"].astype(str) + "#" + b["collective_seq_id"].astype(str),
                    "p:" + pd.Series(src, index=b.index).astype(str) + ">" + pd.Series(dst, index=b.index).astype(str)
                    + ":" + b["tag"].astype(str) + "#" + b["p2p_seq_id"].astype(str))
    out = []
    for _, sub in b.assign(unit=unit).groupby("unit", sort=False):
        ranks = sorted(int(r) for r in sub["rank"])
        waiters = set().union(*(waiters_of.get(comp_of[r], set()) for r in ranks)) - set(ranks)
        row = sub.iloc[0]
        summary, start, direct = _waiting_summary(ctx, waiters, ranks)
        start_all = int(sub["start_ns"].min())
        if row["kind"] == S.KIND_COLLECTIVE:
            g, k = str(row["process_group"]), int(row["collective_seq_id"])
            done = ctx.coll[(ctx.coll["process_group"] == g) & (ctx.coll["collective_seq_id"] == k)
                            & (ctx.coll["status"] == S.STATUS_OK)]["rank"]
            title = (f"{rank_label(ctx.trace, ranks)} stuck in {row['op_name']} #{k} on "
                     f"{group_label(g, ctx.members.get(g))} for {seconds(ctx.end - start_all)} although every "
                     f"member posted it")
            if len(done):
                title += f" ({rank_label(ctx.trace, done)} completed it)"
            title += ": no rank is missing; look for a mismatch or a transport fault"
            extra = {"stalled": [g, k], "instance": [g, k]}
        else:
            title = (f"{rank_label(ctx.trace, ranks)} stuck in {_op_desc(ctx, row)} for "
                     f"{seconds(ctx.end - start_all)} although the peer posted the matching op: "
                     f"look for a size mismatch or a transport fault")
            extra = {"stalled_p2p": [int(row["rank"]), str(row["op_name"]), int(row["peer"]), int(row["p2p_seq_id"])]}
        if summary:
            title += f"; {summary}"
        ev = [_ev(r, f"{r.status}, stalled since {seconds(ctx.end - int(r.start_ns))}")
              for r in sub.head(MAX_EVIDENCE).itertuples(index=False)]
        ev += _waiter_evidence(ctx, waiters, direct, ranks)
        data = _data(ctx, ranks, waiters, direct, start_all, summary, ambiguous=len(ranks) > 1, **extra)
        out.append((_sort_key(waiters | set(ranks), start_all),
                    Finding(kind="hang", severity="error", title=title, ranks=ranks, evidence=ev, data=data)))
    return out


# --------------------------------------------------------------------------
# Stacks
# --------------------------------------------------------------------------
_THREAD_RE = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+")


def stack_excerpt(text: str, max_frames: int = 12, max_chars: int = 2000) -> str:
    """The main thread's top frames from a faulthandler dump (the last dump in the file)."""
    blocks: list[list[str]] = []
    for line in text.splitlines():
        if _THREAD_RE.match(line):
            blocks.append([line])
        elif blocks and line.strip().startswith("File "):
            blocks[-1].append(line.rstrip())
    if not blocks:
        return "\n".join(text.strip().splitlines()[-30:])[-max_chars:]

    def is_main(block: list[str]) -> bool:
        body = "\n".join(block[1:])
        return "<module>" in body or ("threading.py" not in body and "_bootstrap" not in body)

    main = next((b for b in reversed(blocks) if is_main(b)), blocks[-1])
    excerpt = main[: max_frames + 1]
    if len(main) > max_frames + 1:
        excerpt.append(f"  ... {len(main) - max_frames - 1} more frames")
    return "\n".join(excerpt)[:max_chars]


def stack_for(trace: Trace, ranks: Iterable[int], limit: int = 2) -> str:
    """Stack excerpts of the first `limit` root ranks that have a stacks.txt."""
    parts = []
    for r in sorted(ranks):
        if r in trace.stacks and trace.stacks[r].strip():
            parts.append(f"rank {r}:\n{stack_excerpt(trace.stacks[r])}")
        if len(parts) >= limit:
            break
    return "\n\n".join(parts)
