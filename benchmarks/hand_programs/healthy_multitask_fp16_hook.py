"""Healthy: multi-task DDP with find_unused_parameters, an fp16-compression comm hook on every rank, hand-written checkpoints and a rotating curriculum root.
The model has a shared trunk and one head per task; each rank trains the task of its own data stream
(rank r -> task r % 3), so every rank leaves different heads unused and the big "parse" head makes its
rank slower. DDP with find_unused_parameters=True marks the unused heads ready on each rank, and
`fp16_compress_hook` (registered on every rank) all-reduces the buckets in fp16. Every 3 steps the ranks
write their checkpoint shard by hand (rank 0 the model and the run metadata, every rank its optimizer and
RNG state, to /tmp) and meet in a barrier before the old shards are deleted; at every epoch the rank whose
turn it is picks the curriculum difficulty and broadcasts it (src = epoch % world); rank 0 alone prints.
3 ranks, 3 epochs of 3 steps.
Truth: silent, exit 0."""
import datetime
import os
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
from torch.nn.parallel import DistributedDataParallel as DDP


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


DIM, BATCH, EPOCHS, STEPS_PER_EPOCH, CKPT_EVERY = 24, 12, 3, 3, 3
TASKS = ("classify", "regress", "parse")


class MultiTask(nn.Module):
    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(DIM, 48), nn.ReLU(), nn.Linear(48, 32), nn.ReLU())
        self.heads = nn.ModuleDict({
            "classify": nn.Linear(32, 5),
            "regress": nn.Linear(32, 1),
            "parse": nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(32, 32), nn.Tanh())], nn.Linear(32, 8)),
        })

    def forward(self, x, task):
        return self.heads[task](self.trunk(x))


def task_loss(task, out, gen, difficulty):
    if task == "classify":
        return nn.functional.cross_entropy(out, torch.randint(0, 5, (len(out),), generator=gen))
    if task == "regress":
        return nn.functional.mse_loss(out, difficulty * torch.randn(len(out), 1, generator=gen))
    return nn.functional.multilabel_soft_margin_loss(out, (torch.rand(len(out), 8, generator=gen) < 0.3).float())


def save_shard(ckpt_root, step, model, opt, gen):
    step_dir = os.path.join(ckpt_root, f"step{step:04d}")
    os.makedirs(step_dir, exist_ok=True)
    if rank == 0:
        torch.save({"model": model.module.state_dict(), "step": step, "world": world},
                   os.path.join(step_dir, "model.pt"))
    torch.save({"optim": opt.state_dict(), "rng": gen.get_state()}, os.path.join(step_dir, f"shard{rank}.pt"))


torch.set_num_threads(1)
rank, world = _init()
task = TASKS[rank % len(TASKS)]
torch.manual_seed(0)
model = DDP(MultiTask(), find_unused_parameters=True)
model.register_comm_hook(state=None, hook=fp16_compress_hook)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
gen = torch.Generator().manual_seed(31 * rank + 5)
ckpt_root = os.path.join(tempfile.gettempdir(), f"mt-ckpt-{os.environ.get('TORCHELASTIC_RUN_ID', 'local')}")

step, last_saved = 0, None
for epoch in range(EPOCHS):
    difficulty = torch.zeros(1)
    src = epoch % world
    if rank == src:
        difficulty.fill_(0.5 + 0.25 * epoch + 0.1 * torch.rand(1, generator=gen).item())
    dist.broadcast(difficulty, src=src)
    for _ in range(STEPS_PER_EPOCH):
        x = difficulty.item() * torch.randn(BATCH, DIM, generator=gen)
        loss = task_loss(task, model(x, task), gen, difficulty.item())
        loss.backward()
        opt.step()
        opt.zero_grad()
        step += 1
        if rank == 0:
            print(f"epoch {epoch} step {step}: {task} loss {loss.item():.4f}", flush=True)
        if step % CKPT_EVERY == 0:
            save_shard(ckpt_root, step, model, opt, gen)
            dist.barrier()              # every shard of this step is on disk before the old ones go
            if rank == 0 and last_saved is not None:
                shutil.rmtree(os.path.join(ckpt_root, f"step{last_saved:04d}"), ignore_errors=True)
            last_saved = step
dist.barrier()
if rank == 0:
    shutil.rmtree(ckpt_root, ignore_errors=True)
dist.destroy_process_group()
