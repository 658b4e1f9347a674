"""DDP, 4 ranks; at step 2 rank 2 skips its backward and optimizer step (a rank-local "skip a bad
batch" `continue`). Its DDP all_reduces pair one off and it runs out of them one before its peers.
Expected: HANG, rank 2 (it finished without posting the all_reduce its peers wait in)."""
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from _common import init  # noqa: E402

rank, world = init()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    x = torch.randn(8, 16)
    loss = model(x).square().mean()
    if rank == 2 and step == 2:      # bug: a rank-local "skip a bad batch"
        continue
    opt.zero_grad()
    loss.backward()
    opt.step()
dist.destroy_process_group()
