"""Memory: what each rank used per step, next to what the model states need.

Why: "out of memory on rank 7" is easier to act on when the report shows how
much of that memory the model states account for. The ZeRO paper's
accounting for mixed-precision Adam with Φ parameters: fp16 parameters 2Φ,
fp16 gradients 2Φ, fp32 master weights + momentum + variance 12Φ bytes, all
divided by the sharding in effect:

- tensor and pipeline parallelism split all three by tp * pp (each rank
  holds 1/(tp*pp) of the layers' parameters; embeddings make this an
  approximation on the first and last stage);
- ZeRO-1 shards the optimizer states over dp, ZeRO-2 also the gradients,
  ZeRO-3 also the parameters.

For full-precision training (float32/float64) the same formula is used with
parameters and gradients at the element size and Adam's two states at twice
it (no master copy). The measured figure (CUDA allocated, or process RSS on
CPU) is everything: activations, buffers, the allocator's cache, Python.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ncclscope.load.trace import Trace

ELEMENT = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def gpt_params(cfg: dict[str, Any]) -> int:
    """Φ for the runtime's GPT (runtime/model.py): embeddings, blocks, untied head.

    MoE blocks replace the MLP by n_experts MLPs plus a router."""
    d = int(cfg.get("n_embd", 0))
    v = int(cfg.get("vocab_size", 0))
    t = int(cfg.get("block_size", 0))
    layers = int(cfg.get("n_layer", 0))
    experts = int(cfg.get("n_experts", 0) or 0)
    attn = 4 * d * d + 4 * d
    mlp = 8 * d * d + 5 * d
    ffn = experts * mlp + d * experts if experts else mlp
    block = 4 * d + attn + ffn
    return v * d + t * d + layers * block + 2 * d + v * d


def model_state_bytes(phi: float, dtype: str = "bfloat16", tp: int = 1, pp: int = 1, dp: int = 1,
                      zero: int = 0) -> dict[str, float]:
    """Per-rank bytes of parameters, gradients and Adam states (see module docstring)."""
    e = ELEMENT.get(dtype, 4)
    if e == 2:
        params, grads, optim = 2 * phi, 2 * phi, 12 * phi
    else:
        params, grads, optim = e * phi, e * phi, 2 * e * phi
    mp = max(1, tp) * max(1, pp)
    params, grads, optim = params / mp, grads / mp, optim / mp
    dp = max(1, dp)
    if zero >= 1:
        optim /= dp
    if zero >= 2:
        grads /= dp
    if zero >= 3:
        params /= dp
    return {"params_bytes": params, "grads_bytes": grads, "optim_bytes": optim,
            "model_state_bytes": params + grads + optim}


@dataclass
class MemoryResult:
    per_step: pd.DataFrame = field(default_factory=pd.DataFrame)   # rank, step, memory_bytes
    per_rank: pd.DataFrame = field(default_factory=pd.DataFrame)   # rank, peak, first, last, estimate, ratio
    estimate: dict[str, float] = field(default_factory=dict)
    n_params: int = 0
    findings: list = field(default_factory=list)


def analyze_memory(trace: Trace) -> MemoryResult:
    res = MemoryResult()
    cfg = trace.run.config
    phi = int(trace.run.n_params or cfg.get("n_params") or gpt_params(cfg))
    res.n_params = phi
    if phi:
        res.estimate = model_state_bytes(phi, str(cfg.get("dtype", "float32")), int(cfg.get("tp", 1) or 1),
                                         int(cfg.get("pp", 1) or 1), int(cfg.get("dp", 1) or 1),
                                         int(cfg.get("zero", 0) or 0))
    m = trace.metrics
    if not len(m):
        return res
    ps = m[["rank", "step", "memory_bytes"]]
    ps = ps[ps["memory_bytes"] >= 0].sort_values(["rank", "step"]).reset_index(drop=True)
    res.per_step = ps
    if not len(ps):
        return res
    g = ps.groupby("rank")["memory_bytes"]
    per = pd.DataFrame({"peak_bytes": g.max(), "first_bytes": g.first(), "last_bytes": g.last()})
    per["growth"] = per["last_bytes"] / per["first_bytes"].where(per["first_bytes"] > 0) - 1
    est = res.estimate.get("model_state_bytes", np.nan)
    per["model_state_bytes"] = est
    per["state_frac"] = est / per["peak_bytes"]
    res.per_rank = per.reset_index()
    return res
