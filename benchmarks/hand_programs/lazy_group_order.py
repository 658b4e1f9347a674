"""Process groups created lazily on first use (every rank creates every slice of a dimension, as
new_group requires). The last rank owns the loss head and asks for its tensor-parallel group while
building the model, before its data-parallel group; everyone else asks for dp first. Group names come
from a creation counter, so rank 3's "tp" handle is really rank 1's dp group and its "dp" handle rank 2's
tp group: grads (128) meet activations (32). 2 x 2 layout (dp x tp), 4 ranks.
Truth: rank 3 (groups created in another order), line: the `new_group` / the early `get_group("tp")`."""
import datetime
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


LAYOUT = {"dp": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]]}
_groups = {}


def get_group(dim):
    if dim not in _groups:
        for members in LAYOUT[dim]:
            g = dist.new_group(members)  # <BUG>
            if dist.get_rank() in members:
                _groups[dim] = g
    return _groups[dim]


rank, world = _init()
if rank == world - 1:  # the loss head sets up its tensor-parallel group first  # <ALT>
    head_group = get_group("tp")  # <ALT>
dp, tp = get_group("dp"), get_group("tp")
grad, act = torch.ones(128), torch.ones(32)
for step in range(4):
    dist.all_reduce(grad, group=dp)
    grad /= 2
    dist.all_reduce(act, group=tp)
    act /= 2
dist.destroy_process_group()
