"""Per-rank action orders for the common pipeline-parallel schedules.

Why: ncclscope needs the order each pipeline rank *should* run its forward
and backward steps in, so that an observed hang can be compared against it
and so the dry-run simulator (``pipesim.py``) has something to replay.
These are plain functions over integers; no torch, no processes: the
analyzer imports them on a machine without torch, and the runtime's
pipeline executor imports them from here.

Notation follows torchtitan / ``torch.distributed.pipelining``: ``"2F0"`` is
the forward of (virtual) stage 2 on microbatch 0, ``"1B3"`` the backward of
stage 1 on microbatch 3.  A "stage" here is always the *virtual* stage index
0..p*v-1; rank r owns stages r, r+p, r+2p, ... (``stage_to_rank``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

__all__ = [
    "Action",
    "parse_action",
    "format_actions",
    "gpipe",
    "one_f_one_b",
    "interleaved_1f1b",
    "build_schedule",
    "stage_to_rank",
    "num_stages",
    "theoretical_bubble",
    "SCHEDULE_NAMES",
]

FORWARD = "F"
BACKWARD = "B"
SCHEDULE_NAMES = ("gpipe", "1f1b", "interleaved")

_ACTION_RE = re.compile(r"^(\d+)([FB])(\d+)$")


@dataclass(frozen=True)
class Action:
    """One unit of pipeline work: a forward or backward of one stage on one microbatch."""

    stage: int
    kind: str
    microbatch: int

    def __post_init__(self) -> None:
        if self.kind not in (FORWARD, BACKWARD):
            raise ValueError(f"Action kind must be 'F' or 'B', got {self.kind!r}")
        if self.stage < 0 or self.microbatch < 0:
            raise ValueError(
                f"Action stage and microbatch must be >= 0, got stage={self.stage} "
                f"microbatch={self.microbatch}"
            )

    def __str__(self) -> str:
        return f"{self.stage}{self.kind}{self.microbatch}"


def parse_action(text: str) -> Action:
    """Parse torchtitan notation such as ``"2F0"`` into an :class:`Action`."""
    match = _ACTION_RE.match(text.strip())
    if match is None:
        raise ValueError(f"cannot parse action {text!r}; expected e.g. '2F0' or '1B3'")
    return Action(int(match.group(1)), match.group(2), int(match.group(3)))


def format_actions(actions: Iterable[Action]) -> str:
    """Space-separated torchtitan notation, e.g. ``"0F0 0F1 0B0 0B1"``."""
    return " ".join(str(a) for a in actions)


def stage_to_rank(stage: int, p: int) -> int:
    """Pipeline rank that owns virtual ``stage`` (round-robin placement)."""
    return stage % p


def num_stages(p: int, v: int = 1) -> int:
    """Number of virtual stages for ``p`` ranks with ``v`` model chunks each."""
    return p * v


def _check_counts(p: int, m: int, v: int = 1) -> None:
    for name, value in (("p", p), ("m", m), ("v", v)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{name} must be an int, got {value!r}")
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"need p >= 1, m >= 1, v >= 1; got p={p}, m={m}, v={v}")


# ----------------------------------------------------------------------------
# GPipe
# ----------------------------------------------------------------------------


def gpipe(p: int, m: int) -> list[list[Action]]:
    """GPipe: every rank runs all m forwards, then all m backwards (mb 0..m-1).

    Peak in-flight microbatches per rank is m, which is GPipe's memory problem.
    """
    _check_counts(p, m)
    return [
        [Action(r, FORWARD, mb) for mb in range(m)] + [Action(r, BACKWARD, mb) for mb in range(m)]
        for r in range(p)
    ]


# ----------------------------------------------------------------------------
# 1F1B (PipeDream-flush)
# ----------------------------------------------------------------------------


def _one_f_one_b_rank(r: int, p: int, m: int) -> list[Action]:
    warmup = min(p - r - 1, m)
    actions = [Action(r, FORWARD, mb) for mb in range(warmup)]
    # Steady state: each new forward is followed by the oldest pending backward.
    for i in range(m - warmup):
        actions.append(Action(r, FORWARD, warmup + i))
        actions.append(Action(r, BACKWARD, i))
    # Cool-down: drain the backwards of the warm-up forwards.
    actions.extend(Action(r, BACKWARD, mb) for mb in range(m - warmup, m))
    return actions


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    """PipeDream-flush 1F1B: rank r does min(p-r-1, m) warm-up forwards, then
    alternates one forward / one backward, then drains the remaining backwards.

    Peak in-flight microbatches on rank r is min(p-r, m) instead of GPipe's m.
    """
    _check_counts(p, m)
    return [_one_f_one_b_rank(r, p, m) for r in range(p)]


# ----------------------------------------------------------------------------
# Interleaved 1F1B (Megatron-LM virtual pipeline)
# ----------------------------------------------------------------------------


def _chunk_of(k: int, p: int, v: int, forward: bool) -> int:
    """Model chunk for the k-th virtual microbatch (Megatron's get_model_chunk_id).

    Virtual microbatches come in groups of p*v: p microbatches on chunk 0, the
    same p on chunk 1, ...; backwards walk the chunks in reverse.
    """
    chunk = (k % (p * v)) // p
    return chunk if forward else v - 1 - chunk


def _microbatch_of(k: int, p: int, v: int) -> int:
    """Real microbatch of the k-th virtual microbatch (Megatron's
    get_microbatch_id_in_model_chunk with microbatch_group_size_per_vp_stage=p).

    Megatron asserts forward-only here; backwards pop per-chunk FIFO queues, which
    yields the same index, so we use it for both directions.
    """
    return (k // (p * v)) * p + k % p


def _interleaved_action(k: int, r: int, p: int, v: int, forward: bool) -> Action:
    chunk = _chunk_of(k, p, v, forward)
    return Action(chunk * p + r, FORWARD if forward else BACKWARD, _microbatch_of(k, p, v))


def _interleaved_rank(r: int, p: int, m: int, v: int) -> list[Action]:
    total = m * v
    # Megatron: (p-r-1)*2 + (v-1)*p warm-up forwards, capped at the total.
    # Older Megatron also forced "all warm-up" when m == p; current Megatron-core
    # (and this function) only caps, which is the rule the brief asks for.
    warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
    actions = [_interleaved_action(k, r, p, v, True) for k in range(warmup)]
    for k in range(total - warmup):
        actions.append(_interleaved_action(k + warmup, r, p, v, True))
        actions.append(_interleaved_action(k, r, p, v, False))
    actions.extend(_interleaved_action(k, r, p, v, False) for k in range(total - warmup, total))
    return actions


def interleaved_1f1b(p: int, m: int, v: int) -> list[list[Action]]:
    """Megatron-LM interleaved 1F1B with v model chunks per rank.

    Rank r holds virtual stages r, r+p, ..., (v-1)*p+r.  Megatron requires the
    microbatch count to be a multiple of p (microbatches are scheduled in groups
    of p per chunk), so m % p != 0 is rejected.

    v=1 is accepted but is *not* plain 1F1B: the interleaved warm-up keeps its
    factor 2, i.e. min(2*(p-r-1), m) forwards, so peak activation memory is
    higher.  Megatron only uses this code path with a virtual pipeline.
    """
    _check_counts(p, m, v)
    if m % p != 0:
        raise ValueError(
            f"interleaved 1F1B needs m % p == 0; got m={m}, p={p} (m % p = {m % p})"
        )
    return [_interleaved_rank(r, p, m, v) for r in range(p)]


# ----------------------------------------------------------------------------
# Dispatch and theory
# ----------------------------------------------------------------------------


def _check_name_and_v(name: str, v: int) -> None:
    if name not in SCHEDULE_NAMES:
        raise ValueError(f"unknown schedule {name!r}; expected one of {', '.join(SCHEDULE_NAMES)}")
    if v != 1 and name != "interleaved":
        raise ValueError(f"schedule {name!r} has no virtual stages; got v={v} (only 'interleaved' takes v > 1)")


def build_schedule(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Per-rank action lists for ``name`` in {'gpipe', '1f1b', 'interleaved'}."""
    _check_counts(p, m, v)
    _check_name_and_v(name, v)
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    return interleaved_1f1b(p, m, v)


def theoretical_bubble(name: str, p: int, m: int, v: int = 1) -> float:
    """Idle fraction of one training step predicted by the textbook formula.

    (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(v*m+p-1) for interleaved 1F1B.

    Assumptions: every (virtual) stage takes the same forward time and the same
    backward time (the backward may differ from the forward), communication is
    free, and the step ends when the last backward finishes.  For interleaved,
    the per-stage time is that of one model chunk, so a rank does v*m chunk
    forwards and backwards while its fill/drain costs p-1 chunk slots.  The
    bubble is total idle rank-time over p * makespan.  Real runs with
    unequal stages or non-zero p2p latency have a larger bubble.
    """
    _check_counts(p, m, v)
    _check_name_and_v(name, v)
    if name == "interleaved":
        if m % p != 0:
            raise ValueError(f"interleaved 1F1B needs m % p == 0; got m={m}, p={p}")
        return (p - 1) / (v * m + p - 1)
    return (p - 1) / (m + p - 1)
