"""NCCL RAS facts onto a Trace: dead ranks as how their process ended, laggards as the op their peers
wait in.

    ranks = apply_dead(trace.ranks, facts)                  # any source
    tables, groups = ras_rows(facts, labels, last_seq, t)   # only where no source recorded the ops

Why it is shaped so: the hang questions already know what a dead rank and a rank that never posted
an op mean (`index/rank_states.py`, `hang/waitfor.py`), so RAS speaks to them in their own terms
rather than through a question of its own.

- A rank RAS says is dead or unresponsive ends "failed", its end message naming RAS
  ("NCCL RAS: process 4242 on 10.0.0.4 considered dead ..."). That message is what the dead-rank
  verdict quotes. A rank another source saw end (finished, killed, stopped by the launcher) keeps
  what that source says: RAS's snapshot may postdate a normal exit.
- Where no source recorded the ops themselves (RAS alone, or NCCL Inspector, which writes completed
  ops only), each peer of a laggard gets one in-flight row: the collective after the laggard's last
  (instance `launched + 1`, continuing Inspector's numbering where it has the communicator), with
  RAS's count in its message. The laggard is absent from that instance, so the wait-for graph ends at
  it. Beside Flight Recorder dumps or a run directory the ops are already there and only the dead
  ranks are applied; the counts become one warning line.
- The rows carry no duration: RAS has no clock, so they sit at the trace's end and no "since" is said.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from ncclscope import schema as S
from ncclscope.load.foreign.nccl_ras_facts import Lag, RasFacts
from ncclscope.load.foreign.vocab import events_table, group_kind, normalize_op
from ncclscope.load.trace import RankInfo

RAS_MARKER = "nccl_ras_snapshot"
RAS_PREFIX = "NCCL RAS: "
_FUNCS = {"AllReduce": "all_reduce", "AllGather": "all_gather", "ReduceScatter": "reduce_scatter",
          "Broadcast": "broadcast", "Reduce": "reduce"}
KEEP_STATES = ("finished", "killed", "stopped")     # what another source saw wins over RAS


def apply_dead(ranks: dict[int, RankInfo], facts: RasFacts, world: int) -> list[int]:
    """Mark each dead/unresponsive rank's RankInfo failed with RAS's words (module docstring); ranks
    RAS names beyond `world` are skipped. Returns the ranks marked."""
    marked = []
    for g, why in sorted(facts.dead.items()):
        if not 0 <= g < world:
            continue
        info = ranks.setdefault(g, RankInfo(rank=g))
        if info.present and info.state in KEEP_STATES:
            continue
        info.present = True
        info.end_status, info.end_message = S.STATUS_ERROR, RAS_PREFIX + why
        marked.append(g)
    return marked


def lag_lines(facts: RasFacts) -> list[str]:
    """One warning line per laggard (beside a source whose own ops tell the story)."""
    return [f"{RAS_PREFIX}rank(s) {', '.join(map(str, lag.ranks))} {lag.words(cite=False)} on communicator "
            f"0x{lag.comm}" for lag in facts.lags]


def ras_rows(facts: RasFacts, labels: dict[str, str], last_seq: dict[str, int], t_ns: int,
             marked: set[int] | None = None) -> tuple[list[pa.Table], list[dict[str, Any]]]:
    """The peers' in-flight rows of every lag, one marker row per rank RAS heard from (so a rank with
    nothing in flight is still present), and the group rows of communicators no other source named."""
    tables, group_rows = [], []
    for i, lag in enumerate(facts.lags):
        label = labels.get(lag.comm) or f"0x{lag.comm}"
        if lag.comm not in labels:
            members = facts.members.get(lag.comm) or sorted(lag.ranks + lag.peers)
            group_rows += [{"rank": r, "process_group": label, "group_kind": group_kind("", label),
                            "ranks": members, "creation_order": i, "backend": "nccl"} for r in members]
        seq = last_seq.get(lag.comm, lag.launched) + 1
        tables.append(_waiting(lag, label, seq, t_ns, id_base=(i + 1) << 32))
    shown = sorted((facts.answered | set(marked or ())))
    tables.append(_markers(shown, t_ns))
    return [t for t in tables if t.num_rows], group_rows


def _waiting(lag: Lag, label: str, seq: int, t_ns: int, id_base: int) -> pa.Table:
    """Begin rows, no end: each peer launched collective `seq` and waits in it for the laggards."""
    n = len(lag.peers)
    op = normalize_op(_FUNCS.get(lag.func, lag.func or "collective"))
    msg = f"{RAS_PREFIX}launched up to operation {lag.peers_launched} on this communicator; rank(s) " \
          f"{', '.join(map(str, lag.ranks))} {lag.words(cite=False)}"
    return events_table({"rank": np.asarray(lag.peers, dtype=np.int64), "op_id": id_base + np.arange(n),
                         "phase": S.PHASE_BEGIN, "time_ns": t_ns, "kind": S.KIND_COLLECTIVE, "op_name": op,
                         "process_group": label, "collective_seq_id": seq, "p2p_seq_id": -1, "peer": -1,
                         "tag": -1, "message": msg}, n)


def _markers(ranks: list[int], t_ns: int) -> pa.Table:
    """One instant marker per rank at the snapshot: RAS heard from it (or says how it ended)."""
    n = len(ranks)
    return events_table({"rank": np.asarray(ranks, dtype=np.int64), "op_id": (1 << 40) + np.arange(n),
                         "phase": S.PHASE_INSTANT, "time_ns": t_ns, "kind": S.KIND_MARKER, "op_name": RAS_MARKER,
                         "message": "NCCL RAS snapshot"}, n)
