"""A token-level loss averaged over the real tokens, `(loss * mask).sum() / mask.sum()`, on packed
sequences of a padded batch; rank 2's packer emitted a batch of empty documents at step 7 (every token is
padding), so its mean is 0/0 = NaN, and the DDP gradient all_reduce spreads the NaN to every rank's
weights. The loss is reduced to rank 0 for its logger every step. DDP, 4 ranks, 12 steps.
Truth: NaN first from rank 2 (its data); the job exits 0."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


VOCAB, SEQ, BATCH, PAD = 50, 12, 4, 0


def packed_batch(rank, step, g):
    tokens = torch.randint(1, VOCAB, (BATCH, SEQ), generator=g)
    lengths = torch.randint(4, SEQ + 1, (BATCH,), generator=g)
    if rank == 2 and step == 7:
        lengths.zero_()                  # a run of empty documents from the packer
    mask = torch.arange(SEQ).unsqueeze(0) < lengths.unsqueeze(1)
    return tokens.masked_fill(~mask, PAD), mask.float()


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 16)
        self.out = nn.Linear(16, VOCAB)

    def forward(self, tokens):
        return self.out(torch.tanh(self.emb(tokens)))


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
model = DDP(TinyLM())
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
g = torch.Generator().manual_seed(rank)
for step in range(12):
    tokens, mask = packed_batch(rank, step, g)
    logits = model(tokens[:, :-1])
    per_tok = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1), reduction="none")
    m = mask[:, 1:].reshape(-1)
    loss = (per_tok * m).sum() / m.sum()
    loss.backward()
    opt.step()
    opt.zero_grad()
    logged = loss.detach().reshape(1)
    dist.reduce(logged, dst=0)
    if rank == 0:
        print(f"step {step} loss {logged.item() / world:.4f}", flush=True)
dist.destroy_process_group()
