"""A background thread decodes records into a bounded queue and the training loop takes batches with
`queue.get()` (no timeout). Rank 1's 4th record is truncated, so its decode raises inside the thread: the
thread dies (the traceback goes to stderr, the main thread goes on) and rank 1 blocks in `get()` forever,
while rank 0 waits for it in the DDP gradient all_reduce. 2 ranks.
Truth: rank 1 (stuck in compute), line: the `self.queue.get()` / the `loader.next()` call."""
import datetime
import queue
import sys
import threading

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def read_records(rank, n):
    g = torch.Generator().manual_seed(rank)
    records = [torch.randn(4 * 9, generator=g).tolist() for _ in range(n)]
    if rank == 1:
        records[3] = records[3][:30]  # a truncated write in rank 1's data file
    return records


def decode(record):
    t = torch.tensor(record).view(4, 9)
    return t[:, :8], t[:, 8:]


class Prefetcher:
    def __init__(self, records, depth=2):
        self.queue = queue.Queue(maxsize=depth)
        self.thread = threading.Thread(target=self._work, args=(records,), daemon=True)
        self.thread.start()

    def _work(self, records):
        for rec in records:
            self.queue.put(decode(rec))

    def next(self):
        return self.queue.get()  # <BUG>


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
loader = Prefetcher(read_records(rank, 8))
for step in range(8):
    x, y = loader.next()  # <ALT>
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
