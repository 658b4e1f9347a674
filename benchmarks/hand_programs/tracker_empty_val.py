"""A `MeanTracker` class averages a metric over the ranks in its `sync()` method (one all_reduce of
[sum, count]); the trainer calls it for the training loss every step and `evaluate()` calls it for the
validation loss every 4 steps. `sync()` returns early "when there is nothing to average" (count == 0).
The validation set has 5 documents dealt round-robin (`docs[rank::world]`) over 6 ranks, so rank 5 has
none: at step 3 it skips the validation all_reduce and its next one (the gradient all_reduce) meets the
peers' validation [sum, count]. Hand-written data parallelism, 6 ranks.
Truth: rank 5 (skipped all_reduce), line: the `if self.count == 0` in `sync()` / its `return` / the
`val.sync()` in `evaluate()`."""
import datetime
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


EVAL_EVERY = 4


class MeanTracker:
    """Running mean of a per-example metric, averaged over every rank on `sync()`."""

    def __init__(self):
        self.total, self.count = 0.0, 0

    def update(self, value, n):
        self.total += value * n
        self.count += n

    def sync(self):
        if self.count == 0:  # <BUG>
            return float("nan")  # nothing to average on this rank  # <ALT>
        buf = torch.tensor([self.total, float(self.count)])
        dist.all_reduce(buf)
        self.total, self.count = 0.0, 0
        return (buf[0] / buf[1]).item()


def val_documents():
    g = torch.Generator().manual_seed(11)
    return [torch.randn(3 + i, 10, generator=g) for i in range(5)]


def evaluate(model, docs):
    val = MeanTracker()
    with torch.no_grad():
        for doc in docs:
            pred = model(doc)
            val.update(pred.square().mean().item(), len(doc))
    return val.sync()  # <ALT>


def sync_grads(model, world):
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    dist.all_reduce(flat)
    flat /= world
    torch.nn.utils.vector_to_parameters(flat, [p.grad for p in model.parameters()])


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(10, 16), torch.nn.GELU(), torch.nn.Linear(16, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
my_docs = val_documents()[rank::world]
train_loss = MeanTracker()
gen = torch.Generator().manual_seed(rank)
for step in range(10):
    x = torch.randn(8, 10, generator=gen)
    loss = torch.nn.functional.mse_loss(model(x), x[:, :1])
    loss.backward()
    sync_grads(model, world)
    opt.step()
    opt.zero_grad()
    train_loss.update(loss.item(), len(x))
    mean_loss = train_loss.sync()
    if step % EVAL_EVERY == EVAL_EVERY - 1:
        val_loss = evaluate(model, my_docs)  # <ALT>
        if rank == 0:
            print(f"step {step} train {mean_loss:.4f} val {val_loss:.4f}", flush=True)
dist.destroy_process_group()
