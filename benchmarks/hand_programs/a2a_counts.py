"""MoE-style token exchange on 4 ranks: ranks first all_to_all their send counts, then all_to_all_single
the tokens with those splits. Rank 0 skips the count exchange for its "no tokens" fast path at step 2
(sends nothing, so it thinks it need not tell anyone) and goes straight to the token exchange.
Truth: rank 0 (skipped all_to_all), line: the fast-path `if`."""
import datetime
import sys

import torch
import torch.distributed as dist

def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()



rank, world = _init()
for step in range(4):
    send_counts = torch.full((world,), 2, dtype=torch.int64)
    recv_counts = torch.empty(world, dtype=torch.int64)
    if not (rank == 0 and step == 2):  # <BUG>
        dist.all_to_all_single(recv_counts, send_counts)  # <ALT>
    else:
        recv_counts.fill_(2)
    tokens = torch.randn(int(send_counts.sum()), 8)
    out = torch.empty(int(recv_counts.sum()), 8)
    dist.all_to_all_single(out, tokens, output_split_sizes=recv_counts.tolist(),
                           input_split_sizes=send_counts.tolist())
dist.destroy_process_group()
