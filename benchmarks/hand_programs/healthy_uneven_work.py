"""Healthy: uneven per-rank work with correct collectives: rank r accumulates gradients over r + 1
micro-batches of its own sequence lengths each step (so the ranks finish their compute at different
times), then every rank posts the same ops: one all_reduce of its flattened summed gradients, one of its
sample count, and an all_gather_into_tensor of per-rank stats every 2 steps. 5 ranks. Truth: silent, exit 0."""
import datetime
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


def micro_batches(rank, step, gen):
    for mb in range(rank + 1):
        seq = 4 + int(torch.randint(0, 8, (1,), generator=gen))
        yield torch.randn(seq, 8, generator=gen), torch.randn(seq, 1, generator=gen)


torch.set_num_threads(1)
rank, world = _init(30.0)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
params = list(model.parameters())
gen = torch.Generator().manual_seed(50 + rank)
for step in range(6):
    samples = torch.zeros(1)
    for x, y in micro_batches(rank, step, gen):
        torch.nn.functional.mse_loss(model(x), y, reduction="sum").backward()
        samples += x.shape[0]
    flat = torch.cat([p.grad.flatten() for p in params])
    dist.all_reduce(flat)
    dist.all_reduce(samples)
    torch.nn.utils.vector_to_parameters(flat / samples, [p.grad for p in params])
    opt.step()
    opt.zero_grad()
    if step % 2 == 1:
        mine = torch.tensor([float(rank), samples.item(), float(step)])
        everyone = torch.empty(world * 3)
        dist.all_gather_into_tensor(everyone, mine)
dist.destroy_process_group()
