"""Shared fixtures: run the CLI in a child process that can never outlive its test."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class CliResult:
    returncode: int
    stdout: str
    stderr: str


def cli_env() -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONWARNINGS"] = "ignore::FutureWarning"
    return env


def run_cli(*args: str, timeout: float = 90.0, cwd: str | os.PathLike[str] | None = None) -> CliResult:
    """Run `python -m ncclscope ARGS` in its own session; on timeout kill the
    whole session (launcher and ranks) and fail the test, never hang it."""
    proc = subprocess.Popen([sys.executable, "-m", "ncclscope", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=cli_env(), cwd=cwd or ROOT,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"ncclscope {' '.join(args)} did not finish in {timeout} s\n{out}\n{err}")
    return CliResult(proc.returncode, out, err)


def cli_in_process(args: list[str], cwd: str | os.PathLike[str] | None = None) -> CliResult:
    """`ncclscope ARGS` through the CLI's `main` in this process (for commands that never import torch:
    an interpreter start costs ~1 s each), in `cwd` if given, stdout and stderr captured."""
    import contextlib
    import io

    from ncclscope.cli.main import main
    out, err, here = io.StringIO(), io.StringIO(), os.getcwd()
    try:
        if cwd is not None:
            os.chdir(cwd)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = main(args)
    finally:
        os.chdir(here)
    return CliResult(code, out.getvalue(), err.getvalue())


@pytest.fixture
def cli():
    return run_cli


@pytest.fixture(scope="session")
def zygote(tmp_path_factory):
    """One warm process (torch and the analyzer imported once) that forks the suite's real jobs: the
    drills, the healthy layouts, `ncclscope run` of the examples, the `ncclscope train` runs the TUI,
    report, performance, docs and demo tests read, and the test functions that need a fresh process
    but not a fresh interpreter (test_drills_e2e.Zygote: run, cli, call). Started on first use, closed
    at the end of the session; each job runs in its own session, killed whole on timeout and reaped.
    Each CLI command keeps at least one test through a real `python -m ncclscope` process."""
    from test_drills_e2e import make_zygote
    z = make_zygote(tmp_path_factory)
    try:
        yield z
    finally:
        z.close()


@pytest.fixture(scope="session")
def healthy_dp2(zygote, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One healthy `ncclscope train --dp 2 --steps 3` run (a fork of the warm zygote), read-only, shared by
    the tests that only read it (test_tui.py's Pilot run, test_report.py's Chromium render)."""
    return train_run(zygote, tmp_path_factory.mktemp("healthy-dp2") / "run", "--dp", "2", "--steps", "3")


def train_run(zygote, out: Path, *args: str, timeout: float = 150.0) -> Path:
    """`ncclscope train ARGS --out OUT` in a fork of the warm zygote (own session, killed whole past
    `timeout`, reaped); OUT, which must hold a run. The CLI's own process start is tested elsewhere
    (test_dp_runtime.py, test_faults_cli.py run `python -m ncclscope train`)."""
    res = zygote.cli(f"train-{out.parent.name}-{out.name}", ["train", *args, "--out", str(out)], timeout=timeout)
    assert (out / "run.json").exists(), (f"ncclscope train {' '.join(args)} made no run directory "
                                         f"(rc {res.returncode}): {res.stderr[-2000:]}")
    return out


@pytest.fixture(scope="session")
def composed():
    """`ncclscope.verdict.run(load(path))` of a fixed, read-only run directory (the sample traces), computed
    once per session and shared by the tests that hold a face against it (test_faces_agree.py,
    test_tui.py); the faces themselves still compose their own. Callers only read the Analysis."""
    cache: dict[str, object] = {}

    def get(path: str | os.PathLike[str]):
        key = str(Path(path).resolve())
        if key not in cache:
            from ncclscope.load.trace import load
            from ncclscope.verdict import run
            cache[key] = run(load(Path(path)))
        return cache[key]
    return get


@pytest.fixture(scope="session")
def analyze_json():
    """`ncclscope analyze PATH --json` through the CLI's `main` in this process (`cli_in_process`) on a fixed,
    read-only input (the sample traces), run once per session per PATH and shared by the tests that read that
    command's output (test_samples.py, test_faces_agree.py, test_nccl_evidence.py). Returns the CliResult (exit
    code, stdout, stderr); callers only read it."""
    cache: dict[str, CliResult] = {}

    def get(path: str | os.PathLike[str]) -> CliResult:
        key = str(path)
        if key not in cache:
            cache[key] = cli_in_process(["analyze", key, "--json"])
        return cache[key]
    return get


@pytest.fixture(scope="session")
def pp_hung(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Hand-built, deterministic hung pipeline run (tests/tui_runs.py; the TUI snapshots use it)."""
    from tui_runs import write_pp_hung
    return write_pp_hung(tmp_path_factory.mktemp("tui") / "pp_hung")
