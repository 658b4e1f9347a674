"""Pairwise gossip averaging (decentralised SGD) after a resume, with blocking send/recv between partners.
Ranks 0-1 and 2-3 are gossip partners; after each local SGD step a rank swaps its flat parameters with
its partner and averages them. To avoid a deadlock one side sends first, and to spread the link load
the side alternates with the parity of `rank + step`. The step comes from each rank's own newest
complete checkpoint shard: the crash tore rank 3's step-40 shard, so it resumes from its step-35 shard
(checkpoints every 5 steps) while rank 2 resumes at 40, and the odd difference flips rank 3's parity:
at the first step both ranks of the pair send first (gloo does not buffer sends) and wait for each
other forever; ranks 0 and 1 wait for them in the loss all_reduce. 4 ranks.
Truth: rank 3 (swapped send/recv order; partner rank 2), line: the `send_first` parity."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


CKPT_EVERY = 5
# the step of each rank's newest complete checkpoint shard (what `latest_complete_shard()` finds on disk)
SHARD_STEPS = {0: [30, 35, 40], 1: [30, 35, 40], 2: [30, 35, 40], 3: [30, 35]}


def latest_complete_shard(rank):
    return max(SHARD_STEPS[rank])


def swap_with_partner(flat, partner, send_first):
    theirs = torch.empty_like(flat)
    if send_first:
        dist.send(flat, partner)  # <ALT>
        dist.recv(theirs, partner)
    else:
        dist.recv(theirs, partner)
        dist.send(flat, partner)
    return theirs


torch.set_num_threads(1)
rank, world = _init()
partner = rank ^ 1
start = latest_complete_shard(rank)  # <ALT>
torch.manual_seed(start)
model = nn.Sequential(nn.Linear(10, 16), nn.Tanh(), nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
gen = torch.Generator().manual_seed(100 * rank + start)
w_true = torch.linspace(-1, 1, 10)
for step in range(start, start + 12):
    x = torch.randn(16, 10, generator=gen)
    y = (x @ w_true).unsqueeze(1) + 0.1 * torch.randn(16, 1, generator=gen)
    loss = nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    flat = nn.utils.parameters_to_vector(model.parameters()).detach()
    send_first = (rank + step) % 2 == 0  # <BUG>
    theirs = swap_with_partner(flat, partner, send_first)  # <ALT>
    nn.utils.vector_to_parameters(0.5 * (flat + theirs), model.parameters())
    report = loss.detach().reshape(1)
    dist.all_reduce(report)
    if rank == 0 and step % CKPT_EVERY == 0:
        print(f"step {step} mean loss {report.item() / world:.4f}", flush=True)
dist.destroy_process_group()
