"""A rank that died without a dump before anything could time out, while its peers sat outside recorded ops.

Gloo's Flight Recorder keeps no send/recv. A rank that raised in its compute and left no dump, while its
ring neighbours wait on it in a recv, leaves behind dumps where those neighbours are idle (no op in flight)
and nobody waits on the dead rank in anything recorded: the wait-for graph names the idle rank that
others wait on (a `hang`), and the death is a warning ("ended with no rank waiting on it").

The times say which came first. Every dump was written sooner after its rank's last op than the shortest
collective timeout in the dumps (the default group's, where torch gives subgroups 30 min): nothing timed
out, so the job ended for a reason of its own, and the rank with no dump
is the one whose process ended first (the launcher stops the others when one fails, and they dump then).
An idle rank, on the other hand, is idle because it waits on something, and on gloo that may be a
send/recv with the dead rank. The death is the first deviation; the idle ranks are its consequence
(seed 20261218 #262: rank 1 raised in step 3's compute; ranks 0 and 2 wait in the ring's recv from it,
rank 3 in a reduce_scatter with rank 2: HANG on rank 2).

Only where every error root is such an idle rank, the dump times say no timeout fired, and the backend
records no send/recv; NCCL dumps record them, so there an idle rank is outside communication.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from ncclscope.findings import Finding, Severity
from ncclscope.index.dump_gaps import p2p_unrecorded
from ncclscope.index.labels import rank_label


def death_first(ix: Any, roots: list[Finding], context: list[Finding]) -> tuple[list[Finding], list[Finding]]:
    """(roots, context) with an unwaited death without a dump made the first root where it came first
    (module docstring); else both unchanged."""
    dead = next((f for f in context if f.kind == "dead_rank" and f.data.get("unwaited")), None)
    if dead is None or not roots or not all(f.kind == "hang" and f.data.get("rank_role") == "idle" for f in roots):
        return roots, context
    if ix.trace.run.source != "flight_recorder" or not p2p_unrecorded(ix):
        return roots, context
    st = ix.rank_states                       # indexed by rank
    if not all(r in st.index and str(st.at[r, "state"]) == "missing" for r in dead.ranks):
        return roots, context
    idle = ix.dump_gaps                       # None unless the ops carry their timeouts
    if idle is None:
        return roots, context
    tmo = ix.trace.ops["timeout_ms"]
    tmo = tmo[tmo > 0]
    if not len(tmo) or int(idle["gap"].max()) >= int(tmo.min()) * 1_000_000:
        return roots, context
    sat = sorted({r for f in roots for r in f.ranks})
    one = len(dead.ranks) == 1
    title = (f"{rank_label(ix.trace, list(dead.ranks))} left no Flight Recorder dump and ended before any collective "
             f"could time out (every other rank was dumped within the shortest collective timeout), while "
             f"{rank_label(ix.trace, sat)} sat outside every recorded op: gloo records no send/recv, and "
             f"{'it' if one else 'they'} may be waiting on {'it' if one else 'them'} in one")
    head = replace(dead, severity=Severity.ERROR, title=title,
                   data={**dead.data, "unwaited": False, "died_first": True, "idle_ranks": sat})
    return [head] + roots, [f for f in context if f is not dead]
