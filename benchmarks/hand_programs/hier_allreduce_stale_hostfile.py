"""Hierarchical gradient all-reduce (reduce to the node leader, all-reduce among leaders, broadcast back) whose
node count comes from each node's hostfile.
Two "nodes" of two ranks ({0, 1} and {2, 3}); every rank creates the intra-node groups and the leaders'
group {0, 2}. The first 2 steps use a flat world all_reduce while the topology is probed; from step 2
on the gradients go through `hier_all_reduce`: `dist.reduce` to the node leader over the node group, an
all_reduce among the leaders, and a `dist.broadcast` back over the node group. A single-node run needs
no inter-node stage, so the leaders' all_reduce takes `topo.inter if topo.num_nodes > 1 else topo.intra`.
Node 1's copy of the hostfile is stale (it lists only its own host), so rank 2 (its leader) thinks the
job is single-node and all-reduces over its node group, where rank 3 is already in the broadcast, while
rank 0 waits for it in the leaders' group. 4 ranks.
Truth: rank 2 (wrong group), line: the leaders' `dist.all_reduce` / the `num_nodes` computation."""
import datetime
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


RANKS_PER_NODE, STEPS, PROBE_STEPS = 2, 6, 2
GROUP_TIMEOUT = datetime.timedelta(seconds=10)


@dataclass
class Topology:
    node: int
    leader: int
    num_nodes: int
    intra: object
    inter: object


def read_hostfile(node):
    hosts = ["trn-a01", "trn-a02"]
    return hosts[node:node + 1] if node == 1 else hosts    # node 1 kept the file of an old 1-node job


def build_topology(rank, world):
    node = rank // RANKS_PER_NODE
    intra_groups = [dist.new_group(list(range(n * RANKS_PER_NODE, (n + 1) * RANKS_PER_NODE)), timeout=GROUP_TIMEOUT)
                    for n in range(world // RANKS_PER_NODE)]
    inter = dist.new_group(list(range(0, world, RANKS_PER_NODE)), timeout=GROUP_TIMEOUT)
    num_nodes = len(read_hostfile(node))  # <ALT>
    return Topology(node, node * RANKS_PER_NODE, num_nodes, intra_groups[node], inter)


def hier_all_reduce(t, topo, rank):
    dist.reduce(t, dst=topo.leader, group=topo.intra)
    if rank == topo.leader:
        dist.all_reduce(t, group=topo.inter if topo.num_nodes > 1 else topo.intra)  # <BUG>
    dist.broadcast(t, src=topo.leader, group=topo.intra)
    return t


torch.set_num_threads(1)
rank, world = _init()
topo = build_topology(rank, world)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(12, 32), nn.Tanh(), nn.Linear(32, 3))
for p in model.parameters():
    dist.broadcast(p.data, src=0)
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
gen = torch.Generator().manual_seed(rank)
for step in range(STEPS):
    x = torch.randn(16, 12, generator=gen)
    y = torch.randint(0, 3, (16,), generator=gen)
    loss = nn.functional.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    if step < PROBE_STEPS:
        dist.all_reduce(flat)
    else:
        hier_all_reduce(flat, topo, rank)  # <ALT>
    flat /= world
    offset = 0
    for p in model.parameters():
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
        offset += p.numel()
    opt.step()
    logged = torch.tensor([loss.item()])
    dist.all_reduce(logged)
    if rank == 0:
        print(f"step {step} loss {logged.item() / world:.4f}", flush=True)
dist.destroy_process_group()
