"""Pairwise exchange of boundary activations between partner ranks (0-1, 2-3, 4-5) with blocking
send/recv; to avoid a deadlock one rank of each pair receives first, chosen by the parity of the
node-local rank. With 3 ranks per node, pair 2-3 spans the node boundary: rank 2 (local 2) and rank 3
(local 0) are both even, both receive first, and wait for each other forever. 6 ranks, 2 nodes of 3.
Truth: rank 3 (swapped order: its local parity disagrees with its place in the pair), line: the parity."""
import datetime
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


RANKS_PER_NODE = 3


def exchange(boundary, partner, recv_first):
    halo = torch.empty_like(boundary)
    if recv_first:
        dist.recv(halo, partner)  # <ALT>
        dist.send(boundary, partner)
    else:
        dist.send(boundary, partner)
        dist.recv(halo, partner)
    return halo


torch.set_num_threads(1)
rank, world = _init()
local_rank = rank % RANKS_PER_NODE  # what LOCAL_RANK says on a 2-node job
partner = rank ^ 1
recv_first = local_rank % 2 == 0  # <BUG>
field = torch.randn(32, 16)
for step in range(5):
    halo = exchange(field[-1].contiguous(), partner, recv_first)  # <ALT>
    field = 0.5 * field + 0.5 * torch.cat([field[1:], halo.unsqueeze(0)])
    residual = field.square().mean().reshape(1)
    dist.all_reduce(residual)
dist.destroy_process_group()
