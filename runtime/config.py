"""Run configuration: every parallel degree and model size in one validated dataclass.

The whole product of degrees appears in the error, because the user who got
`--tp 2 --pp 2 --dp 2` wrong on 6 processes needs to see all of it at once:
`tp*pp*dp*cp = 2*2*2*1 = 8, but --nproc is 6`. Every rule is one line.
This module imports no torch, so `ncclscope train` can reject a bad config
before paying for spawning ranks.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

SCHEDULES = ("gpipe", "1f1b", "interleaved")


class ConfigError(ValueError):
    """A configuration that cannot run; the message is one line with the numbers."""


@dataclass
class RunConfig:
    # parallel degrees (tp fastest, then cp, dp, pp; ep carved out of dp)
    tp: int = 1
    pp: int = 1
    dp: int = 1
    cp: int = 1
    ep: int = 1
    nproc: int = 0                  # 0: the product of degrees
    zero: int = 0                   # 0 plain DP, 1 sharded optimizer, 2 + sharded grads
    schedule: str = "1f1b"
    microbatches: int = 1
    vpp: int = 1                    # virtual stages per pipeline rank (interleaved)
    pp_layers: list[int] = field(default_factory=list)   # explicit layers per (virtual) stage
    # model
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    block_size: int = 32
    vocab_size: int = 256           # byte-level corpus
    n_experts: int = 0              # 0: dense MLP; >0: MoE block with this many experts
    top_k: int = 1
    capacity_factor: float = 2.0
    aux_loss_coef: float = 0.01     # MoE load-balancing loss weight
    # training
    steps: int = 5
    batch_size: int = 8             # global batch (sequences per step, over all dp replicas)
    lr: float = 1e-3
    grad_clip: float = 1.0
    seed: int = 1234
    dtype: str = "float32"          # float64 for equivalence tests
    bucket_mb: float = 1.0          # gradient all-reduce bucket size
    # comm and job control
    timeout_s: float = 60.0         # default per-op timeout
    deadline_s: float = 0.0         # global job deadline (0: none), enforced by the launcher
    trace: bool = True
    out: str = ""
    inject: list[str] = field(default_factory=list)
    backend: str = "gloo"

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def n_stages(self) -> int:
        return self.pp * self.vpp

    def validate(self) -> "RunConfig":
        """Raise ConfigError naming the first violated rule, with its numbers."""
        for name in ("tp", "pp", "dp", "cp", "ep", "microbatches", "vpp", "n_layer", "n_head", "n_embd",
                     "block_size", "steps", "batch_size", "top_k"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
        product = f"tp*pp*dp*cp = {self.tp}*{self.pp}*{self.dp}*{self.cp} = {self.world_size}"
        if self.nproc == 0:
            self.nproc = self.world_size
        if self.nproc != self.world_size:
            raise ConfigError(f"{product}, but --nproc is {self.nproc}")
        if self.zero not in (0, 1, 2):
            raise ConfigError(f"--zero must be 0, 1 or 2, got {self.zero}")
        if self.schedule not in SCHEDULES:
            raise ConfigError(f"--schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.dtype not in ("float32", "float64"):
            raise ConfigError(f"--dtype must be float32 or float64, got {self.dtype!r}")
        if self.vpp > 1 and self.schedule != "interleaved":
            raise ConfigError(f"--vpp {self.vpp} needs --schedule interleaved (got {self.schedule})")
        if self.schedule == "interleaved" and self.pp > 1 and self.microbatches % self.pp:
            raise ConfigError(f"interleaved schedule needs microbatches % pp == 0: {self.microbatches} % {self.pp} = "
                              f"{self.microbatches % self.pp}")
        if self.n_head % self.tp:
            raise ConfigError(f"n_head must be divisible by tp: {self.n_head} % {self.tp} = {self.n_head % self.tp}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"n_embd must be divisible by n_head: {self.n_embd} % {self.n_head} = "
                              f"{self.n_embd % self.n_head}")
        if (4 * self.n_embd) % self.tp:
            raise ConfigError(f"MLP width 4*n_embd must be divisible by tp: {4 * self.n_embd} % {self.tp} = "
                              f"{(4 * self.n_embd) % self.tp}")
        if self.vocab_size % self.tp:
            raise ConfigError(f"vocab_size must be divisible by tp: {self.vocab_size} % {self.tp} = "
                              f"{self.vocab_size % self.tp}")
        if self.block_size % (2 * self.cp) and self.cp > 1:
            raise ConfigError(f"block_size must be divisible by 2*cp (zig-zag chunks): {self.block_size} % "
                              f"{2 * self.cp} = {self.block_size % (2 * self.cp)}")
        if self.dp % self.ep:
            raise ConfigError(f"--ep must divide --dp (experts are sharded across data-parallel ranks): "
                              f"{self.dp} % {self.ep} = {self.dp % self.ep}")
        if self.ep > 1 and self.n_experts == 0:
            self.n_experts = self.ep
        if self.n_experts and self.n_experts % self.ep:
            raise ConfigError(f"n_experts must be divisible by ep: {self.n_experts} % {self.ep} = "
                              f"{self.n_experts % self.ep}")
        if self.n_experts and self.cp > 1:
            raise ConfigError(f"MoE (n_experts={self.n_experts}) does not combine with --cp {self.cp}: "
                              f"routing groups are whole sequences, which cp splits across ranks")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ConfigError(f"--top-k must be in 1..n_experts={self.n_experts}, got {self.top_k}")
        per_replica = self.batch_size // self.dp if self.batch_size % self.dp == 0 else -1
        if per_replica < 0:
            raise ConfigError(f"batch_size must be divisible by dp: {self.batch_size} % {self.dp} = "
                              f"{self.batch_size % self.dp}")
        if per_replica % self.microbatches:
            raise ConfigError(f"per-replica batch must be divisible by microbatches: {self.batch_size}/{self.dp} = "
                              f"{per_replica}, % {self.microbatches} = {per_replica % self.microbatches}")
        if self.pp_layers:
            if len(self.pp_layers) != self.n_stages:
                raise ConfigError(f"--pp-layers has {len(self.pp_layers)} entries but pp*vpp = {self.pp}*{self.vpp} = "
                                  f"{self.n_stages} stages")
            if any(n < 0 for n in self.pp_layers) or sum(self.pp_layers) != self.n_layer:
                raise ConfigError(f"--pp-layers {','.join(map(str, self.pp_layers))} sums to {sum(self.pp_layers)}, "
                                  f"but n_layer is {self.n_layer}")
        elif self.n_layer % self.n_stages:
            raise ConfigError(f"n_layer must be divisible by pp*vpp (or give --pp-layers): {self.n_layer} % "
                              f"{self.n_stages} = {self.n_layer % self.n_stages}")
        if self.timeout_s <= 0:
            raise ConfigError(f"--timeout-s must be > 0, got {self.timeout_s}")
        if self.deadline_s < 0:
            raise ConfigError(f"--deadline-s must be >= 0, got {self.deadline_s}")
        return self

    def layers_per_stage(self) -> list[int]:
        if self.pp_layers:
            return list(self.pp_layers)
        return [self.n_layer // self.n_stages] * self.n_stages

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "RunConfig":
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The `ncclscope train` / `python -m ncclscope.runtime.train` flags."""
    d = RunConfig()
    p.add_argument("--nproc", type=int, default=0, help="number of ranks (default: tp*pp*dp*cp)")
    for name in ("tp", "pp", "dp", "cp", "ep"):
        p.add_argument(f"--{name}", type=int, default=1, help=f"{name} degree")
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2), help="ZeRO stage for DP")
    p.add_argument("--schedule", default=d.schedule, choices=SCHEDULES, help="pipeline schedule")
    p.add_argument("--microbatches", type=int, default=d.microbatches)
    p.add_argument("--vpp", type=int, default=1, help="virtual pipeline stages per rank (interleaved)")
    p.add_argument("--pp-layers", default="", help="explicit layers per stage, e.g. 1,3")
    p.add_argument("--n-layer", type=int, default=d.n_layer)
    p.add_argument("--n-head", type=int, default=d.n_head)
    p.add_argument("--n-embd", type=int, default=d.n_embd)
    p.add_argument("--block-size", type=int, default=d.block_size)
    p.add_argument("--n-experts", type=int, default=0)
    p.add_argument("--top-k", type=int, default=1)
    p.add_argument("--capacity-factor", type=float, default=d.capacity_factor)
    p.add_argument("--steps", type=int, default=d.steps)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="global batch (sequences per step)")
    p.add_argument("--lr", type=float, default=d.lr)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--dtype", default=d.dtype, choices=("float32", "float64"))
    p.add_argument("--timeout-s", type=float, default=d.timeout_s, help="per-op timeout (s)")
    p.add_argument("--deadline-s", type=float, default=0.0, help="global job deadline (s, 0 = none)")
    p.add_argument("--no-trace", action="store_true", help="run without writing the event log")
    p.add_argument("--out", default="", help="the run directory to write (holds run.json)")
    p.add_argument("--inject", action="append", default=[], metavar="SPEC",
                   help="fault drill KIND:key=value,... (repeatable)")


def from_args(ns: argparse.Namespace) -> RunConfig:
    try:
        pp_layers = [int(x) for x in ns.pp_layers.split(",") if x.strip()] if ns.pp_layers else []
    except ValueError:
        raise ConfigError(f"--pp-layers must be comma-separated integers, got {ns.pp_layers!r}") from None
    cfg = RunConfig(
        tp=ns.tp, pp=ns.pp, dp=ns.dp, cp=ns.cp, ep=ns.ep, nproc=ns.nproc, zero=ns.zero, schedule=ns.schedule,
        microbatches=ns.microbatches, vpp=ns.vpp, pp_layers=pp_layers, n_layer=ns.n_layer, n_head=ns.n_head,
        n_embd=ns.n_embd, block_size=ns.block_size, n_experts=ns.n_experts, top_k=ns.top_k,
        capacity_factor=ns.capacity_factor, steps=ns.steps, batch_size=ns.batch_size, lr=ns.lr, seed=ns.seed,
        dtype=ns.dtype, timeout_s=ns.timeout_s, deadline_s=ns.deadline_s, trace=not ns.no_trace, out=ns.out,
        inject=list(ns.inject),
    )
    return cfg.validate()


def dumps(cfg: RunConfig) -> str:
    return json.dumps(cfg.to_json())
