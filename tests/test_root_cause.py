"""The first deviation is the root cause: pure-logic tests on hand-built traces (no torch, no jobs).

- schedules are evidence: a pipeline rank whose p2p/compute order departs from its schedule's
  action list is named (`schedule_deviation`), and promoted over the p2p deadlock it caused;
  healthy pipeline orders (GPipe, 1F1B, interleaved) are silent;
- a skip before a death: a rank that skipped a collective and then died (gloo's SIGABRT on the
  paired-off call, an allocation failure from garbage counts) is headlined as the skip, the death
  supporting it; a plain death stays DEAD RANK;
- a skip under context parallelism (the skipper went on to the next step's ring p2p) is a skip,
  not a deadlock between it and an innocent waiter.
"""
from __future__ import annotations

import pytest

from ncclscope.verdict.diagnose import diagnose
from ncclscope.hang.schedule_check import (Token, analyze_schedule, expected_tokens, find_schedule_deviations,
                                               first_mismatch)
from ncclscope.schedules import build_schedule
from tests.trace_builder import TraceBuilder

DT = 0.01


# ---------------------------------------------------------------------------
# pipeline schedules
# ---------------------------------------------------------------------------
def _pipeline(schedule: str, p: int, m: int, v: int = 1, steps: int = 2, hook=None,
              exitcode: int | None = 0) -> TraceBuilder:
    """A pipeline job of p ranks (rank = pipeline index) that follows `schedule` for `steps` steps.

    `hook(b, q, step, tokens, t)` may replace one rank's step: it returns the new time, or None to run
    that step normally."""
    b = TraceBuilder(p, groups={"pp0": list(range(p))})
    b.run["config"] = {"pp": p, "vpp": v, "schedule": schedule, "microbatches": m, "dp": 1}
    for q in range(p):
        b.coords(q, pp=q)
        if exitcode is not None:
            b.rank_state(q, exitcode=exitcode)
    plan = build_schedule(schedule, p, m, v)
    sent: dict[tuple[int, int], int] = {}
    recvd: dict[tuple[int, int], int] = {}
    t = 0.0
    for step in range(steps):
        for q in range(p):
            toks = expected_tokens(plan[q], q, p, p * v)
            if hook is not None:
                t2 = hook(b, q, step, toks, t)
                if t2 is not None:
                    t = t2
                    continue
            for tok in toks:
                if tok.what in ("F", "B"):
                    b.compute(q, "forward" if tok.what == "F" else "backward", start=t, end=t + DT, step=step,
                              microbatch=tok.microbatch, stage=tok.stage)
                elif tok.what == "send":
                    k = sent[(q, tok.peer)] = sent.get((q, tok.peer), 0) + 1
                    b.p2p(q, "isend", peer=tok.peer, seq=k, start=t, end=t + DT, group="pp0", step=step,
                          microbatch=tok.microbatch, stage=tok.stage)
                else:
                    k = recvd[(tok.peer, q)] = recvd.get((tok.peer, q), 0) + 1
                    b.p2p(q, "recv", peer=tok.peer, seq=k, start=t, end=t + DT, group="pp0", step=step,
                          microbatch=tok.microbatch, stage=tok.stage)
                t += DT
            if hook is None or step < steps - 1:
                # the step's loss all_reduce over the pipeline group (outside any action: stage -1)
                b.collective(q, "pp0", step + 1, start=t, end=t + 0.3, step=step)
                t += 0.3
    return b


@pytest.mark.parametrize("schedule,p,m,v", [("gpipe", 2, 2, 1), ("1f1b", 2, 4, 1), ("1f1b", 4, 4, 1),
                                             ("interleaved", 2, 2, 2), ("interleaved", 2, 4, 2)])
def test_healthy_pipeline_orders_are_silent(schedule: str, p: int, m: int, v: int) -> None:
    trace = _pipeline(schedule, p, m, v).build()
    assert find_schedule_deviations(trace).empty
    assert analyze_schedule(trace) == []
    assert diagnose(trace).ok


def test_expected_order_has_recv_compute_send_per_action() -> None:
    toks = expected_tokens(build_schedule("1f1b", 2, 1)[0], 0, 2, 2)
    assert [t.what for t in toks] == ["F", "send", "recv", "B"]
    toks = expected_tokens(build_schedule("1f1b", 2, 1)[1], 1, 2, 2)
    assert [t.what for t in toks] == ["recv", "F", "B", "send"]


def test_a_stopped_order_is_a_prefix_not_a_deviation() -> None:
    exp = [Token("F", -1, 0, 0), Token("send", 1, 0, 0)]
    assert first_mismatch(exp[:1], exp) == -1
    assert first_mismatch([Token("F", -1, 0, 0), Token("recv", 1, 0, 0)], exp) == 1
    assert first_mismatch(exp + [Token("F", -1, 0, 1)], exp) == 2


def _recv_before_send(dev_rank: int, step_at: int = 1):
    """`dev_rank` (pipeline stage 0) posts the gradient recv where its schedule sends the activation;
    its neighbour waits for that activation: a 2-rank recv/recv deadlock."""
    def hook(b: TraceBuilder, q: int, step: int, toks: list[Token], t: float):
        if step != step_at:
            return None
        if q == dev_rank:
            first = toks[0]
            b.compute(q, "forward", start=t, end=t + DT, step=step, microbatch=first.microbatch, stage=first.stage)
            nxt = toks[1]
            b.p2p(q, "recv", peer=nxt.peer, seq=100, start=t + DT, end=t + 5, status="timeout", group="pp0",
                  step=step, microbatch=nxt.microbatch, stage=nxt.stage, call_site="executor.py:131")
        else:
            first = toks[0]
            assert first.what == "recv"
            b.p2p(q, "recv", peer=first.peer, seq=100, start=t + DT, end=t + 5, status="timeout", group="pp0",
                  step=step, microbatch=first.microbatch, stage=first.stage, call_site="executor.py:131")
        return t + 2 * DT
    return hook


@pytest.mark.parametrize("schedule,m,v", [("1f1b", 2, 1), ("interleaved", 2, 2), ("gpipe", 2, 1)])
def test_recv_before_send_names_the_deviating_rank_over_the_deadlock(schedule: str, m: int, v: int) -> None:
    trace = _pipeline(schedule, 2, m, v, steps=2, hook=_recv_before_send(0), exitcode=None).build()
    dev = find_schedule_deviations(trace)
    assert list(dev["rank"]) == [0]
    assert "send to pipeline rank 1" in dev.iloc[0]["expected"]
    [f] = analyze_schedule(trace)
    assert f.kind == "schedule_deviation" and f.ranks == [0] and "executor.py:131" in f.title
    d = diagnose(trace)
    assert d.headline is not None and d.headline.kind == "schedule_deviation" and d.headline.ranks == [0]
    assert d.verdict.startswith("SCHEDULE DEVIATION: rank 0")
    dl = [x for x in d.findings if x.kind == "deadlock"]
    assert dl and all(x.role.value == "supporting" for x in dl)


def test_schedule_check_is_silent_without_a_pipeline_config() -> None:
    b = _pipeline("1f1b", 2, 2, 1, hook=_recv_before_send(0), exitcode=None)
    del b.run["config"]
    trace = b.build()
    assert analyze_schedule(trace) == []
    assert diagnose(trace).headline.kind == "deadlock"


# ---------------------------------------------------------------------------
# a skip before a death
# ---------------------------------------------------------------------------
SITES = ["runtime/parallel/data.py:132", "runtime/parallel/data.py:226", "runtime/parallel/data.py:145"]
OPS = ["reduce_scatter_tensor", "all_reduce", "all_gather_into_tensor"]

STACK = """Fatal Python error: Aborted

Thread 0x00007f6e367fc6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Thread 0x00007f6e6ca6cb80 (most recent call first):
  File "/site-packages/torch/distributed/distributed_c10d.py", line 3245 in {fn}
  File "/work/main/runtime/comm.py", line 410 in {fn}
  File "/work/main/{site_path}", line {site_line} in step_fn
  File "/work/main/runtime/train.py", line 226 in train
  File "/usr/bin/ncclscope", line 8 in <module>
"""


def _stack(site: str, fn: str) -> str:
    path, line = site.rsplit(":", 1)
    return STACK.format(fn=fn, site_path=path, site_line=line)


def _zero2(dead: int = 1, stack_site: str | None = SITES[1], signal: str = "SIGABRT", reach: int = 0) -> TraceBuilder:
    """4 ranks, 3 collectives per step (ZeRO-2 style); in step 2 every rank but `dead` posts the step's first
    (reduce_scatter) and waits; `dead` has no record of step 2 and died."""
    b = TraceBuilder(4, groups={"dp0": [0, 1, 2, 3]})
    for r in range(4):
        b.coords(r, dp=r)
    t = 0.0
    for step in range(2):
        for i, (op, site) in enumerate(zip(OPS, SITES)):
            for r in range(4):
                b.collective(r, "dp0", 3 * step + i + 1, op=op, start=t, end=t + 0.05, call_site=site, step=step)
            t += 0.1
    for r in range(4):
        if r != dead:
            for i in range(reach):       # step 2's first `reach` collectives completed (the dead rank's rows lost)
                b.collective(r, "dp0", 7 + i, op=OPS[i], start=t + 0.1 * i, end=t + 0.1 * i + 0.05,
                             call_site=SITES[i], step=2)
            b.collective(r, "dp0", 7 + reach, op=OPS[reach], start=t + 0.1 * reach, end=t + 3.0, status="error",
                         call_site=SITES[reach], step=2)
            b.heartbeats(r, 0.0, t + 3.0)
    b.rank_state(dead, signal=signal)
    if stack_site is not None:
        b.stacks(dead, _stack(stack_site, "all_reduce"))
    for r in range(4):
        if r != dead:
            b.rank_state(r, exitcode=1)
    return b


def test_skip_then_sigabrt_headlines_the_skip_with_the_death_as_consequence() -> None:
    d = diagnose(_zero2().build())
    h = d.headline
    assert h is not None and (h.kind, h.ranks) == ("hang", [1]), d.verdict
    assert "skipped reduce_scatter_tensor" in h.title and SITES[0] in h.title and "then rank 1" in h.title
    assert h.data["call_site"] == SITES[0]
    dead = [f for f in d.findings if f.kind == "dead_rank" and f.severity == "error"]
    assert dead and dead[0].role.value == "supporting"


def test_a_plain_death_stays_dead_rank() -> None:
    for b in (_zero2(stack_site=None, signal="SIGKILL"),      # no stack: killed at the step's start
              _zero2(stack_site=SITES[0])):                    # died inside the op the others are in
        d = diagnose(b.build())
        assert (d.headline.kind, d.headline.ranks) == ("dead_rank", [1]), d.verdict


def test_the_stack_rule_needs_a_known_call_site_of_the_group() -> None:
    # The others wait in the step's first collective; a stack in a site that does not come after it
    # (here: the step's last one, all_gather, seen from a rank whose record ends before step 2) ...
    d = diagnose(_zero2(stack_site=SITES[2]).build())
    # ... comes after reduce_scatter in the step's order, so it is a skip past it
    assert (d.headline.kind, d.headline.ranks) == ("hang", [1]), d.verdict
    # an unknown site (not a collective call site of the group) is no evidence
    d = diagnose(_zero2(stack_site="runtime/model.py:40").build())
    assert d.headline.kind == "dead_rank", d.verdict


A2A = "runtime/parallel/expert.py:190"


def _ep(fail_after: float) -> TraceBuilder:
    """2 ranks in ep0: every forward opens with a counts all_to_all from A2A (0.01 s in). In step 2 rank 0
    posts it and waits; rank 1's forward fails after `fail_after` s with no collective in it."""
    b = TraceBuilder(2, groups={"ep0": [0, 1]})
    for r in range(2):
        b.coords(r, ep=r)
    t, k = 0.0, 0
    for step in range(3):
        k += 1
        for r in range(2):
            b.compute(r, "forward", start=t, end=t + 0.1, step=step, microbatch=0)
            b.collective(r, "ep0", k, op="all_to_all_single", start=t + 0.01, end=t + 0.02, call_site=A2A,
                         step=step, microbatch=0)
        t += 0.2
    b.compute(0, "forward", start=t, end=t + 3.0, status="error", step=3, microbatch=0)
    b.collective(0, "ep0", k + 1, op="all_to_all_single", start=t + 0.01, end=t + 3.0, status="error",
                 call_site=A2A, step=3, microbatch=0)
    b.compute(1, "forward", start=t, end=t + fail_after, status="error", step=3, microbatch=0)
    b.rank_state(0, exitcode=1)
    b.rank_state(1, exitcode=5, end_status="error", end_message="RuntimeError: can't allocate memory")
    return b


def test_ep_forward_that_ran_past_its_all_to_all_is_a_skip() -> None:
    d = diagnose(_ep(fail_after=0.05).build())
    h = d.headline
    assert (h.kind, h.ranks) == ("hang", [1]), d.verdict
    assert "skipped all_to_all_single" in h.title and A2A in h.title and "then rank 1" in h.title


def test_ep_forward_that_failed_before_its_all_to_all_is_a_death() -> None:
    d = diagnose(_ep(fail_after=0.005).build())
    assert (d.headline.kind, d.headline.ranks) == ("dead_rank", [1]), d.verdict


def _ep_exception(line: int, def_line: int = 180, func: str = "_experts") -> TraceBuilder:
    """The failure is too quick for the span rule; rank 1's exception dump says where it raised."""
    b = _ep(fail_after=0.005)
    b._ranks[1].call_sites = {A2A: ("_experts", 180)}
    b.stacks(1, "\n=== ncclscope rank 1: exception RuntimeError at 5 ns ===\n"
                "Current thread 0x00007f0000000001 (most recent call first):\n"
                '  File "/w/runtime/parallel/expert.py", line 98 in forward (def line 94)\n'
                f'  File "/w/runtime/parallel/expert.py", line {line} in {func} (def line {def_line})\n'
                '  File "/w/runtime/model.py", line 170 in forward (def line 168)\n'
                '  File "/w/runtime/train.py", line 320 in run_rank (def line 293)\n')
    return b


def test_an_exception_raised_past_the_all_to_all_line_in_its_function_is_a_skip() -> None:
    d = diagnose(_ep_exception(line=192).build())
    h = d.headline
    assert (h.kind, h.ranks) == ("hang", [1]), d.verdict
    assert "line 192 of _experts" in h.title and A2A in h.title, h.title


@pytest.mark.parametrize("line,def_line,func", [(190, 180, "_experts"),      # raised in the call itself
                                                (185, 180, "_experts"),      # before it
                                                (192, 120, "_experts"),      # a namesake defined elsewhere
                                                (192, 180, "forward")])
def test_an_exception_not_past_the_all_to_all_stays_a_death(line: int, def_line: int, func: str) -> None:
    d = diagnose(_ep_exception(line, def_line, func).build())
    assert (d.headline.kind, d.headline.ranks) == ("dead_rank", [1]), d.verdict


# ---------------------------------------------------------------------------
# context parallelism: the skipper went on to the next step's ring p2p
# ---------------------------------------------------------------------------
def _cp(skipper_step: int) -> TraceBuilder:
    b = TraceBuilder(4, groups={"dp_cp0": [0, 1, 2, 3], "cp0": [0, 1], "cp1": [2, 3]})
    for r in range(4):
        b.coords(r, dp=r // 2, cp=r % 2)
    t = 0.0
    seq = {0: 0, 1: 0, 2: 0, 3: 0}
    for step in range(2):
        for r in range(4):
            peer = r ^ 1
            seq[r] += 1
            b.p2p(r, "isend", peer=peer, seq=seq[r], start=t, end=t + 0.01, group=f"cp{r // 2}", step=step)
            b.p2p(r, "irecv", peer=peer, seq=seq[r], start=t, end=t + 0.01, group=f"cp{r // 2}", step=step)
            b.collective(r, "dp_cp0", step + 1, start=t + 0.02, end=t + 0.05, call_site="data.py:76", step=step)
        t += 0.1
    # step 2: rank 1 skips the all_reduce and posts the ring p2p of step `skipper_step`
    for r in range(4):
        peer = r ^ 1
        seq[r] += 1
        b.p2p(r, "isend", peer=peer, seq=seq[r], start=t, end=t + 0.01, group=f"cp{r // 2}", step=2)
        b.p2p(r, "irecv", peer=peer, seq=seq[r], start=t, end=t + 0.01, group=f"cp{r // 2}", step=2)
        if r != 1:
            b.collective(r, "dp_cp0", 3, start=t + 0.02, end=t + 3.0, status="timeout", call_site="data.py:76",
                         step=2)
    b.p2p(1, "isend", peer=0, seq=seq[1] + 1, start=t + 0.03, end=t + 3.0, status="timeout", group="cp0",
          step=skipper_step)
    b.p2p(1, "irecv", peer=0, seq=seq[1] + 1, start=t + 0.03, group="cp0", step=skipper_step)
    return b


def test_cp_skip_is_a_skip_not_a_deadlock_between_its_victims() -> None:
    d = diagnose(_cp(skipper_step=3).build())
    h = d.headline
    assert (h.kind, h.ranks) == ("hang", [1]), d.verdict
    assert "never posted all_reduce #3" in h.title
    assert not any(f.kind == "deadlock" and f.role.value == "headline" for f in d.findings)


def test_cp_p2p_where_its_loop_posts_the_all_reduce_is_a_departure() -> None:
    # The same picture, but rank 1's second ring exchange carries the same step: the step labels do not
    # say it moved on, its own sequence does. Every earlier iteration of its loop posted the all_reduce
    # after one ring exchange; this one posted a second exchange there and blocked in it (the first
    # deviation, loop_departures.py), where the old rule called the cycle a deadlock.
    d = diagnose(_cp(skipper_step=2).build())
    assert (d.headline.kind, d.headline.ranks) == ("hang", [1]), d.verdict
    assert "left its loop" in d.headline.title and "all_reduce on dp_cp0" in d.headline.title


# ---------------------------------------------------------------------------
# a skip in the rank's own record: its step jumps ahead of its previous step's order
# ---------------------------------------------------------------------------
TOKENS = "runtime/parallel/expert.py:99"


def _ep_tie(skip: bool) -> TraceBuilder:
    """2 ranks in ep0, per step: counts all_to_all (A2A, int64) then two token all_to_alls (TOKENS, float32).
    In step 2 rank 1 skips the counts exchange (when `skip`): its token all_to_all pairs with rank 0's counts
    exchange, a 1 vs 1 dtype tie that no vote can decide."""
    b = TraceBuilder(2, groups={"ep0": [0, 1]})
    for r in range(2):
        b.coords(r, ep=r)
    t, k = 0.0, 0
    plan = [(A2A, "int64"), (TOKENS, "float32"), (TOKENS, "float32")]
    for step in range(2):
        for site, dt in plan:
            k += 1
            for r in range(2):
                b.collective(r, "ep0", k, op="all_to_all_single", start=t, end=t + 0.01, call_site=site,
                             dtype=dt, step=step)
            t += 0.02
    k += 1
    b.collective(0, "ep0", k, op="all_to_all_single", start=t, end=t + 3.0, status="timeout", call_site=A2A,
                 dtype="int64", step=2)
    site, dt = plan[1] if skip else plan[0]
    b.collective(1, "ep0", k, op="all_to_all_single", start=t, end=t + 3.0, status="timeout", call_site=site,
                 dtype=dt, step=2)
    return b


def test_a_jump_ahead_in_the_ranks_own_order_names_the_skipper_over_a_tie() -> None:
    d = diagnose(_ep_tie(skip=True).build())
    h = d.headline
    assert (h.kind, h.ranks) == ("hang", [1]), d.verdict
    assert "skipped all_to_all_single" in h.title and A2A in h.title and TOKENS in h.title


def test_the_same_order_is_no_skip() -> None:
    d = diagnose(_ep_tie(skip=False).build())
    assert not (d.headline is not None and d.headline.kind == "hang" and "skipped" in d.headline.title), d.verdict


def test_a_stack_one_call_ahead_mid_step_says_a_collective_was_skipped() -> None:
    # The others wait in the step's 2nd collective (all_reduce #8); the dead rank's stack is in the 3rd:
    # it is one call ahead, but which of its earlier calls it left out is not in the record.
    d = diagnose(_zero2(stack_site=SITES[2], reach=1).build())
    h = d.headline
    assert (h.kind, h.ranks) == ("hang", [1]), d.verdict
    assert "skipped a collective on dp0" in h.title and "one call ahead" in h.title and SITES[1] in h.title


# ---------------------------------------------------------------------------
# a mismatch before a death: gloo SIGABRTs the innocent partner, whose rows die with it
# ---------------------------------------------------------------------------
def _lost_partner(deviant_size: str) -> TraceBuilder:
    b = TraceBuilder(2, groups={"dp0": [0, 1]})
    for r in range(2):
        b.coords(r, dp=r)
    t = 0.0
    for k, size in ((1, "[[4]]"), (2, "[[4]]"), (3, deviant_size)):     # rank 0's record is lost entirely
        b.collective(1, "dp0", k, start=t, end=t + 0.05, sizes=size, call_site="data.py:76", step=k - 1)
        t += 0.1
    b.collective(1, "dp0", 4, start=t, end=t + 3.0, status="timeout", sizes="[[4]]", call_site="data.py:76", step=3)
    b.heartbeats(1, 0.0, t + 3.0)
    b.rank_state(0, signal="SIGABRT")
    b.rank_state(1, exitcode=1)
    return b


def test_the_survivors_lone_deviating_record_is_the_cause_of_the_partners_death() -> None:
    d = diagnose(_lost_partner("[[5]]").build())
    h = d.headline
    assert (h.kind, h.ranks) == ("collective_mismatch", [1]), d.verdict
    assert "#3" in h.title and "then rank 0" in h.title
    assert any(f.kind == "dead_rank" and f.role.value == "supporting" for f in d.findings)


def test_a_lone_record_that_matches_its_history_leaves_the_death_as_the_cause() -> None:
    d = diagnose(_lost_partner("[[4]]").build())
    assert (d.headline.kind, d.headline.ranks) == ("dead_rank", [0]), d.verdict


# ---------------------------------------------------------------------------
# a wrong group, then a death: gloo pairs the wrong call with a member of that group and aborts it
# ---------------------------------------------------------------------------
GRAD = "train.py:63"
FWD = "model.py:32"


def _wrong_group_then_abort(victim_dies_at: float | None = None) -> TraceBuilder:
    """dp0=[0,2], dp1=[1,3], tp0=[0,1], tp1=[2,3]. Each step: a tp all_reduce (FWD), then the gradient
    all_reduce over dp (GRAD). In step 2 rank 3 sends its gradient all_reduce to tp1 instead of dp1, and
    rank 2 (a tp1 member, blocked in its dp0 call) is SIGABRTed by gloo. With `victim_dies_at`, rank 2
    was instead killed long before, at that time (no record after it): a death the wrong call did not cause."""
    b = TraceBuilder(4, groups={"dp0": [0, 2], "dp1": [1, 3], "tp0": [0, 1], "tp1": [2, 3]})
    for r in range(4):
        b.coords(r, dp=r // 2, tp=r % 2)
    t = 0.0
    for step in range(2):
        for r in range(4):
            b.collective(r, f"tp{r // 2}", step + 1, start=t, end=t + 0.01, call_site=FWD, step=step)
            b.collective(r, f"dp{r % 2}", step + 1, start=t + 0.02, end=t + 0.03, call_site=GRAD, step=step)
        t += 0.1
    for r in range(4):
        b.collective(r, f"tp{r // 2}", 3, start=t, end=t + 0.01, call_site=FWD, step=2)
    b.collective(0, "dp0", 3, start=t + 0.02, end=t + 3.0, status="timeout", call_site=GRAD, step=2)
    b.collective(1, "dp1", 3, start=t + 0.02, end=t + 3.0, status="timeout", call_site=GRAD, step=2)
    b.collective(2, "dp0", 3, start=t + 0.02, call_site=GRAD, step=2)                  # inflight when it died
    b.collective(3, "tp1", 4, start=t + 0.026, end=t + 0.1, status="error", call_site=GRAD, step=2,
                 message="Connection closed by peer")
    for r in (0, 1, 3):
        b.heartbeats(r, 0.0, t + 3.0)
        b.rank_state(r, exitcode=1)
    b.heartbeats(2, 0.0, t)
    b.rank_state(2, signal="SIGABRT")
    return b


def test_a_wrong_group_headlines_over_the_death_of_a_member_of_that_group() -> None:
    d = diagnose(_wrong_group_then_abort().build())
    h = d.headline
    assert (h.kind, h.ranks) == ("wrong_group", [3]), d.verdict
    assert GRAD in h.title and "then rank 2" in h.title and "SIGABRT" in h.title
    assert h.cause.partner_deaths == (2,)
    dead = [f for f in d.findings if f.kind == "dead_rank" and f.severity == "error"]
    assert dead and all(f.role.value == "supporting" for f in dead)


def test_a_death_long_before_the_wrong_call_is_not_its_consequence() -> None:
    from ncclscope.verdict.diagnose import explains
    from ncclscope.hang.group_checks import analyze_groups
    from ncclscope.index.views import index_of

    # the same record, but rank 2's last sign of life is 2 s before the wrong call: it did not die of it
    b = TraceBuilder(4, groups={"dp0": [0, 2], "dp1": [1, 3], "tp1": [2, 3]})
    for r in range(4):
        b.coords(r, dp=r // 2, tp=r % 2)
    for k in (1, 2):
        for r in (1, 3):
            b.collective(r, "dp1", k, start=k * 1.0, end=k * 1.0 + 0.01, call_site=GRAD, step=k - 1)
    b.collective(0, "dp0", 1, start=0.1, end=3.5, status="timeout", call_site=GRAD, step=0)
    b.collective(2, "dp0", 1, start=0.1, call_site=GRAD, step=0)
    b.heartbeats(2, 0.0, 0.2)
    b.rank_state(2, signal="SIGKILL")
    b.collective(1, "dp1", 3, start=2.5, end=5.5, status="timeout", call_site=GRAD, step=2)
    b.collective(3, "tp1", 1, start=2.5, end=5.5, status="timeout", call_site=GRAD, step=2)
    for r in (0, 1, 3):
        b.heartbeats(r, 0.0, 5.5)
        b.rank_state(r, exitcode=1)
    trace = b.build()
    wrong = [f for f in analyze_groups(index_of(trace)).findings if f.kind == "wrong_group"]
    assert wrong and wrong[0].ranks == [3] and wrong[0].cause.partner_deaths is None
    d = diagnose(trace)
    dead = [f for f in d.findings if f.kind == "dead_rank" and f.severity == "error"]
    assert dead and dead[0].ranks == [2] and dead[0].role.value == "headline", d.verdict
    assert not explains(wrong[0], dead[0])


# ---------------------------------------------------------------------------
# a lost partner's survivor, whose only other calls there failed after the death
# ---------------------------------------------------------------------------
def test_the_survivors_failed_calls_still_say_what_it_passed_there() -> None:
    # gloo SIGABRTed rank 0 at #2 (rank 1 passed [[5]] there); rank 1's #1 passed [[4]] and its #3, after
    # the death, failed with [[4]] too: two calls agree against #2, whatever their status.
    b = TraceBuilder(2, groups={"dp0": [0, 1]})
    for r in range(2):
        b.coords(r, dp=r)
    b.collective(1, "dp0", 1, start=0.0, end=0.05, sizes="[[4]]", call_site="data.py:76", step=0)
    b.collective(1, "dp0", 2, start=0.1, end=0.15, sizes="[[5]]", call_site="data.py:76", step=1)
    b.collective(1, "dp0", 3, start=0.2, end=3.2, status="error", sizes="[[4]]", call_site="data.py:76", step=2)
    b.heartbeats(1, 0.0, 3.2)
    b.rank_state(0, signal="SIGABRT")
    b.rank_state(1, exitcode=4)
    d = diagnose(b.build())
    h = d.headline
    assert (h.kind, h.ranks) == ("collective_mismatch", [1]), d.verdict
    assert "#2" in h.title and "data.py:76" in h.title and "then rank 0" in h.title


# ---------------------------------------------------------------------------
# a skipped p2p: the stage that left its own routine, not the deadlock between the two
# ---------------------------------------------------------------------------
PP_SITE = "examples/pipe.py:56"
BARRIER = "examples/pipe.py:61"


def _skipped_batch(skip: bool = True, poster_departs: bool = False) -> TraceBuilder:
    """2 stages; per step rank 0 sends 2 activations and receives 2 gradients, rank 1 the converse (all
    from PP_SITE). In step 1 rank 0 posts its first send again; rank 1 (with `skip`) went straight to the
    barrier after the loop. With `poster_departs`, rank 0's step 1 does not follow its step 0 either."""
    b = TraceBuilder(2, groups={"world": [0, 1]})
    t = 0.0
    for k in (1, 2):
        b.p2p(0, "isend", peer=1, seq=k, start=t, end=t + 0.01, call_site=PP_SITE, step=0)
        b.p2p(1, "irecv", peer=0, seq=k, start=t, end=t + 0.01, call_site=PP_SITE, step=0)
        t += 0.02
    for k in (1, 2):
        b.p2p(1, "isend", peer=0, seq=k, start=t, end=t + 0.01, call_site=PP_SITE, step=0)
        b.p2p(0, "irecv", peer=1, seq=k, start=t, end=t + 0.01, call_site=PP_SITE, step=0)
        t += 0.02
    if poster_departs:
        b.p2p(0, "irecv", peer=1, seq=3, start=t, end=t + 5.0, status="timeout", call_site=PP_SITE, step=1)
    b.p2p(0, "isend", peer=1, seq=3, start=t, end=t + 5.0, status="timeout", call_site=PP_SITE, step=1)
    if skip:
        b.collective(1, "world", 1, op="barrier", start=t, end=t + 5.0, status="error", call_site=BARRIER,
                     step=1)
    else:
        b.p2p(1, "isend", peer=0, seq=3, start=t, end=t + 5.0, status="timeout", call_site=PP_SITE, step=1)
    for r in range(2):
        b.heartbeats(r, 0.0, t + 5.0)
        b.rank_state(r, exitcode=1)
    return b


def test_the_stage_that_skipped_its_recv_is_named_over_the_deadlock() -> None:
    d = diagnose(_skipped_batch().build())
    h = d.headline
    assert (h.kind, h.ranks) == ("unmatched_p2p", [1]), d.verdict
    assert "skipped the recv from rank 0 at step 1" in h.title and PP_SITE in h.title and BARRIER in h.title
    # the cycle (rank 0 in its isend, rank 1 in the barrier) formed in the loop's second iteration: rank 1's
    # loop breaks at its blocked barrier while rank 0 repeats its one earlier iteration, so the cycle is
    # read as rank 1's departure (loop_departures._early_leavers), not as a deadlock of both
    assert any(f.kind == "hang" and "left its loop" in f.title and f.ranks == [1] and f.role.value == "supporting"
               for f in d.findings), d.findings


def test_no_departure_when_the_poster_left_its_routine_too() -> None:
    d = diagnose(_skipped_batch(poster_departs=True).build())
    assert not (d.headline.kind == "unmatched_p2p" and "skipped" in d.headline.title), d.verdict


# ---------------------------------------------------------------------------
# the survivor skipped, and gloo aborted its partner, whose rows of that step died with it
# ---------------------------------------------------------------------------
def test_a_survivor_that_jumped_ahead_is_named_over_its_aborted_partners_stack() -> None:
    # ep0 = [0, 1], per step: counts all_to_all (A2A) then the token all_to_all (TOKENS). In step 2 rank 1
    # skips the counts exchange: its token all_to_all pairs with rank 0's counts exchange and gloo SIGABRTs
    # rank 0, whose step-2 rows are lost; its stack shows it in A2A. Rank 0 followed its routine (A2A is
    # the step's first call), rank 1 did not: rank 1 skipped.
    b = TraceBuilder(2, groups={"ep0": [0, 1]})
    for r in range(2):
        b.coords(r, ep=r)
    t, k = 0.0, 0
    for step in range(2):
        for site, dt in ((A2A, "int64"), (TOKENS, "float32")):
            k += 1
            for r in range(2):
                b.collective(r, "ep0", k, op="all_to_all_single", start=t, end=t + 0.01, call_site=site,
                             dtype=dt, step=step)
            t += 0.02
    b.collective(1, "ep0", k + 1, op="all_to_all_single", start=t, end=t + 3.0, status="error", call_site=TOKENS,
                 dtype="float32", step=2)
    b.heartbeats(1, 0.0, t + 3.0)
    b.heartbeats(0, 0.0, t)
    b.rank_state(0, signal="SIGABRT")
    b.rank_state(1, exitcode=4)
    b.stacks(0, _stack(A2A, "all_to_all_single"))
    d = diagnose(b.build())
    h = d.headline
    assert (h.kind, h.ranks) == ("hang", [1]), d.verdict
    assert "skipped all_to_all_single" in h.title and A2A in h.title and "then rank 0" in h.title
