"""Resuming: rank 0 reads the training state from the checkpoint and broadcasts it with
`broadcast_object_list`; the others size their receive list from their node-local copy of the
checkpoint's meta file, and rank 1's copy is from before the data-loader cursor was added, so its list
is one entry short and the object-size broadcast has another size. 2 ranks.
Truth: rank 1 (short object list), line: its `broadcast_object_list`."""
import datetime
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


# what each node's local copy of <ckpt>/meta.json says; node 1 kept a copy from an older release
NODE_META = {
    0: {"version": 3, "fields": ["step", "lr", "sched", "cursor"]},
    1: {"version": 2, "fields": ["step", "lr", "sched"]},
}


def read_local_meta(rank):
    return NODE_META[rank]


def read_checkpoint_state():
    return {"step": 120, "lr": 0.05, "sched": {"last_epoch": 120}, "cursor": {"shard": 3, "offset": 512}}


torch.set_num_threads(1)
rank, world = _init()
meta = read_local_meta(rank)
if rank == 0:
    state = read_checkpoint_state()
    objs = [state[f] for f in meta["fields"]]
else:
    objs = [None] * len(meta["fields"])  # <ALT>
dist.broadcast_object_list(objs, src=0)  # <BUG>
start, lr = objs[0], objs[1]
torch.manual_seed(0)
model = torch.nn.Linear(8, 1)
opt = torch.optim.SGD(model.parameters(), lr=lr)
for step in range(start, start + 4):
    model(torch.randn(4, 8)).square().mean().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    opt.step()
    opt.zero_grad()
dist.destroy_process_group()
