"""Expert parallelism x data parallelism for an MoE layer, where an expert-load monitor raises when one of a rank's experts gets no tokens.
Two expert-parallel groups of 4 ranks ({0-3} and {4-7}) each hold the 8 experts of an MoE layer, 2 per
rank; the ranks of the same expert slot ({i, i + 4}) are its data-parallel replicas. Each rank routes
its 8 tokens top-1 with a replicated router, exchanges the per-expert counts with `all_to_all_single`,
dispatches the tokens with those splits (an autograd function whose backward runs the exchange with
the splits swapped), runs its experts and combines the outputs back. The dense parameters are averaged
over the world and the expert parameters over their replica group. Before running each local expert,
an `ExpertLoadMonitor` records the expert's token count and the largest token norm it received (to
catch activation blow-ups), with `x.norm(dim=-1).max()`. At step 3 no rank of the second group routes a
token to expert 1 on rank 4, so its slice of the dispatched tokens is empty and `max()` of an empty
tensor raises a RuntimeError; rank 4 dies while its peers wait for it in the combine exchange and the
gradient all_reduces. 8 ranks.
Truth: rank 4 (exception), line: the `.max()` in `ExpertLoadMonitor.record()` / its caller in `moe_layer()`."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


EP, N_EXPERTS, DIM, CLASSES = 4, 8, 16, 6
TOKENS, STEPS, LR, AUX_COEF = 8, 10, 0.1, 0.01
LOCAL = N_EXPERTS // EP


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty(sum(out_splits), x.shape[1])
        dist.all_to_all_single(out, x.contiguous(), output_split_sizes=out_splits,
                               input_split_sizes=in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g):
        out_splits, in_splits = ctx.splits
        gx = g.new_empty(sum(in_splits), g.shape[1])
        dist.all_to_all_single(gx, g.contiguous(), output_split_sizes=in_splits,
                               input_split_sizes=out_splits, group=ctx.group)
        return gx, None, None, None


class ExpertLoadMonitor:
    def __init__(self, expert_ids):
        self.tokens = {e: 0 for e in expert_ids}
        self.peak_norm = {e: 0.0 for e in expert_ids}

    def record(self, expert, x):
        self.tokens[expert] += x.shape[0]
        peak = x.detach().norm(dim=-1).max().item()  # <BUG>
        self.peak_norm[expert] = max(self.peak_norm[expert], peak)


def moe_layer(x, router, experts, local_ids, ep_group, monitor):
    probs = F.softmax(router(F.layer_norm(x, (DIM,))), dim=-1)
    gate, expert_of = probs.max(-1)
    order = expert_of.argsort(stable=True)
    per_expert = torch.bincount(expert_of, minlength=N_EXPERTS)
    # tell every peer how many tokens of each of its experts it gets from me
    recv_per_expert = torch.empty_like(per_expert)
    dist.all_to_all_single(recv_per_expert, per_expert, group=ep_group)
    send_splits = per_expert.view(EP, LOCAL).sum(1).tolist()
    recv_table = recv_per_expert.view(EP, LOCAL)          # [source rank, local expert]
    recv_splits = recv_table.sum(1).tolist()
    routed = AllToAll.apply(x[order], recv_splits, send_splits, ep_group)
    # tokens arrive grouped by source, then by expert; regroup them by local expert
    local_of = torch.cat([torch.arange(LOCAL).repeat_interleave(row) for row in recv_table])
    out = torch.zeros_like(routed)
    for j, (eid, expert) in enumerate(zip(local_ids, experts)):
        idx = (local_of == j).nonzero().flatten()
        x_e = routed[idx]
        monitor.record(eid, x_e)  # <ALT>
        out = out.index_add(0, idx, expert(x_e))
    back = AllToAll.apply(out, send_splits, recv_splits, ep_group)
    y = torch.empty_like(back)
    y[order] = back
    aux = N_EXPERTS * (per_expert.float() / len(x) * probs.mean(0)).sum()
    return x + gate.unsqueeze(1) * y, aux


torch.set_num_threads(1)
rank, world = _init()
n_replicas = world // EP
ep_rank, replica = rank % EP, rank // EP
ep_groups = [dist.new_group(list(range(r * EP, (r + 1) * EP)), timeout=datetime.timedelta(seconds=10))
             for r in range(n_replicas)]
rep_groups = [dist.new_group(list(range(e, world, EP)), timeout=datetime.timedelta(seconds=10))
              for e in range(EP)]
ep_group, rep_group = ep_groups[replica], rep_groups[ep_rank]

torch.manual_seed(0)
proj, router, head = nn.Linear(DIM, DIM), nn.Linear(DIM, N_EXPERTS, bias=False), nn.Linear(DIM, CLASSES)
nn.init.orthogonal_(router.weight)      # equal-norm expert directions: a balanced start
all_experts = [nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
               for _ in range(N_EXPERTS)]
local_ids = list(range(ep_rank * LOCAL, (ep_rank + 1) * LOCAL))
experts = nn.ModuleList(all_experts[e] for e in local_ids)
dense = list(proj.parameters()) + list(router.parameters()) + list(head.parameters())
opt = torch.optim.SGD(dense + list(experts.parameters()), lr=LR)
monitor = ExpertLoadMonitor(local_ids)
teacher = torch.randn(DIM, CLASSES, generator=torch.Generator().manual_seed(3))
gen = torch.Generator().manual_seed(61 + rank)

for step in range(STEPS):
    x = torch.randn(TOKENS, DIM, generator=gen)
    y = (x @ teacher).argmax(-1)
    h, aux = moe_layer(proj(x), router, experts, local_ids, ep_group, monitor)  # <ALT>
    loss = F.cross_entropy(head(h), y) + AUX_COEF * aux
    opt.zero_grad()
    loss.backward()
    for p in dense:
        dist.all_reduce(p.grad)
        p.grad.div_(world)
    for p in experts.parameters():
        dist.all_reduce(p.grad, group=rep_group)
        p.grad.div_(n_replicas)
    opt.step()
    stats = torch.tensor([loss.item(), 1.0])
    dist.all_reduce(stats)
    if rank == 0:
        print(f"step {step}: loss {stats[0] / stats[1]:.4f}, tokens seen by my experts "
              f"{monitor.tokens}", flush=True)
dist.destroy_process_group()
