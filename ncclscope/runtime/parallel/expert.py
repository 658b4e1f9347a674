"""Expert parallelism: a mixture-of-experts feed-forward block whose experts are
spread over the `ep` group, tokens moved by `all_to_all_single`.

The maths (Switch Transformer / GShard):
  - a linear router scores each token against every expert; softmax; top-k;
    with k > 1 the k gates are renormalised (Mixtral), with k = 1 the gate is
    the raw probability (Switch) so the router still learns from the main loss;
  - each expert accepts at most `capacity = ceil(capacity_factor * S * k / E)`
    assignments per routing group of S tokens; first choices take precedence
    over second choices, then earlier tokens over later ones (GShard); the
    rest are dropped and counted (a dropped token keeps only its residual);
  - load-balancing auxiliary loss (Switch eq. 4): `E * sum_e f_e * P_e`, f_e
    the fraction of assignments routed to expert e, P_e its mean probability.

Routing groups are single sequences (GShard's "groups"): capacity and drops
then depend only on the sequence, not on how the batch is split over dp/ep
ranks or microbatches, which is what lets the single-process reference use
this very block (all experts local) and agree to rounding. The price: CP
(which splits a sequence over ranks) is not combined with MoE.

The auxiliary loss enters backward through `AuxLoss` (Megatron's
MoEAuxLossAutoScaler): identity on the activations forward, and backward it
emits d(aux) = aux_coef * grad_scale, so every pipeline stage adds its own
layers' aux gradient without the loss having to travel to the last stage.

EP dispatch (Megatron's alltoall token dispatcher): sort the kept
assignments by expert, exchange per-expert counts with one even
all_to_all_single, then the tokens with uneven splits; run the local experts;
the reverse all_to_all brings results home, where they are weighted by their
gates and summed per token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ncclscope.runtime.comm import Comm, Group


@dataclass
class Routing:
    experts: torch.Tensor    # [G, S, k] chosen expert per token and slot
    gates: torch.Tensor      # [G, S, k] weight of each choice (differentiable)
    keep: torch.Tensor       # [G, S, k] bool: within the expert's capacity
    aux: torch.Tensor        # [G] load-balancing loss per routing group


def capacity(capacity_factor: float, tokens: int, top_k: int, n_experts: int) -> int:
    """Assignments one expert accepts from a routing group of `tokens` tokens."""
    return max(1, math.ceil(capacity_factor * tokens * top_k / n_experts))


def route(logits: torch.Tensor, top_k: int, cap: int) -> Routing:
    """Top-k routing with capacity, for logits [G, S, E] (G groups of S tokens)."""
    G, S, E = logits.shape
    probs = logits.softmax(dim=-1)                                   # [G, S, E]
    gates, experts = probs.topk(top_k, dim=-1)                       # [G, S, k]
    if top_k > 1:
        gates = gates / gates.sum(dim=-1, keepdim=True)
    onehot = F.one_hot(experts, E)                                   # [G, S, k, E]
    by_slot = onehot.transpose(1, 2).reshape(G, top_k * S, E)        # slot-major priority
    position = ((by_slot.cumsum(dim=1) - 1) * by_slot).sum(dim=-1)   # [G, k*S] place in its expert's queue
    keep = (position < cap).view(G, top_k, S).transpose(1, 2)        # [G, S, k]
    f = onehot.sum(dim=(1, 2)).to(probs.dtype) / (S * top_k)         # [G, E] (no gradient, as in Switch)
    aux = E * (f * probs.mean(dim=1)).sum(dim=-1)                    # [G]
    return Routing(experts, gates, keep, aux)


class AuxLoss(torch.autograd.Function):
    """Identity on x forward; backward also feeds `scale` as d(loss)/d(aux)
    (Megatron-LM's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        ctx.save_for_backward(aux)
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (aux,) = ctx.saved_tensors
        return grad, torch.full_like(aux, ctx.scale), None


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with uneven splits; backward is the same exchange with
    the splits swapped (what was sent comes back as a gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], comm: Comm,
                group: Group) -> torch.Tensor:
        ctx.meta = (out_splits, in_splits, comm, group)
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))   # [n_recv, C]
        comm.all_to_all_single(out, x.contiguous(), group, out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        out_splits, in_splits, comm, group = ctx.meta
        back = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:]))
        comm.all_to_all_single(back, grad.contiguous(), group, in_splits, out_splits)
        return back, None, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], comm: Comm | None,
               group: Group | None) -> torch.Tensor:
    if group is None or group.size == 1:
        return x
    return _AllToAll.apply(x, out_splits, in_splits, comm, group)


class ExpertMLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.fc = nn.Linear(n_embd, 4 * n_embd)
        self.proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))                         # [n, C] -> [n, 4C] -> [n, C]


class MoE(nn.Module):
    """MoE feed-forward block. `experts` holds this rank's experts keyed by their
    global index, so parameter names (`experts.5.fc.weight`) are the same in the
    reference and on every EP rank. Without an ep group all experts are local."""

    def __init__(self, n_embd: int, n_experts: int, top_k: int, capacity_factor: float, aux_coef: float,
                 local: range | None = None) -> None:
        super().__init__()
        self.n_experts, self.top_k, self.capacity_factor, self.aux_coef = n_experts, top_k, capacity_factor, aux_coef
        self.router = nn.Linear(n_embd, n_experts, bias=False)
        self.local = local if local is not None else range(n_experts)
        self.experts = nn.ModuleDict({str(e): ExpertMLP(n_embd) for e in self.local})
        self.comm: Comm | None = None
        self.group: Group | None = None
        self.grad_scale = 1.0            # 1/microbatches, set by the trainer
        self.load = torch.zeros(len(self.local), dtype=torch.long)   # tokens per local expert (since reset)
        self.dropped = 0                 # assignments this rank routed that overflowed capacity

    @classmethod
    def shard(cls, full: "MoE", comm: Comm, group: Group) -> "MoE":
        """This EP rank's slice of a full block: the router, and experts
        [rank*E/ep, (rank+1)*E/ep), copied from the full tensors."""
        per = full.n_experts // group.size
        local = range(group.rank * per, (group.rank + 1) * per)
        m = cls(full.router.in_features, full.n_experts, full.top_k, full.capacity_factor, full.aux_coef, local)
        m.to(full.router.weight.dtype).load_state_dict(
            {k: v for k, v in full.state_dict().items() if not k.startswith("experts.") or int(k.split(".")[1]) in local})
        m.comm, m.group = comm, group
        return m

    def reset_stats(self) -> tuple[list[int], int]:
        load, dropped = self.load.tolist(), self.dropped
        self.load.zero_()
        self.dropped = 0
        return load, dropped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        r = route(self.router(x), self.top_k,
                  capacity(self.capacity_factor, T, self.top_k, self.n_experts))   # groups = sequences
        k = self.top_k
        token = torch.arange(B * T).repeat_interleave(k)                 # [B*T*k]
        kept = r.keep.reshape(-1)
        self.dropped += int((~kept).sum())
        expert, gate, token = r.experts.reshape(-1)[kept], r.gates.reshape(-1)[kept], token[kept]
        order = torch.argsort(expert, stable=True)                       # group assignments by expert
        expert, gate, token = expert[order], gate[order], token[order]
        counts = torch.bincount(expert, minlength=self.n_experts)        # [E]
        y = self._experts(x.reshape(B * T, C)[token], counts)            # [n_kept, C]
        out = torch.zeros_like(x.reshape(B * T, C)).index_add(0, token, y * gate[:, None])
        out = out.view(B, T, C)
        return AuxLoss.apply(out, r.aux.mean(), self.aux_coef * self.grad_scale)

    def _experts(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Run each assignment (rows of x, sorted by expert) through its expert,
        wherever that expert lives; rows come back in the same order."""
        ep = 1 if self.group is None else self.group.size
        n_local = len(self.local)
        if ep == 1:
            self.load += counts
            return self._run_local(x, counts.tolist())
        send = counts.view(ep, n_local).sum(dim=1).tolist()             # tokens to each EP rank
        got = torch.empty_like(counts)                                   # [ep * n_local]: from src, for local e
        self.comm.all_to_all_single(got, counts, self.group)           # token counts first (even splits)
        recv = got.view(ep, n_local).sum(dim=1).tolist()
        xr = all_to_all(x, recv, send, self.comm, self.group)            # [n_recv, C], src-major then expert
        expert_of_row = torch.arange(n_local).repeat(ep).repeat_interleave(got)
        perm = torch.argsort(expert_of_row, stable=True)                 # src-major -> expert-major
        per_expert = got.view(ep, n_local).sum(dim=0)
        self.load += per_expert
        ye = self._run_local(xr[perm], per_expert.tolist())
        yr = ye[torch.argsort(perm)]                                     # back to src-major
        return all_to_all(yr, send, recv, self.comm, self.group)         # [n_kept, C]

    def _run_local(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        chunks = x.split(counts)
        outs = [self.experts[str(e)](c) for e, c in zip(self.local, chunks)]
        return torch.cat(outs) if outs else x
