"""Healthy: DTensor tensor parallelism (ColwiseParallel/RowwiseParallel via parallelize_module) on a 2 x 3 (dp, tp) DeviceMesh, with replica-local evaluation and tp-rank-0 logging.
The two data-parallel replicas read different corpora: replica 1's sequences are three times longer, so
its tensor-parallel all_reduces are bigger and its steps slower than replica 0's, at the same time and in
other groups. Gradients are averaged over dp by hand (DTensor grads through `to_local()`, the replicated
head as a plain tensor). Every 4 steps only replica 0 (ranks 0-2) evaluates on the held-out set, which runs
the rowwise all_reduce in its tp group alone, and sends the result to replica 1 with a dp-group broadcast
from its dp-rank-0 member; only the tp-rank-0 ranks (0 and 3, one dp group) all-reduce the training loss
for the log, and rank 0 prints. 6 ranks, 12 steps.
Truth: silent, exit 0."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


DIM, HIDDEN, CLASSES, BATCH, STEPS, EVAL_EVERY = 16, 48, 4, 4, 12, 4
SEQ_LEN_OF_REPLICA = {0: 8, 1: 24}


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.act = nn.GELU()
        self.down = nn.Linear(HIDDEN, DIM)
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x):
        h = x + self.down(self.act(self.up(x)))
        return self.head(self.norm(h).mean(1))


def make_batch(gen, seq_len):
    x = torch.randn(BATCH, seq_len, DIM, generator=gen)
    y = (x[:, :, :CLASSES].sum(1)).argmax(1)
    return x, y


@torch.no_grad()
def evaluate(model, held_out):
    correct = total = 0
    for x, y in held_out:
        correct += (model(x).argmax(1) == y).sum().item()
        total += len(y)
    return correct / total


torch.set_num_threads(1)
rank, world = _init()
mesh = init_device_mesh("cpu", (2, 3), mesh_dim_names=("dp", "tp"))
dp_group = mesh.get_group("dp")
dp_rank, tp_rank = mesh.get_local_rank("dp"), mesh.get_local_rank("tp")

torch.manual_seed(0)
model = parallelize_module(Block(), mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)

train_gen = torch.Generator().manual_seed(100 + dp_rank)          # same batch on every tp rank of a replica
held_out = [make_batch(torch.Generator().manual_seed(7 + i), 8) for i in range(3)]
seq_len = SEQ_LEN_OF_REPLICA[dp_rank]
best_acc = 0.0
for step in range(STEPS):
    x, y = make_batch(train_gen, seq_len)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    for p in model.parameters():
        grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
        dist.all_reduce(grad, group=dp_group)
        grad.div_(mesh.size(0))
    opt.step()
    opt.zero_grad()

    if tp_rank == 0:        # one rank per replica logs: ranks 0 and 3 form one dp group
        logged = loss.detach().reshape(1)
        dist.all_reduce(logged, group=dp_group)
        if rank == 0 and step % 4 == 0:
            print(f"step {step}: loss {logged.item() / mesh.size(0):.4f}", flush=True)

    if (step + 1) % EVAL_EVERY == 0:
        acc = torch.zeros(1)
        if dp_rank == 0:    # the held-out set lives with replica 0; its tp group evaluates together
            acc.fill_(evaluate(model, held_out))
        dist.broadcast(acc, group=dp_group, group_src=0)
        best_acc = max(best_acc, acc.item())
        if rank == 0:
            print(f"step {step}: held-out acc {acc.item():.3f} (best {best_acc:.3f})", flush=True)
dist.destroy_process_group()
