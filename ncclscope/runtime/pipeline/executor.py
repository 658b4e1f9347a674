"""Run one rank's pipeline action list (from schedules.py) for one optimizer step.

    F(s, mb): input = tokens (stage 0), or the activation received from the
              rank of stage s-1; run the stage; the last stage computes the
              loss (divided by the number of microbatches), the others send
              the output to the rank of stage s+1.
    B(s, mb): gradient = d(loss) (last stage), or the one received from the
              rank of stage s+1; backward through the stage; unless s == 0,
              send the input's gradient to the rank of stage s-1.

Sends are `isend`s waited at the end of the step; receives block. Blocking
sends would deadlock 1F1B on gloo, where even a small send waits for its
receiver: rank 0 sends the activation of microbatch 1 while rank 1 sends the
gradient of microbatch 0, each waiting for the other to receive (Megatron
avoids this with batched send/recv pairs; torch.distributed.pipelining with
async sends, as here). Every message has its own tag (direction, stage,
microbatch), so receives match their sends whatever order they are posted in.
Neighbouring stages on the same rank (interleaved with pp == 1) hand their
tensors over locally.

Every op and compute span is tagged with rec.context.stage / chunk /
microbatch, so the analyzer can rebuild the schedule from the trace.

Hooks: `before_remote_send` callables run as `hook(executor, direction,
receiving stage, microbatch)` before every send to another rank; a hook may
call `executor.receive(...)` (the `p2p_order` drill in runtime/faults.py uses
it to post a receive that cannot be matched). Empty by default.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn

from ncclscope.runtime.comm import Comm, Group, Handle
from ncclscope.schedules import FORWARD, Action, build_schedule, stage_to_rank


class PipelineExecutor:
    """Runs `chunks` (this rank's stages, chunk c = stage c*pp + pp_rank) through
    the schedule's actions, with p2p through `comm` over the `pp` group."""

    def __init__(self, chunks: list[nn.Module], schedule: str, microbatches: int, comm: Comm, pp: Group,
                 rec: Any) -> None:
        self.chunks, self.comm, self.pp, self.rec = chunks, comm, pp, rec
        self.before_remote_send: list[Callable[["PipelineExecutor", str, int, int], None]] = []
        self._shape: tuple[int, ...] = ()
        self._dtype = torch.float32
        self._device: Any = None
        self._local: dict[tuple[str, int, int], torch.Tensor] = {}
        self.p, self.v, self.m = pp.size, len(chunks), microbatches
        self.n_stages = self.p * self.v
        name = schedule if self.n_stages > 1 else "1f1b"              # one stage: plain F/B alternation
        self.actions: list[Action] = build_schedule(name, self.p, self.m, self.v)[pp.rank]
        self.tag_context = self.n_stages > 1

    def _tag(self, direction: str, stage: int, mb: int) -> int:
        """A unique tag per message of a step: (direction, receiving stage, microbatch)."""
        return ((0 if direction == FORWARD else 1) * self.n_stages + stage) * self.m + mb + 1

    def _rank_of(self, stage: int) -> int:
        return self.pp.ranks[stage_to_rank(stage, self.p)]

    def _is_local(self, stage: int) -> bool:
        return stage_to_rank(stage, self.p) == self.pp.rank

    def run(self, inputs: list[torch.Tensor], targets: list[torch.Tensor], act_shape: tuple[int, ...],
            dtype: torch.dtype) -> torch.Tensor:
        """One step over m microbatches. Returns the summed loss (last stage; 0 elsewhere)."""
        store: dict[tuple[int, int], tuple[torch.Tensor | None, torch.Tensor]] = {}
        self._local = local = {}
        self._shape, self._dtype, self._device = act_shape, dtype, inputs[0].device
        sends: list[Handle] = []
        loss_sum = torch.zeros((), dtype=dtype, device=self._device)
        ctx = self.rec.context
        try:
            for a in self.actions:
                s, mb = a.stage, a.microbatch
                ctx.microbatch = mb
                if self.tag_context:
                    ctx.stage, ctx.chunk = s, s // self.p
                chunk = self.chunks[s // self.p]
                last = s == self.n_stages - 1
                if a.kind == FORWARD:
                    if s == 0:
                        x: torch.Tensor | None = None
                        inp = inputs[mb]
                    else:
                        x = self.receive(FORWARD, s, mb).requires_grad_()
                        inp = x
                    with self.rec.span("forward"):
                        out = chunk(inp)
                        if last:
                            out = chunk.loss(out, targets[mb]) / self.m
                    store[(s, mb)] = (x, out)
                    if last:
                        loss_sum += out.detach()
                    else:
                        self._send(FORWARD, s + 1, mb, out.detach(), local, sends)
                else:
                    x, out = store.pop((s, mb))
                    grad = None if last else self.receive("B", s, mb)
                    with self.rec.span("backward"):
                        torch.autograd.backward(out, grad)
                    if s > 0:
                        self._send("B", s - 1, mb, x.grad, local, sends)
            ctx.microbatch = ctx.stage = ctx.chunk = -1
            for h in sends:
                h.wait()
        finally:
            ctx.microbatch = ctx.stage = ctx.chunk = -1
        return loss_sum

    def _send(self, direction: str, stage: int, mb: int, t: torch.Tensor, local: dict, sends: list[Handle]) -> None:
        """Send to `stage` (the receiving stage) its input (F) or output gradient (B)."""
        if self._is_local(stage):
            local[(direction, stage, mb)] = t
        else:
            for hook in self.before_remote_send:
                hook(self, direction, stage, mb)
            sends.append(self.comm.isend(t.contiguous(), self._rank_of(stage), self.pp,
                                         tag=self._tag(direction, stage, mb)))

    def receive(self, direction: str, stage: int, mb: int) -> torch.Tensor:
        """Receive stage `stage`'s input (F, from stage-1) or output gradient (B, from stage+1)."""
        if self._is_local(stage - 1 if direction == FORWARD else stage + 1):
            return self._local.pop((direction, stage, mb))
        buf = torch.empty(self._shape, dtype=self._dtype, device=self._device)
        src = self._rank_of(stage - 1 if direction == FORWARD else stage + 1)
        self.comm.recv(buf, src, self.pp, tag=self._tag(direction, stage, mb))
        return buf
