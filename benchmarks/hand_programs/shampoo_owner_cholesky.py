"""A distributed Shampoo-style preconditioner whose owner rank raises a LinAlgError in `torch.linalg.cholesky`
for a head that has not seen its task yet.
A multi-task regressor (shared trunk, a "price" head and a "count" head) averages its gradients with one
flat all_reduce; each 2-D weight is then preconditioned by its owner rank (blocks are assigned greedily by
cost, so rank 2 owns the count head) with the inverse of its accumulated right factor `G^T G` plus a
damping relative to the factor's trace, and the owner broadcasts the preconditioned gradient to the
others. The inverse is recomputed every 2 steps from step 2 on. The count task joins the curriculum only
at step 6, so at step 2 the count head's gradients have always been zero: its factor is all zero, the
relative damping is zero too, and `torch.linalg.cholesky` raises on rank 2 while ranks 0, 1, 3 wait for
it in the first block's broadcast. 4 ranks.
Truth: rank 2 (exception), line: the `torch.linalg.cholesky` call / the `refresh_inverses` call."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


DIM, HIDDEN, STEPS, BATCH = 8, 16, 10, 24
START_PRECOND, REFRESH_EVERY, REL_DAMPING, COUNT_TASK_FROM = 2, 2, 1e-4, 6


class MultiTask(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(DIM, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU())
        self.heads = nn.ModuleDict({"price": nn.Linear(HIDDEN, 1), "count": nn.Linear(HIDDEN, 1)})

    def forward(self, x):
        h = self.trunk(x)
        return {name: head(h).squeeze(1) for name, head in self.heads.items()}


def assign_owners(blocks, world):
    load, owner = [0] * world, {}
    for name, p in sorted(blocks.items(), key=lambda kv: -kv[1].shape[1] ** 3):
        r = min(range(world), key=lambda i: load[i])
        owner[name] = r
        load[r] += p.shape[1] ** 3
    return owner


def inverse_factor(factor):
    damping = REL_DAMPING * factor.trace() / factor.shape[0]
    chol = torch.linalg.cholesky(factor + damping * torch.eye(factor.shape[0]))  # <BUG>
    return torch.cholesky_inverse(chol)


def refresh_inverses(factors, inverses, mine):
    for name in mine:
        inverses[name] = inverse_factor(factors[name])  # <ALT>


def batch(gen, step):
    x = torch.randn(BATCH, DIM, generator=gen)
    task = (torch.rand(BATCH, generator=gen) < 0.3).long() if step >= COUNT_TASK_FROM else torch.zeros(BATCH).long()
    y = torch.where(task == 0, x[:, :2].sum(1), x[:, 2:4].abs().sum(1).round())
    return x, task, y


def multitask_loss(out, task, y):
    total = 0.0
    for t, name in enumerate(("price", "count")):
        m = (task == t).float()
        total = total + ((out[name] - y) ** 2 * m).sum() / m.sum().clamp_min(1.0)
    return total


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
model = MultiTask()
params = list(model.parameters())
blocks = {n: p for n, p in model.named_parameters() if p.dim() == 2}
owner = assign_owners(blocks, world)
mine = [n for n in blocks if owner[n] == rank]
factors = {n: torch.zeros(blocks[n].shape[1], blocks[n].shape[1]) for n in mine}
inverses = {}
opt = torch.optim.SGD(params, lr=0.05)
gen = torch.Generator().manual_seed(10 + rank)
for step in range(STEPS):
    x, task, y = batch(gen, step)
    loss = multitask_loss(model(x), task, y)
    opt.zero_grad()
    loss.backward()
    flat = torch.cat([p.grad.flatten() for p in params])
    dist.all_reduce(flat)
    flat /= world
    for p, g in zip(params, flat.split([p.numel() for p in params])):
        p.grad.copy_(g.view_as(p))
    for n in mine:
        factors[n] += blocks[n].grad.t() @ blocks[n].grad
    if step >= START_PRECOND and (step - START_PRECOND) % REFRESH_EVERY == 0:
        refresh_inverses(factors, inverses, mine)  # <ALT>
    if step >= START_PRECOND:
        for n, p in blocks.items():
            if owner[n] == rank:
                pg = p.grad @ inverses[n]
                p.grad.copy_(pg * (p.grad.norm() / pg.norm().clamp_min(1e-12)))   # graft the SGD norm
            dist.broadcast(p.grad, src=owner[n])
    opt.step()
    if step % 3 == 2:
        logged = torch.tensor([loss.item()])
        dist.all_reduce(logged)
        if rank == 0:
            print(f"step {step} loss {logged.item() / world:.4f}", flush=True)
dist.destroy_process_group()
