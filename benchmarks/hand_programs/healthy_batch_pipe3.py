"""Healthy: a hand-written 3-stage GPipe pipeline with batch_isend_irecv: 4 micro-batches forward
(activations to the next stage), then backward in reverse (input gradients to the previous stage), each
stage stepping its own optimizer; the last stage broadcasts the mean loss. 3 ranks. Truth: silent, exit 0."""
import datetime
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


MICRO, MB_SIZE, WIDTH = 4, 4, 16


def p2p(op, tensor, peer):
    for req in dist.batch_isend_irecv([dist.P2POp(op, tensor, peer)]):
        req.wait()


torch.set_num_threads(1)
rank, world = _init(30.0)
first, last = rank == 0, rank == world - 1
torch.manual_seed(rank)
stage = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh())
opt = torch.optim.SGD(stage.parameters(), lr=0.05)
data = torch.Generator().manual_seed(123)
for step in range(4):
    inputs, outputs, losses = [], [], []
    for mb in range(MICRO):
        if first:
            x = torch.randn(MB_SIZE, WIDTH, generator=data)
        else:
            x = torch.empty(MB_SIZE, WIDTH)
            p2p(dist.irecv, x, rank - 1)
            x.requires_grad_()
        y = stage(x)
        inputs.append(x)
        outputs.append(y)
        if last:
            losses.append(y.square().mean() / MICRO)
        else:
            p2p(dist.isend, y.detach(), rank + 1)
    for mb in reversed(range(MICRO)):
        if last:
            losses[mb].backward()
        else:
            dy = torch.empty(MB_SIZE, WIDTH)
            p2p(dist.irecv, dy, rank + 1)
            outputs[mb].backward(dy)
        if not first:
            p2p(dist.isend, inputs[mb].grad, rank - 1)
    opt.step()
    opt.zero_grad()
    loss = torch.stack(losses).sum().detach().reshape(1) if last else torch.empty(1)
    dist.broadcast(loss, src=world - 1)
dist.destroy_process_group()
