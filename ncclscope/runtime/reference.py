"""Single-process reference training: the ground truth for equivalence tests.

The parallel runtime must reproduce, within a stated tolerance, the losses and
gradients this plain loop computes from the same seed and data. It uses the
same model, batches, clipping and optimizer as `train.py`, with no
communication at all.

What "the same" means for each parallel mode:
  - microbatches / dp: the reference takes the mean loss over the whole global
    batch in one pass; the runtime averages per-microbatch means over m and dp,
    equal because every microbatch has the same number of tokens;
  - MoE: the reference uses the very MoE block of parallel/expert.py with all
    experts local. Capacity is per routing group = per sequence, so which
    tokens are dropped does not depend on how the batch is split; the
    auxiliary loss reaches the gradients (not the reported loss, which is the
    language-model cross-entropy in both);
  - everything else (TP, PP, CP, ZeRO) is the plain full model.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ncclscope.runtime.config import RunConfig
from ncclscope.runtime.corpus import global_batch
from ncclscope.runtime.model import GPT, GPTConfig, clip_, grad_norm_sq


@dataclass
class ReferenceResult:
    losses: list[float] = field(default_factory=list)
    grad_norms: list[float] = field(default_factory=list)       # before clipping
    grads: list[dict[str, torch.Tensor]] = field(default_factory=list)   # per step, by parameter name
    params: dict[str, torch.Tensor] = field(default_factory=dict)        # after the last step


def gpt_config(cfg: RunConfig) -> GPTConfig:
    return GPTConfig(vocab_size=cfg.vocab_size, block_size=cfg.block_size, n_layer=cfg.n_layer,
                     n_head=cfg.n_head, n_embd=cfg.n_embd, n_experts=cfg.n_experts, top_k=cfg.top_k,
                     capacity_factor=cfg.capacity_factor, aux_loss_coef=cfg.aux_loss_coef)


def make_model(cfg: RunConfig) -> GPT:
    """The full model, initialised from cfg.seed alone (identical on every rank)."""
    torch.manual_seed(cfg.seed)
    model = GPT(gpt_config(cfg))
    return model.to(getattr(torch, cfg.dtype))


def run_reference(cfg: RunConfig, keep_grads: bool = True) -> ReferenceResult:
    model = make_model(cfg)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    out = ReferenceResult()
    for step in range(cfg.steps):
        x, y = global_batch(cfg.seed, step, cfg.batch_size, cfg.block_size)
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        norm = math.sqrt(grad_norm_sq(params))
        out.losses.append(float(loss.detach()))
        out.grad_norms.append(norm)
        if keep_grads:
            out.grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
        clip_(params, norm, cfg.grad_clip)
        opt.step()
    out.params = {n: p.detach().clone() for n, p in model.named_parameters()}
    return out
