"""A 2 x 2 x 2 DeviceMesh (dp, cp, tp): a row-parallel layer all-reduces over tp, context is all-gathered
over cp, gradients are all-reduced over dp. A rank whose gradient is non-finite contributes zeros "so
the collective still matches", but that rarely taken branch was copy-pasted from the tp path and passes
`tp_group`; rank 6 takes it at step 5 (a sampling probability the manifest rounded to 0.0). 8 ranks.
Truth: rank 6 (wrong group), line: the all_reduce in the fallback branch / the isfinite `if`."""
import datetime
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


BATCH, HIDDEN, STEPS = 4, 8, 10
MANIFEST_SEED = 730


def load_sampling_probs(rank, n):
    """Per-record sampling probabilities from this rank's shard manifest (written with one decimal)."""
    g = torch.Generator().manual_seed(MANIFEST_SEED + rank)
    raw = 0.045 + 0.955 * torch.rand(n, generator=g)
    return torch.round(raw * 10) / 10


def sync_grad(grad, dp_group, tp_group):
    if torch.isfinite(grad).all():  # <ALT>
        dist.all_reduce(grad, group=dp_group)
    else:
        # a bad batch here: contribute zeros instead of skipping, so that the dp all_reduce still matches
        grad.zero_()
        dist.all_reduce(grad, group=tp_group)  # <BUG>
    return grad


torch.set_num_threads(1)
rank, world = _init()
mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp", "cp", "tp"))
dp_group, cp_group, tp_group = mesh.get_group("dp"), mesh.get_group("cp"), mesh.get_group("tp")
dp_size, cp_size = mesh.size(0), mesh.size(1)
probs = load_sampling_probs(rank, STEPS * BATCH)
torch.manual_seed(rank)
w_tp = (0.1 * torch.randn(HIDDEN, HIDDEN)).requires_grad_()   # this rank's rows of the layer
gen = torch.Generator().manual_seed(10 + rank)
for step in range(STEPS):
    x, y = torch.randn(BATCH, HIDDEN, generator=gen), torch.randn(BATCH, HIDDEN, generator=gen)
    partial = x @ w_tp
    full = partial.detach().clone()
    dist.all_reduce(full, group=tp_group)
    out = partial + (full - partial.detach())       # the all_reduce's backward is the identity
    kv = out.detach().mean(0)
    all_kv = torch.empty(cp_size * HIDDEN)
    dist.all_gather_into_tensor(all_kv, kv, group=cp_group)
    ctx = all_kv.view(cp_size, HIDDEN).mean(0)
    weights = 1.0 / probs[step * BATCH:(step + 1) * BATCH]   # importance weights
    loss = (weights * (out + ctx - y).square().mean(1)).mean()
    loss.backward()
    with torch.no_grad():
        grad = sync_grad(w_tp.grad, dp_group, tp_group)
        w_tp -= 0.01 * grad / dp_size
    w_tp.grad = None
dist.destroy_process_group()
