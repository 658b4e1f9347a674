"""Parameter-server style training with root 0: workers `dist.reduce` their flat gradient to rank 0, which
averages it, steps the optimizer and broadcasts the flat parameters back; the loss is reduced to rank 0 for
its logger. The bag-of-words model grows its vocabulary on the fly (`Vocab.add` + a resized embedding) when
a batch holds a word it has not seen, but each rank grows its OWN vocabulary: rank 4's batch at step 3 has
a typo ("teh") nobody else sees, so its embedding gets a 25th row and its flat gradient 8 more elements.
6 ranks.
Truth: rank 4 (size), line: its `dist.reduce(flat, dst=0)` / the vocabulary growth."""
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn as nn


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


WORDS = ("the cat dog sat on a mat ran to park big small red blue bird sang in tree sun was warm "
         "it rained today").split()
DIM = 8


class BagOfWords(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.vocab = {w: i for i, w in enumerate(vocab)}
        self.emb = nn.EmbeddingBag(len(vocab), DIM, mode="mean")
        self.head = nn.Linear(DIM, 1)

    def grow(self, words):
        new = [w for w in words if w not in self.vocab]
        for w in new:
            self.vocab[w] = len(self.vocab)  # <ALT>
        if new:
            old = self.emb.weight.data
            self.emb = nn.EmbeddingBag(len(self.vocab), DIM, mode="mean")
            self.emb.weight.data[:len(old)] = old

    def forward(self, sentences):
        ids = [torch.tensor([self.vocab[w] for w in s]) for s in sentences]
        offsets = torch.tensor([0] + [len(i) for i in ids[:-1]]).cumsum(0)
        return self.head(self.emb(torch.cat(ids), offsets)).squeeze(1)


def sentences(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    out = [[WORDS[int(i)] for i in torch.randint(len(WORDS), (6,), generator=g)] for _ in range(4)]
    if rank == 4 and step == 3:
        out[2][1] = "teh"
    return out


def flat_params(model):
    return torch.cat([p.data.flatten() for p in model.parameters()])


torch.set_num_threads(1)
rank, world = _init()
torch.manual_seed(0)
model = BagOfWords(WORDS)
opt = torch.optim.SGD(model.parameters(), lr=0.1) if rank == 0 else None
for step in range(8):
    batch = sentences(rank, step)
    model.grow(w for s in batch for w in s)
    target = torch.tensor([float(len(set(s))) for s in batch])
    loss = nn.functional.mse_loss(model(batch), target)
    model.zero_grad()
    loss.backward()
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    dist.reduce(flat, dst=0)  # <BUG>
    if rank == 0:
        torch.nn.utils.vector_to_parameters(flat / world, [p.grad for p in model.parameters()])
        opt.step()
    params = flat_params(model)
    dist.broadcast(params, src=0)
    torch.nn.utils.vector_to_parameters(params, list(model.parameters()))
    logged = loss.detach().reshape(1)
    dist.reduce(logged, dst=0)
    if rank == 0:
        print(f"step {step} loss {logged.item() / world:.3f}", flush=True)
dist.destroy_process_group()
