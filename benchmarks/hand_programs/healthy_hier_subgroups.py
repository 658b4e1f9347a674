"""Healthy: two "nodes" of 4 ranks. `new_subgroups(group_size=4)` gives the intra-node groups and
`new_subgroups_by_enumeration` the cross-node pairs (i, i + 4). A frozen embedding table is sharded over
the hidden dim inside a node and rebuilt with an all_gather over the node group; the gradients are reduced
hierarchically (all_reduce in the node, then across nodes). Rank 0 broadcasts the weights at the start,
writes a checkpoint at step 2 (the others wait in a barrier), and at step 5 every rank reloads it and rank
0 broadcasts the weights again; every 3 steps the ranks all_gather_object their metrics dicts. 8 ranks.
Truth: silent, exit 0."""
import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


NODE, VOCAB, HIDDEN = 4, 40, 16


def sync_weights(module):
    for p in module.parameters():
        dist.broadcast(p.data, src=0)


def embed(tokens, shard, node_group):
    parts = [torch.empty(tokens.numel(), HIDDEN // NODE) for _ in range(NODE)]
    dist.all_gather(parts, shard[tokens.flatten()].contiguous(), group=node_group)
    return torch.cat(parts, 1).view(*tokens.shape, HIDDEN).mean(1)


def hier_all_reduce(flat, node_group, cross_group, world):
    dist.all_reduce(flat, group=node_group)
    dist.all_reduce(flat, group=cross_group)
    flat /= world


torch.set_num_threads(1)
rank, world = _init()
node_group, _ = dist.new_subgroups(group_size=NODE)
cross_group, _ = dist.new_subgroups_by_enumeration([[i, i + NODE] for i in range(NODE)])
table = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(3))
local = rank % NODE
shard = table[:, local * HIDDEN // NODE:(local + 1) * HIDDEN // NODE]
head = nn.Sequential(nn.Linear(HIDDEN, 16), nn.ReLU(), nn.Linear(16, 1))
sync_weights(head)
opt = torch.optim.SGD(head.parameters(), lr=0.05)
ckpt = os.path.join(tempfile.gettempdir(), f"healthy_hier_{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}.pt")
g = torch.Generator().manual_seed(rank)
for step in range(8):
    tokens = torch.randint(VOCAB, (6, 5), generator=g)
    feats = embed(tokens, shard, node_group)
    loss = nn.functional.mse_loss(head(feats), tokens.float().mean(1, keepdim=True) / VOCAB)
    loss.backward()
    flat = torch.cat([p.grad.flatten() for p in head.parameters()])
    hier_all_reduce(flat, node_group, cross_group, world)
    torch.nn.utils.vector_to_parameters(flat, [p.grad for p in head.parameters()])
    opt.step()
    opt.zero_grad()
    if step == 2:
        if rank == 0:
            torch.save(head.state_dict(), ckpt)
        dist.barrier()
    if step == 5:
        head.load_state_dict(torch.load(ckpt))
        sync_weights(head)
    if step % 3 == 2:
        metrics = [None] * world
        dist.all_gather_object(metrics, {"rank": rank, "step": step, "loss": loss.item()})
        if rank == 0:
            print(f"step {step} mean loss {sum(m['loss'] for m in metrics) / world:.4f}", flush=True)
dist.barrier()
if rank == 0:
    os.remove(ckpt)
dist.destroy_process_group()
