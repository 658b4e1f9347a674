"""`ncclscope demo --quick`: the reduced tour ends with the verdicts it promises.

The full tour (`ncclscope demo`, five jobs) is what the README tells a new user
to run; the quick one runs two of its stops (pipeline deadlock, diverging
replica) through the same code, so a regression in the tour shows up here.
"""
from __future__ import annotations

import re

import pytest

from conftest import run_cli

pytestmark = [pytest.mark.e2e, pytest.mark.spawn]


@pytest.mark.timeout(240)
def test_quick_demo_ends_with_the_expected_verdicts(tmp_path, zygote):
    # the tour through the CLI's `main` in a fork of the suite's warm zygote (conftest: torch is not imported
    # again; its own session, killed whole past the timeout, reaped); `python -m ncclscope demo` itself
    # runs in the test below
    out = tmp_path / "demo"
    res = zygote.cli("demo-quick", ["demo", "--quick", "--out", str(out)], timeout=220)
    assert res.returncode == 0, f"stdout:\n{res.stdout}\nstderr:\n{res.stderr[-3000:]}"
    text = res.stdout
    assert "2 real multi-rank jobs" in text
    # each stop prints its verdict line, indented, right after the run line
    verdicts = re.findall(r"^   ([A-Z][A-Z ]+): ", text, flags=re.M)
    assert verdicts == ["SCHEDULE DEVIATION", "DIVERGED"], text
    # the rank that broke the pipeline schedule, not every rank in the deadlock it caused
    assert re.search(r"^   SCHEDULE DEVIATION: rank 0 \(pp 0, dp 0\) broke the 1f1b schedule", text, flags=re.M), text
    assert re.search(r"^   DIVERGED: rank 1 \(dp 1\) diverged .* at step 2", text, flags=re.M), text
    # the reports and runs it points to exist, and it says how to open the hung run in the TUI
    for stop in ("pipeline-deadlock", "diverging-replica"):
        assert (out / stop / "run.json").is_file()
        assert (out / f"{stop}.html").stat().st_size > 10_000
        assert not list((out / stop).glob("*.html")), "reports are written next to the run, never inside it"
    assert f"ncclscope tui {out / 'pipeline-deadlock'}" in text


def test_demo_refuses_a_non_empty_out(tmp_path):
    (tmp_path / "keep.txt").write_text("user data")
    res = run_cli("demo", "--quick", "--out", str(tmp_path), timeout=60)
    assert res.returncode == 2 and "not empty" in res.stderr
    assert (tmp_path / "keep.txt").read_text() == "user data"
