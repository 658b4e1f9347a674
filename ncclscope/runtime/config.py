"""Run configuration: every parallel degree and model size in one validated dataclass.

The whole product of degrees appears in the error, because the user who got
`--tp 2 --pp 2 --dp 2` wrong on 6 processes needs to see all of it at once:
`tp*pp*dp*cp = 2*2*2*1 = 8, but --nproc is 6`. Every rule is one line, and it
names the flags the user typed with their values (`--n-head 2 is not
divisible by --tp 3`), never an internal field name.

The model is sized to the layout when the user did not choose: without
`--n-layer`, a layout with more pipeline stages than the default model has
layers (`--pp 4`, `--pp 2 --vpp 2`) gets one layer per stage, rounded up to a
multiple of the stage count (`n_layer = 0` means "choose").

`--inject` drills are checked against the layout here too (faults.check_specs):
one that cannot fire is refused before any rank starts. `--inject help` lists
the kinds and exits.

This module imports no torch (except to ask, for `--device cuda` only, whether
a CUDA device is there), so `ncclscope train` can reject a bad config before
paying for spawning ranks.
"""
from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

SCHEDULES = ("gpipe", "1f1b", "interleaved")
DEVICES = ("cpu", "cuda")
DEFAULT_N_LAYER = 2
PIPELINE_BLOCKS_PER_STAGE = 2


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
    n_layer: int = 0                # 0: DEFAULT_N_LAYER, raised to fit the pipeline layout
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
    backend: str = "gloo"           # from device: cpu -> gloo, cuda -> nccl
    device: str = "cpu"

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp * self.cp

    @property
    def n_stages(self) -> int:
        return self.pp * self.vpp

    def validate(self) -> "RunConfig":
        """Raise ConfigError naming the first violated rule, with its numbers."""
        self._size_model()
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
            raise ConfigError(f"--schedule interleaved needs --microbatches divisible by --pp: "
                              f"--microbatches {self.microbatches} is not divisible by --pp {self.pp}")
        if self.n_head % self.tp:
            raise ConfigError(f"--n-head {self.n_head} is not divisible by --tp {self.tp}")
        if self.n_embd % self.n_head:
            raise ConfigError(f"--n-embd {self.n_embd} is not divisible by --n-head {self.n_head}")
        if (4 * self.n_embd) % self.tp:
            raise ConfigError(f"the MLP width 4 x --n-embd {self.n_embd} = {4 * self.n_embd} is not divisible by "
                              f"--tp {self.tp}")
        if self.vocab_size % self.tp:
            raise ConfigError(f"the vocabulary ({self.vocab_size} byte tokens) is not divisible by --tp {self.tp}")
        if self.block_size % (2 * self.cp) and self.cp > 1:
            raise ConfigError(f"--block-size {self.block_size} is not divisible by 2 x --cp {self.cp} = "
                              f"{2 * self.cp} (zig-zag chunks)")
        if self.dp % self.ep:
            raise ConfigError(f"--dp {self.dp} is not divisible by --ep {self.ep} "
                              f"(experts are sharded across data-parallel ranks)")
        if self.ep > 1 and self.n_experts == 0:
            self.n_experts = self.ep
        if self.n_experts and self.n_experts % self.ep:
            raise ConfigError(f"--n-experts {self.n_experts} is not divisible by --ep {self.ep}")
        if self.n_experts and self.cp > 1:
            raise ConfigError(f"MoE (--n-experts {self.n_experts}) does not combine with --cp {self.cp}: "
                              f"routing groups are whole sequences, which cp splits across ranks")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ConfigError(f"--top-k {self.top_k} must be between 1 and --n-experts {self.n_experts}")
        if self.batch_size % self.dp:
            raise ConfigError(f"--batch-size {self.batch_size} is not divisible by --dp {self.dp}")
        per_replica = self.batch_size // self.dp
        if per_replica % self.microbatches:
            raise ConfigError(f"--batch-size {self.batch_size} / --dp {self.dp} = {per_replica} sequences per "
                              f"replica is not divisible by --microbatches {self.microbatches}")
        self._check_stages()
        self._check_job()
        return self

    def _check_stages(self) -> None:
        """The pipeline's layers: --pp-layers (one entry a stage, summing to --n-layer), or --n-layer
        divisible by the stages (part of `validate`)."""
        stages = f"--pp {self.pp} x --vpp {self.vpp} = {self.n_stages} stages" if self.vpp > 1 else \
            f"--pp {self.pp}"
        if self.pp_layers:
            if len(self.pp_layers) != self.n_stages:
                made = f"--pp {self.pp} x --vpp {self.vpp}" if self.vpp > 1 else f"--pp {self.pp}"
                raise ConfigError(f"--pp-layers has {len(self.pp_layers)} entries, but {made} makes "
                                  f"{self.n_stages} stages")
            if any(n < 0 for n in self.pp_layers) or sum(self.pp_layers) != self.n_layer:
                raise ConfigError(f"--pp-layers {','.join(map(str, self.pp_layers))} sums to {sum(self.pp_layers)}, "
                                  f"but --n-layer is {self.n_layer}")
        elif self.n_layer % self.n_stages:
            raise ConfigError(f"--n-layer {self.n_layer} is not divisible by {stages} (give another --n-layer, "
                              f"or --pp-layers)")

    def _check_job(self) -> None:
        """Timeouts, the device (and its backend) and the fault drills (part of `validate`, its last checks)."""
        if self.timeout_s <= 0:
            raise ConfigError(f"--timeout-s must be > 0, got {self.timeout_s}")
        if self.deadline_s < 0:
            raise ConfigError(f"--deadline-s must be >= 0, got {self.deadline_s}")
        if self.device not in DEVICES:
            raise ConfigError(f"--device must be cpu or cuda, got {self.device!r}")
        self.backend = "nccl" if self.device == "cuda" else "gloo"
        if self.device == "cuda":
            # under torchrun / env:// the ranks may span hosts: run_rank checks its LOCAL_RANK instead
            check_cuda(0 if "WORLD_SIZE" in os.environ else self.world_size)
        if self.inject:
            from ncclscope.runtime.faults import check_specs   # torch-free
            check_specs(self.inject, self)

    def _size_model(self) -> None:
        """n_layer 0 (not chosen): the default, or what the pipeline layout needs."""
        if self.n_layer != 0:
            return
        if self.pp_layers:
            self.n_layer = sum(self.pp_layers)
            return
        stages = max(1, self.pp) * max(1, self.vpp)
        # Two blocks per pipeline stage: the last stage also runs the LM head and the loss, about
        # two thirds of a block at the default width, so with one block each it would be ~1.6x the
        # first stage, a real imbalance that a healthy default layout must not have.
        self.n_layer = DEFAULT_N_LAYER if stages == 1 else PIPELINE_BLOCKS_PER_STAGE * stages

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
    p.add_argument("--n-layer", type=int, default=None,
                   help=f"transformer blocks (default {DEFAULT_N_LAYER}; with a pipeline, {PIPELINE_BLOCKS_PER_STAGE} "
                        "per (virtual) stage)")
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
    p.add_argument("--inject", action=_InjectAction, default=[], metavar="SPEC",
                   help="fault drill KIND:key=value,... (repeatable; --inject help lists the kinds)")
    p.add_argument("--device", default="cpu", choices=DEVICES,
                   help="cpu (gloo) or cuda (NCCL, one GPU per local rank; see docs/nccl.md)")


class _InjectAction(argparse._AppendAction):
    """`--inject SPEC` appends; `--inject help` prints the drill kinds and exits 0."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if values == "help":
            from ncclscope.runtime.faults import help_text
            print(help_text())
            parser.exit(0)
        super().__call__(parser, namespace, values, option_string)


def check_cuda(ranks_here: int = 0) -> None:
    """`--device cuda` needs CUDA, and one GPU per rank started on this host;
    asked without initialising CUDA in this process (NVML-based count)."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")
    try:
        import torch
    except ImportError:
        raise ConfigError("--device cuda needs torch with CUDA; torch is not installed") from None
    if not torch.backends.cuda.is_built():
        raise ConfigError(f"--device cuda: this torch ({torch.__version__}) is built without CUDA; use --device cpu")
    if not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    count = torch.cuda.device_count()
    if ranks_here > count:
        raise ConfigError(f"--device cuda needs one GPU per rank: {ranks_here} ranks on this host, "
                          f"{count} GPU{'s' if count != 1 else ''} visible")


def from_args(ns: argparse.Namespace) -> RunConfig:
    if ns.n_layer is not None and ns.n_layer < 1:
        raise ConfigError(f"--n-layer must be a positive integer, got {ns.n_layer}")
    try:
        pp_layers = [int(x) for x in ns.pp_layers.split(",") if x.strip()] if ns.pp_layers else []
    except ValueError:
        raise ConfigError(f"--pp-layers must be comma-separated integers, got {ns.pp_layers!r}") from None
    cfg = RunConfig(
        tp=ns.tp, pp=ns.pp, dp=ns.dp, cp=ns.cp, ep=ns.ep, nproc=ns.nproc, zero=ns.zero, schedule=ns.schedule,
        microbatches=ns.microbatches, vpp=ns.vpp, pp_layers=pp_layers, n_layer=ns.n_layer or 0, n_head=ns.n_head,
        n_embd=ns.n_embd, block_size=ns.block_size, n_experts=ns.n_experts, top_k=ns.top_k,
        capacity_factor=ns.capacity_factor, steps=ns.steps, batch_size=ns.batch_size, lr=ns.lr, seed=ns.seed,
        dtype=ns.dtype, timeout_s=ns.timeout_s, deadline_s=ns.deadline_s, trace=not ns.no_trace, out=ns.out,
        inject=list(ns.inject), device=getattr(ns, "device", "cpu"),
    )
    return cfg.validate()


def dumps(cfg: RunConfig) -> str:
    return json.dumps(cfg.to_json())
