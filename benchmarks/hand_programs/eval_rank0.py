"""DDP with BatchNorm (buffers are broadcast at each forward); every 3 steps rank 0 alone runs an
evaluation pass through the DDP model (the classic `if rank == 0: evaluate(model)`). 4 ranks.
Truth: rank 0 (extra collectives from the DDP forward), line: the `evaluate(model)` call."""
import datetime
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()




def evaluate(m):
    m.eval()
    with torch.no_grad():
        for _ in range(2):
            m(torch.randn(8, 8))
    m.train()


rank, world = _init()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(7):
    model(torch.randn(8, 8)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    if step % 3 == 2 and rank == 0:  # <ALT>
        evaluate(model)  # <BUG>
dist.destroy_process_group()
