"""A try/except around a metrics collective: rank 2's metric computation raises (a KeyError in a dict
lookup for a key only its shard lacks) and the handler swallows it, skipping that step's all_reduce of
the metric. 4 ranks.
Truth: rank 2 (skipped all_reduce), line: the except/`pass` or the lookup."""
import datetime
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()



rank, world = _init()
grad = torch.ones(64)
for step in range(5):
    dist.all_reduce(grad)
    stats = {"loss": 1.0, "acc": 0.5} if not (rank == 2 and step == 3) else {"loss": 1.0}
    try:
        metric = torch.tensor([stats["acc"]])  # <BUG>
        dist.all_reduce(metric)  # <ALT>
    except KeyError:  # <ALT>
        pass
dist.destroy_process_group()
