"""Healthy: a parameter server (rank 0) with partial participation and any-source receives.
Each round the server broadcasts the weights, picks a random subset of workers to push this round and
shares the plan with `broadcast_object_list`; every worker computes on its own number of micro-batches
(worker r runs r of them, so they finish at different times), the chosen ones `send` their gradient sum
and sample count with the round as tag, and the others fold theirs into a carry they push next time.
The server receives with `src=None` in arrival order, isends an ack (the round's step size) only to the
workers it heard from, and alone snapshots its state to memory every 3 rounds; every 4 rounds the workers'
stats are `gather_object`-ed to the server. A `monitored_barrier` and a `dist.reduce` of the push counts
close the run (the server checks the workers' counts against its own). 4 ranks.
Truth: silent, exit 0."""
import datetime
import io
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


SERVER, DIM, ROUNDS, BATCH = 0, 16, 12, 8


def local_gradient(w, gen, n_micro, w_true):
    g, n = torch.zeros(DIM), 0
    for _ in range(n_micro):
        x = torch.randn(BATCH, DIM, generator=gen)
        y = x @ w_true + 0.05 * torch.randn(BATCH, generator=gen)
        g += x.t() @ (x @ w - y)
        n += BATCH
    return g, n


def serve_round(w, active, rnd, lr):
    total, count, heard = torch.zeros(DIM), 0, []
    for _ in active:
        buf = torch.empty(DIM + 1)
        src = dist.recv(buf, tag=rnd)  # any source: whoever finishes first
        heard.append(src)
        total += buf[:DIM]
        count += int(buf[DIM].item())
    step = torch.tensor([lr / max(count, 1)])
    acks = [dist.isend(step, dst=src, tag=1000 + rnd) for src in heard]
    for req in acks:
        req.wait()
    return w - step * total, heard


torch.set_num_threads(1)
rank, world = _init()
workers = list(range(1, world))
w = torch.zeros(DIM)
w_true = torch.linspace(-1.0, 1.0, DIM)
gen = torch.Generator().manual_seed(rank)
plan_gen = torch.Generator().manual_seed(1234)
carry, carry_n, pushes, received = torch.zeros(DIM), 0, torch.zeros(world), torch.zeros(world)
snapshots = []
for rnd in range(ROUNDS):
    dist.broadcast(w, src=SERVER)
    plan = [None]
    if rank == SERVER:
        k = 1 + int(torch.randint(len(workers), (1,), generator=plan_gen))
        chosen = torch.randperm(len(workers), generator=plan_gen)[:k]
        plan[0] = sorted(workers[i] for i in chosen.tolist())
    dist.broadcast_object_list(plan, src=SERVER)
    active = plan[0]
    if rank == SERVER:
        w, heard = serve_round(w, active, rnd, lr=0.5)
        for src in heard:
            received[src] += 1
        if rnd % 3 == 2:
            buf = io.BytesIO()
            torch.save({"round": rnd, "w": w.clone(), "received": received.clone()}, buf)
            snapshots.append(buf.getbuffer().nbytes)
    else:
        g, n = local_gradient(w, gen, rank, w_true)
        carry, carry_n = carry + g, carry_n + n
        if rank in active:
            dist.send(torch.cat([carry, torch.tensor([float(carry_n)])]), dst=SERVER, tag=rnd)
            step = torch.empty(1)
            dist.irecv(step, src=SERVER, tag=1000 + rnd).wait()
            carry, carry_n = torch.zeros(DIM), 0
            pushes[rank] += 1
    if rnd % 4 == 3:
        stats = {"rank": rank, "pending": carry_n, "err": (w - w_true).norm().item()}
        everyone = [None] * world if rank == SERVER else None
        dist.gather_object(stats, everyone, dst=SERVER)
        if rank == SERVER:
            pending = {s["rank"]: s["pending"] for s in everyone}
            print(f"round {rnd} err {stats['err']:.4f} pending {pending}", flush=True)
dist.monitored_barrier(timeout=datetime.timedelta(seconds=10))
dist.reduce(pushes, dst=SERVER)
if rank == SERVER:
    assert torch.equal(pushes, received), (pushes, received)
    print(f"pushes per worker {pushes.tolist()[1:]}, {len(snapshots)} snapshots", flush=True)
dist.destroy_process_group()
