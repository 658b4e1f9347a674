"""Healthy: hand-rolled data parallelism that overlaps communication with the backward pass through post-
accumulate-grad hooks, with tied weights and a frozen table.
A tiny language model (token embedding tied to the output projection, a frozen positional table, a
two-layer MLP block) registers `register_post_accumulate_grad_hook` on every trainable parameter: the
hook launches `dist.all_reduce(p.grad, async_op=True)` as soon as that gradient is final and chains a
division by the world size on its future (`get_future().then(...)`). The tied weight gets one hook call
per backward, after both its uses have accumulated. The trainer waits on all the futures before the
optimizer step. The logged loss of step t is all-reduced asynchronously and waited on only after step
t+1's forward, and every 3 steps a validation batch is scored while a gradient-norm all_reduce (MAX) is in
flight. 4 ranks, 9 steps. Truth: silent, exit 0."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


VOCAB, DIM, SEQ, BATCH, STEPS = 64, 16, 12, 8, 9


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.pos.weight.requires_grad_(False)
        self.block = nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        self.out.weight = self.tok.weight

    def forward(self, ids):
        h = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        return self.out(h + self.block(h))


class OverlappedAllReduce:
    def __init__(self, model, world):
        self.world, self.futures = world, []
        seen = set()
        for p in model.parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                p.register_post_accumulate_grad_hook(self._hook)

    def _hook(self, p):
        work = dist.all_reduce(p.grad, async_op=True)
        self.futures.append(work.get_future().then(lambda fut: fut.value()[0].div_(self.world)))

    def wait(self):
        for fut in self.futures:
            fut.wait()
        n = len(self.futures)
        self.futures = []
        return n


def batch(gen):
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
    ids[:, 1::2] = (ids[:, 0:-1:2] * 3 + 1) % VOCAB   # a learnable pattern on every other token
    return ids[:, :-1], ids[:, 1:]


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
model = TinyLM()
syncer = OverlappedAllReduce(model, world)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
gen = torch.Generator().manual_seed(rank)
val_gen = torch.Generator().manual_seed(999)
pending = None
for step in range(STEPS):
    x, y = batch(gen)
    loss = nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
    if pending is not None:
        work, logged, prev = pending
        work.wait()
        if rank == 0:
            print(f"step {prev} loss {logged.item() / world:.4f}", flush=True)
    opt.zero_grad()
    loss.backward()
    n_reduced = syncer.wait()
    assert n_reduced == 7, n_reduced       # tok (tied with out), norm w/b, fc1 w/b, fc2 w/b
    opt.step()
    logged = torch.tensor([loss.item()])
    pending = (dist.all_reduce(logged, async_op=True), logged, step)
    if step % 3 == 2:
        gnorm = torch.tensor([max(p.grad.norm().item() for p in model.parameters() if p.grad is not None)])
        norm_work = dist.all_reduce(gnorm, op=dist.ReduceOp.MAX, async_op=True)
        with torch.no_grad():
            vx, vy = batch(val_gen)
            val = nn.functional.cross_entropy(model(vx).reshape(-1, VOCAB), vy.reshape(-1))
        norm_work.wait()
        if rank == 0:
            print(f"step {step} val {val.item():.4f} max grad norm {gnorm.item():.4f}", flush=True)
pending[0].wait()
dist.barrier()
dist.destroy_process_group()
