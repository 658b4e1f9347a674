"""Four trainer ranks (two "nodes" of two) plus an evaluator sidecar on rank 4, with a group hierarchy.
The trainers reduce gradients hierarchically (all_reduce inside the node group, then across the
cross-node group of the same local slot) and every 3 steps rank 0 ships the weights to the evaluator
over a 2-rank eval group {0, 4}, which sends back a validation score. The two roles set up their groups
in separate functions: the trainers create the node and cross groups by iterating over the layout dict
and add the eval group last; the evaluator's author knew `new_group` must be called by every rank, so
`evaluator_groups()` creates the train groups too, but after its own eval group. Group names come from
a creation counter, so rank 4's first group pairs with the trainers' first (node {0, 1}) and every later
group is shifted by one: rank 4 waits in the eval broadcast on a group the trainers know as a node group,
and rank 0 waits in the creation of the eval group for a member that never joins it. 5 ranks.
Truth: rank 4 (groups created in another order), line: its `new_group(EVAL_RANKS)` in `evaluator_groups`."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


GROUP_TIMEOUT = datetime.timedelta(seconds=10)  # as for the world group: fail fast, do not sit for 30 min
TRAINERS = [0, 1, 2, 3]
EVALUATOR = 4
EVAL_RANKS = [0, EVALUATOR]
LAYOUT = {
    "node": [[0, 1], [2, 3]],
    "cross": [[0, 2], [1, 3]],
}


def trainer_groups(rank):
    mine = {}
    for kind, slices in LAYOUT.items():
        for members in slices:
            g = dist.new_group(members, timeout=GROUP_TIMEOUT)
            if rank in members:
                mine[kind] = g
    mine["eval"] = dist.new_group(EVAL_RANKS, timeout=GROUP_TIMEOUT)
    return mine


def evaluator_groups():
    eval_group = dist.new_group(EVAL_RANKS, timeout=GROUP_TIMEOUT)  # <BUG>
    for slices in LAYOUT.values():  # new_group is collective: create the trainers' groups as well
        for members in slices:
            dist.new_group(members, timeout=GROUP_TIMEOUT)
    return {"eval": eval_group}


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(12, 24), nn.ReLU(), nn.Linear(24, 1))


def batch(gen, n=16):
    x = torch.randn(n, 12, generator=gen)
    return x, x[:, :4].sum(1, keepdim=True) - x[:, 4:].mean(1, keepdim=True)


def ship_weights(model, group):
    flat = nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    dist.broadcast(flat, src=0, group=group)
    return flat


torch.set_num_threads(1)
rank, world = _init()
assert world == len(TRAINERS) + 1
is_eval = rank == EVALUATOR
groups = evaluator_groups() if is_eval else trainer_groups(rank)  # <ALT>
model = make_model()
gen = torch.Generator().manual_seed(rank)
if is_eval:
    val_x, val_y = batch(gen, 64)
    for round_ in range(4):
        flat = ship_weights(model, groups["eval"])
        nn.utils.vector_to_parameters(flat, model.parameters())
        with torch.no_grad():
            score = nn.functional.mse_loss(model(val_x), val_y).reshape(1)
        dist.broadcast(score, src=EVALUATOR, group=groups["eval"])
else:
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(12):
        x, y = batch(gen)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        grads = torch.cat([p.grad.flatten() for p in model.parameters()])
        dist.all_reduce(grads, group=groups["node"])
        dist.all_reduce(grads, group=groups["cross"])
        nn.utils.vector_to_parameters(grads / len(TRAINERS), [p.grad for p in model.parameters()])
        opt.step()
        if step % 3 == 2 and rank in EVAL_RANKS:
            ship_weights(model, groups["eval"])
            score = torch.zeros(1)
            dist.broadcast(score, src=EVALUATOR, group=groups["eval"])
            print(f"step {step} val mse {score.item():.4f}", flush=True)
dist.destroy_process_group()
