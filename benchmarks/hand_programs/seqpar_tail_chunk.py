"""Megatron-style sequence parallelism written by hand: the tensor-parallel ranks hold the activations
sharded along the sequence, all-gather them (`all_gather_into_tensor`) before a column-parallel linear
and reduce-scatter (`reduce_scatter_tensor`) after the row-parallel one, inside two autograd functions
that swap the collectives in backward. The token stream is cut into 25-token chunks (24 inputs and their
shifted targets); 24 divides by 3, and the shard helper gives the remainder of an uneven length to the
last rank "just in case". The stream holds 209 tokens, so the 9th chunk (step 8) is a 9-token tail with
8 inputs: ranks 0 and 1 take 2 positions, rank 2 takes 4, and since each rank sizes its gather output
from its own shard, rank 2's all_gather_into_tensor has twice the others' size. 3 ranks.
Truth: rank 2 (size), line: its `all_gather_into_tensor` in `GatherSeq.forward`."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


VOCAB, HIDDEN, FFN, CHUNK, STREAM = 50, 12, 24, 25, 209


class GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, shard):
        world = dist.get_world_size()
        full = shard.new_empty(world * shard.shape[0], shard.shape[1])
        dist.all_gather_into_tensor(full, shard.contiguous())  # <BUG>
        return full

    @staticmethod
    def backward(ctx, grad_full):
        world = dist.get_world_size()
        grad = grad_full.new_empty(grad_full.shape[0] // world, grad_full.shape[1])
        dist.reduce_scatter_tensor(grad, grad_full.contiguous())
        return grad


class ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial):
        world = dist.get_world_size()
        shard = partial.new_empty(partial.shape[0] // world, partial.shape[1])
        dist.reduce_scatter_tensor(shard, partial.contiguous())
        return shard

    @staticmethod
    def backward(ctx, grad_shard):
        world = dist.get_world_size()
        grad = grad_shard.new_empty(world * grad_shard.shape[0], grad_shard.shape[1])
        dist.all_gather_into_tensor(grad, grad_shard.contiguous())
        return grad


def seq_bounds(length, rank, world):
    per = length // world
    start = rank * per
    stop = length if rank == world - 1 else start + per  # <ALT>
    return start, stop


class SPBlock(nn.Module):
    def __init__(self, rank, world):
        super().__init__()
        torch.manual_seed(0)
        self.norm = nn.LayerNorm(HIDDEN)
        self.up = nn.Linear(HIDDEN, FFN // world)       # column-parallel shard
        self.down = nn.Linear(FFN // world, HIDDEN, bias=False)  # row-parallel shard
        with torch.no_grad():
            full_up, full_down = torch.randn(FFN, HIDDEN) * 0.2, torch.randn(HIDDEN, FFN) * 0.2
            rows = slice(rank * FFN // world, (rank + 1) * FFN // world)
            self.up.weight.copy_(full_up[rows])
            self.down.weight.copy_(full_down[:, rows])

    def forward(self, x_shard):
        full = GatherSeq.apply(self.norm(x_shard))  # <ALT>
        partial = self.down(torch.relu(self.up(full)))
        return x_shard + ReduceScatterSeq.apply(partial)


def chunks(stream):
    for i in range(0, stream.numel(), CHUNK):
        yield stream[i:i + CHUNK]


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
embed = nn.Embedding(VOCAB, HIDDEN)  # replicated
block = SPBlock(rank, world)
head = nn.Linear(HIDDEN, VOCAB)      # replicated
params = list(embed.parameters()) + list(block.parameters()) + list(head.parameters())
replicated = list(embed.parameters()) + [block.norm.weight, block.norm.bias] + list(head.parameters())
opt = torch.optim.SGD(params, lr=0.1)
stream = torch.randint(VOCAB, (STREAM,), generator=torch.Generator().manual_seed(7))  # same on every TP rank
for step, chunk in enumerate(chunks(stream)):
    inputs, targets = chunk[:-1], chunk[1:]
    start, stop = seq_bounds(inputs.numel(), rank, world)
    h = block(embed(inputs[start:stop]))  # <ALT>
    loss = nn.functional.cross_entropy(head(h), targets[start:stop], reduction="sum")
    opt.zero_grad()
    loss.backward()
    for p in replicated:  # the sequence shards saw different tokens: sum their grads
        dist.all_reduce(p.grad)
    opt.step()
    total = loss.detach().reshape(1)
    dist.all_reduce(total)
    if rank == 0:
        print(f"step {step} tokens {inputs.numel()} loss {total.item() / inputs.numel():.4f}", flush=True)
dist.destroy_process_group()
