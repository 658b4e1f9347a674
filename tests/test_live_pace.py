"""The live view's pacing (tui/live_pace.py): the hang diagnosis fresh at every poll, the performance analyses
rerun only when due, and the verdict still made by the one composer from both."""
from __future__ import annotations

from pathlib import Path

import pytest

from ncclscope.load.trace import load
from ncclscope.tui.live_pace import LivePace, something_happened
from ncclscope.verdict import run as compose

pytestmark = pytest.mark.timeout(120)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture(scope="module")
def healthy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from synth import generate
    return generate(tmp_path_factory.mktemp("pace") / "healthy", ranks=8, events=20_000, hang=False, seed=3)


def test_due_at_first_poll_then_by_interval_and_cost() -> None:
    clock = Clock()
    pace = LivePace(clock=clock)
    assert pace.due(live=True)                      # nothing composed yet
    pace.perf, pace.made_at, pace.cost_s = object(), clock.t, 0.5
    assert not pace.due(live=True)
    assert pace.due(live=False)                     # a job that has ended: always the whole analysis
    clock.t += 4.9
    assert not pace.due(live=True)
    clock.t += 0.2                                  # 5.1 s: the least interval has passed
    assert pace.due(live=True)
    pace.cost_s = 2.0                               # a 2 s analysis takes at most a quarter: every 8 s
    assert not pace.due(live=True)
    clock.t += 3.0
    assert pace.due(live=True)


def test_reused_performance_composes_the_same_verdict(healthy: Path) -> None:
    trace = load(healthy)
    full = compose(trace)
    clock = Clock()
    pace = LivePace(clock=clock)
    first, note1 = pace.analyse(trace, live=True)
    assert first.perf is pace.perf and pace.perf is not None and "performance as of" not in note1
    clock.t += 1.0
    again, note2 = pace.analyse(trace, live=True)
    assert again.perf is first.perf                 # not run again: reused
    assert "performance as of 1 s ago" in note2
    # the last diagnosis found nothing and nothing happened since: not run again within HANG_MIN_S
    assert first.diagnosis is not None and again.diagnosis is None
    clock.t += 4.5                                  # 5.5 s after the first poll: both parts are due again
    third, note3 = pace.analyse(trace, live=True)
    assert third.diagnosis is not None and third.perf is not first.perf and "performance as of" not in note3
    for a in (first, again, third):
        assert (a.verdict, a.level, [f.title for f in a.findings]) == (
            full.verdict, full.level, [f.title for f in full.findings])


def test_the_hang_diagnosis_is_fresh_at_every_poll(healthy: Path, pp_hung: Path) -> None:
    """A poll between two performance runs still diagnoses the trace it read: the hang shows at once."""
    clock = Clock()
    pace = LivePace(clock=clock)
    pace.analyse(load(healthy), live=True)
    clock.t += 1.0
    assert not pace.due(live=True)
    hung = load(pp_hung)
    a, _ = pace.analyse(hung, live=True)
    assert a.verdict == compose(hung).verdict and not a.ok     # timeouts are facts: never held
    assert a.diagnosis is not None and not a.diagnosis.ok


def test_what_makes_a_quiet_diagnosis_run_again(healthy: Path, pp_hung: Path) -> None:
    """Anything the live hold would show at once: a status but ok or in flight (here timeouts), an op in
    flight past its live threshold; an op in flight within it is nothing."""
    assert something_happened(load(pp_hung))
    trace = load(healthy)
    assert not something_happened(trace)
    ops = trace.ops
    last = ops.index[(ops["rank"] == 0).to_numpy()][-1]
    ops.loc[last, "status"] = "inflight"
    ops.loc[last, "end_ns"] = -1
    ops.loc[last, "start_ns"] = trace.end_ns - 200_000_000       # 0.2 s: within the least live threshold
    assert not something_happened(trace)
    ops.loc[last, "start_ns"] = trace.end_ns - 301_000_000_000   # past half the run's --timeout-s (600 s)
    assert something_happened(trace)
