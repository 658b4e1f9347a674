"""Healthy: expert parallelism with the list form of all_to_all, one expert per rank, top-1 routing, and a
capacity taken from the GLOBAL max token count (an all_reduce MAX first), so every rank's buffers agree
even though the token counts differ per rank and per step. The dispatch runs inside a timing context
manager, the data read is wrapped in a retry decorator that swallows a flaky first read, and the router's
gradient is all-reduced. 8 ranks. Truth: silent, exit 0."""
import datetime
import functools
import math
import sys
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn as nn


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


DIM, STEPS, CAPACITY_FACTOR = 8, 6, 1.25
TIMES = {}
_FLAKY = set()


def retry(times):
    def wrap(fn):
        @functools.wraps(fn)
        def inner(*args):
            for attempt in range(times):
                try:
                    return fn(*args)
                except IOError:
                    if attempt == times - 1:
                        raise
        return inner
    return wrap


@contextmanager
def timed(name):
    t0 = time.perf_counter()
    yield
    TIMES[name] = TIMES.get(name, 0.0) + time.perf_counter() - t0


@retry(3)
def read_batch(rank, step):
    if (rank + step) % 5 == 0 and (rank, step) not in _FLAKY:    # a flaky network read, once
        _FLAKY.add((rank, step))
        raise IOError("connection reset while reading the shard")
    g = torch.Generator().manual_seed(1000 * rank + step)
    n = 6 + (rank * 3 + step * 5) % 7
    return torch.randn(n, DIM, generator=g)


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
router = nn.Linear(DIM, world, bias=False)
torch.manual_seed(100 + rank)
expert = nn.Linear(DIM, DIM)
opt = torch.optim.SGD(list(router.parameters()) + list(expert.parameters()), lr=0.05)
for step in range(STEPS):
    tokens = read_batch(rank, step)
    count = torch.tensor([float(len(tokens))])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    cap = math.ceil(CAPACITY_FACTOR * count.item() / world)
    probs = router(tokens).softmax(-1)
    gate, expert_of = probs.max(-1)
    sends, kept = [], []
    for e in range(world):
        idx = (expert_of == e).nonzero().flatten()[:cap]
        buf = torch.zeros(cap, DIM)
        buf[:len(idx)] = tokens[idx]
        sends.append(buf)
        kept.append(idx)
    with timed("dispatch"):
        recvs = [torch.empty(cap, DIM) for _ in range(world)]
        dist.all_to_all(recvs, sends)
    outs = [expert(r) for r in recvs]
    with timed("combine"):
        back = [torch.empty(cap, DIM) for _ in range(world)]
        dist.all_to_all(back, [o.detach() for o in outs])
    y = torch.zeros_like(tokens)
    for e in range(world):
        y[kept[e]] = back[e][:len(kept[e])]
    loss = (gate * (y - tokens).square().mean(-1)).mean() + 0.01 * sum(o.square().mean() for o in outs)
    loss.backward()
    dist.all_reduce(router.weight.grad)
    router.weight.grad /= world
    opt.step()
    opt.zero_grad()
if rank == 0:
    print({k: round(v * 1e3, 1) for k, v in TIMES.items()}, "ms", flush=True)
dist.destroy_process_group()
