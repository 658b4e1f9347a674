"""Parameter-server regression with non-blocking pull/push, where a worker skips its push when the label filter
empties its batch.
Rank 0 is the server: each round it `isend`s the weights to every worker (pull, tagged with the round)
and `irecv`s one push from each worker (gradient sum and sample count, same tag), then takes an SGD step
on the pooled gradient. A worker drops the examples whose label is missing (NaN) before computing its
gradient, and "has nothing to push" when none are left, so it `continue`s to the next round. Rank 3's shard
holds a block of unlabeled records (an annotation batch that was never finished), so at round 4 its whole
batch is filtered out: it never sends its push, the server waits for it in round 4, and rank 3 waits for
the round-5 weights the server never sends (ranks 1, 2 wait for them too). 4 ranks.
Truth: rank 3 (its push is never sent), line: the `continue` / the empty-batch `if`."""
import datetime
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


SERVER, DIM, ROUNDS, BATCH = 0, 12, 8, 16
W_TRUE = torch.linspace(-1.0, 1.0, DIM)


def load_shard(rank, n_rows):
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n_rows, DIM, generator=g)
    y = x @ W_TRUE + 0.1 * torch.randn(n_rows, generator=g)
    unlabeled = torch.rand(n_rows, generator=g) < 0.15    # annotators skipped these
    if rank == 3:
        unlabeled[4 * BATCH:5 * BATCH] = True             # the unfinished annotation batch
    y[unlabeled] = float("nan")
    return x, y


def labelled(xb, yb):
    keep = ~torch.isnan(yb)
    return xb[keep], yb[keep]


def serve_round(w, rnd, workers, lr):
    pulls = [dist.isend(w, dst=r, tag=rnd) for r in workers]
    bufs = {r: torch.empty(DIM + 1) for r in workers}
    pushes = [dist.irecv(bufs[r], src=r, tag=rnd) for r in workers]
    for req in pulls + pushes:
        req.wait()
    total = torch.stack([b[:DIM] for b in bufs.values()]).sum(0)
    count = sum(float(b[DIM]) for b in bufs.values())
    return w - lr * total / max(count, 1.0)


def worker_round(w, rnd, x, y):
    dist.irecv(w, src=SERVER, tag=rnd).wait()
    xb, yb = labelled(x[rnd * BATCH:(rnd + 1) * BATCH], y[rnd * BATCH:(rnd + 1) * BATCH])
    if len(yb) == 0:
        return None
    grad = xb.t() @ (xb @ w - yb)
    return dist.isend(torch.cat([grad, torch.tensor([float(len(yb))])]), dst=SERVER, tag=rnd)


torch.set_num_threads(1)
rank, world = _init()
workers = list(range(1, world))
cfg = [{"lr": 0.5, "rounds": ROUNDS}] if rank == SERVER else [None]
dist.broadcast_object_list(cfg, src=SERVER)
w = torch.zeros(DIM)
x, y = load_shard(rank, ROUNDS * BATCH)
for rnd in range(cfg[0]["rounds"]):
    if rank == SERVER:
        w = serve_round(w, rnd, workers, cfg[0]["lr"])
        if rnd % 2 == 1:
            print(f"round {rnd} err {(w - W_TRUE).norm():.4f}", flush=True)
        continue
    push = worker_round(w, rnd, x, y)  # <ALT>
    if push is None:  # <ALT>
        continue  # nothing to push this round  # <BUG>
    push.wait()
err = torch.tensor([(w - W_TRUE).norm().item() if rank == SERVER else 0.0])
dist.all_reduce(err)
dist.destroy_process_group()
