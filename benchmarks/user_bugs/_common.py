"""What every script here starts with: the gloo group a user would create, with a short timeout."""
import datetime

import torch.distributed as dist


def init(timeout_s: float = 5.0) -> tuple[int, int]:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()
