"""Healthy: DDP with activation checkpointing switched on per rank by a memory budget, length-bucketed data, token-weighted losses and a rotating reshuffle root.
Each rank reads its own length bucket of a token corpus (rank r gets sequences of 8 + 6r tokens), so the
ranks' activations differ; a rank whose micro-batch holds more tokens than ACT_BUDGET runs its residual
blocks under `torch.utils.checkpoint` (non-reentrant) and recomputes them in backward, the others keep
their activations: ranks 3 and 4 (100 and 124 tokens) run every block forward twice. Two micro-batches
are accumulated per step with `no_sync()` on the first; the loss is weighted by the rank's share of the
global token count (one all_reduce of the counts before each backward). Every 4 steps every rank
evaluates its held-out batch and the [loss, tokens] sums are all-reduced; rank 0 alone prints, with no
collective behind its `if`. Every 5 steps the data order is reshuffled with a seed broadcast from a
rotating root. 5 ranks, 12 steps.
Truth: silent, exit 0."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


VOCAB, DIM, BLOCKS, BATCH = 96, 32, 3, 4
STEPS, ACCUM, ACT_BUDGET, EVAL_EVERY, RESHUFFLE_EVERY = 12, 2, 90, 4, 5


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)

    def forward(self, h):
        return h + self.fc2(F.gelu(self.fc1(self.norm(h))))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.out = nn.Linear(DIM, VOCAB)
        self.use_checkpoint = False

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            if self.use_checkpoint and self.training:
                h = checkpoint(block, h, use_reentrant=False)
            else:
                h = block(h)
        return self.out(h)


def batches(rank, seed):
    g = torch.Generator().manual_seed(seed * 100 + rank)
    seq = 8 + 6 * rank
    while True:
        start = torch.randint(0, VOCAB, (BATCH, 1), generator=g)
        steps = torch.randint(1, 4, (BATCH, seq), generator=g)
        yield (start + steps.cumsum(1)) % VOCAB     # a learnable "count upwards" language


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
net = TinyLM()
model = DDP(net, bucket_cap_mb=0.01)
opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
stream = batches(rank, seed=0)
held_out = next(batches(rank, seed=999))

for step in range(STEPS):
    if step % RESHUFFLE_EVERY == 0 and step > 0:
        root = (step // RESHUFFLE_EVERY) % world
        seed = torch.tensor([step * 7 + 1 if rank == root else 0])
        dist.broadcast(seed, src=root)
        stream = batches(rank, seed=int(seed))
    model.train()
    opt.zero_grad()
    for micro in range(ACCUM):
        seqs = next(stream)
        inputs, targets = seqs[:, :-1], seqs[:, 1:]
        net.use_checkpoint = inputs.numel() > ACT_BUDGET      # this rank's activation budget
        counts = torch.tensor([float(targets.numel())])
        dist.all_reduce(counts)
        share = world * targets.numel() / counts.item()
        ctx = model.no_sync() if micro < ACCUM - 1 else torch.enable_grad()
        with ctx:
            logits = model(inputs)
            loss = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)) * share / ACCUM
            loss.backward()
    opt.step()
    if rank == 0 and step % 3 == 0:
        print(f"step {step}: local loss {loss.item() * ACCUM / share:.4f} "
              f"(checkpointing: {net.use_checkpoint})", flush=True)
    if step % EVAL_EVERY == EVAL_EVERY - 1:
        model.eval()
        with torch.no_grad():
            logits = net(held_out[:, :-1])
            tgt = held_out[:, 1:]
            s = F.cross_entropy(logits.reshape(-1, VOCAB), tgt.reshape(-1), reduction="sum")
        stats = torch.stack([s, torch.tensor(float(tgt.numel()))])
        dist.all_reduce(stats)
        if rank == 0:
            print(f"step {step}: held-out loss {stats[0] / stats[1]:.4f} over {int(stats[1])} tokens",
                  flush=True)
dist.destroy_process_group()
