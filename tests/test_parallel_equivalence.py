"""Spawned gloo ranks: every parallel layout trains exactly like the single-process reference.

Each test runs a real job through the launcher (`runtime.launch.launch`, the
engine behind `ncclscope train`: forked ranks, FileStore rendezvous, a global
deadline after which it stops and reaps every rank) with `--dtype float64
--dump-grads`, for 2 optimizer steps, then compares with `run_reference`:

  - every gradient each rank holds (its tp shard, or under ZeRO-2 its flat
    piece), each step, before clipping;
  - every parameter after the last step;
  - the loss (last pipeline stage) and the global grad norm (every rank).

Tolerance: REL_TOL = 1e-10, relative to the norm of the full reference tensor
(float64; the observed worst case is ~3e-13: only summation order differs).
Coverage is checked too: the ranks together hold every reference parameter.

    python -m pytest tests/test_parallel_equivalence.py -q
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from ncclscope.runtime.config import RunConfig
from ncclscope.runtime.launch import launch
from ncclscope.schedules import build_schedule
from ncclscope.runtime.reference import ReferenceResult, run_reference
from ncclscope.load.trace import load

pytestmark = [pytest.mark.spawn, pytest.mark.timeout(60)]

REL_TOL = 1e-10
STEPS = 2


def _local(full: torch.Tensor, name: str, dump: dict[str, Any], flat_piece: bool) -> torch.Tensor:
    """The part of a full reference tensor that a rank's dump holds under `name`."""
    if name in dump["shard"]:
        s = dump["shard"][name]
        full = full.index_select(s["dim"], torch.tensor(s["index"]))
    if flat_piece and name in dump["grad_range"]:
        a, b = dump["grad_range"][name]
        full = full.reshape(-1)[a:b]
    return full


def _rel(got: torch.Tensor, want: torch.Tensor, full: torch.Tensor) -> float:
    return float((got - want).norm() / full.norm().clamp_min(1e-300))


def run_layout(tmp_path: Path, **kw: Any) -> tuple[RunConfig, list[dict[str, Any]], Path]:
    cfg = RunConfig(steps=STEPS, dtype="float64", batch_size=8, timeout_s=20.0, deadline_s=50.0,
                    out=str(tmp_path / "run"), **kw).validate()
    run_dir, run = launch(cfg, dump_grads=str(tmp_path / "grads"), quiet=True)
    assert run["end_reason"] == "completed", run["ranks"]
    dumps = [torch.load(tmp_path / "grads" / f"rank-{r}.pt") for r in range(cfg.world_size)]
    return cfg, dumps, run_dir


def assert_equal_to_reference(cfg: RunConfig, dumps: list[dict[str, Any]], ref: ReferenceResult) -> None:
    last_stage_ranks = 0
    for rank, dump in enumerate(dumps):
        for step in range(STEPS):
            for name, g in dump["grads"][step].items():
                full = ref.grads[step][name]
                err = _rel(g, _local(full, name, dump, flat_piece=True), full)
                assert err < REL_TOL, f"rank {rank} step {step} grad {name}: {err:.1e}"
            assert dump["grad_norms"][step] == pytest.approx(ref.grad_norms[step], rel=REL_TOL), (rank, step)
            loss = dump["losses"][step]
            if not math.isnan(loss):
                assert loss == pytest.approx(ref.losses[step], rel=REL_TOL), (rank, step)
                last_stage_ranks += step == 0
        for name, p in dump["params"].items():
            full = ref.params[name]
            err = _rel(p, _local(full, name, dump, flat_piece=False), full)
            assert err < REL_TOL, f"rank {rank} param {name}: {err:.1e}"
    # together the ranks hold every parameter and its gradient (shards and ZeRO pieces included)
    assert set().union(*(d["params"] for d in dumps)) == set(ref.params)
    for step in range(STEPS):
        assert set().union(*(d["grads"][step] for d in dumps)) == set(ref.grads[step])
    assert last_stage_ranks == cfg.world_size // cfg.pp             # loss on the last stage only; NaN elsewhere


LAYOUTS = {
    # each mode alone
    "tp2": dict(tp=2),
    "dp2-zero1": dict(dp=2, zero=1),
    "dp2-zero2-accum": dict(dp=2, zero=2, microbatches=2),
    "pp2-gpipe": dict(pp=2, schedule="gpipe", microbatches=4),
    "pp2-1f1b-uneven": dict(pp=2, schedule="1f1b", microbatches=2, n_layer=4, pp_layers=[1, 3]),
    "pp2-interleaved": dict(pp=2, vpp=2, schedule="interleaved", microbatches=4, n_layer=4),
    "pp4-1f1b-empty-stage": dict(pp=4, schedule="1f1b", microbatches=4, n_layer=4, pp_layers=[1, 0, 2, 1]),
    "cp2": dict(cp=2),
    "cp4": dict(cp=4),
    "dp2-ep2-drops": dict(dp=2, ep=2, capacity_factor=1.0),
    # combinations
    "tp2-pp2-dp2": dict(tp=2, pp=2, dp=2, microbatches=2),
    "pp2-dp2-1f1b": dict(pp=2, dp=2, schedule="1f1b", microbatches=2),
    "dp2-ep2-top2-zero2": dict(dp=2, ep=2, n_experts=4, top_k=2, capacity_factor=0.75, zero=2),
    "cp2-tp2": dict(cp=2, tp=2),
    "cp2-dp2-zero1": dict(cp=2, dp=2, zero=1, microbatches=2),
    "tp2-dp2-ep2": dict(tp=2, dp=2, ep=2, n_experts=4),
    "tp2-dp2-zero2": dict(tp=2, dp=2, zero=2, microbatches=2),
    "pp2-dp2-ep2": dict(pp=2, dp=2, ep=2, microbatches=2, capacity_factor=1.0),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_equals_reference(tmp_path: Path, layout: str) -> None:
    cfg, dumps, _ = run_layout(tmp_path, **LAYOUTS[layout])
    assert_equal_to_reference(cfg, dumps, run_reference(cfg))


def test_pipeline_trace_is_tagged_with_the_schedule(tmp_path: Path) -> None:
    """The analyzer rebuilds schedules from stage/chunk/microbatch tags: each
    rank's compute spans are its action list, and every p2p op is tagged."""
    cfg, _, run_dir = run_layout(tmp_path, pp=2, vpp=2, schedule="interleaved", microbatches=2, n_layer=4)
    ops = load(run_dir).ops
    actions = build_schedule("interleaved", 2, 2, 2)
    for rank in range(2):
        mine = ops[(ops["rank"] == rank) & (ops["step"] == 0)]
        spans = mine[mine["op_name"].isin(["forward", "backward"])].sort_values("start_ns")
        got = [f"{s}{n[0].upper()}{mb}" for s, n, mb in zip(spans["stage"], spans["op_name"], spans["microbatch"])]
        assert got == [str(a) for a in actions[rank]]
        assert (spans["chunk"] == spans["stage"] // cfg.pp).all()
        p2p = mine[mine["kind"] == "p2p"]
        assert len(p2p) > 0 and (p2p["stage"] >= 0).all() and (p2p["microbatch"] >= 0).all()


def test_metrics_carry_expert_load_and_nan_loss_off_the_last_stage(tmp_path: Path) -> None:
    cfg, _, run_dir = run_layout(tmp_path, pp=2, dp=2, ep=2, microbatches=2, capacity_factor=1.0, n_layer=2)
    m = load(run_dir).metrics
    assert len(m) == cfg.world_size * STEPS
    first, last = m[m["rank"] < 2], m[m["rank"] >= 2]              # tp=cp=1, dp=2: stage 0 is ranks 0-1
    assert first["loss"].isna().all() and last["loss"].notna().all()
    assert m.groupby("step")["grad_norm_global"].nunique().eq(1).all()
    assert all(len(x) == 1 for x in m["expert_load"]) and (m["dropped_tokens"] > 0).any()
    # what an ep group routes = what its experts process + what capacity dropped (one MoE layer per stage)
    tokens = cfg.batch_size // cfg.dp * cfg.block_size * cfg.top_k
    for _, rows in m.groupby([m["step"], m["rank"] // 2]):
        assert sum(x[0] for x in rows["expert_load"]) + rows["dropped_tokens"].sum() == cfg.ep * tokens


def test_p2p_order_drill_deadlocks_the_pipeline_neighbours(tmp_path: Path) -> None:
    cfg = RunConfig(pp=2, microbatches=2, steps=3, timeout_s=2.0, deadline_s=40.0, out=str(tmp_path / "run"),
                    inject=["p2p_order:rank=0,step=1"]).validate()
    run_dir, run = launch(cfg, quiet=True)
    assert run["end_reason"] == "rank_failed"
    codes = {r: v["exitcode"] for r, v in run["ranks"].items()}
    # each waits in recv on the other; the first to time out closes the pair, so its
    # neighbour ends by timeout (3) or by "connection closed" (4), whichever comes first
    assert 3 in codes.values() and set(codes.values()) <= {3, 4}, codes
    ops = load(run_dir).ops
    stuck = ops[ops["status"].isin(["timeout", "error"])].set_index("rank")
    assert stuck.loc[0, "op_name"] == "recv" and stuck.loc[0, "peer"] == 1 and stuck.loc[0, "step"] == 1
    assert stuck.loc[1, "op_name"] == "recv" and stuck.loc[1, "peer"] == 0 and stuck.loc[1, "stage"] == 1
