"""Expert-parallel MoE on 3 ranks, rank 1 sends tokens with stale split sizes: it re-routes capacity
overflow to second-choice experts after the per-expert counts were already exchanged. Each rank routes
its 6 tokens (top-1 of a shared router), all_to_all_singles the counts, then the tokens with those splits;
capacity is ceil(1.25 * 6 / 3) = 3 per expert. At step 2 rank 1's batch overflows one expert, so the
tokens it sends no longer match the counts its peers were told. 3 ranks.
Truth: rank 1 (size: split sizes), line: the token `all_to_all_single` / the re-routing after the count exchange."""
import datetime
import math
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


TOKENS, D = 6, 8


def reroute_overflow(dest, second, capacity, n_experts):
    """Send tokens over an expert's capacity to their second choice if it has room, else drop them."""
    dest = dest.clone()
    load = torch.zeros(n_experts, dtype=torch.int64)
    for i in range(len(dest)):
        e = int(dest[i])
        if load[e] < capacity:
            load[e] += 1
        elif load[int(second[i])] < capacity:
            dest[i] = second[i]
            load[int(second[i])] += 1
        else:
            dest[i] = -1
    return dest


torch.set_num_threads(1)
rank, world = _init()
router = torch.randn(D, world, generator=torch.Generator().manual_seed(258))
expert = torch.nn.Linear(D, D)
capacity = math.ceil(1.25 * TOKENS / world)
data = torch.Generator().manual_seed(2580 + rank)
for step in range(5):
    tokens = torch.randn(TOKENS, D, generator=data)
    top2 = (tokens @ router).topk(2, dim=1).indices
    dest = top2[:, 0]
    send_counts = torch.bincount(dest, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts)
    if send_counts.max() > capacity:
        dest = reroute_overflow(dest, top2[:, 1], capacity, world)  # <ALT>
        send_counts = torch.bincount(dest[dest >= 0], minlength=world)
    order = torch.argsort(dest, stable=True)[(dest < 0).sum():]
    routed = torch.empty(int(recv_counts.sum()), D)
    out_splits, in_splits = recv_counts.tolist(), send_counts.tolist()
    dist.all_to_all_single(routed, tokens[order], out_splits, in_splits)  # <BUG>
    with torch.no_grad():
        out = torch.tanh(expert(routed))
    back = torch.empty(int(send_counts.sum()), D)
    dist.all_to_all_single(back, out, output_split_sizes=send_counts.tolist(),
                           input_split_sizes=recv_counts.tolist())
dist.destroy_process_group()
