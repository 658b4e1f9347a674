"""DP-SGD-style per-example clipping at an adaptive threshold (the 90th percentile of the batch's per-example
gradient norms) found by a float32 bisection that never ends on one rank.
Each rank computes its per-example gradients of a linear model in closed form, finds the clip threshold
with `quantile_bisect` (bisect until `hi - lo <= tol`, tol 1e-5), clips, and all-reduces the clipped
gradient sum and the example count. With float32 bounds the loop only ends when the quantile is small
enough for two neighbouring floats to be closer than tol (below 128); otherwise `mid` rounds back onto
`lo` or `hi` and the loop spins for ever. Rank 1's shard holds a block of records from the legacy
exporter (one feature in milli-units), so at step 3 its norms are in the thousands and rank 1 spins in
the bisection while ranks 0, 2, 3 wait for it in the gradient all_reduce. 4 ranks.
Truth: rank 1 (stuck in compute), line: the `while hi - lo > tol` loop / the `quantile_bisect(...)` call."""
import datetime
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


DIM, BATCH, STEPS, Q = 6, 32, 8, 0.9
W_TRUE = torch.tensor([0.8, -0.5, 0.3, 0.0, 0.2, -0.1])


def load_shard(rank, n):
    g = torch.Generator().manual_seed(31 + rank)
    x = torch.randn(n, DIM, generator=g)
    y = x @ W_TRUE + 0.05 * torch.randn(n, generator=g)
    if rank == 1:
        x[3 * BATCH:4 * BATCH, 2] *= 1000.0   # rows written by the legacy exporter (milli-units)
    return x, y


def per_example_grads(w, xb, yb):
    resid = xb @ w - yb
    return resid[:, None] * xb


def quantile_bisect(values, q, tol=1e-5):
    # torch.quantile caps its input at 16M elements; bisection works on any size
    lo, hi = values.min(), values.max()
    while hi - lo > tol:  # <BUG>
        mid = (lo + hi) / 2
        if (values <= mid).float().mean() < q:
            lo = mid
        else:
            hi = mid
    return hi


def clipped_sum(grads, q):
    norms = grads.norm(dim=1)
    clip = quantile_bisect(norms, q)  # <ALT>
    scale = (clip / norms.clamp_min(1e-12)).clamp(max=1.0)
    return (grads * scale[:, None]).sum(0), clip


torch.set_num_threads(1)
rank, world = _init()
x, y = load_shard(rank, STEPS * BATCH)
w = torch.zeros(DIM)
gen = torch.Generator().manual_seed(0)   # the same noise stream on every rank, as the privacy accountant expects
for step in range(STEPS):
    xb, yb = x[step * BATCH:(step + 1) * BATCH], y[step * BATCH:(step + 1) * BATCH]
    g_sum, clip = clipped_sum(per_example_grads(w, xb, yb), Q)  # <ALT>
    packed = torch.cat([g_sum, torch.tensor([float(len(yb))])])
    dist.all_reduce(packed)
    noise = 0.01 * torch.randn(DIM, generator=gen)
    w -= 0.5 * (packed[:DIM] + noise) / packed[DIM]
    if step % 2 == 1:
        err = torch.tensor([(w - W_TRUE).norm().item()])
        dist.all_reduce(err, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"step {step} clip {clip.item():.3f} max err {err.item():.4f}", flush=True)
dist.destroy_process_group()
