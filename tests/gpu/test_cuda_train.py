"""`ncclscope train --device cuda` on the GPUs present (NCCL, one GPU per rank).

    python -m pytest -q -m gpu tests/gpu            # skipped, with one line, without CUDA

Each mode runs on as many ranks as it needs (2, or 4 for tp x pp); a mode that
needs more GPUs than there are is skipped. Checks: the job completes, every
begin row has its end row (on NCCL an end row is written at GPU completion by
the completion thread), the ranks recorded NVML samples, and a `skip` drill's
victims stay open begin rows until their timeout and the verdict names the
skipping rank.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(GPUS == 0, reason="no CUDA device (torch.cuda.is_available() is False)"),
    pytest.mark.timeout(300),
]

MODES = {
    "dp": (["--dp", "2"], 2),
    "tp": (["--tp", "2"], 2),
    "pp-1f1b": (["--pp", "2", "--microbatches", "2", "--schedule", "1f1b"], 2),
    "cp": (["--cp", "2"], 2),
    "ep": (["--dp", "2", "--ep", "2"], 2),
    "zero2": (["--dp", "2", "--zero", "2"], 2),
    "tp-pp": (["--tp", "2", "--pp", "2", "--microbatches", "2"], 4),
}


def _train(out: Path, *args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "ncclscope", "train", "--device", "cuda", *args,
                           "--out", str(out)], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.mark.parametrize("mode", list(MODES))
def test_mode_completes_on_nccl_with_every_op_ended(tmp_path: Path, mode: str) -> None:
    args, need = MODES[mode]
    if need > GPUS:
        pytest.skip(f"{mode} needs {need} GPUs, {GPUS} visible")
    res = _train(tmp_path / "run", *args, "--steps", "3")
    assert res.returncode == 0, res.stderr[-3000:]
    from ncclscope.load.trace import load
    trace = load(tmp_path / "run")
    ops = trace.ops
    comm = ops[ops["kind"].isin(["collective", "p2p"])]
    assert len(comm) > 0
    assert (comm["status"] == "ok").all(), comm[comm["status"] != "ok"].head()   # none left in flight
    rank0 = json.loads((tmp_path / "run" / "rank-00000" / "rank.json").read_text())
    assert rank0["device"] == "cuda:0" and rank0["nccl_env"]["TORCH_NCCL_BLOCKING_WAIT"] in ("0", "")
    samples = trace.samples
    assert len(samples) and (samples["source"] == "nvml").all()


def test_skip_drill_on_nccl_is_diagnosed(tmp_path: Path) -> None:
    if GPUS < 2:
        pytest.skip("the drill needs 2 GPUs")
    res = _train(tmp_path / "run", "--dp", "2", "--steps", "3", "--timeout-s", "10",
                 "--inject", "skip:rank=1,step=1")
    assert res.returncode != 0
    out = subprocess.run([sys.executable, "-m", "ncclscope", "analyze", "--json", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=120)
    report = json.loads(out.stdout)
    head = next(f for f in report["findings"] if f["data"].get("role") == "headline")
    assert head["ranks"] == [1], report["verdict"]
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["ranks"]["0"]["exitcode"] == 3, run["ranks"]   # rank 0's all_reduce timed out: exit 3
