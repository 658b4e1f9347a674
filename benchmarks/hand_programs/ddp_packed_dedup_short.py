"""Language-model pretraining with DDP (static_graph, a mean-allreduce comm hook) on sequence-packed shards; one part lost documents to dedup.
Each rank reads its part of the corpus (36 tokenized documents), packs the documents end to end with an
EOS separator into rows of 32 tokens and cuts the rows into batches of 8, dropping the ragged tail. The
dedup pass removed 7 near-duplicate documents from part 3, so rank 3 packs 28 rows and gets 3 batches per
epoch while every other rank packs 35 or 36 rows and gets 4: rank 3 leaves the batch loop one step early and its
end-of-epoch all_reduce of the token counters meets its peers' DDP gradient all_reduce of step 4. 5 ranks.
Truth: rank 3 (left its loop early), line: the `for inputs_b, targets_b in batches(...)` loop header / the dedup that shortened its part."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


VOCAB, EOS, SEQ, BATCH, DIM, EPOCHS = 64, 0, 32, 8, 32, 2
DOCS_PER_PART = 36
DEDUP_REMOVED = {3: [4, 9, 13, 20, 26, 31, 33]}   # indices the near-duplicate filter dropped, per part


def load_part(part):
    g = torch.Generator().manual_seed(500 + part)
    lengths = torch.randint(20, 45, (DOCS_PER_PART,), generator=g).tolist()
    docs = [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]
    removed = set(DEDUP_REMOVED.get(part, []))
    return [d for i, d in enumerate(docs) if i not in removed]  # <ALT>


def pack(docs, seq_len):
    stream = torch.cat([torch.cat([d, torch.tensor([EOS])]) for d in docs])
    n_rows = (len(stream) - 1) // seq_len
    inputs = stream[:n_rows * seq_len].view(n_rows, seq_len)
    targets = stream[1:n_rows * seq_len + 1].view(n_rows, seq_len)
    return inputs, targets


def batches(inputs, targets, batch_size, gen):
    order = torch.randperm(len(inputs), generator=gen)
    for i in range(0, len(order) - batch_size + 1, batch_size):    # drop_last
        idx = order[i:i + batch_size]
        yield inputs[idx], targets[idx]


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens):
        h = self.embed(tokens)
        h = h + self.mix(h)
        return self.head(self.norm(h))


def mean_allreduce_hook(process_group, bucket):
    group = process_group if process_group is not None else dist.group.WORLD
    buf = bucket.buffer().div_(dist.get_world_size(group))
    fut = dist.all_reduce(buf, group=group, async_op=True).get_future()
    return fut.then(lambda f: f.value()[0])


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
model = DDP(TinyLM(), static_graph=True)
model.register_comm_hook(None, mean_allreduce_hook)
opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
inputs, targets = pack(load_part(rank), SEQ)
shuffle_gen = torch.Generator().manual_seed(rank)

for epoch in range(EPOCHS):
    model.train()
    counters = torch.zeros(2)             # tokens seen, summed loss
    for inputs_b, targets_b in batches(inputs, targets, BATCH, shuffle_gen):  # <BUG>
        logits = model(inputs_b)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets_b.reshape(-1))
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        counters += torch.tensor([targets_b.numel(), loss.item() * targets_b.numel()])
    dist.all_reduce(counters)
    if rank == 0:
        print(f"epoch {epoch}: {int(counters[0])} tokens, loss {counters[1] / counters[0]:.4f}", flush=True)
dist.destroy_process_group()
