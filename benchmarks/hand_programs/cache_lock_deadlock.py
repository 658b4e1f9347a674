"""A thread-safe LRU cache of per-token features (shared with a prefetch thread, hence the lock). Eviction
runs under the lock and calls `size()`, which takes the same non-reentrant lock: the first eviction
deadlocks the rank. The other ranks' shards use a small vocabulary and never fill the cache; rank 2's
shard is in another language and fills it at step 8, so it hangs in compute while its peers wait in the
gradient all_reduce. 4 ranks.
Truth: rank 2 (stuck in compute), line: the `with self._lock` in `size()` / the `_evict()` / `cache.get` calls."""
import datetime
import sys
import threading
from collections import OrderedDict

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


DIM, CAPACITY, STEPS, TOKENS = 16, 64, 12, 8
VOCAB = {0: 40, 1: 40, 2: 5000, 3: 40}   # distinct token ids in each rank's shard


class FeatureCache:
    def __init__(self, capacity):
        self._lock = threading.Lock()
        self._data = OrderedDict()
        self.capacity = capacity

    def size(self):
        with self._lock:  # <BUG>
            return len(self._data)

    def _evict(self):
        while self.size() > self.capacity:  # <ALT>
            self._data.popitem(last=False)

    def get(self, key, compute):
        with self._lock:
            if key in self._data:
                self._data.move_to_end(key)
                return self._data[key]
            value = compute(key)
            self._data[key] = value
            if len(self._data) > self.capacity:
                self._evict()  # <ALT>
            return value


def featurize(token_id):
    g = torch.Generator().manual_seed(int(token_id))
    return torch.randn(DIM, generator=g)


torch.set_num_threads(1)
rank, world = _init()
cache = FeatureCache(CAPACITY)
w = torch.zeros(DIM, requires_grad=True)
gen = torch.Generator().manual_seed(rank)
for step in range(STEPS):
    ids = torch.randint(0, VOCAB[rank], (TOKENS,), generator=gen)
    feats = torch.stack([cache.get(int(t), featurize) for t in ids])  # <ALT>
    loss = (feats @ w - 1.0).square().mean()
    loss.backward()
    dist.all_reduce(w.grad)
    with torch.no_grad():
        w -= 0.1 * w.grad / world
    w.grad = None
dist.destroy_process_group()
