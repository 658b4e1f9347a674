"""Healthy: a hierarchy over two "nodes" of different sizes ({0, 1, 2} and {3, 4}) on 5 ranks.
Rank 0 reads the per-rank job config and `scatter_object_list`s it: node 0 runs 2 micro-batches a step
and node 1 runs 3, and every rank gets its own token count, so compute is uneven. The node groups come
from `new_subgroups_by_enumeration` and the node leaders' group {0, 3} from `new_group`, created by
every rank in the same order. In each micro-batch a rank routes its tokens to the experts of its own
node (3 experts on node 0, 2 on node 1) with an `all_to_all_single` of the counts and then of the tokens
with those splits (uneven, different per rank), and gets them back with the splits swapped. The head's
gradients are reduced hierarchically: an async all_reduce in the node group (waited after a local
metric), an all_reduce over the leaders only, and a broadcast from the node leader. The loss is summed
by a hand-written binomial-tree all-reduce over send/recv for a world that is not a power of two, and
rank 0 alone tracks the best loss. 5 ranks.
Truth: silent, exit 0."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


NODES = [[0, 1, 2], [3, 4]]
HIDDEN = 8


def tree_all_reduce(t, rank, world):
    mask = 1
    while mask < world:  # reduce up the binomial tree to rank 0
        if rank & mask:
            dist.send(t, rank - mask)
            break
        if rank + mask < world:
            child = torch.empty_like(t)
            dist.recv(child, rank + mask)
            t += child
        mask <<= 1
    if rank != 0:  # then broadcast back down the same tree
        dist.recv(t, rank - mask)
    mask >>= 1
    while mask > 0:
        if rank + mask < world:
            dist.send(t, rank + mask)
        mask >>= 1
    return t


def route_to_experts(x, expert_of, experts, node_group, n_local):
    order = torch.argsort(expert_of, stable=True)
    send_counts = torch.bincount(expert_of, minlength=n_local)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=node_group)
    recv = x.new_empty(int(recv_counts.sum()), HIDDEN)
    dist.all_to_all_single(recv, x[order].contiguous(), recv_counts.tolist(), send_counts.tolist(),
                           group=node_group)
    with torch.no_grad():
        out = experts(recv)
    back = x.new_empty(x.shape[0], HIDDEN)
    dist.all_to_all_single(back, out, send_counts.tolist(), recv_counts.tolist(), group=node_group)
    result = torch.empty_like(back)
    result[order] = back
    return result


torch.set_num_threads(1)
rank, world = _init()
assert world == sum(len(n) for n in NODES)
node_group, _ = dist.new_subgroups_by_enumeration(NODES)
leaders = [n[0] for n in NODES]
leader_group = dist.new_group(leaders)
my_node = next(n for n in NODES if rank in n)
leader, n_local = my_node[0], len(my_node)

cfg = [None]
configs = None
if rank == 0:  # micro-batches per step are set per node (the node's collectives must match), tokens per rank
    configs = [{"micro": 2 + i, "tokens": 6 + 4 * r, "seed": 100 + r}
               for i, node in enumerate(NODES) for r in node]
dist.scatter_object_list(cfg, configs, src=0)
cfg = cfg[0]

torch.manual_seed(my_node.index(rank))  # this rank's expert
experts = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.GELU())
torch.manual_seed(0)
head = nn.Linear(HIDDEN, 1)
opt = torch.optim.SGD(head.parameters(), lr=0.3)
gen = torch.Generator().manual_seed(cfg["seed"])
best = float("inf")
for step in range(8):
    opt.zero_grad()
    loss_sum = torch.zeros(1)
    for _ in range(cfg["micro"]):
        x = torch.randn(cfg["tokens"], HIDDEN, generator=gen)
        expert_of = torch.randint(n_local, (cfg["tokens"],), generator=gen)
        feats = route_to_experts(x, expert_of, experts, node_group, n_local)
        loss = nn.functional.mse_loss(head(feats), x.sum(1, keepdim=True).tanh())
        loss.backward()
        loss_sum += loss.detach()
    grads = torch.cat([p.grad.flatten() for p in head.parameters()])
    work = dist.all_reduce(grads, group=node_group, async_op=True)
    grad_norm = sum(p.grad.norm() ** 2 for p in head.parameters()).sqrt()
    work.wait()
    if rank == leader:
        dist.all_reduce(grads, group=leader_group)
    dist.broadcast(grads, src=leader, group=node_group)
    nn.utils.vector_to_parameters(grads / world, [p.grad for p in head.parameters()])
    opt.step()
    stats = tree_all_reduce(torch.cat([loss_sum, torch.tensor([float(cfg["micro"])])]), rank, world)
    if rank == 0:
        mean = (stats[0] / stats[1]).item()
        if mean < best:
            best = mean
            print(f"step {step} new best {best:.4f} (local grad norm {grad_norm.item():.3f})", flush=True)
dist.destroy_process_group()
