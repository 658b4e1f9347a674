"""Generated SPMD program (randprog seed 20261214, #82): 2-d mesh [3, 2], 4 steps."""
import datetime
import os
import time

import torch
import torch.distributed as dist

torch.set_num_threads(1)


def share(t, group=None):
    out = torch.empty(t.numel() // dist.get_world_size(group), dtype=t.dtype)
    dist.reduce_scatter_tensor(out, t, group=group)
    return out

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=12))
rank = dist.get_rank()
nranks = dist.get_world_size()
torch.manual_seed(1234 + rank)
layout = {
    "row": [[0, 2, 4], [1, 3, 5]],
    "rep": [[0, 1], [2, 3], [4, 5]],
}
groups, all_groups = {}, {}
dim_order = ['row', 'rep']
if rank == 5:
    dim_order = dim_order[::-1]  # built in another order here
for dim in dim_order:
    for members in layout[dim]:
        g = dist.new_group(members)
        all_groups[(dim, tuple(members))] = g
        if rank in members:
            groups[dim] = g
row_group = groups["row"]
rep_group = groups["rep"]
row_size = dist.get_world_size(row_group)
row_rank = dist.get_rank(row_group)
rep_size = dist.get_world_size(rep_group)
rep_rank = dist.get_rank(rep_group)
layer = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
sgd = torch.optim.SGD(layer.parameters(), lr=0.01)
for epoch in range(4):
    state = torch.ones(rep_size * 100, dtype=torch.float32)
    state = share(state, rep_group)
    proj = torch.randn(8, 8) / 8
    emb = torch.randn(4, 8)
    for _ in range(24):
        emb = torch.tanh(emb @ proj)
    act = torch.full((16,), float(rank))
    act_in = torch.empty(16)
    ops = [dist.P2POp(dist.isend, act, (rank + 1) % nranks), dist.P2POp(dist.irecv, act_in, (rank - 1) % nranks)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    delta = torch.ones(rep_size * 256, dtype=torch.int64)
    delta = share(delta, group=rep_group)
    xb = torch.randn(2, 32)
    objective = layer(xb).pow(2).mean()
    objective.backward()
    for p in layer.parameters():
        dist.all_reduce(p.grad)
        p.grad /= nranks
    sgd.step()
    sgd.zero_grad()
    w = torch.randn(8, 8) / 8
    mom = torch.randn(1, 8)
    for _ in range(10):
        mom = torch.tanh(mom @ w)
    payload = torch.full((128,), float(rank))
    payload_in = torch.empty(128)
    peer = rank ^ 1
    if peer < nranks:
        send_first = rank % 2 == 0
        if send_first:
            dist.send(payload, peer)
            dist.recv(payload_in, peer)
        else:
            dist.recv(payload_in, peer)
            dist.send(payload, peer)
dist.destroy_process_group()
