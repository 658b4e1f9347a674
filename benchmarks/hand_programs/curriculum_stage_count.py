"""A length curriculum shared with `broadcast_object_list`, whose receive list each rank sizes from its own shard.
The 310 training sequences are cut into contiguous shards of ceil(310 / 3) = 104, so the last rank gets
102; every rank works out the epoch's steps from its shard (`len // BATCH`, drop_last) and the number of
curriculum stages from that (4 steps a stage). Rank 0 builds the stages (maximum sequence length,
learning rate, steps) and broadcasts them; the others receive into `[None] * n_stages`. Rank 2 has 12
steps where the others have 13, so it counts 3 stages instead of 4, and its list is one entry short: the
object-size broadcast of `broadcast_object_list` has another size on rank 2. 3 ranks.
Truth: rank 2 (short object list), line: its `broadcast_object_list`."""
import datetime
import math
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


N_SEQ, VOCAB, FULL_LEN, BATCH, STEPS_PER_STAGE = 310, 50, 48, 8, 4


def make_corpus():
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(1, VOCAB, (N_SEQ, FULL_LEN), generator=g)
    labels = (tokens[:, :6] % 2).sum(1) % 2  # parity of the first tokens: learnable from any prefix
    return tokens, labels


def shard_bounds(rank, world):
    per = math.ceil(N_SEQ / world)
    lo = rank * per
    return lo, min(lo + per, N_SEQ)


def plan_stages(n_examples):
    steps = n_examples // BATCH  # drop_last
    return steps, math.ceil(steps / STEPS_PER_STAGE)


def build_curriculum(n_stages, steps):
    stages, left = [], steps
    for i in range(n_stages):
        stages.append({"max_len": 12 * (i + 1), "lr": 0.2 / (i + 1), "steps": min(STEPS_PER_STAGE, left)})
        left -= STEPS_PER_STAGE
    return stages


class BagClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.EmbeddingBag(VOCAB, 16, mode="mean")
        self.head = nn.Linear(16, 2)

    def forward(self, tokens):
        return self.head(self.emb(tokens))


torch.set_num_threads(1)
rank, world = _init()
tokens, labels = make_corpus()
lo, hi = shard_bounds(rank, world)
my_tokens, my_labels = tokens[lo:hi], labels[lo:hi]
steps, n_stages = plan_stages(hi - lo)  # <ALT>
if rank == 0:
    stages = build_curriculum(n_stages, steps)
else:
    stages = [None] * n_stages  # <ALT>
dist.broadcast_object_list(stages, src=0)  # <BUG>
torch.manual_seed(0)
model = BagClassifier()
opt = torch.optim.SGD(model.parameters(), lr=stages[0]["lr"])
cursor = 0
for stage in stages:
    for group in opt.param_groups:
        group["lr"] = stage["lr"]
    for _ in range(stage["steps"]):
        x = my_tokens[cursor:cursor + BATCH, :stage["max_len"]]
        y = my_labels[cursor:cursor + BATCH]
        cursor += BATCH
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
    report = loss.detach().reshape(1)
    dist.all_reduce(report)
    if rank == 0:
        print(f"stage max_len={stage['max_len']} mean loss {report.item() / world:.4f}", flush=True)
dist.destroy_process_group()
