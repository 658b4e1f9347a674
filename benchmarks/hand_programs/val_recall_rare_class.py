"""Per-class validation recall computed on each rank's shard and merged with `all_gather_object`; a rare class is missing from one shard.
Training and validation both go through `DistributedSampler(shuffle=True)` with `set_epoch(epoch)`, so
every epoch each rank validates on another 15 of the 60 held-out examples. After each epoch a rank builds
a class report of its shard (loss, count, per-class recall from two `Counter`s) and the reports are
all-gathered as objects; rank 0 weights them into the global numbers. Class 3 is rare (5 of 60), and at
epoch 2 the shuffle leaves none of them in rank 2's shard: `hits[c] / support[c]` divides by zero, rank 2
dies with a ZeroDivisionError, and ranks 0, 1, 3 wait for it in the `all_gather_object`. 4 ranks.
Truth: rank 2 (exception), line: the recall division in `class_report` / the `evaluate(...)` call."""
import datetime
import sys
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


N_CLASSES, DIM, EPOCHS = 4, 10, 3
CLASS_PROBS = torch.tensor([0.36, 0.34, 0.24, 0.06])


def make_split(n, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.multinomial(CLASS_PROBS, n, replacement=True, generator=g)
    x = torch.randn(n, DIM, generator=g)
    x[torch.arange(n), y] += 2.0
    return TensorDataset(x, y)


def class_report(preds, labels, loss_sum):
    support = Counter(labels.tolist())
    hits = Counter(l for p, l in zip(preds.tolist(), labels.tolist()) if p == l)
    recall = {c: hits[c] / support[c] for c in range(N_CLASSES)}  # <BUG>
    return {"loss": loss_sum, "n": len(labels), "recall": recall}


@torch.no_grad()
def evaluate(model, loader):
    preds, labels, loss_sum = [], [], 0.0
    for x, y in loader:
        out = model(x)
        loss_sum += nn.functional.cross_entropy(out, y, reduction="sum").item()
        preds.append(out.argmax(1))
        labels.append(y)
    return class_report(torch.cat(preds), torch.cat(labels), loss_sum)


torch.set_num_threads(1)
rank, world = _init()
train_set, val_set = make_split(128, seed=11), make_split(60, seed=169)
train_sampler = DistributedSampler(train_set, shuffle=True, seed=0)
val_sampler = DistributedSampler(val_set, shuffle=True, seed=0)
train_loader = DataLoader(train_set, batch_size=8, sampler=train_sampler)
val_loader = DataLoader(val_set, batch_size=8, sampler=val_sampler)
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(DIM, 24), nn.ReLU(), nn.Linear(24, N_CLASSES))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(EPOCHS):
    train_sampler.set_epoch(epoch)
    val_sampler.set_epoch(epoch)
    for x, y in train_loader:
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        opt.step()
    report = evaluate(model, val_loader)  # <ALT>
    reports = [None] * world
    dist.all_gather_object(reports, report)
    if rank == 0:
        n = sum(r["n"] for r in reports)
        recall = {c: sum(r["recall"][c] * r["n"] for r in reports) / n for c in range(N_CLASSES)}
        print(f"epoch {epoch} val loss {sum(r['loss'] for r in reports) / n:.4f} "
              f"recall {[round(recall[c], 3) for c in range(N_CLASSES)]}", flush=True)
dist.destroy_process_group()
