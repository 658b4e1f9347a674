"""A small GPT (nanoGPT-shaped) with an optional MoE feed-forward block, and
the same model cut for a parallel layout.

Small on purpose: the runtime exists to produce real communication patterns
for the debugger, and the test suite trains it on 2 CPU cores. Shapes are
commented where they change. B = batch, T = sequence, C = n_embd, H = heads,
V = vocab. `GPT` is the single-process model the reference trains;
`ParallelStage` is one pipeline stage of it on one rank of a tp x cp x ep
layout, built by slicing the full model's tensors, with the same parameter
names (a tp shard keeps its full name and says which slice it holds), so
every gradient maps back to the reference's.

    python -c "from ncclscope.runtime.model import GPT, GPTConfig; print(GPT(GPTConfig()))"
"""
from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ncclscope.runtime.comm import Comm, Group
from ncclscope.runtime.parallel.context import ring_attention
from ncclscope.runtime.parallel.expert import MoE
from ncclscope.runtime.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, contiguous_part,
                              head_rows, vocab_parallel_cross_entropy)


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 32
    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 32
    n_experts: int = 0            # 0: dense MLP in every block; >0: MoE block
    top_k: int = 1
    capacity_factor: float = 2.0
    aux_loss_coef: float = 0.01


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)                        # 3 x [B, T, C]
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # [B, H, T, D]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [B, H, T, D]
        y = y.transpose(1, 2).contiguous().view(B, T, C)             # [B, T, C]
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))                          # [B, T, 4C] -> [B, T, C]


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.n_embd)
        self.mlp: nn.Module = (MoE(cfg.n_embd, cfg.n_experts, cfg.top_k, cfg.capacity_factor, cfg.aux_loss_coef)
                               if cfg.n_experts else MLP(cfg))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)   # not tied to wte: stages stay independent
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        B, T = idx.shape
        x = self.wte(idx) + self.wpe(torch.arange(T))                 # [B, T, C]
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))                              # [B, T, V]
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


# ---- the parallel model ---------------------------------------------------------------
@dataclass
class Layout:
    """What the model needs to know of this rank's place in the mesh."""
    comm: Comm
    tp: Group
    cp: Group
    ep: Group
    positions: list[int]          # true positions of the tokens this rank holds (zig-zag under cp)


class ParallelAttention(nn.Module):
    """Heads split over tp (qkv column-parallel, proj row-parallel); the sequence
    over cp (ring attention)."""

    def __init__(self, full: CausalSelfAttention, lay: Layout) -> None:
        super().__init__()
        C, tp = full.qkv.in_features, lay.tp
        self.n_head, self.lay = full.n_head // tp.size, lay
        self.qkv = ColumnParallelLinear(full.qkv, head_rows(C, full.n_head, tp.rank, tp.size, blocks=3), lay.comm, tp)
        self.proj = RowParallelLinear(full.proj, head_rows(C, full.n_head, tp.rank, tp.size), lay.comm, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape                                             # T: this rank's tokens
        q, k, v = self.qkv(x).chunk(3, dim=2)                        # 3 x [B, T, C/tp]
        q, k, v = (t.reshape(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))   # [B, H/tp, T, D]
        y = ring_attention(q, k, v, self.lay.comm, self.lay.cp)       # [B, H/tp, T, D]
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))         # [B, T, C/tp] -> [B, T, C]


class ParallelMLP(nn.Module):
    def __init__(self, full: MLP, lay: Layout) -> None:
        super().__init__()
        cols = contiguous_part(full.fc.out_features, lay.tp.rank, lay.tp.size)
        self.fc = ColumnParallelLinear(full.fc, cols, lay.comm, lay.tp)
        self.proj = RowParallelLinear(full.proj, cols, lay.comm, lay.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))                          # [B, T, 4C/tp] -> [B, T, C]


class ParallelBlock(nn.Module):
    """A block on one rank. LayerNorms are replicated over tp; an MoE block is
    replicated over tp and split over ep."""

    def __init__(self, full: Block, lay: Layout) -> None:
        super().__init__()
        self.ln1, self.ln2 = copy.deepcopy(full.ln1), copy.deepcopy(full.ln2)
        self.attn = ParallelAttention(full.attn, lay)
        self.mlp: nn.Module = (MoE.shard(full.mlp, lay.comm, lay.ep) if isinstance(full.mlp, MoE)
                               else ParallelMLP(full.mlp, lay))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class ParallelStage(nn.Module):
    """Layers `layers` of the full model on this rank; the first stage also
    embeds (vocab-parallel wte, true-position wpe), the last also projects to
    vocab-parallel logits and owns the loss.

    Every tensor is copied or sliced from `full`, the model initialised from
    the seed, never initialised on its own: that is what makes a parallel run
    equal the reference to rounding. (A large model would instead seed each
    shard's RNG so that nobody materialises the full tensors.)"""

    def __init__(self, full: GPT, layers: range, first: bool, last: bool, lay: Layout) -> None:
        super().__init__()
        self.first, self.last, self.lay = first, last, lay
        self.positions = torch.tensor(lay.positions)
        if first:
            self.wte = VocabParallelEmbedding(full.wte, lay.comm, lay.tp)
            self.wpe = copy.deepcopy(full.wpe)
        self.blocks = nn.ModuleDict({str(i): ParallelBlock(full.blocks[i], lay) for i in layers})
        if last:
            self.ln_f = copy.deepcopy(full.ln_f)
            vocab = contiguous_part(full.head.out_features, lay.tp.rank, lay.tp.size)
            self.v0 = vocab[0]
            self.head = ColumnParallelLinear(full.head, vocab, lay.comm, lay.tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.wte(x) + self.wpe(self.positions)                # [B, T] -> [B, T, C]
        for block in self.blocks.values():
            x = block(x)
        if self.last:
            x = self.head(self.ln_f(x))                               # [B, T, V/tp]
        return x

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """This rank's share of the mean token loss: its token losses summed over
        the count of the whole sequence, so the cp ranks' shares add up to it."""
        per_token = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                 self.v0, self.lay.comm, self.lay.tp)   # [B*T]
        return per_token.sum() / (targets.numel() * self.lay.cp.size)


def moe_blocks(model: nn.Module) -> list[MoE]:
    return [m for m in model.modules() if isinstance(m, MoE)]


def num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def param_checksum(params: list[torch.Tensor]) -> float:
    """Sum of all parameters in float64: equal on replicas that hold the same
    weights, different as soon as one replica drifts (cheap, not cryptographic)."""
    total = 0.0
    for p in params:
        total += float(p.detach().double().sum())
    return total


def grad_norm_sq(params: list[torch.Tensor]) -> float:
    total = 0.0
    for p in params:
        if p.grad is not None:
            total += float(p.grad.detach().double().pow(2).sum())
    return total


def clip_(params: list[torch.Tensor], global_norm: float, max_norm: float) -> None:
    """Scale grads by max_norm / global_norm if above; the norm is computed by
    the caller across all parallel dimensions, so every shard clips alike."""
    if max_norm > 0 and math.isfinite(global_norm) and global_norm > max_norm:
        scale = max_norm / (global_norm + 1e-6)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale)
