"""FSDP2 with a per-host mixed-precision policy: bf16 gradient reductions where the CPU supports bf16, fp32 elsewhere.
The trainer builds its `MixedPrecisionPolicy` per process from the host's CPU flags ("use bf16 reductions
where they are fast"), as if the choice were a local performance knob. Ranks 0 and 1 run on a host with
AMX/AVX512-BF16 and reduce in bf16, rank 2 sits alone on an older host and keeps fp32 reductions, so in the
first backward its gradient reduce-scatter has another item size than its peers'. 3 ranks, 12 steps.
Truth: rank 2 (dtype differs: fp32 reduce-scatter among bf16 ones), line: the `loss.backward()` (the reduce-scatter is issued by FSDP in backward) / the policy choice."""
import datetime
import math
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


# what /proc/cpuinfo reports on each host of the allocation
HOST_OF_RANK = {0: "cpu-node-a", 1: "cpu-node-a", 2: "cpu-node-b"}
CPU_FLAGS = {
    "cpu-node-a": {"avx2", "avx512f", "avx512_bf16", "amx_bf16"},
    "cpu-node-b": {"avx2", "avx512f"},
}
IN_DIM, HIDDEN, OUT_DIM, BATCH, STEPS, WARMUP = 12, 48, 3, 16, 12, 3


def host_has_fast_bf16(rank):
    flags = CPU_FLAGS[HOST_OF_RANK[rank]]
    return "avx512_bf16" in flags or "amx_bf16" in flags


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN_DIM, HIDDEN), nn.GELU(), nn.LayerNorm(HIDDEN),
                         nn.Linear(HIDDEN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, OUT_DIM))


def lr_at(step, base=3e-3):
    if step < WARMUP:
        return base * (step + 1) / WARMUP
    progress = (step - WARMUP) / max(1, STEPS - WARMUP)
    return base * 0.5 * (1.0 + math.cos(math.pi * progress))


torch.set_num_threads(1)
rank, world = _init()
reduce_dtype = torch.bfloat16 if host_has_fast_bf16(rank) else torch.float32  # <ALT>
mp_policy = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=reduce_dtype)
model = build_model()
for block in (model[0], model[3], model[5]):
    fully_shard(block, mp_policy=mp_policy)
fully_shard(model, mp_policy=mp_policy)
opt = torch.optim.AdamW(model.parameters(), lr=lr_at(0), weight_decay=0.01)

gen = torch.Generator().manual_seed(1000 + rank)
proj = torch.randn(IN_DIM, OUT_DIM, generator=torch.Generator().manual_seed(7))
running = 0.0
for step in range(STEPS):
    for group in opt.param_groups:
        group["lr"] = lr_at(step)
    x = torch.randn(BATCH, IN_DIM, generator=gen)
    y = torch.tanh(x @ proj) + 0.05 * torch.randn(BATCH, OUT_DIM, generator=gen)
    loss = nn.functional.smooth_l1_loss(model(x), y)
    loss.backward()  # <BUG>
    opt.step()
    opt.zero_grad()
    running += loss.item()
    if step % 4 == 3:
        avg = torch.tensor([running / 4])
        dist.all_reduce(avg)
        running = 0.0
        if rank == 0:
            print(f"step {step + 1}: loss {avg.item() / world:.4f} lr {lr_at(step):.2e}", flush=True)
dist.destroy_process_group()
