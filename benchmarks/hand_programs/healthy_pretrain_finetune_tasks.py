"""Healthy: a two-phase job, data-parallel pretraining with an early-stop vote, then per-task finetuning in new groups of unequal size and length.
Phase 1 pretrains a shared trunk over all ranks with a `DistributedSampler` (100 samples on 8 ranks, so
the sampler pads and the last batch of each epoch is short); the gradient is averaged by sample count,
and after each epoch every rank feeds its own plateau detector and the ranks vote with all_reduce(MAX):
rank 5's detector fires first and stops everyone together. Rank 0 then broadcasts the finetune config
with `broadcast_object_list` and `scatter_object_list`s each rank its task and seed. Phase 2 creates one
new group per task (every rank creates every group, in the sorted order of the task names) and an eval
group of the task leaders {0, 5}; the "sst" group (5 ranks) runs 4 steps, the "nli" group (3 ranks) 6,
each all-reducing only inside its own group; the leaders exchange their task scores in the eval group,
and every rank's summary is gathered as objects to rank 7. 8 ranks.
Truth: silent, exit 0."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


GROUP_TIMEOUT = datetime.timedelta(seconds=10)
DIM, HID, MAX_PRETRAIN_EPOCHS, SUMMARY_RANK = 10, 16, 8, 7
TASK_RANKS = {"sst": [0, 1, 2, 3, 4], "nli": [5, 6, 7]}
TASK_CLASSES = {"sst": 2, "nli": 3}
TASK_STEPS = {"sst": 4, "nli": 6}


class Plateau:
    """Rank-local: fires when the local loss has not improved by 2 % for `patience` epochs."""

    def __init__(self, patience):
        self.best, self.bad, self.patience = float("inf"), 0, patience

    def update(self, loss):
        if loss < 0.98 * self.best:
            self.best, self.bad = loss, 0
        else:
            self.bad += 1
        return self.bad >= self.patience


def pretrain_data():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(100, DIM, generator=g)
    return TensorDataset(x, torch.tanh(x @ torch.linspace(-1, 1, DIM)).unsqueeze(1))


def task_batch(gen, n_classes, n=8):
    x = torch.randn(n, DIM, generator=gen)
    y = (x[:, :n_classes].argmax(1) + (x[:, -1] > 1.5).long()) % n_classes
    return x, y


def average_grads(params, group=None, weight=1.0):
    flat = torch.cat([p.grad.flatten() * weight for p in params])
    dist.all_reduce(flat, group=group)
    return flat


torch.set_num_threads(1)
rank, world = _init()
assert world == 8
torch.manual_seed(0)
trunk = nn.Sequential(nn.Linear(DIM, HID), nn.ReLU())
probe = nn.Linear(HID, 1)
params = list(trunk.parameters()) + list(probe.parameters())
opt = torch.optim.SGD(params, lr=0.1)
data = pretrain_data()
sampler = DistributedSampler(data, shuffle=True, seed=1)
loader = DataLoader(data, batch_size=5, sampler=sampler)
detector = Plateau(patience=1 if rank == 5 else 3)  # rank 5 was launched with the aggressive preset
for epoch in range(MAX_PRETRAIN_EPOCHS):
    sampler.set_epoch(epoch)
    epoch_loss, seen = 0.0, 0
    for x, y in loader:
        loss = nn.functional.mse_loss(probe(trunk(x)), y)
        opt.zero_grad()
        loss.backward()
        count = torch.tensor([float(len(x))])
        dist.all_reduce(count)
        flat = average_grads(params, weight=len(x))
        nn.utils.vector_to_parameters(flat / count, [p.grad for p in params])
        opt.step()
        epoch_loss += loss.item() * len(x)
        seen += len(x)
    vote = torch.tensor([1.0 if detector.update(epoch_loss / seen) else 0.0])
    dist.all_reduce(vote, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"pretrain epoch {epoch} local loss {epoch_loss / seen:.4f} stop vote {vote.item():.0f}", flush=True)
    if vote.item() > 0:
        break

cfg = [None]
if rank == 0:
    cfg[0] = {"lr": 0.05, "freeze_trunk_steps": 2, "layout": TASK_RANKS}
dist.broadcast_object_list(cfg, src=0)
cfg = cfg[0]
mine = [None]
plans = None
if rank == 0:
    plans = [{"task": t, "seed": 100 + r} for r in range(world)
             for t, members in cfg["layout"].items() if r in members]
dist.scatter_object_list(mine, plans, src=0)
plan = mine[0]

task_groups = {}
for task in sorted(cfg["layout"]):
    task_groups[task] = dist.new_group(cfg["layout"][task], timeout=GROUP_TIMEOUT)
leaders = [members[0] for _, members in sorted(cfg["layout"].items(), key=lambda kv: kv[1][0])]
eval_group = dist.new_group(leaders, timeout=GROUP_TIMEOUT)

task = plan["task"]
group = task_groups[task]
members = cfg["layout"][task]
gen = torch.Generator().manual_seed(plan["seed"])
head = nn.Linear(HID, TASK_CLASSES[task])
ft_params = list(trunk.parameters()) + list(head.parameters())
ft_opt = torch.optim.SGD(ft_params, lr=cfg["lr"])
for step in range(TASK_STEPS[task]):
    x, y = task_batch(gen, TASK_CLASSES[task])
    loss = nn.functional.cross_entropy(head(trunk(x)), y)
    ft_opt.zero_grad()
    loss.backward()
    if step < cfg["freeze_trunk_steps"]:
        for p in trunk.parameters():
            p.grad.zero_()
    flat = average_grads(ft_params, group=group)
    nn.utils.vector_to_parameters(flat / len(members), [p.grad for p in ft_params])
    ft_opt.step()

summary = {"rank": rank, "task": task, "final_loss": round(loss.item(), 4)}
if rank in leaders:
    with torch.no_grad():
        x, y = task_batch(torch.Generator().manual_seed(999), TASK_CLASSES[task], n=64)
        acc = (head(trunk(x)).argmax(1) == y).float().mean()
    scores = [torch.zeros(1) for _ in leaders]
    dist.all_gather(scores, acc.reshape(1), group=eval_group)
    summary["scores"] = {t: round(s.item(), 3) for t, s in zip(sorted(cfg["layout"], key=lambda t: cfg["layout"][t][0]), scores)}
everyone = [None] * world if rank == SUMMARY_RANK else None
dist.gather_object(summary, everyone, dst=SUMMARY_RANK)
if rank == SUMMARY_RANK:
    for s in everyone:
        print(s, flush=True)
dist.barrier()
dist.destroy_process_group()
