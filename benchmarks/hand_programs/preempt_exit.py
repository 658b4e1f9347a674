"""Preemption handling: each rank polls its node's preemption notice after every step and, when its
node is about to be reclaimed, saves a checkpoint and leaves with `os._exit(0)` so that the scheduler
requeues the job, without telling the other ranks. Rank 3 (alone on node 1) gets the notice at step 3;
ranks 0-2 wait for it in the next DDP gradient all_reduce. 4 ranks.
Truth: rank 3 (exit), line: the `os._exit(0)` / the `checkpoint_and_exit(...)` call."""
import datetime
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


NODE_OF_RANK = {0: 0, 1: 0, 2: 0, 3: 1}


def node_agent(notice_dir, node, step):
    # stands in for the cluster's node agent: node 1 is reclaimed after step 3
    if node == 1 and step == 3:
        open(os.path.join(notice_dir, f"preempt-node{node}"), "w").close()


def preempted(notice_dir, node):
    return os.path.exists(os.path.join(notice_dir, f"preempt-node{node}"))


def checkpoint_and_exit(model, opt, step, ckpt_dir):
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step},
               os.path.join(ckpt_dir, f"preempt-rank{dist.get_rank()}.pt"))
    print(f"rank {dist.get_rank()}: preempted at step {step}, checkpoint saved, exiting", file=sys.stderr, flush=True)
    os._exit(0)  # <BUG>


torch.set_num_threads(1)
rank, world = _init()
node = NODE_OF_RANK[rank]
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
with tempfile.TemporaryDirectory(prefix=f"preempt-r{rank}-") as tmp:
    for step in range(8):
        model(torch.randn(8, 8)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        node_agent(tmp, node, step)
        if preempted(tmp, node):  # <ALT>
            checkpoint_and_exit(model, opt, step, tmp)  # <ALT>
dist.destroy_process_group()
