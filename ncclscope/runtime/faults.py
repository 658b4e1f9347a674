"""Fault drills: make a real job fail the way production jobs fail, on purpose.

`ncclscope train --inject SPEC` (repeatable), SPEC = `KIND:key=value,...`;
`--inject help` prints the kinds and their keys (the table `KINDS` below).

Drills attach to the runtime only through hooks, so the production path has
no drill-specific code (`FaultPlan.install`):
  - comm hooks (`Comm.add_hook`): before an op is issued, skip it, issue it on
    another group, or distort it (skip, wrong_group, mismatch);
  - step hooks (`train.StepHooks`): at the start of a step, after compute,
    after backward, before the gradient reduction (hang, kill, crash, slow,
    nan, desync_grad);
  - pipeline hooks (`PipelineExecutor.before_remote_send`): p2p_order;
  - group_order changes the order the mesh is planned in (`reorder_groups`).

Drills are matched against the recorder's context (step) and fire once each
(except slow and group_order, which hold for the whole run). A drill that
cannot fire on the configured layout (a rank that does not exist, a step past
--steps, a group of one) is refused before any rank starts (`check_specs`).
Nothing here is written to the trace: the analyzer must find the fault from
evidence alone.

This module imports no torch at import time: the CLI checks specs before it
pays for spawning ranks.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

# kind: (keys it takes, keys it needs, what it does)
KINDS: dict[str, tuple[tuple[str, ...], tuple[str, ...], str]] = {
    "skip": (("rank", "step", "op", "group"), ("rank", "step"),
             "the rank skips that step's first collective (or the one named by op=, on group kind group=)"),
    "hang": (("rank", "step"), ("rank", "step"), "the rank blocks in compute forever at the start of the step"),
    "kill": (("rank", "step"), ("rank", "step"), "the rank SIGKILLs itself at the start of the step"),
    "crash": (("rank", "step"), ("rank", "step"), "the rank raises at the start of the step"),
    "wrong_group": (("rank", "step", "use", "op", "group"), ("rank", "step", "use"),
                    "the rank issues that collective on a group of kind use= instead"),
    "p2p_order": (("rank", "step"), ("rank", "step"),
                  "a pipeline rank receives before its first activation send: unpaired send/recv deadlock"),
    "mismatch": (("rank", "step", "what", "op", "group"), ("rank", "step", "what"),
                 "the rank's all_reduce differs from its peers': what=size|dtype|type (type: a broadcast)"),
    "slow": (("rank", "factor"), ("rank", "factor"), "the rank's compute runs factor (>= 1) times slower, every step"),
    "nan": (("rank", "step"), ("rank", "step"), "NaN in that rank's gradients before the reduction"),
    "desync_grad": (("rank", "step"), ("rank", "step"), "the rank ignores its reduced gradient once"),
    "group_order": (("rank",), ("rank",), "the rank plans its process groups in another order"),
}
COMM_KINDS = ("skip", "wrong_group", "mismatch")
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
               "all_to_all_single", "broadcast", "barrier")
GROUP_KINDS = ("world", "tp", "cp", "dp", "pp", "dp_cp", "ep", "edp")


class FaultSpecError(ValueError):
    """A --inject SPEC that cannot be parsed or cannot fire; one line saying why."""


class InjectedCrash(RuntimeError):
    """Raised by the `crash` drill."""


@dataclass
class Fault:
    kind: str
    rank: int
    step: int = -1
    params: dict[str, str] = field(default_factory=dict)
    fired: bool = False
    spec: str = ""

    def __str__(self) -> str:
        extra = "".join(f",{k}={v}" for k, v in self.params.items())
        step = f",step={self.step}" if self.step >= 0 else ""
        return f"{self.kind}:rank={self.rank}{step}{extra}"


def help_text() -> str:
    """What `--inject help` prints: every kind with its keys."""
    lines = ["--inject KIND:key=value,...  (repeatable; rank is a global rank, step counts from 0)", ""]
    for kind, (keys, required, what) in KINDS.items():
        shown = ",".join(f"{k}={k.upper()}" for k in keys if k in required)
        shown += "".join(f"[,{k}={k.upper()}]" for k in keys if k not in required)
        lines += [f"  {kind}:{shown}", f"      {what}"]
    lines += ["", f"  OP:   {', '.join(COLLECTIVES)}",
              f"  GROUP, USE: a group kind: {', '.join(GROUP_KINDS)}"]
    return "\n".join(lines)


def parse_spec(spec: str) -> Fault:
    kind, _, rest = spec.partition(":")
    kind = kind.strip()
    if kind not in KINDS:
        raise FaultSpecError(f"--inject {spec}: unknown kind {kind!r} (one of {', '.join(KINDS)}; "
                             f"--inject help lists them)")
    keys, required, _ = KINDS[kind]
    values: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not value:
            raise FaultSpecError(f"--inject {spec}: expected key=value, got {item!r}")
        if key not in keys:
            raise FaultSpecError(f"--inject {spec}: unknown key {key!r}; {kind} takes {', '.join(keys)}")
        values[key] = value
    missing = [k for k in required if k not in values]
    if missing:
        raise FaultSpecError(f"--inject {spec}: {kind} needs {', '.join(missing)}")
    try:
        rank = int(values.pop("rank"))
        step = int(values.pop("step", -1))
    except ValueError:
        raise FaultSpecError(f"--inject {spec}: rank and step must be integers") from None
    if kind == "mismatch" and values["what"] not in ("size", "dtype", "type"):
        raise FaultSpecError(f"--inject {spec}: what must be size, dtype or type, not {values['what']!r}")
    if kind == "slow":
        try:
            if float(values["factor"]) < 1:
                raise ValueError
        except ValueError:
            raise FaultSpecError(f"--inject {spec}: factor must be a number >= 1") from None
    if "op" in values and values["op"] not in COLLECTIVES:
        raise FaultSpecError(f"--inject {spec}: op={values['op']} is not a collective "
                             f"(one of {', '.join(COLLECTIVES)})")
    for key in ("group", "use"):
        if key in values and values[key] not in GROUP_KINDS:
            raise FaultSpecError(f"--inject {spec}: {key}={values[key]} is not a group kind "
                                 f"(one of {', '.join(GROUP_KINDS)})")
    return Fault(kind, rank, step, values, spec=spec)


def group_sizes(cfg: Any) -> dict[str, int]:
    """Size of each group kind of the layout (1: the kind has no real group)."""
    world = cfg.tp * cfg.pp * cfg.dp * cfg.cp
    return {"world": world, "tp": cfg.tp, "cp": cfg.cp, "dp": cfg.dp, "pp": cfg.pp,
            "dp_cp": cfg.dp * cfg.cp if cfg.cp > 1 else 1, "ep": cfg.ep,
            "edp": cfg.dp // cfg.ep if cfg.ep > 1 else 1}


def check_specs(specs: list[str], cfg: Any) -> list[Fault]:
    """Parse every spec and refuse, in one line naming the reason, a drill that
    cannot fire on this layout. `cfg` is a RunConfig (degrees and --steps)."""
    faults = [parse_spec(s) for s in specs]
    sizes = group_sizes(cfg)
    world = sizes["world"]
    for f in faults:
        spec = f.spec
        if not 0 <= f.rank < world:
            raise FaultSpecError(f"--inject {spec}: rank {f.rank} does not exist "
                                 f"(the job has {world} rank{'s' if world != 1 else ''}: 0..{world - 1})")
        if "step" in KINDS[f.kind][1] and not 0 <= f.step < cfg.steps:
            raise FaultSpecError(f"--inject {spec}: step {f.step} never runs (--steps {cfg.steps} runs "
                                 f"steps 0..{cfg.steps - 1})")
        if f.kind in COMM_KINDS + ("group_order",) and world == 1:
            raise FaultSpecError(f"--inject {spec}: one rank has no collective to {f.kind.replace('_', ' ')}")
        kind = f.params.get("group")
        if kind is not None and sizes[kind] < 2:
            raise FaultSpecError(f"--inject {spec}: group={kind} has one rank on this layout, so it issues "
                                 f"no collective (give --{kind.split('_')[0]} > 1 or another group)")
        use = f.params.get("use")
        if use is not None and sizes[use] < 2:
            raise FaultSpecError(f"--inject {spec}: use={use} has one rank on this layout; pick a group kind "
                                 f"with more ({', '.join(k for k, n in sizes.items() if n > 1)})")
        if f.kind == "p2p_order":
            pp_rank = f.rank // (cfg.tp * cfg.cp * cfg.dp)
            if cfg.pp < 2:
                raise FaultSpecError(f"--inject {spec}: needs pipeline parallelism (--pp > 1; --pp is {cfg.pp})")
            if pp_rank == cfg.pp - 1 and cfg.vpp == 1:
                raise FaultSpecError(f"--inject {spec}: rank {f.rank} is the last pipeline stage and sends no "
                                     f"activations onward (--pp {cfg.pp}); pick a rank of an earlier stage")
        if f.kind == "desync_grad" and cfg.dp * cfg.cp < 2:
            raise FaultSpecError(f"--inject {spec}: needs data parallelism (--dp > 1): no replica to disagree with")
        if f.kind == "desync_grad" and cfg.zero >= 1:
            raise FaultSpecError(f"--inject {spec}: under --zero {cfg.zero} every replica copies its parameters "
                                 "from the all-gather of the shard owners' updates, so a rank that keeps its own "
                                 "gradient changes a shard all replicas share and none can drift; use --zero 0")
    return faults


class FaultPlan:
    """The drills that concern one rank; `install` attaches them as hooks."""

    def __init__(self, specs: list[str], rank: int, recorder: Any) -> None:
        self.rank = rank
        self.rec = recorder
        self.faults = [f for f in (parse_spec(s) for s in specs) if f.rank == rank]

    def __bool__(self) -> bool:
        return bool(self.faults)

    def _due(self, f: Fault) -> bool:
        """At the drill's step, not yet fired."""
        return not f.fired and f.step == self.rec.context.step

    def reorder_groups(self) -> bool:
        return any(f.kind == "group_order" for f in self.faults)

    def install(self, comm: Any = None, steps: Any = None, pipeline: Any = None) -> None:
        """Register each drill's hooks: comm hooks on `comm` (runtime.comm.Comm),
        step hooks on `steps` (train.StepHooks), pipeline hooks on `pipeline`
        (a PipelineExecutor). Any of them may be None (not installed)."""
        for f in self.faults:
            if f.kind in COMM_KINDS and comm is not None:
                comm.add_hook(self._comm_hook(f))
            elif f.kind in ("kill", "crash", "hang") and steps is not None:
                steps.step_start.append(self._stop_hook(f))
            elif f.kind == "slow" and steps is not None:
                steps.after_compute.append(self._slow_hook(f))
            elif f.kind == "nan" and steps is not None:
                steps.after_backward.append(self._nan_hook(f))
            elif f.kind == "desync_grad" and steps is not None:
                steps.reduce_options.append(self._desync_hook(f))
            elif f.kind == "p2p_order" and pipeline is not None:
                pipeline.before_remote_send.append(self._p2p_order_hook(f))

    # -- step hooks ------------------------------------------------------------
    def _stop_hook(self, f: Fault) -> Any:
        rec = self.rec

        def at_step_start(step: int) -> None:
            if not self._due(f):
                return
            f.fired = True
            if f.kind == "kill":
                rec.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            if f.kind == "crash":
                raise InjectedCrash(f"injected crash ({f})")
            with rec.span("forward"):   # stuck in compute: no op in flight, heartbeats go on
                while True:
                    time.sleep(3600)
        return at_step_start

    def _slow_hook(self, f: Fault) -> Any:
        factor = float(f.params["factor"])
        rec = self.rec

        def after_compute(step: int, compute_s: float) -> None:
            if factor > 1:
                with rec.span("forward", message=f"slowed x{factor:g}"):
                    time.sleep((factor - 1) * compute_s)
        return after_compute

    def _nan_hook(self, f: Fault) -> Any:
        def after_backward(step: int, params: list[Any]) -> None:
            if self._due(f):       # as if backward had produced it on this rank
                f.fired = True
                params[0].grad.view(-1)[0] = float("nan")
        return after_backward

    def _desync_hook(self, f: Fault) -> Any:
        def reduce_options(step: int) -> dict[str, Any]:
            if self._due(f):
                f.fired = True
                return {"keep_local": True}
            return {}
        return reduce_options

    # -- pipeline hook -----------------------------------------------------------
    def _p2p_order_hook(self, f: Fault) -> Any:
        def before_remote_send(ex: Any, direction: str, stage: int, mb: int) -> None:
            """Before the step's first activation send to another rank, block on
            receiving that microbatch's gradient from the next stage first -
            which cannot come before the activation it has not sent."""
            if direction == "F" and self._due(f):
                f.fired = True
                ex.receive("B", stage - 1, mb)
        return before_remote_send

    # -- comm hook ---------------------------------------------------------------
    def _comm_hook(self, f: Fault) -> Any:
        import torch

        from ncclscope.runtime.comm import BROADCAST
        # a mismatch without op= targets the step's first all_reduce: the
        # distortions (size, dtype, all_reduce -> broadcast) are defined for it
        wanted = f.params.get("op", "all_reduce" if f.kind == "mismatch" else None)
        group_kind = f.params.get("group")

        def before_issue(comm: Any, call: Any) -> None:
            if not self._due(f) or call.op.kind != "collective":
                return
            if wanted is not None and wanted != call.op.name:
                return
            if group_kind is not None and group_kind != call.group.kind:
                return
            f.fired = True
            if f.kind == "skip":
                call.skip = True
            elif f.kind == "wrong_group":
                use = f.params["use"]
                target = next((g for g in comm.groups.values() if g.kind == use and g.rank >= 0 and g.size > 1),
                              None)
                call.group = target or (comm.groups["world"] if use == "world" else call.group)
            elif f.params["what"] == "size" and call.t is not None:
                t = call.t
                call.t = torch.zeros(t.numel() + 1, dtype=t.dtype, device=t.device)
            elif f.params["what"] == "dtype" and call.t is not None:
                t = call.t
                call.t = t.to(torch.float32 if t.dtype == torch.float64 else torch.float64)
            elif f.params["what"] == "type":
                call.op, call.arg = BROADCAST, call.group.ranks[0]
        return before_issue
