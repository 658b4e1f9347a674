"""Dynamic micro-batch rows agreed with all_reduce(MIN), re-negotiated only "when my token budget changed".
Each rank's shard is bucketed by sequence length (four buckets, shortest first, three steps each, as
listed in the shard's index). A batch holds at most TOKEN_BUDGET tokens, so a rank wants
TOKEN_BUDGET // max_len rows, and all ranks take the minimum so that every sample weighs the same in the
averaged gradient. To save a collective per step, the trainer re-negotiates only when its own wanted row
count changes, assuming that only happens at the bucket boundaries, which all ranks cross together. Rank
3's shard has many documents cut at 24 tokens, so its second and third buckets have the same maximum
length: at step 6 its wanted rows stay at 16, it skips the negotiation and its gradient all_reduce pairs
with the others' row vote. 5 ranks.
Truth: rank 3 (skipped all_reduce), line: the `if want != last_want` / the `negotiate(...)` call."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


TOKEN_BUDGET, VOCAB, STEPS_PER_BUCKET = 384, 64, 3
# max sequence length of each length bucket of the rank's shard (from the shard's index file)
SHARD_BUCKETS = {
    0: [16, 24, 40, 64],
    1: [16, 32, 40, 48],
    2: [20, 24, 32, 64],
    3: [16, 24, 24, 48],
    4: [12, 28, 40, 56],
}


def negotiate(want):
    rows = torch.tensor([want])
    dist.all_reduce(rows, op=dist.ReduceOp.MIN)  # <ALT>
    return int(rows)


def next_batch(gen, rows, max_len):
    lengths = torch.randint(max_len // 2, max_len + 1, (rows,), generator=gen)
    tokens = torch.randint(1, VOCAB, (rows, max_len), generator=gen)
    mask = torch.arange(max_len) < lengths.unsqueeze(1)
    tokens = tokens * mask  # 0 is padding
    target = (tokens % 3 == 0).sum(1, keepdim=True).float() / lengths.unsqueeze(1)
    return tokens, target


class Pooled(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(VOCAB, 16, mode="mean", padding_idx=0)
        self.out = nn.Linear(16, 1)

    def forward(self, tokens):
        return self.out(self.emb(tokens))


torch.set_num_threads(1)
rank, world = _init()
buckets = SHARD_BUCKETS[rank]
gen = torch.Generator().manual_seed(rank)
torch.manual_seed(0)
model = Pooled()
opt = torch.optim.SGD(model.parameters(), lr=0.5)
last_want, rows = None, None
for step in range(len(buckets) * STEPS_PER_BUCKET):
    max_len = buckets[step // STEPS_PER_BUCKET]
    want = TOKEN_BUDGET // max_len
    if want != last_want:  # <BUG>
        rows = negotiate(want)  # <ALT>
        last_want = want
    tokens, target = next_batch(gen, rows, max_len)
    loss = nn.functional.mse_loss(model(tokens), target)
    opt.zero_grad()
    loss.backward()
    grads = torch.cat([p.grad.flatten() for p in model.parameters()])
    dist.all_reduce(grads)
    nn.utils.vector_to_parameters(grads / world, [p.grad for p in model.parameters()])
    opt.step()
    if rank == 0 and step % STEPS_PER_BUCKET == 0:
        print(f"step {step} rows {rows} loss {loss.item():.4f}", flush=True)
dist.destroy_process_group()
