"""A ring all-reduce written by hand with isend/irecv over ranks 0-3 while rank 4 is a spare that only
evaluates; the left-neighbour formula wraps around with the world size instead of the ring size, so rank
0 posts its irecv from rank 4 (which never sends) and rank 3's send to rank 0 is never received.
Reduce-scatter then all-gather phases over 4 chunks; a world all_reduce of the loss after each step. 5 ranks.
Truth: rank 0 (wrong peer), line: its left-neighbour computation / the irecv."""
import datetime
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


N_TRAIN = 4  # ranks 0..3 train and reduce their gradients in a ring; the last rank evaluates


def neighbours(rank, n_ring):
    right = (rank + 1) % n_ring
    left = rank - 1 if rank > 0 else dist.get_world_size() - 1  # <BUG>
    return left, right


def ring_step(send_chunk, recv_buf, left, right):
    reqs = [dist.isend(send_chunk.contiguous(), right), dist.irecv(recv_buf, left)]  # <ALT>
    for r in reqs:
        r.wait()  # <ALT>


def ring_all_reduce(flat, rank, n):
    left, right = neighbours(rank, n)  # <ALT>
    chunks = list(flat.chunk(n))
    buf = torch.empty_like(chunks[0])
    for i in range(n - 1):  # reduce-scatter: after it, rank r holds the full sum of chunk (r + 1) % n
        ring_step(chunks[(rank - i) % n], buf, left, right)
        chunks[(rank - i - 1) % n] += buf
    for i in range(n - 1):  # all-gather
        ring_step(chunks[(rank + 1 - i) % n], buf, left, right)
        chunks[(rank - i) % n].copy_(buf)
    return torch.cat(chunks)


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
params = list(model.parameters())
for step in range(4):
    x, y = torch.randn(16, 8), torch.randn(16, 4)
    loss = torch.nn.functional.mse_loss(model(x), y)
    if rank < N_TRAIN:
        loss.backward()
        flat = torch.cat([p.grad.flatten() for p in params])
        flat = ring_all_reduce(flat, rank, N_TRAIN) / N_TRAIN
        torch.nn.utils.vector_to_parameters(flat, [p.grad for p in params])
        opt.step()
        opt.zero_grad()
    else:
        loss = loss.detach()
    total = loss.detach().reshape(1)
    dist.all_reduce(total)
dist.destroy_process_group()
