"""`ncclscope train` refuses what cannot run, in one line naming the flags, exit 2,
before any rank starts; `--inject help` lists the drills; a pipeline layout
that needs more layers than the default model has sizes the model to fit."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from ncclscope.runtime.config import ConfigError, RunConfig
from ncclscope.runtime.faults import KINDS, FaultSpecError, check_specs, help_text

pytestmark = pytest.mark.timeout(120)


def _train(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ncclscope", "train", *args, "--out", str(tmp_path / "run")],
                          capture_output=True, text=True, timeout=100)


@pytest.mark.parametrize("args, message", [
    (("--dp", "2", "--inject", "skip:rank=9,step=1"),
     "ncclscope: --inject skip:rank=9,step=1: rank 9 does not exist (the job has 2 ranks: 0..1)"),
    (("--dp", "2", "--steps", "3", "--inject", "hang:rank=1,step=3"),
     "ncclscope: --inject hang:rank=1,step=3: step 3 never runs (--steps 3 runs steps 0..2)"),
    (("--dp", "2", "--inject", "skip:rank=1,step=1,when=now"),
     "ncclscope: --inject skip:rank=1,step=1,when=now: unknown key 'when'; skip takes rank, step, op, group"),
    (("--tp", "3", "--n-head", "2"), "ncclscope: --n-head 2 is not divisible by --tp 3"),
    (("--device", "cuda",), None),   # no CUDA here: one line, whatever torch says about why
])
def test_cli_refuses_in_one_line_exit_2(tmp_path: Path, args: tuple[str, ...], message: str | None) -> None:
    res = _train(tmp_path, *args)
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    if message is None:
        assert lines[0].startswith("ncclscope: --device cuda")
    else:
        assert lines[0] == message
    assert not (tmp_path / "run").exists()   # refused before the run directory is made


def test_inject_help_lists_every_kind_with_its_keys(tmp_path: Path) -> None:
    res = _train(tmp_path, "--inject", "help")
    assert res.returncode == 0, res.stderr
    for kind, (keys, _, _) in KINDS.items():
        line = next(x for x in res.stdout.splitlines() if x.strip().startswith(kind + ":"))
        for key in keys:
            assert f"{key}=" in line, (kind, key, line)
    assert res.stdout.strip() == help_text().strip()


@pytest.mark.parametrize("kwargs, spec, reason", [
    (dict(dp=2), "p2p_order:rank=0,step=1", "needs pipeline parallelism (--pp > 1; --pp is 1)"),
    (dict(pp=2), "p2p_order:rank=1,step=1", "rank 1 is the last pipeline stage"),
    (dict(dp=2), "skip:rank=0,step=1,group=tp", "group=tp has one rank on this layout"),
    (dict(dp=2), "wrong_group:rank=0,step=1,use=pp", "use=pp has one rank on this layout"),
    (dict(pp=2), "desync_grad:rank=0,step=1", "needs data parallelism"),
    (dict(dp=2, zero=2), "desync_grad:rank=0,step=1", "under --zero 2 every replica copies its parameters"),
    (dict(), "skip:rank=0,step=1", "one rank has no collective to skip"),
    (dict(dp=2), "skip:rank=0,step=1,op=all_reduce_coalesced", "is not a collective"),
    (dict(dp=2), "mismatch:rank=0,step=1,what=shape", "what must be size, dtype or type"),
])
def test_drills_that_cannot_fire_are_refused(kwargs: dict, spec: str, reason: str) -> None:
    cfg = RunConfig(**kwargs)
    with pytest.raises(FaultSpecError) as err:
        check_specs([spec], cfg.validate())
    assert reason in str(err.value) and str(err.value).startswith(f"--inject {spec}: ")
    assert "\n" not in str(err.value)


def test_drills_that_can_fire_pass() -> None:
    cfg = RunConfig(pp=2, dp=2, microbatches=2).validate()
    specs = ["skip:rank=3,step=4,group=dp", "p2p_order:rank=0,step=1", "desync_grad:rank=1,step=0",
             "wrong_group:rank=0,step=1,use=pp", "slow:rank=2,factor=2", "group_order:rank=1"]
    assert len(check_specs(specs, cfg)) == len(specs)
    RunConfig(pp=2, dp=2, microbatches=2, inject=specs).validate()


@pytest.mark.parametrize("kwargs, n_layer", [
    (dict(pp=4), 8), (dict(pp=2, vpp=2, schedule="interleaved", microbatches=2), 8), (dict(pp=3), 6),
    (dict(pp=2), 4), (dict(), 2), (dict(pp=2, pp_layers=[1, 3]), 4),
])
def test_default_model_is_sized_to_the_layout(kwargs: dict, n_layer: int) -> None:
    assert RunConfig(**kwargs).validate().n_layer == n_layer


def test_an_explicit_n_layer_is_kept_and_checked() -> None:
    with pytest.raises(ConfigError) as err:
        RunConfig(pp=4, n_layer=2).validate()
    assert str(err.value) == "--n-layer 2 is not divisible by --pp 4 (give another --n-layer, or --pp-layers)"


def test_cli_sizes_the_model_for_pp4_without_n_layer() -> None:
    import argparse

    from ncclscope.runtime import config as C
    p = argparse.ArgumentParser()
    C.add_arguments(p)
    assert C.from_args(p.parse_args(["--pp", "4"])).n_layer == 8
    with pytest.raises(ConfigError, match=r"^--n-layer 2 is not divisible by --pp 4"):
        C.from_args(p.parse_args(["--pp", "4", "--n-layer", "2"]))
