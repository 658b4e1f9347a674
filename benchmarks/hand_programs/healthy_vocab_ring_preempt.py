"""Healthy: a vocabulary broadcast sized by a length broadcast, batch sizes agreed by vote, a hand-made p2p ring for validation, and a preemption vote that stops every rank together.
Rank 0 builds the vocabulary from its corpus sample; it first broadcasts the vocabulary's length as a
tensor and only then do the others size their `broadcast_object_list` receive list from it. Every 4
steps the ranks agree on the batch size with all_reduce(MIN) of their prefetch queue depths (which
differ). Validation runs on uneven shards (rank r holds 3 + r sequences) and is summed by passing a
running [loss, count] around a ring with blocking send/recv: rank 0 sends first and receives the total
last, every other rank receives from its left before sending right; rank 0 then broadcasts the total.
After every step each rank polls its node's preemption notice and the ranks vote with all_reduce(MAX):
only rank 3's node is reclaimed (from step 9), and every rank checkpoints to memory and leaves the loop
at the same step. 7 ranks.
Truth: silent, exit 0."""
import datetime
import io
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


MAX_STEPS, AGREE_EVERY, VAL_EVERY, SEQ, DIM = 16, 4, 4, 12, 8
WORDS = ["the", "a", "model", "loss", "rank", "ring", "token", "batch", "grad", "step", "node", "epoch",
         "shard", "vote", "eval", "queue", "train", "data", "mean", "sum", "send", "recv", "peer", "seed"]


def build_vocab(gen):
    sample = torch.randint(len(WORDS), (200,), generator=gen).tolist()
    return ["<pad>", "<unk>"] + sorted({WORDS[i] for i in sample})


def share_vocab(rank, gen):
    vocab = build_vocab(gen) if rank == 0 else None
    n = torch.tensor([len(vocab) if rank == 0 else 0])
    dist.broadcast(n, src=0)
    objs = vocab if rank == 0 else [None] * int(n)
    dist.broadcast_object_list(objs, src=0)
    return objs


def preemption_notice(rank, step):
    return rank == 3 and step >= 9  # what the node's metadata endpoint reports


def queue_depth(rank, step, gen):
    return 6 + (rank * 5 + step * 3) % 7 + int(torch.randint(3, (1,), generator=gen))


def ring_sum(local, rank, world):
    right, left = (rank + 1) % world, (rank - 1) % world
    acc = local.clone()
    if rank == 0:
        dist.send(acc, right)
        dist.recv(acc, left)  # the total, after a full lap
    else:
        incoming = torch.empty_like(acc)
        dist.recv(incoming, left)
        acc = incoming + local
        dist.send(acc, right)
    dist.broadcast(acc, src=0)
    return acc


def make_batch(gen, n, vocab_size):
    ids = torch.randint(2, vocab_size, (n, SEQ), generator=gen)
    y = ((ids % 5).float().mean(1, keepdim=True) - 2.0) / 2.0
    return ids, y


class Regressor(nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.emb = nn.EmbeddingBag(vocab_size, DIM, mode="mean", padding_idx=0)
        self.out = nn.Linear(DIM, 1)

    def forward(self, ids):
        return self.out(self.emb(ids))


torch.set_num_threads(1)
rank, world = _init()
gen = torch.Generator().manual_seed(rank)
vocab = share_vocab(rank, gen)
torch.manual_seed(0)
model = Regressor(len(vocab))
opt = torch.optim.SGD(model.parameters(), lr=0.3)
val_ids, val_y = make_batch(torch.Generator().manual_seed(50 + rank), 3 + rank, len(vocab))
snapshot, batch = None, None
for step in range(MAX_STEPS):
    if step % AGREE_EVERY == 0:
        depth = torch.tensor([queue_depth(rank, step, gen)])
        dist.all_reduce(depth, op=dist.ReduceOp.MIN)
        batch = int(depth)
    ids, y = make_batch(gen, batch, len(vocab))
    loss = nn.functional.mse_loss(model(ids), y)
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()
    if step % VAL_EVERY == VAL_EVERY - 1:
        with torch.no_grad():
            val = torch.tensor([nn.functional.mse_loss(model(val_ids), val_y, reduction="sum").item(),
                                float(len(val_y))])
        total = ring_sum(val, rank, world)
        if rank == 0:
            print(f"step {step} batch {batch} val mse {total[0].item() / total[1].item():.4f} "
                  f"over {int(total[1])} sequences", flush=True)
    flag = torch.tensor([1.0 if preemption_notice(rank, step) else 0.0])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if flag.item() > 0:
        buf = io.BytesIO()
        torch.save({"step": step, "model": model.state_dict(), "opt": opt.state_dict()}, buf)
        snapshot = buf.getbuffer().nbytes
        break
done = [None] * world
dist.all_gather_object(done, {"rank": rank, "stopped_at": step, "snapshot_bytes": snapshot})
assert len({d["stopped_at"] for d in done}) == 1
if rank == 0:
    print(f"preempted at step {step}; {world} snapshots of {snapshot} bytes", flush=True)
dist.destroy_process_group()
