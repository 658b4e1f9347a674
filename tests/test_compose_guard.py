"""The one error guard (ncclscope/verdict/guard.py): the composer and the performance analyses both run
their analyses through it, so a failure is one line, in one format, wherever it happens."""
from __future__ import annotations

import pytest

from ncclscope.verdict.guard import Guard, error_line


def _boom() -> None:
    raise ValueError("bad column")


def test_guard_returns_the_value_and_times_it() -> None:
    after: list[int] = []
    guard = Guard(after=lambda: after.append(1))
    assert guard("a", lambda: 42) == 42
    assert guard("a", lambda: 43) == 43
    assert guard.errors == [] and set(guard.timings) == {"a"} and guard.timings["a"] >= 0 and after == [1, 1]


def test_guard_turns_a_failure_into_one_line() -> None:
    after: list[int] = []
    guard = Guard(after=lambda: after.append(1))
    assert guard("bubbles", _boom) is None
    assert guard("comm", lambda: "still runs") == "still runs"
    assert len(guard.errors) == 1 and "\n" not in guard.errors[0]
    assert guard.errors[0].startswith("bubbles failed: ValueError: bad column at test_compose_guard.py:")
    assert after == [1, 1] and set(guard.timings) == {"bubbles", "comm"}


def test_error_line_without_a_traceback() -> None:
    assert error_line("memory", KeyError("x")) == "memory failed: KeyError: 'x'"


def test_a_failing_performance_analysis_is_one_error_of_the_verdict(monkeypatch: pytest.MonkeyPatch) -> None:
    from test_perf_analyses import straggler_trace
    from ncclscope.perf import performance
    from ncclscope.verdict import run

    def broken(trace: object) -> None:
        raise RuntimeError("strange trace")

    monkeypatch.setattr(performance, "analyze_memory", broken)
    perf = performance.analyze_performance(straggler_trace(late=0.5, steps=8))
    assert len(perf.errors) == 1 and perf.errors[0].startswith("memory failed: RuntimeError: strange trace at ")
    assert "memory" in perf.timings and [f.kind for f in perf.findings] == ["straggler"]
    a = run(straggler_trace(late=0.5, steps=8), hang=False)
    assert a.errors == [perf.errors[0]]
    assert set(a.timings_s) >= {"performance", "perf.memory", "perf.bubbles"}
    assert a.verdict.startswith("STRAGGLER: ")       # a failure elsewhere does not hide what the rest found
