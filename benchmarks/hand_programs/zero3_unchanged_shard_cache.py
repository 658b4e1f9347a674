"""Hand-written ZeRO-3 whose gather cache trusts the local shard: a unit skips its all-gather when its own shard did not change.
Each unit (embedding, fc1, fc2, head) keeps its parameters as one flat buffer padded to a multiple of
world * ALIGN and holds only its shard; before the forward every unit all-gathers its full parameters
(`all_gather_into_tensor`), after the backward the full gradients are reduce-scattered
(`reduce_scatter_tensor`) and each rank steps its own shard with SGD. To save the gathers of frozen or
idle units, a unit keeps its gathered buffer and reuses it when its shard's version did not move since
the last gather, and the version only moves when the optimizer changes the shard ("nothing to update"
when the gradient shard is all zero). The 4-class head has 16 * 4 + 4 = 68 parameters, padded to 96:
rank 3's 24-element shard is pure padding, its gradient shard is always zero, so after step 0 its
version never moves and at step 1 it reuses its stale head and posts no all_gather_into_tensor for it
while ranks 0-2 do. 4 ranks, 8 steps.
Truth: rank 3 (skipped all_gather_into_tensor), line: the early `return self.full` in `Unit.gather()`."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


VOCAB, DIM, HIDDEN, CLASSES, ALIGN = 64, 16, 32, 4, 8
SEQ, BATCH, STEPS, LR = 10, 8, 8, 0.5


class Unit:
    """One ZeRO-3 unit: a flat, padded parameter buffer of which this rank holds one shard."""

    def __init__(self, name, module, rank, world):
        self.name = name
        self.shapes = [p.shape for p in module.parameters()]
        flat = torch.cat([p.detach().flatten() for p in module.parameters()])
        self.numel = flat.numel()
        multiple = world * ALIGN
        self.padded = (self.numel + multiple - 1) // multiple * multiple
        flat = torch.cat([flat, flat.new_zeros(self.padded - self.numel)])
        self.shard = flat.chunk(world)[rank].clone()
        self.version = 0               # bumped each time the optimizer changes this rank's shard
        self.gathered_version = -1
        self.full = None

    def gather(self):
        if self.full is not None and self.gathered_version == self.version:  # <ALT>
            return self.full  # <BUG>
        full = torch.empty(self.padded)
        dist.all_gather_into_tensor(full, self.shard)  # <ALT>
        self.full = full.requires_grad_()
        self.gathered_version = self.version
        return self.full

    def views(self, full):
        out, off = [], 0
        for shape in self.shapes:
            n = shape.numel()
            out.append(full[off:off + n].view(shape))
            off += n
        return out

    def reduce_and_step(self, world):
        grad = self.full.grad if self.full.grad is not None else torch.zeros(self.padded)
        grad_shard = torch.empty_like(self.shard)
        dist.reduce_scatter_tensor(grad_shard, grad.contiguous())
        grad_shard /= world
        self.full.grad = None
        if grad_shard.any():           # nothing to update otherwise
            self.shard -= LR * grad_shard
            self.version += 1


def forward(units, tokens):
    emb, = units["embed"].views(units["embed"].gather())
    w1, b1 = units["fc1"].views(units["fc1"].gather())
    w2, b2 = units["fc2"].views(units["fc2"].gather())
    wh, bh = units["head"].views(units["head"].gather())  # <ALT>
    h = F.embedding(tokens, emb).mean(1)
    h = F.gelu(F.linear(h, w1, b1))
    h = F.gelu(F.linear(h, w2, b2))
    return F.linear(h, wh, bh)


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
modules = {"embed": nn.Embedding(VOCAB, DIM), "fc1": nn.Linear(DIM, HIDDEN),
           "fc2": nn.Linear(HIDDEN, DIM), "head": nn.Linear(DIM, CLASSES)}
units = {name: Unit(name, m, rank, world) for name, m in modules.items()}
del modules
if rank == 0:
    print({n: (u.numel, u.padded) for n, u in units.items()}, flush=True)

gen = torch.Generator().manual_seed(1000 + rank)
for step in range(STEPS):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = (tokens[:, 0] % CLASSES)
    logits = forward(units, tokens)  # <ALT>
    loss = F.cross_entropy(logits, labels)
    loss.backward()
    for name in reversed(list(units)):
        units[name].reduce_and_step(world)
    stats = torch.stack([loss.detach(), torch.tensor(1.0)])
    dist.all_reduce(stats)
    if rank == 0:
        print(f"step {step}: loss {stats[0] / stats[1]:.4f}", flush=True)
dist.destroy_process_group()
