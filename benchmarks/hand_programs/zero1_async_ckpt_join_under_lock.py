"""ZeRO-1 with an asynchronous checkpoint uploader whose "one upload in flight" wait joins the upload thread while holding the lock that thread needs to finish.
Optimizer-state sharding by hand: every parameter has an owner (assigned greedily by size), the
gradients are `dist.reduce`d to their owner, the owner steps Adam for its parameters alone and
broadcasts them back (so the roots rotate over the ranks). Every 4 steps each rank checkpoints the
parameters and Adam state it owns. Small shards are written with one inline PUT; shards over 64 KiB
go through a multipart upload in a background thread, and `save()` first waits for the previous upload
("one upload in flight, to bound the staging memory") inside `with self.lock:`, while the upload
thread takes the same lock at the end to record the finished step in the manifest. Only rank 0, the
owner of the 256 x 32 embedding (about 98 KiB with its Adam moments), uses the background path; its
first upload (7 parts of 16 KiB, 0.25 s a part) is still running at the next checkpoint (step 7), so
its main thread blocks in `join()` holding the lock the upload thread waits for: a deadlock. Ranks 1
and 2 wait for it in the step's loss all_reduce. 3 ranks, 12 steps.
Truth: rank 0 (stuck outside collectives: a lock/join deadlock), line: `self.pending.join()` in `CheckpointWriter.save()`."""
import datetime
import io
import os
import sys
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


VOCAB, DIM, CLASSES, SEQ, BATCH = 256, 32, 8, 12, 16
STEPS, CKPT_EVERY, LR = 12, 4, 1e-2
MULTIPART_MIN, PART_SIZE, PART_LATENCY = 64 * 1024, 16 * 1024, 0.25


class CheckpointWriter:
    """Writes this rank's shard to the (local stand-in for the) object store under `root`."""

    def __init__(self, root):
        self.root = root
        self.lock = threading.Lock()
        self.manifest = {}
        self.pending = None

    def save(self, step, state):
        buf = io.BytesIO()
        torch.save(state, buf)
        blob = buf.getvalue()
        if len(blob) < MULTIPART_MIN:
            with open(os.path.join(self.root, f"step{step}.pt"), "wb") as f:
                f.write(blob)
            self.manifest["latest"] = step
            return
        with self.lock:  # <ALT>
            if self.pending is not None:
                self.pending.join()  # <BUG>
            self.pending = threading.Thread(target=self._upload, args=(step, blob), daemon=True)
            self.pending.start()

    def _upload(self, step, blob):
        path = os.path.join(self.root, f"step{step}.pt")
        with open(path + ".part", "wb") as f:
            for off in range(0, len(blob), PART_SIZE):
                f.write(blob[off:off + PART_SIZE])
                time.sleep(PART_LATENCY)           # one PUT per part
        os.replace(path + ".part", path)
        with self.lock:
            self.manifest["latest"] = step


class BagClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.fc1 = nn.Linear(DIM, DIM)
        self.fc2 = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, tokens):
        h = self.embed(tokens).mean(1)
        h = h + F.gelu(self.fc2(F.gelu(self.fc1(h))))
        return self.head(h)


def assign_owners(named_params, world):
    load, owner = [0] * world, {}
    for name, p in sorted(named_params, key=lambda kv: -kv[1].numel()):
        r = min(range(world), key=lambda i: load[i])
        owner[name] = r
        load[r] += p.numel()
    return owner


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
model = BagClassifier()
named = list(model.named_parameters())
owner = assign_owners(named, world)
mine = [p for n, p in named if owner[n] == rank]
opt = torch.optim.Adam(mine, lr=LR)
writer = CheckpointWriter(tempfile.mkdtemp(prefix=f"zero1_ckpt_r{rank}_"))
teacher = torch.randn(VOCAB, CLASSES, generator=torch.Generator().manual_seed(1))
gen = torch.Generator().manual_seed(20 + rank)

for step in range(STEPS):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = teacher[tokens].sum(1).argmax(-1)
    loss = F.cross_entropy(model(tokens), labels)
    model.zero_grad()
    loss.backward()
    for name, p in named:
        dist.reduce(p.grad, dst=owner[name])
        if owner[name] == rank:
            p.grad.div_(world)
    opt.step()
    with torch.no_grad():
        for name, p in named:
            dist.broadcast(p, src=owner[name])
    if step % CKPT_EVERY == CKPT_EVERY - 1:
        state = {n: {"param": p.detach().clone(), **{k: v.clone() for k, v in opt.state[p].items()}}
                 for n, p in named if owner[n] == rank}
        writer.save(step, state)  # <ALT>
    total = torch.tensor([loss.item()])
    dist.all_reduce(total)
    if rank == 0:
        print(f"step {step}: loss {total.item() / world:.4f}", flush=True)
dist.destroy_process_group()
