"""Global-norm gradient clipping: a helper all-reduces the squared norm, the trainer calls it from
`clip()` every step, and `log()` on the last rank (the one that prints, next to the loss) calls it
again every 5 steps to report the clipped norm: an all_reduce no other rank posts. 8 ranks.
Truth: rank 7 (extra all_reduce), line: the `global_grad_norm(...)` call in `log()` / its `if`."""
import datetime
import math
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


LOG_EVERY = 5
MAX_NORM = 1.0


def global_grad_norm(params):
    """The L2 norm of the whole (data-parallel averaged) gradient."""
    sq = torch.stack([p.grad.detach().square().sum() for p in params]).sum().reshape(1)
    dist.all_reduce(sq)
    return math.sqrt(sq.item())


class Trainer:
    def __init__(self, model, rank, world, lr=0.05):
        self.model, self.rank, self.world = model, rank, world
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.opt = torch.optim.SGD(self.params, lr=lr)

    def sync_grads(self):
        flat = torch.cat([p.grad.flatten() for p in self.params])
        dist.all_reduce(flat)
        flat /= self.world
        offset = 0
        for p in self.params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def clip(self):
        norm = global_grad_norm(self.params)
        if norm > MAX_NORM:
            for p in self.params:
                p.grad.mul_(MAX_NORM / (norm + 1e-6))
        return norm

    def log(self, step, loss):
        if self.rank == self.world - 1 and step % LOG_EVERY == LOG_EVERY - 1:  # <ALT>
            print(f"step {step} loss {loss:.4f} clipped norm {global_grad_norm(self.params):.4f}", flush=True)  # <BUG>

    def step(self, x, y):
        self.opt.zero_grad()
        loss = torch.nn.functional.mse_loss(self.model(x), y)
        loss.backward()
        self.sync_grads()
        self.clip()
        self.opt.step()
        return loss.item()


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(12, 24), torch.nn.Tanh(), torch.nn.Linear(24, 1))
trainer = Trainer(model, rank, world)
gen = torch.Generator().manual_seed(100 + rank)
for step in range(12):
    x = torch.randn(16, 12, generator=gen)
    y = x[:, :1] * 3.0 + 1.0
    loss = trainer.step(x, y)
    trainer.log(step, loss)  # <ALT>
dist.destroy_process_group()
