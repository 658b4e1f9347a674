"""A byte-level text corpus that needs no download: Python's own standard library.

Every rank on a host reads the same files in the same order, so the same seed
gives every rank (and the single-process reference) the same batches. The
global batch of a step is drawn from (seed, step) alone; a data-parallel rank
takes its contiguous slice of it, which is what makes DP exactly equal to the
reference.
"""
from __future__ import annotations

import functools
import os
import sysconfig

import torch

# Fixed, stable modules: their text changes rarely across 3.x patch releases.
_FILES = ("argparse.py", "textwrap.py", "string.py", "bisect.py", "heapq.py", "fractions.py",
          "functools.py", "pprint.py", "difflib.py", "shlex.py")
CORPUS_BYTES = 400_000


@functools.lru_cache(maxsize=1)
def corpus() -> torch.Tensor:
    """uint8 tensor of the corpus (byte values are the tokens, vocab 256)."""
    stdlib = sysconfig.get_paths()["stdlib"]
    chunks: list[bytes] = []
    total = 0
    for name in _FILES:
        path = os.path.join(stdlib, name)
        if os.path.exists(path):
            with open(path, "rb") as f:
                data = f.read()
            chunks.append(data)
            total += len(data)
        if total >= CORPUS_BYTES:
            break
    text = b"".join(chunks)[:CORPUS_BYTES]
    if len(text) < 10_000:  # a stripped Python: fall back to a deterministic synthetic text
        text = (b"the quick brown fox jumps over the lazy dog. " * 500)
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).clone()


def global_batch(seed: int, step: int, batch_size: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(x, y) int64 [batch_size, block_size] for one optimizer step; y is x shifted by one."""
    data = corpus()
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - block_size - 1, (batch_size,), generator=g)
    idx = starts[:, None] + torch.arange(block_size + 1)[None, :]   # [B, T+1]
    tokens = data[idx].long()
    return tokens[:, :-1], tokens[:, 1:]


def shard(x: torch.Tensor, index: int, parts: int) -> torch.Tensor:
    """Contiguous slice `index` of `parts` along dim 0 (a dp rank's share)."""
    n = x.shape[0] // parts
    return x[index * n:(index + 1) * n]
