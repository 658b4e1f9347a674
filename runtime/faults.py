"""Fault drills: make a real job fail the way production jobs fail, on purpose.

`ncclscope train --inject SPEC` (repeatable), SPEC = `KIND:key=value,...`:

    skip:rank=R,step=S[,op=all_reduce][,group=dp]   rank skips that collective
    hang:rank=R,step=S                              rank blocks in compute forever
    kill:rank=R,step=S                              rank SIGKILLs itself
    crash:rank=R,step=S                             rank raises
    wrong_group:rank=R,step=S,use=G[,op=..][,group=..]  collective issued on group kind G
    p2p_order:rank=R,step=S                         pipeline rank posts recv before send (deadlock;
                                                    needs a rank that sends activations onward)
    mismatch:rank=R,step=S,what=size|dtype|type     its all_reduce differs from its peers'
    slow:rank=R,factor=F                            compute F x slower
    nan:rank=R,step=S                               NaN in that rank's gradients
    desync_grad:rank=R,step=S                       rank ignores its reduced gradient once
    group_order:rank=R                              rank plans its groups in another order

Drills are matched against the recorder's context (step) and fire once each
(except slow and group_order, which hold for the whole run). Nothing here is
written to the trace: the analyzer must find the fault from evidence alone.
"""
from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass, field
from typing import Any

KINDS = {
    "skip": {"rank", "step", "op", "group"},
    "hang": {"rank", "step"},
    "kill": {"rank", "step"},
    "crash": {"rank", "step"},
    "wrong_group": {"rank", "step", "use", "op", "group"},
    "p2p_order": {"rank", "step"},
    "mismatch": {"rank", "step", "what", "op", "group"},
    "slow": {"rank", "factor"},
    "nan": {"rank", "step"},
    "desync_grad": {"rank", "step"},
    "group_order": {"rank"},
}
REQUIRED = {
    "skip": {"rank", "step"}, "hang": {"rank", "step"}, "kill": {"rank", "step"}, "crash": {"rank", "step"},
    "wrong_group": {"rank", "step", "use"}, "p2p_order": {"rank", "step"},
    "mismatch": {"rank", "step", "what"}, "slow": {"rank", "factor"}, "nan": {"rank", "step"},
    "desync_grad": {"rank", "step"}, "group_order": {"rank"},
}


class FaultSpecError(ValueError):
    """A --inject SPEC that cannot be parsed; one line saying what is wrong."""


class InjectedCrash(RuntimeError):
    """Raised by the `crash` drill."""


@dataclass
class Fault:
    kind: str
    rank: int
    step: int = -1
    params: dict[str, str] = field(default_factory=dict)
    fired: bool = False

    def __str__(self) -> str:
        extra = "".join(f",{k}={v}" for k, v in self.params.items())
        step = f",step={self.step}" if self.step >= 0 else ""
        return f"{self.kind}:rank={self.rank}{step}{extra}"


def parse_spec(spec: str) -> Fault:
    kind, _, rest = spec.partition(":")
    kind = kind.strip()
    if kind not in KINDS:
        raise FaultSpecError(f"--inject {spec!r}: unknown kind {kind!r} (one of {', '.join(sorted(KINDS))})")
    values: dict[str, str] = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not value:
            raise FaultSpecError(f"--inject {spec!r}: expected key=value, got {item!r}")
        if key not in KINDS[kind]:
            raise FaultSpecError(f"--inject {spec!r}: {kind} takes {', '.join(sorted(KINDS[kind]))}, not {key!r}")
        values[key] = value
    missing = REQUIRED[kind] - values.keys()
    if missing:
        raise FaultSpecError(f"--inject {spec!r}: {kind} needs {', '.join(sorted(missing))}")
    try:
        rank = int(values.pop("rank"))
        step = int(values.pop("step", -1))
    except ValueError:
        raise FaultSpecError(f"--inject {spec!r}: rank and step must be integers") from None
    if kind == "mismatch" and values["what"] not in ("size", "dtype", "type"):
        raise FaultSpecError(f"--inject {spec!r}: what must be size, dtype or type")
    if kind == "slow":
        try:
            if float(values["factor"]) < 1:
                raise ValueError
        except ValueError:
            raise FaultSpecError(f"--inject {spec!r}: factor must be a number >= 1") from None
    return Fault(kind, rank, step, values)


class FaultPlan:
    """The drills that concern one rank, queried by the runtime at fixed points."""

    def __init__(self, specs: list[str], rank: int, recorder: Any) -> None:
        self.rank = rank
        self.rec = recorder
        self.faults = [f for f in (parse_spec(s) for s in specs) if f.rank == rank]

    def __bool__(self) -> bool:
        return bool(self.faults)

    def _due(self, kind: str) -> Fault | None:
        step = self.rec.context.step
        for f in self.faults:
            if f.kind == kind and not f.fired and f.step == step:
                return f
        return None

    # -- queried by the training loop --------------------------------------
    def at_step_start(self) -> None:
        """hang / kill / crash drills fire at the start of their step."""
        f = self._due("kill")
        if f:
            self.rec.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        f = self._due("crash")
        if f:
            f.fired = True
            raise InjectedCrash(f"injected crash ({f})")
        f = self._due("hang")
        if f:
            f.fired = True
            with self.rec.span("forward"):   # stuck in compute: no op in flight, heartbeats go on
                while True:
                    time.sleep(3600)

    def slow_factor(self) -> float:
        for f in self.faults:
            if f.kind == "slow":
                return float(f.params["factor"])
        return 1.0

    def take(self, kind: str) -> bool:
        """True once, at the drill's step (nan, desync_grad, p2p_order)."""
        f = self._due(kind)
        if f:
            f.fired = True
            return True
        return False

    def reorder_groups(self) -> bool:
        return any(f.kind == "group_order" for f in self.faults)

    # -- queried by comm.py for every collective ---------------------------
    def tamper(self, comm: Any, op: str, group: Any, t: Any) -> tuple[Any, Any, str, bool]:
        """Return (group, tensor, op name, skip) for this call."""
        for kind in ("skip", "wrong_group", "mismatch"):
            f = self._due(kind)
            if f is None:
                continue
            # a mismatch without op= targets the step's first all_reduce: the
            # distortions (size, dtype, all_reduce -> broadcast) are defined for it
            wanted = f.params.get("op", "all_reduce" if kind == "mismatch" else None)
            if wanted is not None and wanted != op:
                continue
            if "group" in f.params and f.params["group"] != group.kind:
                continue
            f.fired = True
            if kind == "skip":
                return group, t, op, True
            if kind == "wrong_group":
                use = f.params["use"]
                target = next((g for g in comm.groups.values()
                               if g.kind == use and g.rank >= 0 and g.size > 1), None)
                if target is None:
                    target = comm.groups["world"] if use == "world" else group
                return target, t, op, False
            what = f.params["what"]
            if what == "size" and t is not None:
                import torch
                return group, torch.zeros(t.numel() + 1, dtype=t.dtype), op, False
            if what == "dtype" and t is not None:
                import torch
                other = torch.float32 if t.dtype == torch.float64 else torch.float64
                return group, t.to(other), op, False
            if what == "type":
                return group, t, "broadcast", False
        return group, t, op, False
