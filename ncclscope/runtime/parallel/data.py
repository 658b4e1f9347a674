"""Data parallelism: gradient reduction over the replicas, ZeRO-1/2, and global
grad-norm clipping across every parallel dimension.

Maths: every replica computes the mean loss over its own slice of the global
batch; with equal slices, the mean of the replicas' gradients is the gradient
of the mean loss over the whole batch. So: all-reduce(SUM) / dp. Under CP a
replica's loss is already split into per-rank shares that add up, so dense
gradients are summed over the dp x cp group (`dp_cp`) and divided by dp only.
Expert gradients (EP) are summed over `edp`, the ranks holding the same
experts, and divided by dp too: an expert's gradient already sums the losses
of the ep ranks whose tokens it served.

Buckets (about `bucket_mb` each, parameters in reverse registration order, the
order backward produces them) turn many tiny collectives into a few larger
ones, as DistributedDataParallel does.

ZeRO (Rajbhandari et al., 2020) over the same groups, with one flat buffer per
parameter set split into equal contiguous shards (padded):
  stage 1  all-reduce the gradients; each rank runs AdamW on its shard only
           (optimizer state is 1/dp), then all-gather the updated shards;
  stage 2  reduce-scatter the gradients, so each rank only ever holds its
           shard of the reduced gradient; then the same step and all-gather.
AdamW is elementwise, so a sharded step equals the unsharded one exactly.
"""
from __future__ import annotations

import math

import torch

from ncclscope.runtime.comm import Comm, Group


class GradSync:
    """Bucketed all-reduce of gradients over `group`, divided by `divisor`
    (default: the group size, i.e. an average)."""

    def __init__(self, params: list[torch.nn.Parameter], comm: Comm, group: Group, bucket_mb: float = 1.0,
                 divisor: int | None = None) -> None:
        self.comm = comm
        self.group = group
        self.divisor = group.size if divisor is None else divisor
        self.buckets: list[list[torch.nn.Parameter]] = []
        limit = max(1, int(bucket_mb * 2**20))
        current: list[torch.nn.Parameter] = []
        size = 0
        for p in reversed([p for p in params if p.requires_grad]):
            current.append(p)
            size += p.numel() * p.element_size()
            if size >= limit:
                self.buckets.append(current)
                current, size = [], 0
        if current:
            self.buckets.append(current)

    def all_reduce(self, extras: torch.Tensor | None = None, keep_local: bool = False) -> torch.Tensor | None:
        """Reduce gradients over the group in place; return `extras` reduced too.

        `extras` (a few scalars such as the loss) ride in the first bucket, so
        reporting the global loss costs no collective of its own.

        keep_local=True is the `desync_grad` drill: the collective still runs
        (so peers do not hang) but this replica keeps its own unreduced
        gradient, and from then on its weights drift from the others'.
        """
        if self.group.size == 1 and self.divisor == 1:
            return extras
        n_extra = 0 if extras is None else extras.numel()
        reduced_extras = extras
        for i, bucket in enumerate(self.buckets):
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            parts = [g.reshape(-1) for g in grads]
            if i == 0 and extras is not None:
                parts.append(extras.reshape(-1).to(parts[0].dtype))
            flat = torch.cat(parts)                                   # [sum numel (+ extras)]
            self.comm.all_reduce(flat, self.group)
            flat.div_(self.divisor)
            if i == 0 and extras is not None:
                reduced_extras = flat[flat.numel() - n_extra:].clone()
            if keep_local:
                continue
            offset = 0
            for p, g in zip(bucket, grads):
                n = g.numel()
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.copy_(flat[offset:offset + n].view_as(p))
                offset += n
        return reduced_extras


class ZeroShard:
    """ZeRO stage 1 or 2 for one parameter set reduced over one group."""

    def __init__(self, params: list[torch.nn.Parameter], comm: Comm, group: Group, stage: int, divisor: int,
                 lr: float) -> None:
        self.params, self.comm, self.group, self.stage, self.divisor = params, comm, group, stage, divisor
        self.total = sum(p.numel() for p in params)
        self.shard = -(-self.total // group.size)                      # ceil: the last shard is padded
        self.lo = group.rank * self.shard                               # my range of the flat buffer
        flat = self._flat([p.detach() for p in params])
        self.master = torch.nn.Parameter(flat[self.lo:self.lo + self.shard].clone())
        self.opt = torch.optim.AdamW([self.master], lr=lr, weight_decay=0.0)
        self.grad_shard = torch.zeros_like(self.master.detach())

    def _flat(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        flat = torch.cat([t.reshape(-1) for t in tensors])             # [total]
        return torch.nn.functional.pad(flat, (0, self.shard * self.group.size - self.total))   # [dp * shard]

    def reduce(self, extras: torch.Tensor | None, keep_local: bool = False) -> torch.Tensor | None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        flat = self._flat(grads)
        n_extra = 0 if extras is None else extras.numel()
        ex = torch.zeros(0, dtype=flat.dtype) if extras is None else extras.reshape(-1).to(flat.dtype)
        local = flat[self.lo:self.lo + self.shard].clone()
        if self.stage == 1:
            buf = torch.cat([flat, ex])                                  # [dp * shard + extras]
            self.comm.all_reduce(buf, self.group)
            buf.div_(self.divisor)
            shard, reduced_ex = buf[self.lo:self.lo + self.shard], buf[buf.numel() - n_extra:]
            if not keep_local:
                offset = 0
                for p in self.params:
                    if p.grad is None:
                        p.grad = torch.zeros_like(p)
                    p.grad.copy_(buf[offset:offset + p.numel()].view_as(p))
                    offset += p.numel()
        else:
            # each rank's segment carries the extras, so every rank receives their sum
            buf = torch.cat([flat.view(self.group.size, self.shard), ex.expand(self.group.size, n_extra)], dim=1)
            out = torch.empty(self.shard + n_extra, dtype=flat.dtype)  # [shard + extras]
            self.comm.reduce_scatter_tensor(out, buf.reshape(-1), self.group)
            out.div_(self.divisor)
            shard, reduced_ex = out[:self.shard], out[self.shard:]
            for p in self.params:                                      # sharded gradients: the full ones go
                p.grad = None
        self.grad_shard = local if keep_local else shard.clone()
        return None if extras is None else reduced_ex.clone()

    def step(self, scale: float) -> None:
        """AdamW on my shard, then all-gather the updated parameters."""
        self.master.grad = self.grad_shard * scale
        self.opt.step()
        full = torch.empty(self.shard * self.group.size, dtype=self.master.dtype)
        self.comm.all_gather_into_tensor(full, self.master.detach(), self.group)
        offset = 0
        with torch.no_grad():
            for p in self.params:
                p.copy_(full[offset:offset + p.numel()].view_as(p))
                offset += p.numel()

    def grad_piece(self, index: int) -> tuple[torch.Tensor, int, int] | None:
        """The part of parameter `index`'s reduced gradient (flattened) that this
        rank holds: (values, start, stop), or None when its shard misses it."""
        start = sum(p.numel() for p in self.params[:index])
        lo, hi = max(self.lo, start), min(self.lo + self.shard, start + self.params[index].numel())
        if lo >= hi:
            return None
        return self.grad_shard[lo - self.lo:hi - self.lo], lo - start, hi - start


class ParamSet:
    """Parameters reduced together over one group: dense ones over dp (or dp x
    cp), expert ones over edp. `counted[i]` is False for a parameter whose
    identical copy another tp rank counts in the global norm."""

    def __init__(self, params: list[torch.nn.Parameter], counted: list[bool], comm: Comm, group: Group,
                 zero: int, divisor: int, lr: float, bucket_mb: float) -> None:
        self.params, self.counted, self.group = params, counted, group
        self.zero: ZeroShard | None = None
        if zero and params:
            self.zero = ZeroShard(params, comm, group, zero, divisor, lr)
            weight = [torch.full((p.numel(),), float(c), dtype=p.dtype) for p, c in zip(params, counted)]
            self.weight = self.zero._flat(weight)[self.zero.lo:self.zero.lo + self.zero.shard]
        else:
            self.sync = GradSync(params, comm, group, bucket_mb, divisor)
            self.opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0) if params else None

    def reduce(self, extras: torch.Tensor | None, keep_local: bool) -> torch.Tensor | None:
        if self.zero is not None:
            return self.zero.reduce(extras, keep_local)
        return self.sync.all_reduce(extras, keep_local)

    def norm_sq(self) -> float:
        """Sum of squares of the gradient this rank holds and counts."""
        if self.zero is not None:
            return float((self.zero.grad_shard.double().pow(2) * self.weight.double()).sum())
        return sum(float(p.grad.double().pow(2).sum()) for p, c in zip(self.params, self.counted)
                   if c and p.grad is not None)

    def step(self, scale: float) -> None:
        if self.zero is not None:
            self.zero.step(scale)
        elif self.opt is not None:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(scale)
            self.opt.step()


class DataParallel:
    """Gradient reduction, global-norm clipping and the optimizer step for a
    rank's parameters: `dense` over `dense_group`, `expert` over `expert_group`.

    The global norm is the norm of the whole model's gradient. Each rank adds
    up the squares of what it uniquely holds (its tp shards; replicated
    parameters on tp rank 0 only; under ZeRO only its gradient shard), then
    the sums are all-reduced: over the ZeRO group when sharded, over ep for the
    experts, then over tp and pp. Every rank gets the same number and clips
    its shards by the same factor, which is what clipping the full gradient does.
    """

    def __init__(self, dense: ParamSet, expert: ParamSet | None, comm: Comm, tp: Group, pp: Group,
                 ep: Group) -> None:
        self.dense, self.expert, self.comm, self.tp, self.pp, self.ep = dense, expert, comm, tp, pp, ep

    def reduce(self, extras: torch.Tensor | None = None, keep_local: bool = False) -> torch.Tensor | None:
        reduced = self.dense.reduce(extras, keep_local)
        if self.expert is not None:
            self.expert.reduce(None, keep_local)
        return reduced

    def global_norm(self) -> float:
        dense = torch.tensor([self.dense.norm_sq()], dtype=torch.float64)
        if self.dense.zero is not None:
            self.comm.all_reduce(dense, self.dense.group)
        total = dense
        if self.expert is not None:
            expert = torch.tensor([self.expert.norm_sq()], dtype=torch.float64)
            if self.expert.zero is not None:
                self.comm.all_reduce(expert, self.expert.group)
            self.comm.all_reduce(expert, self.ep)
            total = dense + expert
        self.comm.all_reduce(total, self.tp)
        self.comm.all_reduce(total, self.pp)
        return math.sqrt(float(total[0]))

    def step(self, global_norm: float, max_norm: float) -> None:
        """Clip by the global norm (as model.clip_ does) and step."""
        scale = 1.0
        if max_norm > 0 and math.isfinite(global_norm) and global_norm > max_norm:
            scale = max_norm / (global_norm + 1e-6)
        self.dense.step(scale)
        if self.expert is not None:
            self.expert.step(scale)
