"""Streaming training from shard files with an `IterableDataset` and a `DataLoader` (batch_size 4): the
corpus is 12 shard files of 24 records, rank r reads file 2r + epoch in each of 2 epochs, and after
every epoch the ranks exchange metrics dicts with `all_gather_object`. Shard file 5 was cut short by a
failed upload (20 records, 5 batches): rank 2 reads it in epoch 1, leaves its loop one batch early, and
its `all_gather_object` meets the peers' next DDP gradient all_reduce. DDP, 6 ranks.
Truth: rank 2 (left its loop early), line: the `for x, y in loader` loop header / the short file."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, IterableDataset


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


N_FILES, RECORDS, EPOCHS = 12, 24, 2
SHORT_FILES = {5: 20}   # what the storage listing says for the failed upload


class ShardStream(IterableDataset):
    def __init__(self, file_id):
        self.file_id = file_id

    def __iter__(self):
        n = SHORT_FILES.get(self.file_id, RECORDS)  # <ALT>
        g = torch.Generator().manual_seed(self.file_id)
        for _ in range(n):
            x = torch.randn(10, generator=g)
            yield x, (x[:3].sum() > 0).float()


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
model = DDP(nn.Sequential(nn.Linear(10, 16), nn.ReLU(), nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(EPOCHS):
    loader = DataLoader(ShardStream(2 * rank + epoch), batch_size=4)
    seen, total = 0, 0.0
    for x, y in loader:  # <BUG>
        loss = nn.functional.binary_cross_entropy_with_logits(model(x).squeeze(1), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        seen += len(x)
        total += loss.item() * len(x)
    metrics = [None] * world
    dist.all_gather_object(metrics, {"rank": rank, "epoch": epoch, "loss": total / seen, "seen": seen})
    if rank == 0:
        print(f"epoch {epoch}: {sum(m['seen'] for m in metrics)} records, "
              f"loss {sum(m['loss'] for m in metrics) / world:.4f}", flush=True)
dist.destroy_process_group()
