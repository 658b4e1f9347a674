"""Tensor parallel x data parallel with global-norm clipping, where the metrics rank's copy of the clip call drops its group and reduces over the world.
A hand-written Megatron-style MLP on a 3 x 2 (dp, tp) grid: a replicated LayerNorm, a column-parallel fc1
and a row-parallel fc2 (all_reduce over tp in forward, in the input's backward), a replicated bias and
head. After the backward every gradient is averaged over the data-parallel group, then
`clip_grad_norm_` sums the squares of the tensor-parallel shards over the group it is given (the
replicated parameters are counted once) and scales the gradients. On log steps the metrics writer
(dp 0, tp 0) wants the pre-clip norm for its metrics line, so the loop calls the helper in a branch of
its own to keep the return value; that copy of the call was written without `group=`, so the helper
falls back to the default (world) group: at step 4 rank 0 all-reduces its norm over all 6 ranks while
its tensor-parallel partner waits for it in the tp group. 6 ranks, 12 steps.
Truth: rank 0 (wrong group: world instead of its tp group), line: the `clip_grad_norm_(params, MAX_NORM)` call in the metrics branch."""
import datetime
import math
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


TP, DIM, HIDDEN, CLASSES = 2, 16, 64, 5
BATCH, STEPS, LR, MAX_NORM, LOG_EVERY = 8, 12, 0.05, 1.0, 5


class CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


class TPMLP(nn.Module):
    def __init__(self, tp_rank, tp_group):
        super().__init__()
        self.tp_group = tp_group
        torch.manual_seed(0)
        full_fc1, full_fc2 = nn.Linear(DIM, HIDDEN), nn.Linear(HIDDEN, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN // TP)
        self.fc2 = nn.Linear(HIDDEN // TP, DIM, bias=False)
        self.fc2_bias = nn.Parameter(full_fc2.bias.detach().clone())
        self.head = nn.Linear(DIM, CLASSES)
        cols = slice(tp_rank * HIDDEN // TP, (tp_rank + 1) * HIDDEN // TP)
        with torch.no_grad():
            self.fc1.weight.copy_(full_fc1.weight[cols])
            self.fc1.bias.copy_(full_fc1.bias[cols])
            self.fc2.weight.copy_(full_fc2.weight[:, cols])
        for p in (self.fc1.weight, self.fc1.bias, self.fc2.weight):
            p.tp_sharded = True

    def forward(self, x):
        h = CopyToTP.apply(self.norm(x), self.tp_group)
        h = F.gelu(self.fc1(h))
        h = ReduceFromTP.apply(self.fc2(h), self.tp_group) + self.fc2_bias
        return self.head(x + h)


def clip_grad_norm_(params, max_norm, group=None):
    """Clip by the global 2-norm of a tensor-parallel model. The squares of the sharded gradients are
    summed over `group`, the group they are sharded over (None: the default group); the replicated
    gradients are the same on every tensor-parallel rank, so they are counted once."""
    sharded = torch.zeros(1)
    replicated = torch.zeros(1)
    for p in params:
        if getattr(p, "tp_sharded", False):
            sharded += p.grad.square().sum()
        else:
            replicated += p.grad.square().sum()
    dist.all_reduce(sharded, group=group)
    total = (sharded + replicated).sqrt()
    coef = (max_norm / (total + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.mul_(coef)
    return total.item()


torch.set_num_threads(1)
rank, world = _init()
dp = world // TP
dp_rank, tp_rank = rank // TP, rank % TP
tp_groups = [dist.new_group(list(range(d * TP, (d + 1) * TP)), timeout=datetime.timedelta(seconds=10))
             for d in range(dp)]
dp_groups = [dist.new_group(list(range(t, world, TP)), timeout=datetime.timedelta(seconds=10))
             for t in range(TP)]
tp_group, dp_group = tp_groups[dp_rank], dp_groups[tp_rank]
is_metrics_writer = dp_rank == 0 and tp_rank == 0

model = TPMLP(tp_rank, tp_group)
params = list(model.parameters())
opt = torch.optim.SGD(params, lr=LR, momentum=0.9)
gen = torch.Generator().manual_seed(500 + dp_rank)       # the tp ranks of a replica read the same batch
proto = torch.randn(CLASSES, DIM, generator=torch.Generator().manual_seed(7))

for step in range(STEPS):
    y = torch.randint(0, CLASSES, (BATCH,), generator=gen)
    x = proto[y] + 0.8 * torch.randn(BATCH, DIM, generator=gen)
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    for p in params:
        dist.all_reduce(p.grad, group=dp_group)
        p.grad.div_(dp)
    if is_metrics_writer and (step + 1) % LOG_EVERY == 0:  # <ALT>
        gnorm = clip_grad_norm_(params, MAX_NORM)  # <BUG>
        print(f"step {step}: loss {loss.item():.4f} grad-norm {gnorm:.4f}", flush=True)
    else:
        clip_grad_norm_(params, MAX_NORM, group=tp_group)
    opt.step()
    stats = torch.stack([loss.detach(), torch.tensor(float(BATCH))])
    dist.all_reduce(stats)
    if rank == 0 and step % 3 == 0:
        print(f"step {step}: mean loss over the replicas {stats[0] / world:.4f}", flush=True)
dist.destroy_process_group()
