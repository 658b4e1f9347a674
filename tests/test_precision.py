"""Precision: a finding at warning or error severity stands out of the run's own noise.

Ranks that share cores (8 ranks on 2 here) take turns being late by scheduler
noise, and tiny pipelines idle waiting for p2p messages. These tests hold the
analyses to that:

- pure logic on hand-built traces (tests/trace_builder.py): the straggler rule
  (binomial test on last arrivals, effect size against the spread between the
  healthy peers, what-if floor), the comm-stall baseline, the slow-collective
  pattern rule, root-or-inherited divergence and the live watchdog;
- real healthy runs of seven layouts (`ncclscope train`, 3 steps each, run once
  in a module fixture): `ncclscope analyze` exits 0 and says no warning.
"""
from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from trace_builder import TraceBuilder
from test_perf_analyses import metrics_trace, pipeline

from ncclscope import schema as S
from ncclscope.verdict import run as analyse
from ncclscope.perf.bubbles import analyze_bubbles
from ncclscope.perf.comm_stats import analyze_comm
from ncclscope.perf.divergence import analyze_divergence
from ncclscope.perf.straggler_stats import ALPHA, MIN_Z, binom_tail
from ncclscope.perf.stragglers import analyze_stragglers
from ncclscope.load.trace import Trace, load

pytestmark = pytest.mark.timeout(60)


# ---- the binomial tail ----
def test_binomial_tail_is_exact() -> None:
    for n in (1, 2, 5, 12, 40):
        for p in (0.125, 0.25, 0.5, 0.9):
            for k in range(n + 2):
                want = sum(math.comb(n, j) * p**j * (1 - p) ** (n - j) for j in range(k, n + 1))
                assert binom_tail(k, n, p) == pytest.approx(want, rel=1e-9, abs=1e-15), (k, n, p)
    assert binom_tail(0, 5, 0.3) == 1.0 and binom_tail(6, 5, 0.3) == 0.0
    assert 0 < binom_tail(5000, 5000, 0.25) < 1e-300 or binom_tail(5000, 5000, 0.25) == 0.0


# ---- stragglers ----
def dp_trace(factors: list[float], steps: int, noise: float, seed: int = 0, base: float = 0.1) -> Trace:
    """One all_reduce per step after each rank's compute: base * factor * lognormal(noise)."""
    n = len(factors)
    rng = np.random.default_rng(seed)
    b = TraceBuilder(n, groups={"dp0": list(range(n))}, coords={r: {"dp": r} for r in range(n)})
    for step in range(steps):
        t = 10.0 * step
        c = [base * f * math.exp(noise * rng.standard_normal()) for f in factors]
        end = t + max(c) + 0.01
        for r in range(n):
            b.compute(r, "forward", t, t + c[r], step=step, microbatch=0)
            b.collective(r, "dp0", step + 1, start=t + c[r], end=end, step=step)
    return b.build()


def warnings_of(findings: list) -> list:
    return [f for f in findings if f.severity in ("warning", "error")]


@pytest.mark.parametrize("seed", range(20))
def test_noisy_but_healthy_ranks_are_not_stragglers(seed: int) -> None:
    # 30% lognormal noise per step, as on 8 ranks sharing 2 cores: someone is always last, nobody consistently
    res = analyze_stragglers(dp_trace([1.0] * 4, steps=8, noise=0.3, seed=seed))
    assert warnings_of(res.findings) == [], [f.title for f in res.findings]


def test_a_systematically_slightly_slower_rank_is_below_the_floor() -> None:
    # 1.1x every step, always last: consistent, but under the effect-size floor (z and 1.25x)
    res = analyze_stragglers(dp_trace([1.0, 1.0, 1.0, 1.1], steps=8, noise=0.02))
    assert warnings_of(res.findings) == []
    row = res.ranks.set_index("rank").loc[3]
    assert row["p_last"] <= ALPHA and row["z"] < MIN_Z


@pytest.mark.parametrize("seed", range(5))
def test_a_consistent_1_5x_straggler_is_found(seed: int) -> None:
    res = analyze_stragglers(dp_trace([1.0, 1.0, 1.5, 1.0], steps=8, noise=0.1, seed=seed))
    (f,) = warnings_of(res.findings)
    assert f.kind == "straggler" and f.ranks == [2]
    assert f.data["p_last"] <= ALPHA and f.data["z"] >= MIN_Z and f.data["significant"]
    assert f.data["effect_ratio"] == pytest.approx(1.5, rel=0.15)
    assert "binomial p=" in f.title and "z=" in f.title


def test_two_ranks_need_enough_steps() -> None:
    # with one peer, the spread is step to step; four steps cannot reach p <= 0.01 (1/2^4), ten can
    short = analyze_stragglers(dp_trace([1.0, 1.5], steps=4, noise=0.05))
    assert warnings_of(short.findings) == [] and [f.severity for f in short.findings] == ["info"]
    assert "within this run's noise" in short.findings[0].title
    long = analyze_stragglers(dp_trace([1.0, 1.5], steps=10, noise=0.05))
    (f,) = warnings_of(long.findings)
    assert f.ranks == [1] and f.data["noise_from"].startswith("step-to-step")


def test_a_straggler_saving_under_the_floor_is_not_reported() -> None:
    # 1.5x of a compute that is 1% of the step: consistent, but saves < 5% of run time
    n, steps = 4, 8
    b = TraceBuilder(n, groups={"dp0": list(range(n))}, coords={r: {"dp": r} for r in range(n)})
    for step in range(steps):
        t = 10.0 * step
        for r in range(n):
            c = 0.01 * (1.5 if r == 1 else 1.0)
            b.compute(r, "forward", t, t + c, step=step, microbatch=0)
            b.collective(r, "dp0", step + 1, start=t + c, end=t + 1.0, step=step)
    assert analyze_stragglers(b.build()).findings == []


# ---- pipeline bubble: the comm-stall baseline ----
LATENT = [(0, "F", 0, 0, 1), (0, "F", 1, 1, 2), (0, "B", 0, 10, 12), (0, "B", 1, 16, 18),
          (1, "F", 0, 4, 5), (1, "B", 0, 5, 7), (1, "F", 1, 10, 11), (1, "B", 1, 11, 13)]


def test_comm_stall_at_the_runs_own_p2p_latency_is_not_a_warning() -> None:
    # the trace of test_big_comm_stall_is_a_pipeline_bubble_finding, with the messages that cost it:
    # every message takes 3 s, so the stall is what this run's interconnect costs (its baseline)
    p2p = [(0, "isend", 1, 0, 1, 1.01), (1, "irecv", 0, 0, 1, 4), (0, "isend", 1, 1, 2, 2.01), (1, "irecv", 0, 1, 7, 10),
           (1, "isend", 0, 0, 7, 7.01), (0, "irecv", 1, 0, 7, 10), (1, "isend", 0, 1, 13, 13.01),
           (0, "irecv", 1, 1, 13, 16)]
    res = analyze_bubbles(pipeline(LATENT, p2p))
    (f,) = [f for f in res.findings if f.kind == "pipeline_bubble"]
    assert f.severity == "info" and not f.data["significant"]
    assert f.data["p2p_latency_ns"] == pytest.approx(3e9)
    assert "baseline" in f.title and "3000.00 ms" in f.title
    # without the messages there is no baseline: the same stall is a warning
    (g,) = [f for f in analyze_bubbles(pipeline(LATENT)).findings if f.kind == "pipeline_bubble"]
    assert g.severity == "warning" and g.data["comm_stall_baseline"] == 0


# ---- slow collectives: a pattern, not one hiccup ----
def coll_trace(slow: set[int], n: int = 30, slow_s: float = 0.2) -> Trace:
    """2 ranks, n all_reduces of 10 ms, one a step; those in `slow` take slow_s."""
    b = TraceBuilder(2, groups={"tp0": [0, 1]})
    for seq in range(1, n + 1):
        dur = slow_s if seq in slow else 0.010
        for r in range(2):
            b.collective(r, "tp0", seq, start=float(seq), end=seq + dur, step=seq)
    return b.build()


def test_one_slow_collective_is_noise_many_are_a_warning() -> None:
    (one,) = analyze_comm(coll_trace({7})).findings
    assert one.severity == "info" and "within this run's noise" in one.title
    (many,) = analyze_comm(coll_trace({5, 9, 14, 20, 26})).findings
    assert many.severity == "warning" and many.data["count"] == 5 and many.data["cost_frac"] >= 0.05
    # one long stall is a warning ...
    (stall,) = analyze_comm(coll_trace({12}, slow_s=5.0)).findings
    assert stall.severity == "warning" and stall.data["count"] == 1
    # ... but not in the first step: that is gloo's connection set-up
    (first,) = analyze_comm(coll_trace({1}, slow_s=5.0)).findings
    assert first.severity == "info"
    # 5.5x-over-median hiccups of 45 ms: scheduler noise on shared cores, under the 50 ms stall floor
    (hiccups,) = analyze_comm(coll_trace({5, 9, 14, 20, 26}, slow_s=0.055)).findings
    assert hiccups.severity == "info"


# ---- divergence: the cause, and who only inherited it ----
def test_pipeline_partner_that_inherited_the_divergence_is_affected_not_a_cause() -> None:
    # pp 2 x dp 4: rank 1 (pp 0, dp 1) applies a different update at step 2. Its pipeline partner
    # rank 5 (pp 1, dp 1) sees a different global norm at once and, through the clip coefficient,
    # a parameter change 1000x smaller; its own parameters did not diverge.
    coords = {r: {"tp": 0, "pp": r // 4, "dp": r % 4, "ep": 0} for r in range(8)}
    rows = []
    for step in range(5):
        for r in range(8):
            pp, dp = r // 4, r % 4
            off = step >= 2 and dp == 1
            ck = (60.0 if pp == 0 else 100.0) + step
            ck += (0.02 if pp == 0 else 0.00002) if off else 0.0
            rows.append({"rank": r, "step": step, "grad_norm_local": 1.0 + r, "loss": 3.0 if pp == 1 else math.nan,
                         "grad_norm_global": 2.0 + (0.01 if off and step == 2 else 0.0), "param_checksum": ck})
    res = analyze_divergence(metrics_trace(rows, coords))
    (f,) = [f for f in res.findings if f.kind == "grad_divergence"]
    assert f.ranks == [1] and f.data["affected"] == [5] and f.data["step"] == 2 and not f.data["ambiguous"]
    assert "rank 5 (pp 1, dp 1) inherited it" in f.title and "global grad norm" in f.title


def test_two_ranks_of_different_replicas_diverging_on_their_own_are_both_causes() -> None:
    coords = {r: {"tp": 0, "pp": r // 4, "dp": r % 4, "ep": 0} for r in range(8)}
    rows = [{"rank": r, "step": s, "grad_norm_global": 2.0, "grad_norm_local": 1.0,
             "param_checksum": 10.0 + s + (0.5 if s >= 1 and r in (1, 6) else 0.0)}
            for s in range(3) for r in range(8)]
    (f,) = [f for f in analyze_divergence(metrics_trace(rows, coords)).findings if f.kind == "grad_divergence"]
    assert f.ranks == [1, 6] and f.data["affected"] == []


# norms of a real pp 2 x dp 2 desync_grad drill at step 2 (rank, local norm) by injected rank; the global norm
# per dp replica (dp 0: ranks 0, 2; dp 1: ranks 1, 3). Two replicas: the checksums alone cannot say which.
LOCAL = {0: 0.815980682972, 1: 0.797718244389, 2: 1.918107945268, 3: 2.081945505127}
GLOBAL = {0: (2.142651379901, 2.124623989881), 1: (2.124623989881, 2.135763296398),
          2: (2.065922246181, 2.124623989881), 3: (2.124623989881, 2.218872173851)}


@pytest.mark.parametrize("injected", [0, 1, 2, 3])
def test_two_replica_pipeline_divergence_is_pinned_by_the_norms(injected: int) -> None:
    coords = {r: {"tp": 0, "pp": r // 2, "dp": r % 2, "ep": 0} for r in range(4)}
    rows = []
    for step in range(4):
        for r in range(4):
            dp = r % 2
            moved = step >= 2 and dp == injected % 2
            g = GLOBAL[injected][dp] if step == 2 else 2.5
            ck = 60.0 + 40.0 * (r // 2) + step + ((0.03 if r == injected else 0.0001) if moved else 0.0)
            rows.append({"rank": r, "step": step, "grad_norm_local": LOCAL[r] if step == 2 else 1.0 + r,
                         "grad_norm_global": g, "param_checksum": ck})
    (f,) = [f for f in analyze_divergence(metrics_trace(rows, coords)).findings if f.kind == "grad_divergence"]
    partner = {0: 2, 1: 3, 2: 0, 3: 1}[injected]
    assert f.ranks == [injected] and f.data["affected"] == [partner] and not f.data["ambiguous"], f.title
    assert "inherited it" in f.title and "single out" in f.title
    # (injected 2: the norms also fit rank 1; its stage's checksums moved 100x more, which decides)


# ---- the live watchdog ----
def test_watchdog_judges_an_op_by_its_own_history(tmp_path: Path) -> None:
    from ncclscope.runtime.recorder import SUSPECT_MIN_S, Recorder
    rec = Recorder(tmp_path, 0, 1, flush_interval_s=60)
    try:
        for seq in (1, 2):
            rec.end(rec.begin("collective", "all_reduce", group="dp0", seq=seq, nbytes=64))
        fresh = rec.begin("collective", "all_gather", group="dp0", seq=3, nbytes=64)   # no history: never suspect
        slow = rec.begin("collective", "all_reduce", group="dp0", seq=4, nbytes=64)
        young = rec.begin("collective", "all_reduce", group="dp0", seq=5, nbytes=64)   # 20x its history, < 2 s
        now = time.time_ns()
        for op, ago in ((fresh, 30.0), (slow, SUSPECT_MIN_S + 0.5), (young, 0.05)):
            rec._inflight[op] = (now - int(ago * 1e9), *rec._inflight[op][1:])
        rec._watchdog()
        rec._watchdog()                       # once per op
        status, message = S.EVENT_COLUMNS.index("status"), S.EVENT_COLUMNS.index("message")
        rows = [r for r in rec.events.rows if r[status] == S.STATUS_SUSPECT]
    finally:
        rec.close()
    assert [r[1] for r in rows] == [slow]
    msg = rows[0][message]
    assert msg.startswith("in flight 2.5 s; slowest earlier ") and "0.0 s" not in msg and "0.0 ms" not in msg


# ---- real healthy runs: exit 0, no warning ----
LAYOUTS = {
    "dp4": ["--dp", "4"],
    "tp2-dp2-zero1": ["--tp", "2", "--dp", "2", "--zero", "1"],
    "pp2-gpipe": ["--pp", "2", "--schedule", "gpipe", "--microbatches", "2"],
    "pp2-1f1b-dp2": ["--pp", "2", "--dp", "2", "--microbatches", "4", "--batch-size", "16"],
    "pp2-interleaved-dp2": ["--pp", "2", "--dp", "2", "--schedule", "interleaved", "--vpp", "2", "--n-layer", "4",
                            "--microbatches", "4", "--batch-size", "16"],
    "cp2-dp2": ["--cp", "2", "--dp", "2"],
    "dp2-ep2-zero2": ["--dp", "2", "--ep", "2", "--zero", "2"],
    "tp2-pp2-dp2": ["--tp", "2", "--pp", "2", "--dp", "2", "--microbatches", "4", "--batch-size", "16"],
}


@pytest.fixture(scope="module")
def healthy_runs(zygote) -> dict[str, Any]:
    """Each layout run as `ncclscope train` through the suite's warm zygote (conftest: torch is imported
    once for all of them, not once per job: ~3 s per layout on 2 cores). These are the suite's healthy
    jobs of every layout (tests/test_drills_e2e.py runs the faulty ones)."""
    out = {}
    for name, layout in LAYOUTS.items():
        job = zygote.run(f"precision-{name}", [*layout, "--steps", "3"], timeout=150)
        assert (job.run_dir / S.RUN_JSON).exists(), f"{name}: {job.train_err[-2000:]}"
        out[name] = job
    return out


@pytest.mark.spawn
@pytest.mark.e2e
@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_healthy_layout_exits_0_with_no_warning(healthy_runs: dict[str, Any], name: str) -> None:
    from test_drills_e2e import _assert_no_orphans
    job = healthy_runs[name]
    trace = load(job.run_dir)
    assert trace.run.end_reason == "completed", job.explain()
    assert job.result.get("rc_train") == 0 and not job.errors(), job.explain()
    a = analyse(trace)
    serious = [f"{f.severity}: {f.title}" for f in a.findings if f.severity in ("warning", "error")]
    assert a.exit_code == 0 and not serious and a.verdict.startswith("OK"), (a.verdict, serious)
    lines = [ln for ln in job.train_out.splitlines() if ln.strip()]
    assert lines and lines[0] == job.verdict == a.verdict     # `ncclscope train` prints the verdict first
    _assert_no_orphans(job)


# ---- stragglers: power and the noise of the other pipeline positions ----
def test_a_pair_cannot_reach_the_binomial_floor_but_a_rank_last_every_step_4x_slower_is_found() -> None:
    # two ranks, six steps: no outcome is rarer than 1/64 > ALPHA; last in all six and 4x slower is enough
    res = analyze_stragglers(dp_trace([1.0, 4.0], steps=6, noise=0.05))
    (f,) = warnings_of(res.findings)
    assert f.ranks == [1] and f.data["power_limited"] and f.data["p_last"] > ALPHA
    # ... but 1.5x is not (the effect must stand out twice as far from the noise then)
    assert warnings_of(analyze_stragglers(dp_trace([1.0, 1.5], steps=6, noise=0.05)).findings) == []


def pp_dp_trace(slow: float, other_swing: float, steps: int = 6, seed: int = 0) -> Trace:
    """pp 2 x dp 2: ranks 0,1 (pp 0) all-reduce over dp0, ranks 2,3 (pp 1) over dp1. Rank 1 computes `slow`
    x rank 0 every step; in the other position rank 3 swings by up to `other_swing` (log) against rank 2."""
    rng = np.random.default_rng(seed)
    coords = {r: {"pp": r // 2, "dp": r % 2} for r in range(4)}
    b = TraceBuilder(4, groups={"dp0": [0, 1], "dp1": [2, 3]}, coords=coords)
    for step in range(steps):
        t = 10.0 * step
        c = [0.1, 0.1 * slow, 0.1, 0.1 * math.exp(other_swing * rng.uniform(-1, 1))]
        for g, pair in (("dp0", (0, 1)), ("dp1", (2, 3))):
            end = t + max(c[r] for r in pair) + 0.01
            for r in pair:
                b.compute(r, "forward", t, t + c[r], step=step, microbatch=0)
                b.collective(r, g, step + 1, start=t + c[r], end=end, step=step)
    return b.build()


def test_one_peer_is_judged_against_the_spread_of_the_other_positions() -> None:
    # rank 1 is 2x rank 0 at every step, but in this run two healthy ranks of the other stage drift
    # apart by as much: that is this run's noise, not a straggler
    assert warnings_of(analyze_stragglers(pp_dp_trace(2.0, other_swing=1.2)).findings) == []
    # the same 2x where the other stage's ranks agree: a straggler
    (f,) = warnings_of(analyze_stragglers(pp_dp_trace(2.0, other_swing=0.02)).findings)
    assert f.ranks == [1]


# ---- divergence: the job-wide global norm ----
def test_a_tied_replica_pair_is_decided_by_the_job_wide_global_norm_and_the_moved_checksums() -> None:
    # dp 4 x ep 2: checksums compare within an expert position ({0,2}, {1,3}), pairs that tie; the global
    # norm is one number for the whole job. Rank 2 kept its gradient: its norm leaves the job's majority,
    # rank 3 (same expert group) follows it a little, and the {0,2} checksums move 30x more than {1,3}'s.
    coords = {r: {"tp": 0, "pp": 0, "dp": r, "ep": r % 2} for r in range(4)}
    rows = []
    for step in range(4):
        for r in range(4):
            g = {2: 2.6, 3: 2.15}.get(r, 2.02) if step == 2 else 2.0 + step
            ck = (160.0 if r % 2 == 0 else 150.0) + step + ({2: 0.4, 3: 0.013}.get(r, 0.0) if step >= 2 else 0.0)
            rows.append({"rank": r, "step": step, "grad_norm_local": 1.0 + r, "grad_norm_global": g,
                         "param_checksum": ck})
    (f,) = [f for f in analyze_divergence(metrics_trace(rows, coords)).findings if f.kind == "grad_divergence"]
    assert f.ranks == [2] and 3 in f.data["affected"] and not f.data["ambiguous"], f.title


def test_replica_sets_of_one_still_compare_the_global_norm() -> None:
    # ep carved out of dp 3: every dp rank holds other experts, no checksum compares; the global norm does
    coords = {r: {"tp": 0, "pp": 0, "dp": r, "ep": r} for r in range(3)}
    rows = [{"rank": r, "step": s, "grad_norm_local": 1.0, "param_checksum": 10.0 * r + s,
             "grad_norm_global": 2.0 + s + (0.3 if (s == 2 and r == 1) else 0.0)} for s in range(4) for r in range(3)]
    (f,) = [f for f in analyze_divergence(metrics_trace(rows, coords)).findings if f.kind == "grad_divergence"]
    assert f.ranks == [1] and f.data["step"] == 2 and not f.data["ambiguous"], f.title
    # equal everywhere: nothing
    same = [{**r, "grad_norm_global": 2.0 + r["step"]} for r in rows]
    assert [f for f in analyze_divergence(metrics_trace(same, coords)).findings if f.kind == "grad_divergence"] == []


def test_a_rank_causing_most_of_the_waiting_is_tested_though_last_at_few_of_its_collectives() -> None:
    """ZeRO-2 shape: three collectives a step, only the first after the compute. Rank 1 computes 3x as
    long and is last there (and causes nearly all the waiting), the other two are a toss-up: last at about
    a third of its collectives, below the 50% share, it must still reach the tests and be found."""
    from trace_builder import TraceBuilder
    b = TraceBuilder(4, groups={"dp0": [0, 1, 2, 3]})
    for r in range(4):
        b.coords(r, dp=r)
    rng = np.random.default_rng(3)
    t, k = 0.0, 0
    for step in range(8):
        comp = {r: 0.01 * (3.0 if r == 1 else 1.0) * (1 + 0.05 * rng.random()) for r in range(4)}
        for r in range(4):
            b.compute(r, "forward", start=t, end=t + comp[r], step=step)
        arrive = t + max(comp.values())
        for j in range(3):
            k += 1
            late = int(rng.integers(4)) if j else 1
            for r in range(4):
                start = (t + comp[r]) if j == 0 else arrive + (0.001 if r == late else 0.0)
                b.collective(r, "dp0", k, op=("reduce_scatter_tensor", "all_reduce", "all_gather_into_tensor")[j],
                             start=start, end=arrive + 0.0015, step=step)
            arrive += 0.002
        t = arrive + 0.001
    res = analyze_stragglers(b.build())
    (f,) = warnings_of(res.findings)
    assert f.ranks == [1] and f.data["last_frac"] < 0.5, f.title


def test_a_strong_compute_effect_carries_a_weaker_last_arrival_record() -> None:
    """A loaded host: rank 0 computes 2x its peers every step, but in two of six steps another rank reaches
    the all_reduce later (it idled before it: scheduling, not compute). Last in 4 of 6 (p=0.038 > ALPHA),
    z far above MIN_Z: a straggler. With only 3 of 6 (p=0.17) it is not, however slow."""
    def trace(late_steps: tuple[int, ...]) -> Trace:
        rng = np.random.default_rng(3)
        b = TraceBuilder(4, groups={"dp0": [0, 1, 2, 3]}, coords={r: {"dp": r} for r in range(4)})
        for step in range(6):
            t = 10.0 * step
            c = [0.1 * (2.0 if r == 0 else 1.0) * math.exp(0.05 * rng.standard_normal()) for r in range(4)]
            arrive = [t + c[r] + (0.3 if (r == 1 and step in late_steps) else 0.0) for r in range(4)]
            for r in range(4):
                b.compute(r, "forward", t, t + c[r], step=step, microbatch=0)
                b.collective(r, "dp0", step + 1, start=arrive[r], end=max(arrive) + 0.01, step=step)
        return b.build()
    res = analyze_stragglers(trace((1, 4)))
    (f,) = warnings_of(res.findings)
    assert f.ranks == [0] and ALPHA < f.data["p_last"] <= 0.05 and f.data["z"] >= 1.5 * MIN_Z
    assert warnings_of(analyze_stragglers(trace((1, 3, 4))).findings) == []


def test_a_rank_last_in_every_step_carries_an_effect_the_spread_blurs() -> None:
    """The mirror case: rank 0 is last in all 8 steps (p = 4^-8), 2x its peers' median compute, but the
    healthy peers differ among themselves by about 20% (a loaded host), so z stays under MIN_Z (about 2.4). A straggler; the same spread without the record (last in 5 of 8) is not."""
    def trace(last_steps: int) -> Trace:
        rng = np.random.default_rng(5)
        b = TraceBuilder(4, groups={"dp0": [0, 1, 2, 3]}, coords={r: {"dp": r} for r in range(4)})
        for step in range(8):
            t = 10.0 * step
            c = [0.1 * f * math.exp(0.05 * rng.standard_normal()) for f in (2.0, 1.0, 1.25, 0.8)]
            arrive = [t + c[r] for r in range(4)]
            if step >= last_steps:          # another rank idles before the all_reduce: last there
                arrive[1] = max(arrive) + 0.05
            for r in range(4):
                b.compute(r, "forward", t, t + c[r], step=step, microbatch=0)
                b.collective(r, "dp0", step + 1, start=arrive[r], end=max(arrive) + 0.01, step=step)
        return b.build()
    res = analyze_stragglers(trace(8))
    row = res.ranks.set_index("rank").loc[0]
    assert row["p_last"] <= ALPHA / 10 and 2.0 <= row["z"] < MIN_Z, (row["p_last"], row["z"])
    (f,) = warnings_of(res.findings)
    assert f.ranks == [0]
    assert warnings_of(analyze_stragglers(trace(5)).findings) == []
