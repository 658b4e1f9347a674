"""Stragglers in traces without compute spans (a user's script under `ncclscope run`).

Such a trace has collective rows only (DDP's all-reduces from Flight Recorder; on gloo their ends are
inferred, not measured), so a slow rank shows only in when it posts its collectives. The effect size is
then the arrival skew itself (ncclscope/perf/straggler_arrival.py); these cases are hand-built: a slow
data loader on one rank is named, scheduler noise on shared cores and a single hiccup are not.
"""
from __future__ import annotations

import numpy as np
import pytest

from ncclscope.perf.straggler_stats import ALPHA, MIN_Z
from ncclscope.perf.stragglers import analyze_stragglers
from trace_builder import TraceBuilder

pytestmark = pytest.mark.timeout(60)

STEP = 0.060        # seconds between steps
WORK = 0.005        # each rank's own work before its step's all-reduce


def user_trace(delays, n: int = 4, inferred_ends: bool = False, steps_marked: bool = True,
               per_step: int = 1) -> object:
    """`delays[step][rank]`: seconds a rank posts its step's all-reduce(s) after WORK; collectives only.
    All members leave an instance together just after its last arrival (or, with `inferred_ends`, each
    row ends where that rank's next op starts, as gloo Flight Recorder rows do)."""
    b = TraceBuilder(n, groups={"world": list(range(n))}, group_kinds={"world": "world"})
    rows, seq = [], 0
    for step, d in enumerate(delays):
        t = STEP * step
        for k in range(per_step):
            seq += 1
            starts = [t + WORK + float(d[r]) + 0.0005 * k for r in range(n)]
            rows.append((seq, step, starts, max(starts) + 0.0002))
    for r in range(n):
        for i, (seq, step, starts, end) in enumerate(rows):
            if inferred_ends:
                end = rows[i + 1][2][r] if i + 1 < len(rows) else starts[r] + 0.001
            b.collective(r, "world", seq, start=starts[r], end=end, step=step if steps_marked else -1,
                         message="flight_recorder; completion inferred from a later op" if inferred_ends else "")
    return b.build()


def warnings_of(res) -> list:
    return [f for f in res.findings if f.severity in ("warning", "error")]


def jitter(rng: np.random.Generator, steps: int, n: int, scale: float = 0.001) -> np.ndarray:
    return rng.uniform(0, scale, size=(steps, n))


@pytest.mark.parametrize("inferred_ends", [False, True])
def test_a_rank_consistently_late_at_every_step_is_named(inferred_ends: bool) -> None:
    rng = np.random.default_rng(0)
    d = jitter(rng, 20, 4)
    d[:, 2] += 0.050                                    # a slow data loader: 50 ms before every batch
    res = analyze_stragglers(user_trace(d, inferred_ends=inferred_ends))
    (f,) = warnings_of(res)
    assert f.kind == "straggler" and f.ranks == [2]
    assert f.data["effect_from"] == "arrival" and f.data["late_ms"] == pytest.approx(50, abs=2)
    assert f.data["p_last"] <= ALPHA and f.data["z"] >= MIN_Z and f.data["steps_led"] == 20
    assert f.data["saving_per_step_ns"] == pytest.approx(50e6, rel=0.06)
    assert "last to arrive at 100% of its collectives by a median" in f.title and "ms a step" in f.title
    assert f.evidence and all(e.rank == 2 for e in f.evidence)


def test_several_collectives_a_step_count_the_delay_once() -> None:
    # DDP with three buckets: the late rank posts all three late; the what-if saving is one delay a step
    d = jitter(np.random.default_rng(1), 12, 4)
    d[:, 1] += 0.040
    (f,) = warnings_of(analyze_stragglers(user_trace(d, per_step=3)))
    assert f.ranks == [1] and f.data["saving_per_step_ns"] == pytest.approx(40e6, rel=0.06)


def test_without_steps_every_collective_is_a_trial() -> None:
    d = jitter(np.random.default_rng(2), 16, 4)
    d[:, 3] += 0.030
    (f,) = warnings_of(analyze_stragglers(user_trace(d, steps_marked=False)))
    assert f.ranks == [3] and f.data["effect_from"] == "arrival"


def test_two_ranks_consistently_late_one_is_named() -> None:
    d = jitter(np.random.default_rng(3), 12, 2)
    d[:, 0] += 0.040
    (f,) = warnings_of(analyze_stragglers(user_trace(d, n=2)))
    assert f.ranks == [0] and f.data["noise_from"].startswith("step-to-step")


@pytest.mark.parametrize("seed", range(12))
def test_scheduler_noise_taking_turns_is_silent(seed: int) -> None:
    # 4 ranks on 2 shared cores: every step someone is descheduled for up to 70% of a step, by turns
    rng = np.random.default_rng(seed)
    steps, n = 20, 4
    d = jitter(rng, steps, n, scale=0.004)
    late = rng.integers(0, n, size=steps)
    d[np.arange(steps), late] += rng.uniform(0.0, 0.042, size=steps)
    res = analyze_stragglers(user_trace(d, inferred_ends=bool(seed % 2)))
    assert warnings_of(res) == [], [f.title for f in res.findings]


@pytest.mark.parametrize("seed", range(8))
def test_every_rank_noisy_every_step_is_silent(seed: int) -> None:
    # every rank's work between all-reduces swings by 30% (lognormal) each step: someone is always last
    rng = np.random.default_rng(100 + seed)
    d = 0.020 * np.exp(0.3 * rng.standard_normal(size=(20, 4)))
    res = analyze_stragglers(user_trace(d, inferred_ends=True))
    assert warnings_of(res) == [], [f.title for f in res.findings]


def test_a_small_systematic_lateness_is_below_the_floor() -> None:
    # one rank always last by 3 ms of a 60 ms step (the tracer's own rank 0 on a busy host): consistent,
    # but not a straggler worth a warning
    d = jitter(np.random.default_rng(4), 20, 4, scale=0.0005)
    d[:, 0] += 0.003
    assert warnings_of(analyze_stragglers(user_trace(d))) == []


@pytest.mark.parametrize("hiccup", [0.3, 2.0])
def test_a_single_very_late_step_is_silent(hiccup: float) -> None:
    # one rank stalls once (a page-cache miss, a GC pause); its peers wait once, nobody is a straggler
    d = jitter(np.random.default_rng(5), 20, 4)
    d[7, 1] += hiccup
    res = analyze_stragglers(user_trace(d))
    assert warnings_of(res) == [], [f.title for f in res.findings]
    for f in res.findings:
        assert "within this run's noise" in f.title


def test_compute_spans_keep_the_compute_rule() -> None:
    # with compute rows, the compute effect decides as before (no arrival fields in the finding)
    b = TraceBuilder(4, groups={"dp0": [0, 1, 2, 3]}, coords={r: {"dp": r} for r in range(4)})
    for step in range(8):
        t = step * 1.0
        c = [0.1, 0.1, 0.25, 0.1]
        for r in range(4):
            b.compute(r, "forward", t, t + c[r], step=step)
            b.collective(r, "dp0", step + 1, start=t + c[r], end=t + 0.26, step=step)
    (f,) = warnings_of(analyze_stragglers(b.build()))
    assert f.ranks == [2] and "effect_from" not in f.data and "compute" in f.title


def test_lateness_passed_on_through_a_barrier_is_not_blamed() -> None:
    """seed 20261205 #14: rank 1 sleeps before its pair's barrier every step; rank 0 waits for it there, so
    both post the world all-reduce that follows ~50 ms late and rank 0 is as often last as rank 1. The gap
    each rank spent outside communication before posting tells them apart: rank 1's holds the sleep."""
    rng = np.random.default_rng(3)
    groups = {"p0": [0, 1], "p1": [2, 3], "world": [0, 1, 2, 3]}
    b = TraceBuilder(4, groups=groups)
    for step in range(12):
        t = STEP * step
        j = rng.uniform(0, 0.001, size=4)
        arrive = [t + WORK + j[r] + (0.050 if r == 1 else 0.0) for r in range(4)]
        for pair, name in (((0, 1), "p0"), ((2, 3), "p1")):
            done = max(arrive[r] for r in pair) + 0.0003
            for r in pair:
                b.collective(r, name, step + 1, op="barrier", start=arrive[r], end=done, step=step)
        after = {r: max(arrive[q] for q in ((0, 1) if r < 2 else (2, 3))) + 0.0003 for r in range(4)}
        starts = [after[r] + 0.002 + j[r] for r in range(4)]
        for r in range(4):
            b.collective(r, "world", step + 1, start=starts[r], end=max(starts) + 0.0002, step=step)
    res = analyze_stragglers(b.build())
    (f,) = warnings_of(res)
    assert f.kind == "straggler" and f.ranks == [1], [x.title for x in res.findings]


def test_a_rank_slow_before_a_p2p_exchange_is_named_though_no_collective_shows_it() -> None:
    """seed 20261208 #39 (its run directory as written: tests/data/randprog/): 2 ranks; rank 0 sleeps 150 ms
    before the send/recv exchange with rank 1, every step. Rank 1 absorbs the delay in its recv, and both
    post every collective together, so no collective shows a late arrival: the analysis said OK. The
    transfers are rendezvous of two (straggler_arrival.with_p2p_pairs): rank 0 posts its send 150 ms late."""
    from pathlib import Path

    from ncclscope.load.trace import load
    from ncclscope.verdict import run
    a = run(load(Path(__file__).parent / "data" / "randprog" / "rp20261208_039_slow"))
    assert a.level == "warning" and a.headline is not None, a.verdict
    assert (a.headline.kind, a.headline.ranks) == ("straggler", [0]), a.verdict
    assert "p2p transfers" in a.verdict


def test_a_rank_slow_before_a_ring_exchange_is_named_in_a_script_that_marks_no_steps() -> None:
    """seed 20261209 #69 (its run directory as written, less samples): 5 ranks, no optimizer, so no step
    marks; every iteration opens with an isend/irecv ring and rank 3 sleeps 150 ms at its end. The ring
    spreads the delay to every rank before the all_gathers, so no collective shows a late arrival, and the
    transfers were counted only in traces with marked steps: OK. Each side of a transfer now takes the loop
    iteration its rank issued it in (its sends and receives read with its collectives:
    straggler_arrival.p2p_loop_steps), and the ring's transfers show rank 3 posting 150 ms late."""
    from pathlib import Path

    from ncclscope.load.trace import load
    from ncclscope.verdict import run
    a = run(load(Path(__file__).parent / "data" / "randprog" / "rp20261209_069_slow"))
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("straggler", [3]), a.verdict
    assert "p2p transfers" in a.verdict


def test_p2p_transfers_of_a_pipeline_where_every_send_waits_on_its_own_compute_name_no_straggler() -> None:
    """The other side of with_p2p_pairs: in a pipeline every stage's send is late against the recv posted
    for it (it computes first), and so every stage alike; none is late against its peers' median."""
    n, steps = 4, 8
    b = TraceBuilder(n, groups={"world": list(range(n))}, group_kinds={"world": "world"})
    rng = np.random.default_rng(3)
    seq = 0
    for step in range(steps):
        t = 0.2 * step
        for r in range(n - 1):                       # stage r computes 20 ms, then sends to r+1, which waits
            send_at = t + 0.020 * (r + 1) + rng.uniform(0, 0.001)
            b.p2p(r, "send", r + 1, seq=step, start=send_at, end=send_at + 0.0003, step=step)
            b.p2p(r + 1, "recv", r, seq=step, start=t + 0.020 * r + 0.0001, end=send_at + 0.0003, step=step)
        seq += 1
        starts = [t + 0.1 + rng.uniform(0, 0.0005) for _ in range(n)]
        for r in range(n):
            b.collective(r, "world", seq, start=starts[r], end=max(starts) + 0.0002, step=step)
    res = analyze_stragglers(b.build())
    assert not [f for f in res.findings if f.severity.value == "warning"], [f.title for f in res.findings]


def test_a_loop_followed_by_a_final_barrier_still_has_iterations() -> None:
    """seed 20261208 #231 (its run directory as written): no steps marked, rank 3 sleeps 50 ms every pass of
    an 11-pass loop, and the script ends with dist.barrier(). The loop's iterations were found only for a
    sequence that repeats to its last call, so the barrier left none: every collective was its own trial and
    the 50 ms a pass read as noise. Calls after the loop are teardown, not a broken loop."""
    from pathlib import Path

    from ncclscope.index.repetition import loop_iterations
    from ncclscope.load.trace import load
    from ncclscope.verdict import run
    assert loop_iterations(["a", "b", "a", "b", "a", "b", "barrier"]).tolist() == [0, 0, 1, 1, 2, 2, -1]
    assert loop_iterations(["x", "a", "b", "a", "b", "a", "b", "y", "z"]).tolist() == [-1, 0, 0, 1, 1, 2, 2, -1, -1]
    assert loop_iterations(["a", "b", "a", "c", "d"]) is None
    a = run(load(Path(__file__).parent / "data" / "randprog" / "rp20261208_231_slow"))
    assert (a.headline.kind, a.headline.ranks) == ("straggler", [3]), a.verdict


def test_too_few_steps_for_any_record_to_be_rare_is_not_a_straggler_however_late(tmp_path) -> None:
    """Seed 20261212 #364, a healthy 4-rank job of 3 steps (gloo dumps as written): rank 1 arrived last at
    every collective by 7 ms a step, z 4.8. Three steps of four ranks can give no record rarer than
    4^-3 = 0.016 > ALPHA, so the strong-effect path (p <= 0.05) must not stand in for it: the power-limited
    rule asks for at least MIN_STEPS_ALL steps, all led. It read as a STRAGGLER warning before."""
    from ncclscope.load.foreign.flight_recorder import load_flight_recorder
    from ncclscope.verdict import run
    from randprog_data import timed_dumps
    # dumped on demand right after the last op (the fixture keeps no file times; copied ones read STOPPED)
    a = run(load_flight_recorder(timed_dumps("rp20261212_364_healthy_fr", tmp_path, gap_s={r: 0.05 for r in range(4)})))
    assert a.ok and a.verdict.startswith("OK"), a.verdict
    late = [f for f in a.findings if f.kind == "straggler"]
    assert late and all(f.severity == "info" for f in late), [(f.severity, f.title) for f in late]
    assert "a straggler needs p<=0.01" in late[0].title


@pytest.mark.parametrize("steps, warned", [(4, False), (5, True)])
def test_two_ranks_need_a_record_as_rare_as_a_strong_effect(steps: int, warned: bool) -> None:
    """CI, a healthy 2-rank DDP job of 3 steps (4 with its set-up) on a loaded host: rank 1 posted 6 ms
    after rank 0 in each of its 4 steps, z far past POWER_Z. Two ranks over 4 steps give no record rarer
    than 2^-4 = 0.0625: a host's bias towards one process is as likely as a slow loader, and the run cannot
    tell them apart. Five steps (1/32 <= ALPHA_STRONG) can."""
    d = jitter(np.random.default_rng(4), steps, 2, scale=0.0002)
    d[:, 1] += 0.020                              # a third of a step here (6 ms of a short step in CI)
    res = analyze_stragglers(user_trace(d, n=2))
    late = [f for f in res.findings if f.kind == "straggler"]
    assert late and late[0].ranks == [1], [f.title for f in res.findings]
    assert (late[0].severity.value == "warning") is warned, late[0].title
