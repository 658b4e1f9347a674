"""Data parallelism: bucketed gradient all-reduce over the dp group.

Maths: every replica computes the mean loss over its own slice of the global
batch; with equal slices, the mean of the replicas' gradients is the gradient
of the mean loss over the whole batch. So: all-reduce(SUM) / dp.

Buckets (about `bucket_mb` each, parameters in reverse registration order, the
order backward produces them) turn many tiny collectives into a few larger
ones, as DistributedDataParallel does.
"""
from __future__ import annotations

import torch

from ..comm import Comm, Group


class GradSync:
    def __init__(self, params: list[torch.nn.Parameter], comm: Comm, group: Group, bucket_mb: float = 1.0) -> None:
        self.comm = comm
        self.group = group
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
        """Average gradients over the dp group in place; return `extras` averaged too.

        `extras` (a few scalars such as the loss) ride in the first bucket, so
        reporting the global loss costs no collective of its own.

        keep_local=True is the `desync_grad` drill: the collective still runs
        (so peers do not hang) but this replica keeps its own unreduced
        gradient, and from then on its weights drift from the others'.
        """
        if self.group.size == 1:
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
            flat.div_(self.group.size)
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
