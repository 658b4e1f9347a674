"""Spawned gloo ranks: DP equals the single-process reference; a skipped
collective ends in a recorded timeout, stacks and a job that ends by itself."""
from __future__ import annotations

import json
from pathlib import Path

import psutil
import pytest
import torch

from ncclscope.runtime.config import RunConfig
from ncclscope.runtime.reference import run_reference
from ncclscope.load.trace import load

pytestmark = [pytest.mark.spawn, pytest.mark.timeout(180)]

REL_TOL = 1e-10


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def test_dp4_equals_reference(tmp_path: Path, cli) -> None:
    out, grads = tmp_path / "run", tmp_path / "grads"
    res = cli("train", "--dp", "4", "--steps", "3", "--dtype", "float64", "--batch-size", "8",
              "--microbatches", "2", "--out", str(out), "--dump-grads", str(grads), timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    ref = run_reference(RunConfig(dp=4, steps=3, dtype="float64", batch_size=8, microbatches=2).validate())
    trace = load(out)
    for rank in range(4):
        dumped = torch.load(grads / f"rank-{rank}.pt")
        for step in range(3):
            for name, g in ref.grads[step].items():
                assert _rel(dumped["grads"][step][name], g) < REL_TOL, (rank, step, name)
        for name, p in ref.params.items():
            assert _rel(dumped["params"][name], p) < REL_TOL, (rank, name)
        losses = trace.metrics[trace.metrics["rank"] == rank].sort_values("step")["loss"].tolist()
        assert losses == pytest.approx(ref.losses, rel=REL_TOL)
    # replicas agree bit for bit on their parameters, step by step
    assert trace.metrics.groupby("step")["param_checksum"].nunique().eq(1).all()


def test_skipped_collective_times_out_and_job_ends(tmp_path: Path, zygote) -> None:
    # `ncclscope train` in a fork of the suite's warm zygote (conftest; its own session, killed whole past
    # the timeout); test_dp4_equals_reference above starts `python -m ncclscope train` itself
    out = tmp_path / "run"
    timeout_s = 2.0
    res = zygote.cli("dp-skip", ["train", "--dp", "2", "--steps", "3", "--timeout-s", str(timeout_s), "--out",
                                 str(out), "--inject", "skip:rank=1,step=1"], timeout=90)
    assert res.returncode == 1, res.stdout + res.stderr
    run = json.loads((out / "run.json").read_text())
    assert run["end_reason"] == "rank_failed"
    for info in run["ranks"].values():
        assert not psutil.pid_exists(info["pid"]) or psutil.Process(info["pid"]).status() == psutil.STATUS_ZOMBIE
    trace = load(out)
    timed_out = trace.ops[trace.ops["status"] == "timeout"]
    assert set(timed_out["rank"]) == {0, 1}           # the waiter and the skipper both time out
    waiter = timed_out[timed_out["rank"] == 0].iloc[0]
    assert waiter["op_name"] == "all_reduce" and waiter["process_group"] == "dp0"
    assert timeout_s * 1e9 <= waiter["duration_ns"] <= (timeout_s + 1.0) * 1e9
    assert "timed out after 2 s" in waiter["message"]
    for rank in (0, 1):
        stacks = (out / f"rank-{rank:05d}" / "stacks.txt").read_text()
        assert "timed out" in stacks and "File " in stacks
    assert run["ranks"]["0"]["exitcode"] == 3          # EXIT_TIMEOUT


def test_entry_point_runs_unchanged_under_torchrun(tmp_path: Path) -> None:
    import os
    import signal
    import subprocess
    import sys

    from conftest import cli_env
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "ncclscope.runtime.train", "--dp", "2", "--steps", "2", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=cli_env(),
                            start_new_session=True)
    try:
        text, _ = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail("torchrun did not finish in 120 s")
    assert proc.returncode == 0, text
    run = json.loads((out / "run.json").read_text())
    assert run["launcher"] == "torchrun" and run["world_size"] == 2
    trace = load(out)
    assert trace.warnings == []
    assert all(info.state == "finished" for info in trace.ranks.values())
    assert sorted(trace.metrics["step"].unique()) == [0, 1]
