"""Dry-run simulator for per-rank pipeline action lists.

Why: given the order each pipeline rank will run its forwards and backwards
(from ``ncclscope.schedules`` or reconstructed from a hung job's trace), we want to
know without GPUs whether that order can deadlock, which rank would be stuck
on which peer, and what the idle "bubble" looks like under simple timing.

Model (deliberately simple, documented so results are not over-read):

* each rank runs its list strictly in order, one action at a time;
* ``F(s, mb)`` for s > 0 needs ``F(s-1, mb)`` finished (+ ``t_comm`` when
  stage s-1 lives on another rank);
* ``B(s, mb)`` needs ``F(s, mb)`` finished and, for s below the last stage,
  ``B(s+1, mb)`` finished (+ ``t_comm`` across ranks);
* sends never block (infinite buffering), so a rank only ever waits on data.

Because ranks are strictly ordered and sends are free to complete, an
action's start time is ``max(rank free, deps finished + comm)`` and depends
only on already-known finish times.  The simulator therefore walks the
dependency graph (repeatedly advancing any rank whose next action is ready)
rather than stepping a clock; when no rank can advance and work remains, that
is a deadlock and is reported, never looped on.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple, Sequence, Union

from ncclscope.schedules import BACKWARD, FORWARD, Action, parse_action, stage_to_rank

__all__ = ["SimResult", "Blocked", "TimedAction", "simulate", "validate_actions"]

Duration = Union[float, Sequence[float]]


class TimedAction(NamedTuple):
    rank: int
    action: Action
    start: float
    end: float


class Blocked(NamedTuple):
    rank: int
    action: Action
    waiting_for: Action


@dataclass
class SimResult:
    """Outcome of one dry run.

    ``makespan`` is the finish time of the last completed action; on deadlock
    it (and busy/idle/bubble) covers only the work that did complete.
    ``bubble_fraction`` is total idle rank-time / (p * makespan).
    """

    deadlock: bool
    blocked: list[Blocked] = field(default_factory=list)
    makespan: float = 0.0
    busy: list[float] = field(default_factory=list)
    idle: list[float] = field(default_factory=list)
    bubble_fraction: float = 0.0
    timeline: list[TimedAction] = field(default_factory=list)


# ----------------------------------------------------------------------------
# Validation
# ----------------------------------------------------------------------------


def _normalise(actions_per_rank: Sequence[Sequence[Action | str]]) -> list[list[Action]]:
    if len(actions_per_rank) == 0:
        raise ValueError("need at least one rank's action list, got none")
    out: list[list[Action]] = []
    for rank_actions in actions_per_rank:
        row = []
        for a in rank_actions:
            if isinstance(a, str):
                a = parse_action(a)
            if not isinstance(a, Action):
                raise ValueError(f"expected Action or str like '2F0', got {a!r}")
            row.append(a)
        out.append(row)
    return out


def _infer_shape(lists: list[list[Action]]) -> tuple[int, int]:
    """(num_stages, num_microbatches) implied by the lists' largest indices.

    The stage count is rounded up to a multiple of p, since every rank holds the
    same number of virtual stages.  Pass them explicitly when a whole stage or
    the last microbatch may be absent, otherwise absence cannot be seen.
    """
    p = len(lists)
    all_actions = [a for row in lists for a in row]
    if not all_actions:
        return p, 0
    max_stage = max(a.stage for a in all_actions)
    stages = (max_stage // p + 1) * p
    return stages, max(a.microbatch for a in all_actions) + 1


def validate_actions(
    actions_per_rank: Sequence[Sequence[Action | str]],
    num_microbatches: int | None = None,
    num_stages: int | None = None,
) -> tuple[int, int]:
    """Check that every (stage, F/B, mb) appears exactly once, on its owner rank.

    Returns (num_stages, num_microbatches).  Raises ValueError naming the first
    misplaced, out-of-range, duplicated or missing action.
    """
    lists = _normalise(actions_per_rank)
    return _validate(lists, num_microbatches, num_stages)


def _validate(
    lists: list[list[Action]], num_microbatches: int | None, num_stages: int | None
) -> tuple[int, int]:
    p = len(lists)
    inferred_stages, inferred_mb = _infer_shape(lists)
    stages = inferred_stages if num_stages is None else num_stages
    mbs = inferred_mb if num_microbatches is None else num_microbatches
    if stages % p != 0:
        raise ValueError(f"num_stages={stages} is not a multiple of p={p}")

    seen: dict[Action, int] = {}
    for rank, row in enumerate(lists):
        for a in row:
            if a.stage >= stages or a.microbatch >= mbs:
                raise ValueError(
                    f"action {a} on rank {rank} is out of range "
                    f"(num_stages={stages}, num_microbatches={mbs})"
                )
            owner = stage_to_rank(a.stage, p)
            if owner != rank:
                raise ValueError(
                    f"action {a} is on rank {rank} but stage {a.stage} belongs to rank {owner} (p={p})"
                )
            if a in seen:
                raise ValueError(f"duplicated action {a} (rank {seen[a]} and rank {rank})")
            seen[a] = rank

    for s in range(stages):
        for kind in (FORWARD, BACKWARD):
            for mb in range(mbs):
                a = Action(s, kind, mb)
                if a not in seen:
                    raise ValueError(f"missing action {a} (expected on rank {stage_to_rank(s, p)})")
    return stages, mbs


# ----------------------------------------------------------------------------
# Simulation
# ----------------------------------------------------------------------------


def _per_stage(value: Duration, stages: int, name: str) -> list[float]:
    if isinstance(value, (int, float)):
        values = [float(value)] * stages
    else:
        values = [float(x) for x in value]
        if len(values) != stages:
            raise ValueError(f"{name} has {len(values)} entries but there are {stages} stages")
    if any(x < 0 for x in values):
        raise ValueError(f"{name} must be non-negative, got {values}")
    return values


def _dependencies(a: Action, stages: int) -> list[Action]:
    """Actions that must finish before ``a`` may start (same-rank one first)."""
    if a.kind == FORWARD:
        return [Action(a.stage - 1, FORWARD, a.microbatch)] if a.stage > 0 else []
    deps = [Action(a.stage, FORWARD, a.microbatch)]
    if a.stage < stages - 1:
        deps.append(Action(a.stage + 1, BACKWARD, a.microbatch))
    return deps


def _ready_time(a: Action, end: dict[Action, float], p: int, stages: int, t_comm: float) -> float | Action:
    """Earliest start allowed by data dependencies, or the first unmet dependency."""
    ready = 0.0
    for dep in _dependencies(a, stages):
        if dep not in end:
            return dep
        comm = t_comm if stage_to_rank(dep.stage, p) != stage_to_rank(a.stage, p) else 0.0
        ready = max(ready, end[dep] + comm)
    return ready


def simulate(
    actions_per_rank: Sequence[Sequence[Action | str]],
    t_fwd: Duration = 1.0,
    t_bwd: Duration = 2.0,
    t_comm: float = 0.0,
    *,
    num_microbatches: int | None = None,
    num_stages: int | None = None,
) -> SimResult:
    """Replay per-rank action lists; report deadlock or timing.

    ``t_fwd``/``t_bwd`` are a float or one value per virtual stage.  Invalid
    lists (missing/duplicate/misplaced actions) raise ValueError rather than
    being reported as a deadlock.
    """
    lists = _normalise(actions_per_rank)
    stages, _ = _validate(lists, num_microbatches, num_stages)
    if t_comm < 0:
        raise ValueError(f"t_comm must be non-negative, got {t_comm}")
    fwd = _per_stage(t_fwd, stages, "t_fwd")
    bwd = _per_stage(t_bwd, stages, "t_bwd")
    p = len(lists)

    end: dict[Action, float] = {}
    timeline: list[TimedAction] = []
    next_idx = [0] * p
    rank_free = [0.0] * p
    busy = [0.0] * p

    progressed = True
    while progressed:
        progressed = False
        for rank in range(p):
            while next_idx[rank] < len(lists[rank]):
                a = lists[rank][next_idx[rank]]
                ready = _ready_time(a, end, p, stages, t_comm)
                if isinstance(ready, Action):
                    break  # waits on a peer (or on itself); try other ranks
                duration = fwd[a.stage] if a.kind == FORWARD else bwd[a.stage]
                start = max(rank_free[rank], ready)
                end[a] = rank_free[rank] = start + duration
                busy[rank] += duration
                timeline.append(TimedAction(rank, a, start, start + duration))
                next_idx[rank] += 1
                progressed = True

    blocked = []
    for rank in range(p):
        if next_idx[rank] < len(lists[rank]):
            a = lists[rank][next_idx[rank]]
            waiting = _ready_time(a, end, p, stages, t_comm)
            assert isinstance(waiting, Action)  # else the loop above would have run it
            blocked.append(Blocked(rank, a, waiting))

    makespan = max((t.end for t in timeline), default=0.0)
    idle = [makespan - b for b in busy]
    bubble = sum(idle) / (p * makespan) if makespan > 0 else 0.0
    timeline.sort(key=lambda t: (t.start, t.rank))
    return SimResult(
        deadlock=bool(blocked),
        blocked=blocked,
        makespan=makespan,
        busy=busy,
        idle=idle,
        bubble_fraction=bubble,
        timeline=timeline,
    )
