"""Issue 25's classes, each as a hand-built trace: the rule that missed it, and what decides it now.

Pure logic (no processes): every case is stated op by op with `TraceBuilder`.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from ncclscope.hang.schedule_check import expected_tokens, find_schedule_deviations
from ncclscope.schedules import build_schedule
from ncclscope.verdict.compose import run
from ncclscope.verdict.diagnose import diagnose
from trace_builder import TraceBuilder

DT = 0.01


def _cp_pipeline(schedule: str, m: int, steps: int = 2) -> TraceBuilder:
    """cp 2 x pp 2: ranks 0,1 are pipeline stage 0 (cp 0,1), ranks 2,3 stage 1. Every forward and
    backward passes K/V around its cp ring with isend/irecv that carry the stage and microbatch of the
    action they belong to, as ring attention does inside a pipeline stage."""
    groups = {"pp0": [0, 2], "pp1": [1, 3], "cp0": [0, 1], "cp1": [2, 3]}
    b = TraceBuilder(4, groups=groups)
    b.run["config"] = {"pp": 2, "cp": 2, "vpp": 1, "schedule": schedule, "microbatches": m, "dp": 1}
    pp_of, cp_of = {0: 0, 1: 0, 2: 1, 3: 1}, {0: 0, 1: 1, 2: 0, 3: 1}
    for r in range(4):
        b.coords(r, pp=pp_of[r], cp=cp_of[r])
        b.rank_state(r, exitcode=0)
    plan = build_schedule(schedule, 2, m, 1)
    seq: dict[tuple[int, int, str], int] = {}
    t = 0.0
    for step in range(steps):
        for r in range(4):
            q, c = pp_of[r], cp_of[r]
            ring = r + 1 if c == 0 else r - 1
            pipe = {0: 2, 2: 0, 1: 3, 3: 1}[r]
            for tok in expected_tokens(plan[q], q, 2, 2):
                kw = dict(step=step, microbatch=tok.microbatch, stage=tok.stage)
                if tok.what in ("F", "B"):
                    for op, peer in (("isend", ring), ("irecv", ring)):
                        k = seq[(r, peer, op)] = seq.get((r, peer, op), 0) + 1
                        b.p2p(r, op, peer=peer, seq=k, start=t, end=t + DT, group=f"cp{q}", **kw)
                    b.compute(r, "forward" if tok.what == "F" else "backward", start=t, end=t + DT, **kw)
                else:
                    op = "isend" if tok.what == "send" else "recv"
                    k = seq[(r, pipe, op)] = seq.get((r, pipe, op), 0) + 1
                    b.p2p(r, op, peer=pipe, seq=k, start=t, end=t + DT, group=f"pp{c}", **kw)
                t += DT
    return b


def test_class9_cp_ring_inside_a_pipeline_stage_is_no_schedule_deviation() -> None:
    """Class 9 (a healthy cp 2 x pp 2 GPipe run read as SCHEDULE DEVIATION): the schedule check took the
    ring's isend/irecv, which carry the stage and microbatch of their forward, for pipeline actions. A
    pipeline action's p2p goes to another stage; p2p with a peer at the rank's own pipeline index is not
    one (both the numpy and the pandas path)."""
    for schedule, m in (("gpipe", 4), ("1f1b", 4)):
        trace = _cp_pipeline(schedule, m).build()
        assert find_schedule_deviations(trace).empty, schedule
        assert diagnose(trace).ok, schedule


def _zero2_ep(skipper: int, hang_step: int) -> TraceBuilder:
    """dp 4 x ep 2 with ZeRO-2: per step every rank reduce-scatters its dense grads on dp0, its expert grads
    on its expert-data-parallel pair (edp0 = 0,2; edp1 = 1,3), then all-reduces the loss on dp0. At
    `hang_step` the skipper leaves its edp reduce_scatter out and goes on to the all_reduce."""
    groups = {"dp0": [0, 1, 2, 3], "edp0": [0, 2], "edp1": [1, 3]}
    b = TraceBuilder(4, groups=groups)
    t = 0.0
    for step in range(hang_step + 1):
        for r in range(4):
            edp = f"edp{r % 2}"
            b.collective(r, "dp0", 2 * step + 1, op="reduce_scatter_tensor", start=t, end=t + DT,
                         call_site="runtime/parallel/data.py:132", step=step)
            last = step == hang_step
            if last and r == skipper:
                b.collective(r, "dp0", 2 * step + 2, start=t + 0.1, end=t + 3.1, status="timeout",
                             call_site="runtime/parallel/data.py:226", step=step)
                continue
            partner_hangs = last and r % 2 == skipper % 2
            b.collective(r, edp, step + 1, op="reduce_scatter_tensor", start=t + 0.02,
                         end=t + 3.02 if partner_hangs else t + 0.03, status="timeout" if partner_hangs else "ok",
                         call_site="runtime/parallel/data.py:132", step=step)
            if partner_hangs:
                continue
            b.collective(r, "dp0", 2 * step + 2, start=t + 0.05, end=t + 3.05 if last else t + 0.06,
                         status="timeout" if last else "ok", call_site="runtime/parallel/data.py:226", step=step)
        t += 1.0
    return b


@pytest.mark.parametrize("skipper,hang_step", [(1, 1), (2, 1), (1, 2), (0, 2), (3, 1)])
def test_class8_a_rank_waiting_earlier_in_its_own_loop_did_not_skip(skipper: int, hang_step: int) -> None:
    """Class 8 (dp 4 x ep 2, ZeRO-2, one rank skips its reduce_scatter on its expert-data-parallel pair): the
    majority rule called the skipper's pair partner the root, because 3 of 4 dp members began the loss
    all_reduce and the partner did not. The partner is blocked in the reduce_scatter its loop issues
    before that all_reduce: it has not reached it. The skipper went past its reduce_scatter (its previous
    iteration issued it before the all_reduce): the first deviation, named."""
    d = diagnose(_zero2_ep(skipper, hang_step).build())
    assert d.headline is not None and d.headline.kind == "hang", d.verdict
    assert d.headline.ranks == [skipper], d.verdict
    assert "reduce_scatter_tensor" in d.headline.title and f"edp{skipper % 2}" in d.headline.title


def test_class10_a_live_job_with_nothing_in_flight_is_not_stopped() -> None:
    """Class 10 (`tui --follow` on a healthy job crying wolf): the first poll of a job that has posted no op
    yet, or whose ranks are all between ops, read as `STOPPED` (no_op_in_flight), a post-mortem's word. A
    live job is held back from it; the same trace read as a finished job still says it."""
    from ncclscope.tui.follow import hold_premature_hang
    from ncclscope.verdict.compose import run as compose

    b = TraceBuilder(2, groups={"dp0": [0, 1]})
    for r in range(2):
        b.heartbeats(r, 0.0, 3.0)
    trace = b.build()
    post_mortem = compose(trace)
    assert post_mortem.verdict.startswith("STOPPED"), post_mortem.verdict
    live, note = hold_premature_hang(post_mortem, trace)
    assert not live.verdict.startswith("STOPPED"), live.verdict
    assert note.startswith("live:")
    # a hang whose wait is long is still called live
    b = TraceBuilder(2, groups={"dp0": [0, 1]})
    b.collective(0, "dp0", 1, start=0.0, end=0.01)
    b.collective(1, "dp0", 1, start=0.0, end=0.01)
    b.collective(0, "dp0", 2, start=0.1)
    b.compute(1, "forward", start=0.1)
    b.heartbeats(0, 0.0, 60.0)
    b.heartbeats(1, 0.0, 60.0)
    trace = b.build()
    live, note = hold_premature_hang(compose(trace), trace)
    assert live.verdict.startswith("STUCK IN COMPUTE"), live.verdict


def test_class10_a_live_rank_with_no_directory_yet_has_not_started() -> None:
    """follow_watch.py, pp2dp2 and tp2dp2 under load 18, poll 1: `DEAD RANK: ranks 1-3 ... left no trace
    directory`. On a loaded machine ranks start seconds apart: live, a rank with no directory is judged by
    its peers' waits on it, as any wait; a long wait on it is still called."""
    from ncclscope.tui.follow import hold_premature_hang
    from ncclscope.verdict.compose import run as compose

    def job(wait_s: float):
        b = TraceBuilder(4, groups={"world": [0, 1, 2, 3]})
        b.collective(0, "world", 1, start=0.0)
        b.heartbeats(0, 0.0, wait_s)
        for r in (1, 2, 3):
            b.rank_state(r, present=False)
        return b.build()

    trace = job(0.5)
    post_mortem = compose(trace)
    assert post_mortem.verdict.startswith("DEAD RANK"), post_mortem.verdict
    live, note = hold_premature_hang(post_mortem, trace)
    assert live.verdict.startswith("OK"), live.verdict
    assert note.startswith("live:")
    trace = job(120.0)
    live, _ = hold_premature_hang(compose(trace), trace)
    assert live.verdict.startswith("DEAD RANK"), live.verdict
    # follow_watch tp2dp2 poll 1: ranks 0,1 started (nothing in flight yet), ranks 2,3 not even listed
    b = TraceBuilder(4, groups={"world": [0, 1, 2, 3]})
    for r in (0, 1):
        b.marker(r, "setup", 0.1)
        b.heartbeats(r, 0.0, 0.5)
    trace = b.build()
    for r in (2, 3):
        trace.ranks.pop(r, None)
    post_mortem = compose(trace)
    assert post_mortem.verdict.startswith("DEAD RANK"), post_mortem.verdict
    live, note = hold_premature_hang(post_mortem, trace)
    assert not live.verdict.startswith("DEAD RANK"), live.verdict



@pytest.mark.parametrize("wait_s, held", [(0.016, True), (30.0, False)])
def test_class10_a_young_unmatched_send_whose_poster_went_on_computing_is_held(wait_s: float, held: bool) -> None:
    """follow_watch.py pp2dp2, poll 39: `UNMATCHED P2P: rank 1 never posted the recv matching rank 3's isend
    ... since 16 ms`, not held. The finding names only the rank that has not posted its side yet (between
    ops, nothing in flight); the wait is the poster's, cited in its evidence, and is judged as any wait."""
    from ncclscope.tui.follow import hold_premature_hang
    from ncclscope.verdict.compose import run as compose

    b = TraceBuilder(2, groups={"world": [0, 1]})
    t = 0.0
    for k in range(1, 6):
        for r, op in ((0, "isend"), (1, "irecv")):
            b.p2p(r, op, 1 - r, k, start=t, end=t + 0.01, tag=9, step=k)
            b.compute(r, "forward", start=t + 0.01, end=t + 0.05, step=k)
        t += 0.1
    b.p2p(0, "isend", 1, 6, start=t, tag=9, step=6)
    b.compute(0, "forward", start=t + 0.001, step=6)       # the poster went on to its next microbatch
    for r in (0, 1):
        b.heartbeats(r, 0.0, t + wait_s)
    trace = b.build()
    post_mortem = compose(trace)
    assert post_mortem.verdict.startswith("UNMATCHED P2P: rank 1"), post_mortem.verdict
    live, note = hold_premature_hang(post_mortem, trace)
    assert live.verdict.startswith("OK" if held else "UNMATCHED P2P"), live.verdict
    assert note.startswith("live: rank 0") if held else note == ""


def _tp_dp_wrong_group(sites: bool) -> TraceBuilder:
    """tp 2 x dp 2 as a Flight Recorder dump reads it (no step numbers): each iteration an all_reduce on the
    tp group (site A), then one on the dp group (site B), equal sizes. In iteration 2 rank 1 issues its tp
    all_reduce on its dp group: gloo pairs it with rank 3's B silently, and the job stops in a cycle
    through all four ranks: 0 waits on 1 in tp0 #3, 1 on 3 in dp1 #4, 3 on 2 in tp1 #4, 2 on 0 in dp0 #3."""
    b = TraceBuilder(4, groups={"tp0": [0, 1], "tp1": [2, 3], "dp0": [0, 2], "dp1": [1, 3]})
    A, B = ("train.py:30", "train.py:31") if sites else ("", "")
    tp, dp = {0: "tp0", 1: "tp0", 2: "tp1", 3: "tp1"}, {0: "dp0", 1: "dp1", 2: "dp0", 3: "dp1"}
    t = 0.0
    for k in (1, 2):
        for r in range(4):
            b.collective(r, tp[r], k, start=t, end=t + 0.01, call_site=A, step=-1)
            b.collective(r, dp[r], k, start=t + 0.02, end=t + 0.03, call_site=B, step=-1)
        t += 0.1
    hang = dict(start=t + 0.05, end=t + 3.05, status="timeout", step=-1)
    b.collective(0, "tp0", 3, call_site=A, **hang)
    b.collective(1, "dp1", 3, start=t, end=t + 0.01, call_site=A, step=-1)          # the wrong group
    b.collective(1, "dp1", 4, call_site=B, **hang)
    b.collective(2, "tp1", 3, start=t, end=t + 0.01, call_site=A, step=-1)
    b.collective(2, "dp0", 3, call_site=B, **hang)
    b.collective(3, "tp1", 3, start=t, end=t + 0.01, call_site=A, step=-1)
    b.collective(3, "dp1", 3, start=t + 0.01, end=t + 0.02, call_site=B, step=-1)
    b.collective(3, "tp1", 4, call_site=A, **hang)
    return b


@pytest.mark.parametrize("sites", [True, False])
def test_class1_the_rank_whose_loop_broke_inside_a_cycle_is_named(sites: bool) -> None:
    """Class 1 (tp x dp dumps, one rank's tp all_reduce issued on its dp group, equal sizes): every rank
    waits on the next in a cycle, and the verdict named all four. Rank 1's own sequence went tp, dp, tp, dp,
    dp, dp where its loop (and every peer's) goes tp, dp: it left its loop at the wrong call and blocked
    one call later; the others repeat their loops to the op they wait in."""
    d = diagnose(_tp_dp_wrong_group(sites).build())
    assert d.headline is not None and d.headline.ranks == [1], d.verdict
    assert d.headline.kind in ("hang", "wrong_group"), d.verdict


@pytest.mark.parametrize("recorded", [[], [3, 4, 5]])
def test_class2_dumps_of_a_job_that_stopped_before_communicating_are_never_ok(recorded: list[int]) -> None:
    """Class 2 (Flight Recorder dumps of a job that hung in process-group creation; raw gloo dumps carry no
    group table): the verdict was OK. Every rank left a dump and some (or all) hold no op, with nothing in
    flight: those ranks stopped before their first collective. Never OK, and no one rank blamed."""
    b = TraceBuilder(6, groups={"row0": [3, 4, 5]} if recorded else {})   # raw gloo dumps: no group table
    b.run["source"] = "flight_recorder"
    for r in recorded:
        b.collective(r, "row0", 1, op="all_gather", start=0.0, end=0.01, step=-1)
    d = diagnose(b.build())
    assert d.headline is not None and d.headline.kind == "no_op_in_flight", d.verdict
    assert d.headline.ranks == list(range(6)) and d.headline.severity == "error"
    assert "cannot say which rank" in d.headline.title


def test_class2_complete_dumps_of_a_healthy_job_stay_ok() -> None:
    b = TraceBuilder(4, groups={"world": [0, 1, 2, 3]})
    b.run["source"] = "flight_recorder"
    for k in range(1, 4):
        for r in range(4):
            b.collective(r, "world", k, start=k * 0.1, end=k * 0.1 + 0.01, step=-1)
    assert diagnose(b.build()).ok


# ---------------------------------------------------------------------------
# class 11: helpers shared by call sites; a rank that left its loop; the first deviation in iteration 2
# ---------------------------------------------------------------------------
def _helper_site() -> str:
    from ncclscope.runtime.usertrace.callsite import call_site
    return call_site(depth=1)          # as if the op were issued here, inside a helper


def test_class11_a_helpers_call_site_names_the_caller_that_tells_the_calls_apart() -> None:
    """The tracer wrote the helper's line for every op it issued: two loop lines calling one helper were
    one site. A site is the user's line and up to two user callers ("a.py:20 < a.py:58"); frames of
    installed packages (pytest here) end it."""
    from ncclscope import sites
    first = _helper_site()
    second = _helper_site()
    assert first != second and sites.inner(first) == sites.inner(second)
    assert all(len(sites.frames(s)) == 2 for s in (first, second))
    assert all(f.startswith("tests/test_issue25_classes.py:") for s in (first, second) for f in sites.frames(s))


LOOP_SCRIPT = """\
import torch.distributed as dist


def sync(t):
    dist.all_reduce(t)


def main(batches):
    for batch in batches:
        sync(batch)
        sync(batch * 2)
    dist.barrier()
"""


def test_class11_a_rank_that_ran_out_of_data_is_named_with_the_loop_it_left(tmp_path) -> None:
    """Class 11 (uneven loop counts): the verdict named the post-loop barrier the short rank went on to,
    never the loop. The loop's header comes from the script's source, where it is still on disk."""
    script = tmp_path / "train.py"
    script.write_text(LOOP_SCRIPT)
    a, b_, after = f"{script}:5 < {script}:10", f"{script}:5 < {script}:11", f"{script}:12"
    b = TraceBuilder(3)
    k, t = 0, 0.0
    for it in range(4):
        for site in (a, b_):
            k += 1
            for r in range(3):
                if it == 3 and r == 1:
                    continue
                last = it == 3 and site == a
                b.collective(r, "world", k, start=t, end=None if last else t + DT, call_site=site,
                             status="timeout" if last else "ok")
            t += 0.05
            if it == 3:
                break
    b.collective(1, "world", 7, op="barrier", start=t, end=None, call_site=after, status="error")
    for r in range(3):
        b.rank_state(r, exitcode=1)
    d = diagnose(b.build())
    assert d.headline.ranks == [1], d.verdict
    assert f"in the loop at {script}:9; it left that loop early" in d.verdict, d.verdict


def test_class11_a_wrong_peer_in_the_last_iteration_is_not_blamed_on_the_rank_that_finished() -> None:
    """Ring of 3 (isend to r+1, irecv from r-1) for 4 iterations; in the last, rank 2 sends to rank 1
    instead of rank 0. Rank 1 received from rank 0 and finished; rank 2 waits on it. The finished rank
    ran its loop to the end; rank 2's loop broke at the very op it waits in: rank 2 is the root."""
    site = "ring.py:30 < ring.py:41"
    b = TraceBuilder(3)
    t = 0.0
    for it in range(4):
        for r in range(3):
            dst = (r + 1) % 3 if not (it == 3 and r == 2) else 1
            stuck = it == 3 and r in (2, 0)
            b.p2p(r, "isend", peer=dst, seq=it + 1, start=t, end=None if it == 3 and r == 2 else t + DT,
                  call_site=site, status="error" if it == 3 and r == 2 else "ok")
            b.p2p(r, "irecv", peer=(r - 1) % 3, seq=it + 1, start=t, end=None if stuck else t + DT,
                  call_site=site, status="error" if stuck else "ok")
        t += 0.05
    b.rank_state(1, exitcode=0)
    b.rank_state(2, exitcode=1)
    b.rank_state(0, exitcode=1)
    d = diagnose(b.build())
    assert d.headline.ranks == [2], d.verdict
    assert "departed from its loop in iteration 4" in d.verdict and "isend to rank 1" in d.verdict


def test_class11_a_skip_in_the_second_iteration_breaks_a_two_rank_cycle() -> None:
    """2 ranks; per iteration all_reduce A, reduce B on the world, then a blocking exchange. In iteration 2
    rank 0 skips B and blocks in its send while rank 1 blocks in B: a cycle. One earlier iteration is all
    the history, read with one loop shape for both: rank 1 repeats it, rank 0 breaks at its blocked send."""
    b = TraceBuilder(2)
    t, k = 0.0, 0
    for it in range(2):
        for op in ("all_reduce", "reduce"):
            k += 1
            for r in range(2):
                if it == 1 and r == 0 and op == "reduce":
                    continue
                hung = it == 1 and op == "reduce"
                b.collective(r, "world", k, op=op, start=t, end=None if hung else t + DT, call_site=f"x.py:{10 if op == 'all_reduce' else 11}",
                             status="timeout" if hung else "ok")
            t += 0.05
        for r in range(2):
            first, second = ("send", "recv") if r == 0 else ("recv", "send")
            if it == 1 and r == 1:
                break
            hung = it == 1
            b.p2p(r, first, peer=1 - r, seq=it + 1, start=t, end=None if hung else t + DT, call_site="x.py:14",
                  status="timeout" if hung else "ok")
            if not hung:
                b.p2p(r, second, peer=1 - r, seq=it + 1, start=t + DT, end=t + 2 * DT, call_site="x.py:15")
        t += 0.05
    for r in range(2):
        b.rank_state(r, exitcode=1)
    d = diagnose(b.build())
    assert d.headline.ranks == [0], d.verdict
    assert "x.py:11" in d.verdict, d.verdict       # the op it left out: where its earlier iteration was


def test_class3_a_slow_rank_is_found_per_loop_iteration_without_step_marks() -> None:
    """Class 3 (a slow data loader, one rank 50 ms late per step, 2 ranks): a script that never calls an
    optimizer marks no steps, and each collective was its own trial; the one right after the delay is late
    and the next arrives together, so 'last at 65 % of collectives' was noise. The loop's iterations
    (the repeating call sites) are the trials: last in 10 of 10."""
    b = TraceBuilder(2)
    t, k = 0.0, 0
    for it in range(10):
        for j, site in enumerate(("s.py:20", "s.py:21")):
            k += 1
            for r in range(2):
                late = 0.05 if (r == 1 and j == 0) else 0.0
                b.collective(r, "world", k, start=t + late, end=t + 0.05 + 0.002, call_site=site, step=0)
            t += 0.06
        t += 0.01
    for r in range(2):
        b.rank_state(r, exitcode=0)
    a = run(b.build())
    assert a.verdict.startswith("STRAGGLER: rank 1 is a straggler"), a.verdict
    assert "last in 10 of 10 steps" in a.verdict


# ---- ties a 2-member group cannot vote on: each voter's own earlier iterations decide ---------------------
def _two_rank_loop(bad: dict[int, dict], iterations: int = 3) -> TraceBuilder:
    """Two ranks, one all_reduce of [[8]] from loop.py:12 per iteration (no step marked, as in a plain script);
    in the last iteration rank r issues bad[r] (collective() keywords) instead; both block there."""
    b = TraceBuilder(2, groups={"world": [0, 1]})
    for it in range(iterations):
        last = it == iterations - 1
        for r in range(2):
            kw = {"sizes": "[[8]]", "call_site": "loop.py:12", **(bad.get(r, {}) if last else {})}
            b.collective(r, "world", it + 1, start=it * 0.1, end=None if last else it * 0.1 + DT,
                         status="inflight" if last else "ok", step=-1, **kw)
    for r in range(2):
        b.rank_state(r, exitcode=1)
    return b


def _headline(d):
    return d.headline


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_a_one_vs_one_size_tie_is_decided_by_one_earlier_iteration(bad_rank: int) -> None:
    """seed 20261205 #5: rank 1 passed 4103 elements where both passed 4096 one iteration before. Was
    `ambiguous (1 vs 1 tie), naming the lowest rank 0` (history needed 2 earlier calls and a marked step)."""
    d = diagnose(_two_rank_loop({bad_rank: {"sizes": "[[9]]"}}, iterations=2).build())
    assert (_headline(d).kind, _headline(d).ranks) == ("collective_mismatch", [bad_rank]), d.verdict
    assert "ambiguous" not in d.verdict


@pytest.mark.parametrize("bad_rank", [0, 1])
def test_an_op_from_a_line_never_reached_before_is_the_deviation(bad_rank: int) -> None:
    """seed 20261205 #16, #32: an `if rank == ...` branch issues another op type from another line in a
    2-member group; the other voter's call is what its own loop always made there."""
    d = diagnose(_two_rank_loop({bad_rank: {"op": "broadcast", "call_site": "loop.py:30"}}).build())
    assert (_headline(d).kind, _headline(d).ranks) == ("collective_mismatch", [bad_rank]), d.verdict
    assert "a line it never reached before" in d.verdict


def test_both_voters_changing_stays_a_tie() -> None:
    """Neither voter kept to its own loop: history cannot single one out, the verdict says ambiguous."""
    d = diagnose(_two_rank_loop({0: {"sizes": "[[9]]"}, 1: {"sizes": "[[7]]"}}).build())
    assert "ambiguous" in d.verdict, d.verdict


# ---- a rank whose batch isend completed and its irecv timed out is waiting, not dead ---------------------
def test_a_timed_out_irecv_posted_with_a_completed_isend_is_a_wait_not_a_death() -> None:
    """seed 20261205 #17: a ring of 3 (isend to r+1, irecv from r-1); in iteration 3 rank 2 sends to rank 1
    instead of rank 0. Rank 0's isend completed, its irecv (posted in the same batch, before the isend
    ended) timed out, then the launcher stopped it. It was called dead (failed, not blocked)."""
    b = TraceBuilder(3)
    site = "ring.py:30 < ring.py:41"
    for it in range(4):
        t = it * 0.1
        for r in range(3):
            wrong = it == 3 and r == 2
            b.p2p(r, "isend", peer=1 if wrong else (r + 1) % 3, seq=it + 1, start=t,
                  end=None if wrong else t + 0.002, status="inflight" if wrong else "ok", call_site=site, step=-1)
            stuck = it == 3 and r == 0
            b.p2p(r, "irecv", peer=(r - 1) % 3, seq=it + 1, start=t + 0.001, end=t + 5.0 if stuck else t + DT,
                  status="timeout" if stuck else "ok", call_site=site, step=-1)
    b.rank_state(0, signal="SIGTERM", stopped_by_launcher=True, end_status="error",
                 end_message="RuntimeError: Timed out waiting 5000ms for recv operation to complete")
    b.rank_state(1, exitcode=0)
    b.rank_state(2, signal="SIGTERM", stopped_by_launcher=True)
    d = diagnose(b.build())
    assert _headline(d).ranks == [2] and _headline(d).kind != "dead_rank", d.verdict


def test_class7_a_tie_on_one_group_goes_to_the_rank_the_other_groups_already_name() -> None:
    """seed 20261206 #115 (rank 1 built the mesh in another order): on the groups three ranks hold the vote
    names rank 1; on one group only ranks 0 and 1 hold, the tie named rank 0 (`ambiguous ... naming the
    lowest rank`) and headed the verdict. The tie goes to the rank the vote already names."""
    b = TraceBuilder(4)                       # each rank holds a view of the groups it is in, as torch's do
    for r in (0, 2):
        b.group_view(r, "g1", [0, 1, 2], creation_order=0)
    b.group_view(1, "g1", [0, 1, 3], creation_order=0)
    for r in (2, 3):
        b.group_view(r, "g2", [1, 2, 3], creation_order=1)
    b.group_view(1, "g2", [0, 2, 3], creation_order=1)
    b.group_view(0, "g3", [0, 1], creation_order=2)
    b.group_view(1, "g3", [1, 2], creation_order=2)
    for r in range(4):
        b.rank_state(r, exitcode=0)
    d = diagnose(b.build())
    views = [f for f in d.findings if f.kind == "group_mismatch"]
    assert [f.ranks for f in views] == [[1]], [f.title for f in views]
    assert "ambiguous" not in d.verdict and "3 groups" in d.verdict, d.verdict


def test_a_rank_ahead_inside_an_unfinished_step_issued_nothing_extra() -> None:
    """seed 20261206 #63: every op in step 0 (a loop with no optimizer step), rank 0 sends to the wrong peer
    in iteration 2; rank 2 got its message and went on to the iteration's all_gather, one more than the
    others had reached. The step census called that all_gather an extra one; nobody finished the step, so
    counts there are not final: the root is the rank whose loop broke."""
    site_p2p, site_ag = "ring.py:29 < ring.py:45", "ring.py:34 < ring.py:45"
    b = TraceBuilder(3, groups={"world": [0, 1, 2]})
    for it in range(2):
        t = it * 0.1
        for r in range(3):
            wrong = it == 1 and r == 0
            dst = 2 if wrong else (r + 1) % 3
            b.p2p(r, "isend", peer=dst, seq=it + 1, start=t, end=None if wrong else t + 0.002,
                  status="inflight" if wrong else "ok", call_site=site_p2p)
            waits = it == 1 and r in (0, 1)
            b.p2p(r, "irecv", peer=(r - 1) % 3, seq=it + 1, start=t + 0.001, end=None if waits else t + 0.003,
                  status="inflight" if waits else "ok", call_site=site_p2p)
            if it == 0 or r == 2:
                b.collective(r, "world", it + 1, op="all_gather_into_tensor", start=t + 0.01,
                             end=None if it == 1 else t + 0.02, status="inflight" if it == 1 else "ok",
                             call_site=site_ag, step=0)
    for r in range(3):
        b.rank_state(r, exitcode=1)
    d = diagnose(b.build())
    assert "extra" not in d.verdict, d.verdict
    assert d.headline.ranks == [0], d.verdict


def test_an_exit_past_the_loops_collective_after_the_optimizer_step_is_a_death_not_a_skip() -> None:
    """seed 20261206 #171 (its run directory, kept as written: tests/data/randprog/): a user script (no
    compute spans; its steps come from the optimizer.step() hook) calls os._exit at the end of iteration 3,
    after the optimizer step began step 4. Its stack is past the loop's all_reduce line and it issued
    nothing in step 4, which read as `skipped all_reduce`: it died there."""
    from pathlib import Path

    from ncclscope.load.trace import load
    d = diagnose(load(Path(__file__).parent / "data" / "randprog" / "rp20261206_171_exit"))
    assert (d.headline.kind, d.headline.ranks) == ("dead_rank", [0]), d.verdict
    assert "os._exit(1)" in d.verdict


def test_a_rank_that_died_without_a_dump_is_counted_by_the_default_group_s_all_gather_shapes() -> None:
    """seed 20261208 #50 (rank 0's gloo dump as written: tests/data/randprog/): 2 ranks, rank 1 calls
    os._exit(2) and leaves no dump. gloo lists no members, so the world was the highest dump + 1 = one rank,
    healthy: "OK". Rank 0's all_gathers on the default group record outputs of 2 inputs (fr_world): the
    world has 2 ranks, and rank 1 is the one that left no dump."""
    from pathlib import Path

    from ncclscope.load.foreign.flight_recorder import load_flight_recorder
    from ncclscope.load.foreign.fr_world import gathered_width
    trace = load_flight_recorder(Path(__file__).parent / "data" / "randprog" / "rp20261208_050_exit_fr")
    assert trace.world_size == 2 and trace.ranks[1].state == "missing"
    assert any("all_gather shapes say the world has 2 ranks" in w for w in trace.warnings)
    from ncclscope.verdict import run
    a = run(trace)
    assert a.level != "ok" and a.headline is not None and a.headline.ranks == [1], a.verdict
    assert a.verdict.startswith("DEAD RANK: rank 1 ")
    # the shapes rules: a list of W inputs, one stacked [W] + S, one flat W x S; anything else says nothing
    assert gathered_width([[3]], [[3], [3], [3]]) == 3 and gathered_width([[3]], [[2, 3]]) == 2
    assert gathered_width([[4, 8]], [[16, 8]]) == 4 and gathered_width([[4]], [[5]]) is None
    assert gathered_width([[3], [3]], [[6]]) is None


def test_one_line_that_issues_several_different_collectives_is_one_call_not_a_loop() -> None:
    """seed 20261208 #122 (rank 0's gloo dump as written): `mlp = DDP(mlp)` issues an all_gather and two
    broadcasts, every one from the user's line 28. Numbered as iterations of one call, the all_gather read as
    deviating from "its own other iterations" (broadcasts) and the verdict blamed rank 0; rank 1 raised
    KeyError and left no dump. A run of calls from one line, of more than one op, is one statement."""
    from pathlib import Path

    from ncclscope.load.foreign.flight_recorder import load_flight_recorder
    from ncclscope.verdict import run
    a = run(load_flight_recorder(Path(__file__).parent / "data" / "randprog" / "rp20261208_122_exception_fr"))
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("dead_rank", [1]), a.verdict
    assert not [f for f in a.findings if f.kind == "collective_mismatch" and 0 in f.ranks], \
        [f.title for f in a.findings]


def test_a_rebuilt_group_takes_back_the_rank_without_a_dump_when_its_all_gather_shapes_say_so() -> None:
    """gloo lists no members, so a group is rebuilt from the ranks whose dumps used it. seed 20261208 #141:
    group 5 = [4, 5], rank 4 left no dump, so it read as [5] alone and every collective on it complete.
    Its all_gathers' outputs hold 2 inputs: the one rank of the world without a dump is its other member.
    With two ranks missing and one seat free, nothing is guessed."""
    from ncclscope.load.foreign.fr_fixups import group_members
    dumps = {r: {} for r in (0, 1, 2, 3, 5)}
    got = group_members([5, 0], ["5", "0"], ["undefined", "default_pg"], dumps, 6, [], {"5": 2})
    assert got == [(4, 5), tuple(range(6))]
    dumps = {r: {} for r in (0, 1, 2, 5)}
    got = group_members([5], ["5"], ["undefined"], dumps, 6, [], {"5": 2})
    assert got == [(5,)]


def test_a_send_to_another_peer_from_the_line_whose_earlier_calls_all_went_to_one_peer_is_the_deviation() -> None:
    """seed 20261208 #174 (its run directory as written): a 3-rank ring, each rank isends to r+1 and
    irecvs from r-1 at one line; in its second iteration rank 1 isends to rank 0. Rank 2 waits in its irecv
    from 1, rank 0 never posts a recv from 1, and rank 0 and 1 deadlock through the next broadcast. One
    iteration before the break is too few for the loop's period, so the cycle was the verdict; the line's
    own earlier call (to rank 2) says rank 1 changed peer (p2p.with_peer_change)."""
    from pathlib import Path

    from ncclscope.load.trace import load
    d = diagnose(load(Path(__file__).parent / "data" / "randprog" / "rp20261208_174_wrong_peer"))
    assert (d.headline.kind, d.headline.ranks) == ("unmatched_p2p", [1]), d.verdict
    assert "posted isend to rank 0" in d.verdict and "went to rank 2" in d.verdict
    assert d.headline.cause.departure is not None


def test_a_ring_send_to_another_peer_in_a_marked_step_is_the_deviation() -> None:
    """The marked-steps branch of with_departure (seed 20261208 #302 and #259 ran it): the previous step
    cannot be replayed as a routine (rank 1's step 1 has ops step 0 did not), so the line's own earlier
    call decides: rank 1's isend at ring.py:5 went to rank 2 in step 0 and to rank 0 in step 1."""
    b = TraceBuilder(3, groups={"world": [0, 1, 2]}, group_kinds={"world": "world"})
    for r in range(3):
        b.heartbeats(r, 0.0, 20.0)
    seq = 0
    for step in range(2):
        t = step * 1.0
        for r in range(3):
            dst = (r + 1) % 3 if not (r == 1 and step == 1) else 0
            ok = not (step == 1 and r in (1, 2))
            end = t + 0.01 if ok else None
            b.p2p(r, "isend", dst, seq=step + 1 if not (r == 1 and step == 1) else 1, start=t, end=end,
                  status="ok" if ok else "timeout", call_site="ring.py:5", step=step)
            src = (r - 1) % 3
            recv_ok = not (step == 1 and r == 2)
            b.p2p(r, "irecv", src, seq=step + 1, start=t + 0.001, end=t + 0.01 if recv_ok else None,
                  status="ok" if recv_ok else "timeout", call_site="ring.py:5", step=step)
        seq += 1
        for r in range(3):
            if step == 1 and r in (1, 2):
                continue
            b.collective(r, "world", seq, start=t + 0.02, end=t + 0.03 if step == 0 else None,
                         status="ok" if step == 0 else "timeout", call_site="ring.py:9", step=step)
    d = diagnose(b.build())
    assert (d.headline.kind, d.headline.ranks) == ("unmatched_p2p", [1]), d.verdict
    assert "posted isend to rank 0 at ring.py:5" in d.verdict


def test_ranks_that_stopped_at_the_same_point_outside_any_recorded_op_are_one_finding_that_says_so() -> None:
    """seed 20261208 #171 (the gloo dumps as written): 4 ranks; at step 2 rank 3 flips its send/recv order
    with rank 2, so both receive first and deadlock. gloo records no p2p op, so both dumps end after
    all_reduce #10 with nothing in flight while ranks 0,1 wait in #11. Nothing recorded orders 2 and 3: the
    verdict named rank 2 and listed rank 3 as "+1 more root cause", as if they were two faults. Now one
    finding names both and says the order is unknown; its root stays the lowest rank, a convention the
    sentence states (same_stop.py: measured on seed 20261209, naming all was right less often)."""
    from pathlib import Path

    from ncclscope.load.foreign.flight_recorder import load_flight_recorder
    from ncclscope.verdict import run
    a = run(load_flight_recorder(Path(__file__).parent / "data" / "randprog" / "rp20261208_171_swap_order_fr"))
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("hang", [2]), a.verdict
    assert a.verdict.startswith("HANG: rank 2 never posted all_reduce #11 on default_pg")
    assert "rank 3 stopped at the same point and nothing recorded says which of them stopped first" in a.verdict
    assert a.headline.data["same_stop"] == [2, 3] and 3 in a.headline.involved_ranks
    assert "+1 more root cause" not in a.verdict
    assert not [f for f in a.findings if f.kind == "hang" and f.ranks == [3]], [f.title for f in a.findings]


def test_a_rank_that_skipped_a_collective_and_went_on_to_a_send_of_its_loop_is_the_deviation() -> None:
    """seed 20261208 #377 (its run directory as written, less samples): 8 ranks; in step 1 rank 4 skips the
    world all_gather its loop issues first and goes on to the ring's isend to rank 5, which waits in that
    all_gather: a cycle 4 -> 5 -> 4. The skip rule asked only for a rank gone on to a collective on another
    group, so the verdict was the DEADLOCK of ranks 3-5. Rank 4's own loop (its sends read with its
    collectives) puts the all_gather before that isend: it went past it (loop_order.p2p_passers)."""
    from pathlib import Path

    from ncclscope.load.trace import load
    d = diagnose(load(Path(__file__).parent / "data" / "randprog" / "rp20261208_377_skip"))
    assert (d.headline.kind, d.headline.ranks) == ("hang", [4]), d.verdict
    assert "never posted all_gather_into_tensor #8 on world" in d.verdict and "went on to isend #3 to rank 5" in d.verdict
    assert ":28" in d.verdict    # the user's call of the helper in the loop


def test_a_one_against_one_tie_is_decided_by_what_each_rank_s_own_loop_issues_at_that_point() -> None:
    """seed 20261208 #334 (the gloo dumps as written): 2 ranks; in step 2 rank 1 skips the all_reduce its
    loop issues at line 61 and goes on to broadcast_object_list, which pairs with rank 0's all_reduce. Both
    calls come from sites each rank used before with the same op, so the site histories tie and the
    verdict named the lowest rank. Each rank's own sequence on the group says what comes next: after the
    all_gather of line 58 its loop issues the all_reduce of line 61; rank 0 did, rank 1 did not."""
    from pathlib import Path

    from ncclscope.hang.loop_order import predicted_next
    from ncclscope.load.foreign.flight_recorder import load_flight_recorder
    from ncclscope.verdict import run
    a = run(load_flight_recorder(Path(__file__).parent / "data" / "randprog" / "rp20261208_334_skip_fr"))
    # the headline: the skip read from rank 1's own loop (its passes on the group, the dumps marking no
    # steps), the tie's mismatch, decided by the same sequences, filed under it
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("hang", [1]), a.verdict
    assert "rank 1 skipped all_reduce" in a.verdict and ":61" in a.verdict
    assert "ambiguous" not in a.verdict
    assert any(f.kind == "collective_mismatch" and f.ranks == [1]
               and "its own earlier calls on default_pg issue all_reduce" in f.title for f in a.findings)
    # the prediction: the longest earlier-seen context, one earlier pass is enough, disagreement says nothing
    assert predicted_next(list("abcdeabc")) == ("d", 1) and predicted_next(list("abcdeabcdeabc"))[0] == "d"
    assert predicted_next(list("ab")) is None and predicted_next(list("abcxabcyabc")) is None
    # a match back to the record's start is as long as the evidence goes (seed 20261223 #102: the group's
    # record began with its loop's barrier); one the record contradicts before that says nothing
    assert predicted_next(list("bcdeb")) == ("c", 1) and predicted_next(list("xbcdb")) is None


def test_a_rank_that_left_its_loop_comes_before_ranks_whose_state_nothing_says() -> None:
    """seed 20261209 #46 (the gloo dumps as written): 4 ranks, mesh [2, 2]; in step 3 rank 0 skips its
    all_gather on its sp group and goes on to the world all_gather, where it waits; its sp partner (rank 2)
    waits in the skipped all_gather. Ranks 1 and 3 finished their sp all_gather and are in the ring's
    send/recv, which gloo does not record: "in no communication op, state unknown". Their finding came
    first and named them as the root. A rank the evidence shows leaving its loop comes before ranks whose
    state nothing says (waitfor: idle chain ends are ordered last)."""
    from pathlib import Path

    from ncclscope.load.foreign.flight_recorder import load_flight_recorder
    from ncclscope.verdict import run
    a = run(load_flight_recorder(Path(__file__).parent / "data" / "randprog" / "rp20261209_046_skip_fr"))
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("hang", [0]), a.verdict
    assert "never posted all_gather #4 on mesh_sp:1" in a.verdict


def _dumps_as_cloned(name: str, tmp_path: Path) -> Path:
    """A fixture's dumps copied as a fresh clone has them: every file's time is now, not when torch wrote it."""
    import shutil

    from randprog_data import DATA
    dst = tmp_path / name
    shutil.copytree(DATA / name, dst)
    return dst


def test_a_lone_record_whose_partner_left_no_dump_breaks_its_one_earlier_call_from_the_same_line(tmp_path) -> None:
    """seed 20261209 #59 (rank 1's gloo dump as written): 2 ranks; in step 1 rank 1 passes 1002 elements to an
    all_gather_into_tensor where it passed 1000 in step 0 from the same line. gloo aborted rank 0 on the size
    mismatch, so its record of the op died with it and the verdict read "DEAD RANK: rank 0": the consequence.
    With the partner's whole dump gone nothing else can speak for the op, so one earlier call from the very
    call site is history enough (two are asked where a partner's record could still disagree)."""
    from ncclscope.load.foreign.flight_recorder import load_flight_recorder
    from ncclscope.verdict import run
    a = run(load_flight_recorder(_dumps_as_cloned("rp20261209_059_size_fr", tmp_path)))
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("collective_mismatch", [1]), a.verdict
    assert "passed sizes [[1002]]" in a.verdict and "rp20261209_059_size.py:39" in a.verdict
    assert "rank 0 left no record of #5" in a.verdict


def test_an_all_to_all_that_received_other_rows_than_it_sent_had_a_peer_that_left_no_dump(tmp_path) -> None:
    """seed 20261209 #183 (rank 0's gloo dump as written): 2 ranks, rank 1 calls os._exit(137) and leaves no
    dump, and rank 0's dump has no all_gather to count the world by: one rank, "OK". Its all_to_all_single on a
    new group sent 4 rows and received 3: a group of one sends itself what it receives, so the group, and the
    world, had another member, and rank 1 is one of them (fr_world.group_floors)."""
    from ncclscope.load.foreign.flight_recorder import load_flight_recorder
    from ncclscope.load.foreign.fr_world import group_floors
    from ncclscope.verdict import run
    trace = load_flight_recorder(_dumps_as_cloned("rp20261209_183_exit_fr", tmp_path))
    assert trace.world_size == 2 and trace.ranks[1].state == "missing"
    assert any("at least 2 ranks and rank(s) 1 left no dump" in w for w in trace.warnings), trace.warnings
    a = run(trace)
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("dead_rank", [1]), a.verdict

    class _Ents:            # the rule alone: equal rows say nothing; a list form says nothing
        n = 3
        pnames = ["gloo:all_to_all", "gloo:all_to_all", "gloo:all_to_all"]
        pn_code = __import__("numpy").array([0, 1, 2])
        pg_code = __import__("numpy").array([0, 1, 2])
        pg_names = ["0", "1", "2"]
        size_code = __import__("numpy").array([0, 1, 2])
        out_size_code = __import__("numpy").array([0, 1, 2])
        size_texts = ["[[4, 15]]", "[[8, 64]]", "[[3], [3]]"]
        out_size_texts = ["[[3, 15]]", "[[8, 64]]", "[[2], [4]]"]
    assert group_floors(_Ents()) == {"0": 2}


def test_a_mesh_dimension_s_group_takes_back_its_rank_without_a_dump_by_its_sibling_groups_size() -> None:
    """seed 20261209 #102: DeviceMesh rep groups {0,1} and {2,3} (both described "mesh_rep"); rank 0 died
    without a dump, so group 3 was rebuilt as [1] alone and rank 1's deviating all_reduce on it read as
    complete. The groups of one mesh dimension have one size: with exactly the one missing seat and one rank
    without a dump, that rank is put back. Without a mesh description the one other group's shape does the
    same where the rank it puts back is one whose dump is missing between others (fr_fixups.complete_groups,
    seed 20261214 #366), even with another rank missing above them; a shape that would put back only ranks
    past the dumps' names guesses nothing."""
    from ncclscope.load.foreign.fr_fixups import group_members
    dumps = {r: {} for r in (1, 2, 3)}
    got = group_members([1, 2, 3], ["3", "4", "4"], ["mesh_rep", "mesh_rep", "mesh_rep"], dumps, 4, [])
    assert got == [(0, 1), (2, 3), (2, 3)]
    got = group_members([1, 2, 3], ["3", "4", "4"], ["undefined", "undefined", "undefined"], dumps, 4, [])
    assert got == [(0, 1), (2, 3), (2, 3)]
    got = group_members([1, 2, 3], ["3", "4", "4"], ["mesh_rep", "mesh_rep", "mesh_rep"], dumps, 5, [])
    assert got == [(0, 1), (2, 3), (2, 3)]
    dumps = {r: {} for r in (0, 1, 2)}          # {2} next to {0,1}: only rank 3, past the dumps, would fit
    got = group_members([0, 1, 2], ["3", "3", "4"], ["undefined", "undefined", "undefined"], dumps, 3, [])
    assert got == [(0, 1), (0, 1), (2,)]


def test_a_finished_lone_record_whose_partner_then_died_without_a_dump_is_the_deviation(tmp_path) -> None:
    """seed 20261210 #9 (the gloo dumps as written; that seed's first run measured the code before this rule):
    4 ranks; rank 1 passes 1007 elements to an all_gather on its 2-rank group where it passed 1000 from the same
    line one iteration before. gloo completed rank 1's side and aborted rank 0, which left no dump; rank 1 went
    on to the world all_gather and waits there with everyone else, so the verdict read "DEAD RANK: rank 0".
    Its record of the group's last instance is alone, finished, and breaks its own history: the deviation
    before the death, which the death is the consequence of."""
    from ncclscope.load.foreign.flight_recorder import load_flight_recorder
    from ncclscope.verdict import run
    a = run(load_flight_recorder(_dumps_as_cloned("rp20261210_009_size_fr", tmp_path)))
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("collective_mismatch", [1]), a.verdict
    assert "all_gather #4" in a.verdict and "passed sizes [[1007]]" in a.verdict
    assert a.headline.cause.before_death and a.headline.cause.absent_ranks == (0,)



def test_a_survivor_s_loop_order_against_one_earlier_iteration_blames_nobody(tmp_path: Path) -> None:
    """seed 20261210 #236 (the gloo dumps as written): rank 2 all-reduces on the wrong group and dies without a
    dump. Its dp partner, rank 0, issued two DDP broadcasts in its loop's second iteration and none in the
    first or third, so against one earlier iteration its last all_reduce reads as a skip: a first version of
    the survivor's loop-order rule blamed it. A loop's first iterations may differ; the survivor's loop order
    speaks only where two earlier iterations agree (the 1-vs-1 tie rule compares two members instead)."""
    import pandas as pd

    from ncclscope.hang.loop_order import sequence_deviant
    from ncclscope.load.foreign.flight_recorder import load_flight_recorder
    from ncclscope.verdict import run
    a = run(load_flight_recorder(_dumps_as_cloned("rp20261210_236_wrong_group_fr", tmp_path)))
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("dead_rank", [2]), a.verdict
    assert not [f for f in a.findings if f.kind == "collective_mismatch" and f.severity == "error" and 0 in f.ranks]
    # the rule itself: a lone call against its own earlier calls on the group, with how many iterations say so
    sites = ["a", "b", "c"] * 3 + ["a", "c"]
    coll = pd.DataFrame({"rank": 1, "process_group": "g", "collective_seq_id": range(1, len(sites) + 1),
                         "op_id": range(len(sites)), "op_name": "all_reduce", "call_site": sites})
    got = sequence_deviant(coll, coll.iloc[[-1]], "g", alone=True)
    # iterations 1-3 say so (the first one's match runs back to the start of the record: as far as it goes)
    assert got is not None and got[0] == 1 and got[2] == "b" and got[3] == 3
    assert sequence_deviant(coll, coll.iloc[[-1]], "g") is None      # two members are needed otherwise
    # ... not from a line the rank never called from before (the first call after its loop looks the same)
    novel = coll.assign(call_site=sites[:-1] + ["d"])
    assert sequence_deviant(novel, novel.iloc[[-1]], "g", alone=True) is None
    # ... nor where another rank made that very call at that point of its own sequence, on its own group
    peer = coll.assign(rank=3, process_group="h", op_id=range(100, 100 + len(sites)))
    both = pd.concat([coll, peer], ignore_index=True)
    assert sequence_deviant(both, coll.iloc[[-1]], "g", alone=True) is None


def test_an_absent_rank_whose_previous_iteration_never_posted_the_match_does_not_break_the_diagnosis() -> None:
    """seed 20261213 #371 (its run directory as written): rank 0 alone all-reduces a scalar on its cp group
    at step 3, where its peers' loop issues a reduce_scatter_tensor. A peer's unmatched p2p op led the p2p
    departure check to the absent rank's previous iteration, which never posted the matching op either:
    the check indexed a missing call and the whole hang diagnosis failed ("INCOMPLETE: 1 analysis failed").
    Now that check says nothing, and the mismatch names rank 0 at its line."""
    from ncclscope.load.trace import load
    d = diagnose(load(Path(__file__).parent / "data" / "randprog" / "rp20261213_371_extra"))
    assert (d.headline.kind, d.headline.ranks) == ("collective_mismatch", [0]), d.verdict
    assert "program.py:82" in d.verdict or "rp20261213_371_extra.py:82" in d.verdict, d.verdict
