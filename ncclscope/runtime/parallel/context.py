"""Context parallelism: causal ring attention over a sequence split across the
`cp` group (Liu et al., "Ring Attention", 2023), with zig-zag load balancing.

Layout. The sequence of T tokens is cut into 2*cp chunks; rank i holds chunks
i and 2*cp-1-i (`zigzag_index`). Under a causal mask the early chunks have
little to attend to and the late ones a lot; pairing chunk i with its mirror
gives every rank the same work (Megatron-LM's and ring-flash-attn's zig-zag).

Ring. Each rank starts with its own K/V, then cp-1 times passes the K/V it
holds to the next rank and takes the previous rank's (`ring_shift`: isend to
next, irecv from prev; its backward sends the gradient back the other way).
At step j a rank holds the K/V of rank src = (i - j) mod cp and, by the
zig-zag layout, only one of two rectangles is visible, never a triangle:
  src < i: both local query chunks see src's first chunk, not its second;
  src > i: only the local second query chunk sees, and it sees both of src's.
Partial results are merged exactly with their log-sum-exp (the online
softmax of flash attention), so the output equals full causal attention up
to rounding. Autograd keeps each step's blocks; a production kernel would
recompute them in backward (this model is tiny), and would overlap the next
shift with the current block's maths.
"""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F

from ncclscope.runtime.comm import Comm, Group


def zigzag_index(rank: int, cp: int, seq_len: int) -> list[int]:
    """Token positions held by `rank`: chunk rank, then chunk 2*cp-1-rank."""
    if cp == 1:
        return list(range(seq_len))
    c = seq_len // (2 * cp)
    first, second = rank * c, (2 * cp - 1 - rank) * c
    return list(range(first, first + c)) + list(range(second, second + c))


class _RingShift(torch.autograd.Function):
    """Forward: send x to the next rank, receive the previous rank's.
    Backward: the reverse shift (gradients go back to where the data came from)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
        ctx.comm, ctx.group = comm, group
        return _shift(x, comm, group, +1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _shift(grad, ctx.comm, ctx.group, -1), None, None


def _shift(x: torch.Tensor, comm: Comm, group: Group, direction: int) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    n, i = group.size, group.rank
    dst, src = group.ranks[(i + direction) % n], group.ranks[(i - direction) % n]
    handles = [comm.isend(x, dst, group), comm.irecv(out, src, group)]   # both posted before either waits
    for h in handles:
        h.wait()
    return out


def ring_shift(x: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    return x if group.size == 1 else _RingShift.apply(x, comm, group)


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of one block and the log-sum-exp of its scores."""
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])               # [B, H, Tq, Tk]
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)                                   # [B, H, Tq]
    return torch.exp(s - lse[..., None]) @ v, lse                      # [B, H, Tq, D]


def _merge(out: torch.Tensor, lse: torch.Tensor, out_b: torch.Tensor,
           lse_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two softmax-normalised partial attentions over disjoint keys."""
    new = torch.logaddexp(lse, lse_b)
    return out * torch.exp(lse - new)[..., None] + out_b * torch.exp(lse_b - new)[..., None], new


def attend_own(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rank: int,
               cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ring step 0: the rank's queries against its own two chunks, causal by true position."""
    pos = torch.tensor(zigzag_index(rank, cp, q.shape[-2] * cp))
    return _block(q, k, v, pos[:, None] >= pos[None, :])


def attend_remote(out: torch.Tensor, lse: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  rank: int, src: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge rank `src`'s K/V [B, H, 2c, D] into rank `rank`'s partial result:
    the one visible rectangle (see the module docstring), no mask needed."""
    c = q.shape[-2] // 2
    if src < rank:
        o, l = _block(q, k[..., :c, :], v[..., :c, :])
        return _merge(out, lse, o, l)
    o, l = _block(q[..., c:, :], k, v)
    o2, l2 = _merge(out[..., c:, :], lse[..., c:], o, l)
    return torch.cat([out[..., :c, :], o2], dim=-2), torch.cat([lse[..., :c], l2], dim=-1)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, comm: Comm, group: Group) -> torch.Tensor:
    """Causal attention for q, k, v [B, H, 2c, D] laid out zig-zag over `group`."""
    if group.size == 1:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    i, cp = group.rank, group.size
    out, lse = attend_own(q, k, v, i, cp)                              # [B, H, 2c, D], [B, H, 2c]
    kv = torch.stack([k, v])                                           # [2, B, H, 2c, D]
    for step in range(1, cp):
        kv = ring_shift(kv, comm, group)                               # now rank (i - step)'s K/V
        out, lse = attend_remote(out, lse, q, kv[0], kv[1], i, (i - step) % cp)
    return out
