"""Hand-rolled data parallelism that overlaps the gradient all-reduces (async_op=True, one per parameter,
waited on before the optimizer step) and skips parameters whose .grad is None "because they were not
used". The auxiliary head is only used on batches holding an auxiliary label; rank 1's batch at step 6
has none, so it skips that parameter's all_reduce and its later ones pair with the peers' others. 4 ranks.
Truth: rank 1 (skipped all_reduce), line: the `continue` / the `if p.grad is None`."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


BATCH, STEPS, DATA_SEED = 6, 10, 350


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.head = nn.Linear(32, 1)
        self.aux_head = nn.Linear(32, 1, bias=False)

    def forward(self, x, has_aux):
        h = self.trunk(x)
        out = self.head(h)
        aux = self.aux_head(h[has_aux]) if has_aux.any() else None
        return out, aux


class GradSync:
    """Launch every gradient's all_reduce without waiting, wait for all of them before the step."""

    def __init__(self, params, world):
        self.params, self.world, self.pending = list(params), world, []

    def launch(self):
        for p in self.params:
            if p.grad is None:  # not used in this step's forward  # <ALT>
                continue  # <BUG>
            self.pending.append((p, dist.all_reduce(p.grad, async_op=True)))

    def finish(self):
        for p, work in self.pending:
            work.wait()
            p.grad /= self.world
        self.pending.clear()


def batches(rank):
    g = torch.Generator().manual_seed(DATA_SEED + rank)
    for _ in range(STEPS):
        x = torch.randn(BATCH, 16, generator=g)
        y = torch.randn(BATCH, 1, generator=g)
        has_aux = torch.rand(BATCH, generator=g) < 0.5   # records that carry an auxiliary label
        yield x, y, has_aux


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.05)
sync = GradSync(model.parameters(), world)
for step, (x, y, has_aux) in enumerate(batches(rank)):
    out, aux = model(x, has_aux)
    loss = nn.functional.mse_loss(out, y)
    if aux is not None:
        loss = loss + 0.1 * aux.square().mean()
    loss.backward()
    sync.launch()
    sync.finish()
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
