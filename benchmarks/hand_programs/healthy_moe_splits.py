"""Healthy: an MoE token exchange with random routing, so the split sizes differ per rank and change
every step: each rank first all_to_all_singles its per-destination counts, then the tokens with those
splits, and sends the expert outputs back with the splits swapped. 4 ranks. Truth: silent, exit 0."""
import datetime
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()



rank, world = _init(30.0)
gen = torch.Generator().manual_seed(100 + rank)
expert = torch.nn.Linear(8, 8)
for step in range(5):
    send_counts = torch.randint(1, 5, (world,), generator=gen)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    tokens = torch.randn(int(send_counts.sum()), 8)
    routed = torch.empty(int(recv_counts.sum()), 8)
    dist.all_to_all_single(routed, tokens, output_split_sizes=recv_counts.tolist(),
                           input_split_sizes=send_counts.tolist())
    with torch.no_grad():
        out = torch.tanh(expert(routed))
    back = torch.empty_like(tokens)
    dist.all_to_all_single(back, out, output_split_sizes=send_counts.tolist(),
                           input_split_sizes=recv_counts.tolist())
    assert back.shape == tokens.shape
dist.destroy_process_group()
