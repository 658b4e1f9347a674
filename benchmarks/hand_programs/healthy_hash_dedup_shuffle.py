"""Healthy: a global dedup-and-reshuffle of the training documents by hash partitioning before training, with
split sizes agreed through an all_gather of per-destination counts.
Every rank loads its own raw shard (with duplicates, also across shards), sends each document to the rank
that owns its hash (`doc_id * PRIME % world`): the per-destination counts are all-gathered into a
world x world matrix (`all_gather_into_tensor`), each rank reads its receive splits from its column, and
the ids and then the feature rows are exchanged with `all_to_all_single` with those uneven splits. The
owner drops duplicate ids, so the ranks end with different numbers of documents; the number of steps
is agreed with all_reduce(MIN) over the local batch counts and the totals are checked with an
all_reduce. Training is plain data parallelism (one flat gradient all_reduce per step); the reshuffle is
redone every epoch with another salt. 4 ranks, 2 epochs. Truth: silent, exit 0."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


DIM, PRIME, BATCH, EPOCHS, ID_SPACE = 6, 2654435761, 8, 2, 300


def load_raw_shard(rank):
    g = torch.Generator().manual_seed(500 + rank)
    n = 70 + 10 * rank
    ids = torch.randint(0, ID_SPACE, (n,), generator=g)
    return ids, doc_features(ids)


def doc_features(ids):
    g = torch.Generator().manual_seed(0)
    table = torch.randn(ID_SPACE, DIM, generator=g)   # a document's features depend only on its id
    return table[ids]


def owners(ids, world, salt):
    return ((ids * PRIME + salt) % 1000003) % world


def exchange(ids, feats, world, salt):
    dest = owners(ids, world, salt)
    order = torch.argsort(dest, stable=True)
    ids, feats = ids[order], feats[order]
    send_counts = torch.bincount(dest, minlength=world)
    matrix = torch.empty(world * world, dtype=send_counts.dtype)
    dist.all_gather_into_tensor(matrix, send_counts)
    recv_counts = matrix.view(world, world)[:, dist.get_rank()]
    send, recv = send_counts.tolist(), recv_counts.tolist()
    out_ids = torch.empty(sum(recv), dtype=ids.dtype)
    dist.all_to_all_single(out_ids, ids, output_split_sizes=recv, input_split_sizes=send)
    out_feats = torch.empty(sum(recv), DIM)
    dist.all_to_all_single(out_feats, feats, output_split_sizes=recv, input_split_sizes=send)
    return out_ids, out_feats


def dedup(ids, feats):
    uniq, first = [], {}
    for i, d in enumerate(ids.tolist()):
        if d not in first:
            first[d] = i
            uniq.append(i)
    keep = torch.tensor(uniq, dtype=torch.long)
    return ids[keep], feats[keep]


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(DIM, 16), nn.ReLU(), nn.Linear(16, 1))
params = list(model.parameters())
opt = torch.optim.SGD(params, lr=0.05)
raw_ids, raw_feats = load_raw_shard(rank)
for epoch in range(EPOCHS):
    ids, feats = dedup(*exchange(raw_ids, raw_feats, world, salt=17 * epoch))
    assert torch.equal(feats, doc_features(ids))
    totals = torch.tensor([len(raw_ids), len(ids)])
    dist.all_reduce(totals)
    steps = torch.tensor([len(ids) // BATCH])
    dist.all_reduce(steps, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"epoch {epoch}: {totals[0]} raw docs, {totals[1]} unique, {steps.item()} steps", flush=True)
    perm = torch.randperm(len(ids), generator=torch.Generator().manual_seed(epoch * world + rank))
    for step in range(int(steps)):
        rows = perm[step * BATCH:(step + 1) * BATCH]
        x = feats[rows]
        y = x[:, :2].sum(1, keepdim=True)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        flat = torch.cat([p.grad.flatten() for p in params])
        dist.all_reduce(flat)
        for p, g in zip(params, (flat / world).split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))
        opt.step()
    ev = torch.tensor([loss.item()])
    dist.all_reduce(ev)
    if rank == 0:
        print(f"epoch {epoch} last loss {ev.item() / world:.4f}", flush=True)
dist.destroy_process_group()
