"""Tensor parallelism (Megatron-LM, Shoeybi et al. 2019): linear layers split
across the `tp` group, attention heads split with them, and a vocab-parallel
embedding and cross-entropy so the [tokens, vocab] logits are never gathered.

The two conjugate pairs carry all the communication:
  copy_to / reduce_from    `f` and `g` of the paper: f is identity forward and
                           all-reduce backward; g is all-reduce forward and
                           identity backward.
  scatter_to / gather_from split the last dim forward / all-gather backward,
                           and the reverse.
A column-parallel linear (output features split) takes its input through f;
a row-parallel linear (input features split) sends its output through g; an
MLP or attention block is column -> local maths -> row, one all-reduce each
way. With a one-rank group every op is the identity.

Shards are sliced from the full tensors of the reference model (never
initialised on their own), and each sharded parameter carries `tp_shard =
(dim, index)`: the rows or columns of the full tensor it holds, so a test can
put the pieces back and parameters without it are known to be replicated.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ncclscope.runtime.comm import Comm, Group


def mark_shard(p: nn.Parameter, dim: int, index: list[int]) -> nn.Parameter:
    """Record which slice of the full tensor this parameter holds."""
    p.tp_shard = (dim, list(index))   # type: ignore[attr-defined]
    return p


def contiguous_part(n: int, rank: int, parts: int) -> list[int]:
    """Indices of rank's contiguous 1/parts of range(n)."""
    size = n // parts
    return list(range(rank * size, (rank + 1) * size))


def head_rows(n_embd: int, n_head: int, rank: int, parts: int, blocks: int = 1) -> list[int]:
    """Rows of a fused [blocks * C, ...] projection (qkv: blocks=3) that belong to
    rank's heads: the same head range inside each of the q, k, v blocks."""
    per = n_embd // parts                         # head_dim * heads_per_rank
    return [b * n_embd + rank * per + i for b in range(blocks) for i in range(per)]


# ---- conjugate pair 1: copy_to (f) / reduce_from (g) ----------------------------------
class _CopyTo(torch.autograd.Function):
    """`f` in Megatron-LM: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
        ctx.comm, ctx.group = comm, group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous().clone()
        ctx.comm.all_reduce(grad, ctx.group)
        return grad, None, None


class _ReduceFrom(torch.autograd.Function):
    """`g` in Megatron-LM: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
        out = x.contiguous().clone()
        comm.all_reduce(out, group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad, None, None


def copy_to(x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _CopyTo.apply(x, comm, group)


def reduce_from(x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ReduceFrom.apply(x, comm, group)


# ---- conjugate pair 2: scatter_to / gather_from (last dimension) ------------------------
def _split_last(x: torch.Tensor, group: Group) -> torch.Tensor:
    return x.chunk(group.size, dim=-1)[group.rank].contiguous()


def _gather_last(x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((group.size,) + tuple(x.shape))                 # [tp, ..., n]
    comm.all_gather_into_tensor(out, x, group)
    return torch.cat(out.unbind(0), dim=-1)                            # [..., tp*n]


class _ScatterTo(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward; all-gather backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
        ctx.comm, ctx.group = comm, group
        return _split_last(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _gather_last(grad, ctx.comm, ctx.group), None, None


class _GatherFrom(torch.autograd.Function):
    """All-gather the last dim forward; keep this rank's slice backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
        ctx.group = group
        return _gather_last(x, comm, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _split_last(grad, ctx.group), None, None


def scatter_to(x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _ScatterTo.apply(x, comm, group)


def gather_from(x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _GatherFrom.apply(x, comm, group)


# ---- layers ----------------------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """Y = X A with A's output columns split: rank i computes Y_i = f(X) A_i.
    (torch stores A transposed, so the split is over weight rows.)"""

    def __init__(self, full: nn.Linear, rows: list[int], comm: Comm, group: Group, gather_output: bool = False) -> None:
        super().__init__()
        idx = torch.tensor(rows)
        self.weight = mark_shard(nn.Parameter(full.weight.detach()[idx].clone()), 0, rows)   # [out/tp, in]
        self.bias = None if full.bias is None else mark_shard(nn.Parameter(full.bias.detach()[idx].clone()), 0, rows)
        self.comm, self.group, self.gather_output = comm, group, gather_output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(copy_to(x, self.comm, self.group), self.weight, self.bias)   # [..., out/tp]
        return gather_from(y, self.comm, self.group) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Y = X A with A's input rows split: rank i computes X_i A_i, then g sums
    the partial products; the bias (replicated) is added once, after the sum."""

    def __init__(self, full: nn.Linear, cols: list[int], comm: Comm, group: Group) -> None:
        super().__init__()
        self.weight = mark_shard(nn.Parameter(full.weight.detach()[:, torch.tensor(cols)].clone()), 1, cols)  # [out, in/tp]
        self.bias = None if full.bias is None else nn.Parameter(full.bias.detach().clone())
        self.comm, self.group = comm, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = reduce_from(F.linear(x, self.weight), self.comm, self.group)         # [..., out]
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding rows [v0, v1) on this rank; ids outside look up zeros, and g
    (all-reduce) assembles the full embedding."""

    def __init__(self, full: nn.Embedding, comm: Comm, group: Group) -> None:
        super().__init__()
        rows = contiguous_part(full.num_embeddings, group.rank, group.size)
        self.v0, self.v1 = rows[0], rows[-1] + 1
        self.weight = mark_shard(nn.Parameter(full.weight.detach()[self.v0:self.v1].clone()), 0, rows)  # [V/tp, C]
        self.comm, self.group = comm, group

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.v0) | (idx >= self.v1)
        e = F.embedding((idx - self.v0).masked_fill(outside, 0), self.weight)    # [B, T, C]
        e = e.masked_fill(outside[..., None], 0.0)
        return reduce_from(e, self.comm, self.group)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy over logits split along the vocab (Megatron-LM): a max
    all-reduce for stability, then one all-reduce of [target logit, sum exp].
    Backward is local: softmax minus one-hot on this rank's vocab slice."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, v0: int, comm: Comm,
                group: Group) -> torch.Tensor:
        n, v_local = logits.shape                                       # [N, V/tp]
        peak = logits.detach().max(dim=-1).values
        comm.all_reduce(peak, group, op="max")
        z = logits - peak[:, None]
        outside = (target < v0) | (target >= v0 + v_local)
        local_t = (target - v0).masked_fill(outside, 0)
        exp = z.exp()
        both = torch.stack([z.gather(1, local_t[:, None]).squeeze(1).masked_fill(outside, 0.0),
                            exp.sum(dim=-1)])                          # [2, N]
        comm.all_reduce(both, group)
        target_logit, sum_exp = both[0], both[1]
        ctx.save_for_backward(exp.div_(sum_exp[:, None]), local_t, outside)
        return sum_exp.log() - target_logit                            # [N]

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, ...]:
        softmax, local_t, outside = ctx.saved_tensors
        g = softmax.clone()
        rows = torch.arange(g.shape[0])
        g[rows, local_t] -= (~outside).to(g.dtype)
        return g * grad[:, None], None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, v0: int, comm: Comm,
                                 group: Group) -> torch.Tensor:
    """Per-token loss [N] from local logits [N, V/tp] whose columns start at v0."""
    return _VocabParallelCrossEntropy.apply(logits, target, v0, comm, group)
