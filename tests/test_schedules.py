"""Tests for the pure-logic pipeline schedules and the dry-run simulator.

The expected action lists below were written out by hand from the algorithms
(GPipe, PipeDream-flush 1F1B, and Megatron-LM's
forward_backward_pipelining_with_interleaving: warm-up (p-r-1)*2 + (v-1)*p
capped at m*v, chunk = (k % (p*v)) // p reversed for backwards,
microbatch = (k // (p*v))*p + k % p), not copied from the code's output.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ncclscope.schedules import (
    Action,
    build_schedule,
    format_actions,
    gpipe,
    interleaved_1f1b,
    num_stages,
    one_f_one_b,
    parse_action,
    stage_to_rank,
    theoretical_bubble,
)
from ncclscope.pipesim import Blocked, simulate, validate_actions

pytestmark = pytest.mark.timeout(60)


def acts(text: str) -> list[Action]:
    return [parse_action(t) for t in text.split()]


def peak_in_flight(actions: list[Action]) -> int:
    """Max number of (stage, mb) whose forward ran and backward has not yet."""
    live: set[tuple[int, int]] = set()
    peak = 0
    for a in actions:
        if a.kind == "F":
            live.add((a.stage, a.microbatch))
            peak = max(peak, len(live))
        else:
            live.discard((a.stage, a.microbatch))
    return peak


def assert_complete(schedule: list[list[Action]], p: int, m: int, v: int) -> None:
    """Independent completeness check (does not rely on validate_actions)."""
    counts = Counter(a for row in schedule for a in row)
    expected = {Action(s, k, mb) for s in range(p * v) for k in "FB" for mb in range(m)}
    assert set(counts) == expected
    assert all(c == 1 for c in counts.values())
    for rank, row in enumerate(schedule):
        assert all(a.stage % p == rank for a in row)


def valid_cases():
    for p in (1, 2, 3, 4):
        for m in (1, 2, 4, 8):
            yield "gpipe", p, m, 1
            yield "1f1b", p, m, 1
        # p=3 has no multiple in {1,2,4,8}; add m=3,6 so interleaved p=3 is covered.
        for m in sorted({1, 2, 4, 8, 3 * p, 2 * p}):
            if m % p == 0:
                for v in (1, 2, 3):
                    yield "interleaved", p, m, v


CASES = list(valid_cases())


# ---------------------------------------------------------------- notation


def test_action_notation_roundtrip():
    a = Action(2, "F", 0)
    assert str(a) == "2F0"
    assert parse_action("1B3") == Action(1, "B", 3)
    assert parse_action(str(Action(12, "B", 10))) == Action(12, "B", 10)
    assert format_actions([Action(0, "F", 0), Action(0, "B", 0)]) == "0F0 0B0"
    with pytest.raises(ValueError, match="2X0"):
        parse_action("2X0")
    with pytest.raises(ValueError):
        Action(0, "W", 0)


def test_stage_helpers():
    assert stage_to_rank(5, 2) == 1
    assert stage_to_rank(2, 4) == 2
    assert num_stages(4, 3) == 12


# ---------------------------------------------------------------- exact lists


def test_gpipe_p2_m2_exact():
    assert gpipe(2, 2) == [acts("0F0 0F1 0B0 0B1"), acts("1F0 1F1 1B0 1B1")]


def test_1f1b_p2_m3_exact():
    assert one_f_one_b(2, 3) == [
        acts("0F0 0F1 0B0 0F2 0B1 0B2"),
        acts("1F0 1B0 1F1 1B1 1F2 1B2"),
    ]


def test_1f1b_fewer_microbatches_than_stages_exact():
    # p=4, m=2: warm-up min(p-r-1, m) = 2, 2, 1, 0.
    assert one_f_one_b(4, 2) == [
        acts("0F0 0F1 0B0 0B1"),
        acts("1F0 1F1 1B0 1B1"),
        acts("2F0 2F1 2B0 2B1"),
        acts("3F0 3B0 3F1 3B1"),
    ]


def test_interleaved_p2_m4_v2_exact():
    # rank 0: warm-up (2-0-1)*2 + (2-1)*2 = 4 of 8; rank 1: 0*2 + 2 = 2.
    # forward k -> (chunk, mb): 0:(0,0) 1:(0,1) 2:(1,0) 3:(1,1) 4:(0,2) 5:(0,3) 6:(1,2) 7:(1,3)
    # backward k -> chunk reversed: 0:(1,0) 1:(1,1) 2:(0,0) 3:(0,1) 4:(1,2) 5:(1,3) 6:(0,2) 7:(0,3)
    # stage = chunk*p + rank.
    assert interleaved_1f1b(2, 4, 2) == [
        acts("0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1 2B2 2B3 0B2 0B3"),
        acts("1F0 1F1 3F0 3B0 3F1 3B1 1F2 1B0 1F3 1B1 3F2 3B2 3F3 3B3 1B2 1B3"),
    ]


def test_interleaved_p2_m2_v2_warmup_capped():
    # rank 0's warm-up (2+2=4) equals m*v=4, so it is all forwards then all
    # backwards.  (Older Megatron forced this for every rank when m == p;
    # current Megatron-core only caps, as here, so rank 1 still does 1F1B.)
    assert interleaved_1f1b(2, 2, 2) == [
        acts("0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1"),
        acts("1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1"),
    ]


def test_interleaved_v1_is_not_plain_1f1b():
    # Megatron's interleaved warm-up keeps the factor 2 even at v=1
    # ((p-r-1)*2, capped at m), whereas plain 1F1B warms up p-r-1.  Megatron
    # itself runs the non-interleaved schedule when there is no virtual
    # pipeline, so v=1 here is a faithful-but-unusual configuration.
    assert interleaved_1f1b(2, 4, 1) == [
        acts("0F0 0F1 0F2 0B0 0F3 0B1 0B2 0B3"),
        acts("1F0 1B0 1F1 1B1 1F2 1B2 1F3 1B3"),
    ]
    assert one_f_one_b(2, 4)[0] == acts("0F0 0F1 0B0 0F2 0B1 0F3 0B2 0B3")


# ---------------------------------------------------------------- properties


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_schedule_complete_and_deadlock_free(name, p, m, v):
    schedule = build_schedule(name, p, m, v)
    assert len(schedule) == p
    assert_complete(schedule, p, m, v)
    assert validate_actions(schedule) == (p * v, m)
    result = simulate(schedule)
    assert not result.deadlock and result.blocked == []


@pytest.mark.parametrize("p", [1, 2, 3, 4])
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_peak_in_flight(p, m):
    for r, row in enumerate(one_f_one_b(p, m)):
        assert peak_in_flight(row) == min(p - r, m)
    for row in gpipe(p, m):
        assert peak_in_flight(row) == m


@pytest.mark.parametrize("name,p,m,v", CASES)
def test_simulated_bubble_matches_theory(name, p, m, v):
    # With t_fwd=1, t_bwd=2, t_comm=0 the makespan is exactly 3*(v*m + p - 1)
    # for all three schedules (interleaved included: no case in this grid, nor
    # p<=8, m=p..5p, v<=4 checked while writing, deviates).  Values are small
    # integers, so float equality is exact.
    result = simulate(build_schedule(name, p, m, v), t_fwd=1.0, t_bwd=2.0, t_comm=0.0)
    assert result.makespan == 3 * (v * m + p - 1)
    assert result.busy == [3.0 * m * v] * p
    assert result.bubble_fraction == theoretical_bubble(name, p, m, v)
    if name == "interleaved":
        assert result.bubble_fraction == (p - 1) / (v * m + p - 1)


def test_nonzero_comm_exceeds_theory():
    # The formula assumes free communication; latency only adds bubble.
    for name, p, m, v in (("1f1b", 4, 8, 1), ("interleaved", 2, 4, 2)):
        r = simulate(build_schedule(name, p, m, v), t_comm=0.5)
        assert not r.deadlock
        assert r.bubble_fraction > theoretical_bubble(name, p, m, v)


def test_per_stage_times_and_comm():
    r = simulate(one_f_one_b(2, 1), t_fwd=[1.0, 3.0], t_bwd=[2.0, 4.0], t_comm=0.5)
    assert [(t.rank, str(t.action), t.start, t.end) for t in r.timeline] == [
        (0, "0F0", 0.0, 1.0),
        (1, "1F0", 1.5, 4.5),
        (1, "1B0", 4.5, 8.5),
        (0, "0B0", 9.0, 11.0),
    ]
    assert r.makespan == 11.0
    assert r.busy == [3.0, 7.0] and r.idle == [8.0, 4.0]
    assert r.bubble_fraction == 12.0 / 22.0
    with pytest.raises(ValueError, match="3 entries but there are 2 stages"):
        simulate(one_f_one_b(2, 1), t_fwd=[1.0, 1.0, 1.0])


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(["gpipe", "1f1b", "interleaved"]),
    p=st.integers(1, 6),
    k=st.integers(1, 4),
    v=st.integers(1, 3),
    extra=st.integers(0, 5),
)
def test_random_schedules_complete_and_deadlock_free(name, p, k, v, extra):
    if name == "interleaved":
        m = p * k
    else:
        m, v = k + extra, 1
    schedule = build_schedule(name, p, m, v)
    assert_complete(schedule, p, m, v)
    result = simulate(schedule)
    assert not result.deadlock
    assert result.bubble_fraction == theoretical_bubble(name, p, m, v)


# ---------------------------------------------------------------- broken lists


def test_backward_before_its_forward_deadlocks():
    # 1F1B p=2 m=2 with rank 1's 1B1 moved ahead of 1F1.
    broken = [acts("0F0 0F1 0B0 0B1"), acts("1F0 1B0 1B1 1F1")]
    r = simulate(broken)
    assert r.deadlock
    assert r.blocked == [
        Blocked(0, parse_action("0B1"), parse_action("1B1")),
        Blocked(1, parse_action("1B1"), parse_action("1F1")),
    ]
    # Work that could run did run and is reported.
    assert [str(t.action) for t in r.timeline if t.rank == 1] == ["1F0", "1B0"]


def test_cross_rank_wait_cycle_deadlocks():
    # rank 0 wants 1B0 before sending F1; rank 1 wants F1 before doing mb 0.
    broken = [acts("0F0 0B0 0F1 0B1"), acts("1F1 1F0 1B0 1B1")]
    r = simulate(broken)
    assert r.deadlock
    assert r.blocked == [
        Blocked(0, parse_action("0B0"), parse_action("1B0")),
        Blocked(1, parse_action("1F1"), parse_action("0F1")),
    ]


def test_missing_duplicate_misplaced_raise():
    with pytest.raises(ValueError, match="missing action 1B1"):
        simulate([acts("0F0 0F1 0B0 0B1"), acts("1F0 1B0 1F1")])
    with pytest.raises(ValueError, match="duplicated action 0F1"):
        simulate([acts("0F0 0F1 0F1 0B0 0B1"), acts("1F0 1B0 1F1 1B1")])
    with pytest.raises(ValueError, match="1F0 is on rank 0 but stage 1 belongs to rank 1"):
        simulate([acts("0F0 1F0 0B0"), acts("1B0")])
    # A whole missing microbatch is only visible when the count is given.
    with pytest.raises(ValueError, match="missing action 0F1"):
        simulate(gpipe(2, 1), num_microbatches=2)


# ---------------------------------------------------------------- bad inputs


def test_invalid_inputs_name_the_numbers():
    with pytest.raises(ValueError, match=r"m=6, p=4"):
        build_schedule("interleaved", 4, 6, 2)
    with pytest.raises(ValueError, match=r"m=3, p=2"):
        interleaved_1f1b(2, 3, 2)
    with pytest.raises(ValueError, match=r"v=2"):
        build_schedule("gpipe", 2, 4, 2)
    with pytest.raises(ValueError, match=r"v=3"):
        build_schedule("1f1b", 2, 4, 3)
    with pytest.raises(ValueError, match=r"p=0"):
        build_schedule("1f1b", 0, 4)
    with pytest.raises(ValueError, match=r"m=0"):
        gpipe(2, 0)
    with pytest.raises(ValueError, match=r"v=0"):
        interleaved_1f1b(2, 4, 0)
    with pytest.raises(ValueError, match="unknown schedule 'zb'"):
        build_schedule("zb", 2, 4)
    with pytest.raises(ValueError, match=r"v=2"):
        theoretical_bubble("gpipe", 2, 4, 2)


def test_analyzer_and_schedules_import_without_torch() -> None:
    """The analyzer runs where torch is absent: every module of every analyzer
    package (all of ncclscope but the runtime), the schedules and the simulator
    import with torch blocked, and none of them pulls in the runtime."""
    import subprocess
    import sys
    code = (
        "import sys, importlib\n"
        "sys.modules['torch'] = None\n"
        "import ncclscope, pathlib\n"
        "top = pathlib.Path(ncclscope.__file__).parent\n"
        "names = ['.'.join(('ncclscope',) + p.relative_to(top).with_suffix('').parts).removesuffix('.__init__')\n"
        "         for p in sorted(top.rglob('*.py')) if p.relative_to(top).parts[0] not in\n"
        "         ('runtime', 'run.py', '__main__.py')]\n"
        "for n in names + ['ncclscope.schedules', 'ncclscope.pipesim']:\n"
        "    importlib.import_module(n)\n"
        "from ncclscope.perf.bubbles import theoretical_bubble\n"
        "assert abs(theoretical_bubble('1f1b', 4, 8) - 3 / 11) < 1e-12\n"
        "bad = sorted(m for m in sys.modules if m.startswith('ncclscope.runtime'))\n"
        "assert not bad, bad\n"
        "print(len(names))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert int(res.stdout.strip()) >= 100
