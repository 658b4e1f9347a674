"""Healthy: two data-parallel replicas of a hand-written 3-stage GPipe pipeline that accumulate over different numbers of micro-batches.
Ranks 0-2 and 3-5 are the two pipelines (stage = rank % 3); the ranks of one stage ({0, 3}, {1, 4},
{2, 5}) are its data-parallel group. Each replica reads its own corpus, whose loader packs micro-batches
of a different size (replica 0: 4 samples, replica 1: 8), so to cover its 16 samples a step replica 0
runs 4 micro-batches and replica 1 runs 2: replica 0 posts twice as many sends and receives. The stage-0
rank of each pipeline broadcasts the step's plan [micro-batches, micro size] over its pipeline group
(roots 0 and 3), sends activations to stage 1 and the labels straight to the last stage with
isend/irecv; after all forwards the gradients flow back micro-batch by micro-batch. Losses are summed
over samples and divided by the global batch, so the gradients are summed (not averaged) over each
stage's data-parallel group. Only the last stages all-reduce the loss for the log, and only rank 2
prints. 6 ranks, 10 steps.
Truth: silent, exit 0."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


STAGES, DIM, CLASSES, SAMPLES_PER_REPLICA, STEPS = 3, 24, 4, 16, 10
MICRO_SIZE = {0: 4, 1: 8}                   # what each replica's loader packs


def build_stage(stage):
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh()),
              nn.Sequential(nn.Linear(DIM, DIM), nn.Tanh(), nn.Linear(DIM, DIM), nn.Tanh()),
              nn.Linear(DIM, CLASSES)]
    return stages[stage]


def loader(replica):
    g = torch.Generator().manual_seed(40 + replica)
    w = torch.randn(DIM, CLASSES, generator=torch.Generator().manual_seed(2))
    while True:
        x = torch.randn(MICRO_SIZE[replica], DIM, generator=g)
        yield x, (x @ w).argmax(-1)


torch.set_num_threads(1)
rank, world = _init()
n_replicas = world // STAGES
replica, stage = rank // STAGES, rank % STAGES
first, last = replica * STAGES, replica * STAGES + STAGES - 1
pipe_groups = [dist.new_group(list(range(r * STAGES, (r + 1) * STAGES)), timeout=datetime.timedelta(seconds=10))
               for r in range(n_replicas)]
dp_groups = [dist.new_group(list(range(s, world, STAGES)), timeout=datetime.timedelta(seconds=10))
             for s in range(STAGES)]
pipe_group, dp_group = pipe_groups[replica], dp_groups[stage]
module = build_stage(stage)
opt = torch.optim.SGD(module.parameters(), lr=0.2, momentum=0.9)
data = loader(replica) if stage == 0 else None
global_batch = SAMPLES_PER_REPLICA * n_replicas

for step in range(STEPS):
    plan = torch.zeros(2, dtype=torch.long)
    if stage == 0:
        size = MICRO_SIZE[replica]
        plan = torch.tensor([SAMPLES_PER_REPLICA // size, size])
    dist.broadcast(plan, src=first, group=pipe_group)
    n_micro, size = plan.tolist()

    inputs, outputs, losses, sends = [], [], [], []
    for m in range(n_micro):
        if stage == 0:
            x, y = next(data)
            sends.append(dist.isend(y, dst=last))
        else:
            x = torch.empty(size, DIM)
            dist.irecv(x, src=rank - 1).wait()
            x.requires_grad_()
        out = module(x)
        inputs.append(x)
        if stage < STAGES - 1:
            outputs.append(out)
            sends.append(dist.isend(out.detach(), dst=rank + 1))
        else:
            y = torch.empty(size, dtype=torch.long)
            dist.irecv(y, src=first).wait()
            losses.append(F.cross_entropy(out, y, reduction="sum") / global_batch)
    for req in sends:
        req.wait()

    opt.zero_grad()
    sends = []
    for m in reversed(range(n_micro)):
        if stage == STAGES - 1:
            losses[m].backward()
        else:
            g = torch.empty(size, DIM)
            dist.irecv(g, src=rank + 1).wait()
            outputs[m].backward(g)
        if stage > 0:
            sends.append(dist.isend(inputs[m].grad, dst=rank - 1))
    for req in sends:
        req.wait()

    for p in module.parameters():
        dist.all_reduce(p.grad, group=dp_group)
    opt.step()

    if stage == STAGES - 1:
        total = torch.stack(losses).sum().detach().reshape(1)
        dist.all_reduce(total, group=dp_group)
        if rank == last and replica == 0:
            print(f"step {step}: global loss {total.item():.4f} "
                  f"(replica 0 ran {n_micro} micro-batches)", flush=True)
dist.destroy_process_group()
