"""A pipeline rank that computes outside its schedule every step holds the other stages up
(analysis/pipeline_straggler.py), on hand-built 2-stage traces: named when it holds in every
steady step and the other stage waits for it; silent for one slow step, for work every stage
does (the optimizer), and without microbatch labels."""
from __future__ import annotations

from trace_builder import TraceBuilder

from ncclscope.verdict import run
from ncclscope.perf.pipeline_straggler import analyze_pipeline_stragglers


def _pipeline(extra: dict[int, float], steps: int = 4, labels: bool = True, optimizer: float = 0.002) -> TraceBuilder:
    """2 stages, 2 microbatches; rank 0 sends activations, rank 1 returns gradients. `extra[s]`: seconds rank 0
    computes outside the schedule at the end of step s (rank 1 then waits at the start of step s + 1)."""
    b = TraceBuilder(2, coords={0: {"pp": 0}, 1: {"pp": 1}})
    t, seq, ready1 = 0.0, 0, 0.0          # ready1: when rank 1 finished its last step and posted its next recv
    for s in range(steps):
        for mb in range(2):
            mbl = mb if labels else -1
            seq += 1
            b.compute(0, "forward", start=t, end=t + 0.003, step=s, microbatch=mbl)
            b.p2p(0, "send", peer=1, seq=seq, start=t + 0.003, end=t + 0.004, step=s, microbatch=mbl)
            b.p2p(1, "recv", peer=0, seq=seq, start=ready1 if mb == 0 else t, end=t + 0.004, step=s, microbatch=mbl)
            b.compute(1, "forward", start=t + 0.004, end=t + 0.007, step=s, microbatch=mbl)
            b.compute(1, "backward", start=t + 0.007, end=t + 0.01, step=s, microbatch=mbl)
            b.p2p(1, "send", peer=0, seq=seq, start=t + 0.01, end=t + 0.011, step=s, microbatch=mbl)
            b.p2p(0, "recv", peer=1, seq=seq, start=t + 0.004, end=t + 0.011, step=s, microbatch=mbl)
            b.compute(0, "backward", start=t + 0.011, end=t + 0.014, step=s, microbatch=mbl)
            t += 0.014
        for r in (0, 1):
            b.compute(r, "optimizer", start=t, end=t + optimizer, step=s)
        t += optimizer
        ready1 = t
        if extra.get(s):
            b.compute(0, "forward", start=t, end=t + extra[s], step=s)        # no microbatch: outside the schedule
            t += extra[s]
    return b


def test_a_rank_computing_outside_its_schedule_every_step_is_named() -> None:
    trace = _pipeline({s: 0.1 for s in range(4)}).build()
    (f,) = analyze_pipeline_stragglers(trace)
    assert (f.kind, f.severity, f.ranks) == ("straggler", "warning", [0]), f.title
    assert "outside its schedule's microbatches (forward 100.0 ms" in f.title and "steps 1-3" in f.title
    verdict = run(trace).verdict
    assert verdict.startswith("STRAGGLER: rank 0 (pp 0) holds up the pipeline"), verdict


def test_one_slow_step_is_noise() -> None:
    assert analyze_pipeline_stragglers(_pipeline({2: 0.1}).build()) == []


def test_work_every_stage_does_outside_the_schedule_is_no_straggler() -> None:
    assert analyze_pipeline_stragglers(_pipeline({}, optimizer=0.05).build()) == []


def test_without_microbatch_labels_nothing_is_outside_a_schedule() -> None:
    assert analyze_pipeline_stragglers(_pipeline({s: 0.1 for s in range(4)}, labels=False).build()) == []


def test_one_steady_step_is_not_enough() -> None:
    assert analyze_pipeline_stragglers(_pipeline({0: 0.1, 1: 0.1}, steps=2).build()) == []
