"""Expert parallelism with the list form of all_to_all: one expert per rank, top-1 routing, fixed-capacity
dispatch buffers. The capacity is computed from the LOCAL token count (ceil(1.25 * tokens / world)), and
batches are cut per packed file without carry-over, so rank 3's first file (68 tokens) ends in an
8-token batch at step 5: its buffers hold 2 tokens per expert where the peers' hold 3. 6 ranks.
Truth: rank 3 (size), line: the dispatch `dist.all_to_all` / the capacity computed from `len(tokens)`."""
import datetime
import math
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


DIM, TOKENS_PER_BATCH, CAPACITY_FACTOR, STEPS = 8, 12, 1.25, 9
# token counts of each rank's packed files (the loader cuts batches inside a file, no carry-over)
FILES = {0: [72, 48], 1: [96, 24], 2: [120], 3: [68, 52], 4: [60, 60], 5: [108, 12]}


def token_batches(rank):
    g = torch.Generator().manual_seed(rank)
    for n in FILES[rank]:
        tokens = torch.randn(n, DIM, generator=g)
        for i in range(0, n, TOKENS_PER_BATCH):
            yield tokens[i:i + TOKENS_PER_BATCH]


def dispatch_buffers(tokens, expert_of, world, cap):
    sends, kept = [], []
    for e in range(world):
        idx = (expert_of == e).nonzero().flatten()[:cap]
        buf = torch.zeros(cap, DIM)
        buf[:len(idx)] = tokens[idx]
        sends.append(buf)
        kept.append(idx)
    return sends, kept


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
router = nn.Linear(DIM, world, bias=False)      # replicated
torch.manual_seed(100 + rank)
expert = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))   # this rank's expert
for step, tokens in zip(range(STEPS), token_batches(rank)):
    with torch.no_grad():
        expert_of = router(tokens).argmax(-1)
        cap = math.ceil(CAPACITY_FACTOR * len(tokens) / world)  # <ALT>
        sends, kept = dispatch_buffers(tokens, expert_of, world, cap)
        recvs = [torch.empty(cap, DIM) for _ in range(world)]
        dist.all_to_all(recvs, sends)  # <BUG>
        outs = [expert(r) for r in recvs]
        back = [torch.empty(cap, DIM) for _ in range(world)]
        dist.all_to_all(back, outs)
        y = tokens.clone()
        for e in range(world):
            y[kept[e]] += back[e][:len(kept[e])]
        stats = torch.tensor([float(sum(len(k) for k in kept)), float(len(tokens))])
        dist.all_reduce(stats)
    if rank == 0 and step % 3 == 2:
        print(f"step {step}: {stats[0] / stats[1]:.2%} of tokens within capacity", flush=True)
dist.destroy_process_group()
