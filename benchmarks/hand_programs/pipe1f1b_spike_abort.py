"""Two data-parallel replicas of a 2-stage torch.distributed.pipelining model (Schedule1F1B on a 2 x 2 (dp, pp) DeviceMesh) with a loss-spike guard on the last stage.
The last stage is the only one that sees the loss, so it keeps an EMA of it and, as the run's
"fail fast on divergence" policy, prints an error and calls `sys.exit(1)` when a step's loss exceeds ten
times the EMA, expecting the job to be resumed from the last checkpoint. Each replica reads its own
part files; the part behind steps 6-7 of replica 1 was exported with targets in millimetres instead of
metres, so rank 3 (replica 1, last stage) sees a loss spike at step 6 and leaves alone: its pipeline
partner and its data-parallel peer wait for it. Gradients are averaged over dp by hand. 4 ranks, 10 steps.
Truth: rank 3 (exit), line: the `sys.exit(1)` in `check_divergence()` / its caller."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


DIM, BATCH, MICRO, STEPS, SPIKE, EMA_DECAY = 16, 16, 4, 10, 10.0, 0.8
MM_PARTS = {1: {6, 7}}     # replica -> steps whose part file was exported in millimetres


def load_batch(replica, step):
    g = torch.Generator().manual_seed(1000 * replica + step)
    x = torch.randn(BATCH, DIM, generator=g)
    y = 0.5 * x.roll(1, dims=1) + 0.1 * torch.randn(BATCH, DIM, generator=g)
    if step in MM_PARTS.get(replica, ()):
        y = y * 1000.0
    return x, y


def build_stage_module(stage_idx, n_stages):
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.Tanh(), nn.Linear(2 * DIM, DIM)) for _ in range(n_stages)]
    return blocks[stage_idx]


class DivergenceGuard:
    def __init__(self):
        self.ema = None

    def check_divergence(self, step, loss):
        if self.ema is not None and loss > SPIKE * self.ema:
            print(f"rank {dist.get_rank()}: loss {loss:.3g} at step {step} is over {SPIKE}x the EMA "
                  f"{self.ema:.3g}; aborting so that the job restarts from the last checkpoint",
                  file=sys.stderr, flush=True)
            sys.exit(1)  # <BUG>
        self.ema = loss if self.ema is None else EMA_DECAY * self.ema + (1 - EMA_DECAY) * loss


torch.set_num_threads(1)
rank, world = _init()
mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "pp"))
dp_group, pp_group = mesh.get_group("dp"), mesh.get_group("pp")
replica, stage_idx = mesh.get_local_rank("dp"), mesh.get_local_rank("pp")
n_stages = mesh.size(1)
is_last = stage_idx == n_stages - 1

module = build_stage_module(stage_idx, n_stages)
example = torch.empty(BATCH // MICRO, DIM, requires_grad=True)
stage = PipelineStage(module, stage_idx, n_stages, torch.device("cpu"),
                      input_args=(example,), output_args=example, group=pp_group)
schedule = Schedule1F1B(stage, n_microbatches=MICRO, loss_fn=lambda out, tgt: nn.functional.mse_loss(out, tgt))
opt = torch.optim.Adam(module.parameters(), lr=1e-3)
guard = DivergenceGuard()

for step in range(STEPS):
    x, y = load_batch(replica, step)
    if stage_idx == 0:
        schedule.step(x)
    else:
        losses = []
        schedule.step(target=y, losses=losses)
        step_loss = torch.stack(losses).mean().item()
        guard.check_divergence(step, step_loss)  # <ALT>
    for p in module.parameters():
        dist.all_reduce(p.grad, group=dp_group)
        p.grad.div_(mesh.size(0))
    opt.step()
    opt.zero_grad()
    if is_last and replica == 0 and step % 3 == 0:
        print(f"step {step}: replica-0 loss {step_loss:.4f}", flush=True)
dist.destroy_process_group()
