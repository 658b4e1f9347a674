"""Process-free tests of the parallel building blocks: zig-zag maps and ring
attention maths, MoE routing and capacity, TP sharding maps, ZeRO shards, the
pipeline executor on one rank, and the config rules these modes add."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from ncclscope.runtime.comm import Comm, Group
from ncclscope.runtime.config import ConfigError, RunConfig
from ncclscope.runtime.corpus import global_batch
from ncclscope.runtime.model import Layout, ParallelStage, moe_blocks
from ncclscope.runtime.parallel.context import attend_own, attend_remote, zigzag_index
from ncclscope.runtime.parallel.data import ZeroShard
from ncclscope.runtime.parallel.expert import MoE, capacity, route
from ncclscope.runtime.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                               contiguous_part, head_rows, vocab_parallel_cross_entropy)
from ncclscope.runtime.pipeline.executor import PipelineExecutor
from ncclscope.schedules import build_schedule
from ncclscope.runtime.null_recorder import NullRecorder
from ncclscope.runtime.reference import make_model, run_reference

pytestmark = pytest.mark.timeout(60)
torch.set_num_threads(1)


def _group(rank: int = 0, size: int = 1, kind: str = "tp") -> Group:
    """A group as one rank of `size` sees it, with no torch handle behind it."""
    return Group(f"{kind}-test", kind, tuple(range(size)), None, -1, rank)


class _LocalComm:
    """Stands in for Comm where a test wants each rank's *partial* result:
    reductions are the identity, so the test can add the ranks up itself."""

    def all_reduce(self, t: torch.Tensor, group: Group, op: str = "sum", timeout_s: float | None = None) -> torch.Tensor:
        return t


# ---- CP: zig-zag layout and ring attention maths ------------------------------------------
@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_covers_every_position_once_and_balances_causal_work(cp: int) -> None:
    T = 8 * cp
    held = [zigzag_index(r, cp, T) for r in range(cp)]
    assert sorted(p for h in held for p in h) == list(range(T))
    assert zigzag_index(0, 2, 8) == [0, 1, 6, 7] and zigzag_index(1, 2, 8) == [2, 3, 4, 5]
    work = [sum(p + 1 for p in h) for h in held]        # keys each rank's queries see under a causal mask
    assert len(set(work)) == 1


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_steps_reproduce_full_causal_attention(cp: int) -> None:
    torch.manual_seed(0)
    B, H, T, D = 2, 2, 4 * cp, 4
    q, k, v = (torch.randn(B, H, T, D, dtype=torch.float64) for _ in range(3))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    for i in range(cp):
        idx = {r: torch.tensor(zigzag_index(r, cp, T)) for r in range(cp)}
        qi = q[..., idx[i], :]
        out, lse = attend_own(qi, k[..., idx[i], :], v[..., idx[i], :], i, cp)
        for step in range(1, cp):                           # the K/V the ring would deliver, in ring order
            src = (i - step) % cp
            out, lse = attend_remote(out, lse, qi, k[..., idx[src], :], v[..., idx[src], :], i, src)
        torch.testing.assert_close(out, full[..., idx[i], :], rtol=1e-12, atol=1e-12)


# ---- EP: routing, capacity, aux loss ----------------------------------------------------------
def test_capacity_rule() -> None:
    assert capacity(1.0, 32, 1, 4) == 8
    assert capacity(1.25, 32, 2, 4) == 20
    assert capacity(0.01, 4, 1, 8) == 1               # never zero


def test_route_drops_by_slot_then_token_priority() -> None:
    # 4 tokens, 2 experts, top-2, capacity 3: all first choices fit (expert 0: t0,t1,t2; expert 1: t3);
    # second choices queue behind them: expert 1 takes t0 and t1, expert 0 has no room for t3's.
    logits = torch.tensor([[[2.0, 1.0], [2.0, 1.0], [2.0, 1.0], [1.0, 2.0]]], dtype=torch.float64)
    r = route(logits, top_k=2, cap=3)
    assert r.experts[0].tolist() == [[0, 1], [0, 1], [0, 1], [1, 0]]
    assert r.keep[0].tolist() == [[True, True], [True, True], [True, False], [True, False]]
    torch.testing.assert_close(r.gates.sum(-1), torch.ones(1, 4, dtype=torch.float64))   # renormalised for k > 1


def test_aux_loss_is_one_when_balanced_and_grows_when_not() -> None:
    balanced = torch.tensor([[[5.0, 0.0], [0.0, 5.0]]], dtype=torch.float64)
    skewed = torch.tensor([[[5.0, 0.0], [5.0, 0.0]]], dtype=torch.float64)
    assert float(route(balanced, 1, 2).aux) == pytest.approx(1.0)
    assert float(route(skewed, 1, 2).aux) > 1.9


def test_moe_block_equals_gate_weighted_experts_and_counts_drops() -> None:
    torch.manual_seed(1)
    moe = MoE(8, n_experts=4, top_k=2, capacity_factor=0.5, aux_coef=0.01).double()
    x = torch.randn(3, 8, 8, dtype=torch.float64)
    out = moe(x)
    r = route(moe.router(x), 2, capacity(0.5, 8, 2, 4))
    want = torch.zeros_like(x)
    for b in range(3):
        for t in range(8):
            for j in range(2):
                if r.keep[b, t, j]:
                    e = int(r.experts[b, t, j])
                    want[b, t] += r.gates[b, t, j] * moe.experts[str(e)](x[b, t][None])[0]
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    load, dropped = moe.reset_stats()
    assert dropped == int((~r.keep).sum()) > 0 and sum(load) == int(r.keep.sum())
    assert all(n <= capacity(0.5, 8, 2, 4) * 3 for n in load)          # 3 sequences, one capacity each


def test_moe_aux_gradient_reaches_the_router() -> None:
    torch.manual_seed(2)
    moe = MoE(8, n_experts=2, top_k=1, capacity_factor=2.0, aux_coef=1.0).double()
    x = torch.randn(2, 4, 8, dtype=torch.float64)
    moe(x).sum().backward()
    with_aux = moe.router.weight.grad.clone()
    moe.zero_grad()
    moe.aux_coef = 0.0
    moe(x).sum().backward()
    assert not torch.allclose(with_aux, moe.router.weight.grad)


# ---- TP: sharding maps and the layers' partial results ---------------------------------------
def test_head_rows_pick_the_same_heads_in_q_k_and_v() -> None:
    assert head_rows(8, 4, 1, 2, blocks=3) == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]
    rows = [head_rows(8, 4, r, 2, blocks=3) for r in range(2)]
    assert sorted(rows[0] + rows[1]) == list(range(24))
    assert contiguous_part(10, 1, 2) == [5, 6, 7, 8, 9]


def test_column_then_row_parallel_partials_sum_to_the_full_mlp() -> None:
    torch.manual_seed(3)
    fc, proj = torch.nn.Linear(4, 8).double(), torch.nn.Linear(8, 4).double()
    x = torch.randn(3, 4, dtype=torch.float64)
    full = proj(F.gelu(fc(x)))
    comm, tp = _LocalComm(), 2
    parts = []
    for r in range(tp):
        cols = contiguous_part(8, r, tp)
        col = ColumnParallelLinear(fc, cols, comm, _group(r, tp))
        row = RowParallelLinear(proj, cols, comm, _group(r, tp))
        assert col.weight.tp_shard == (0, cols) and row.weight.tp_shard == (1, cols)
        assert not hasattr(row.bias, "tp_shard")                       # replicated, added once after the sum
        parts.append(row(F.gelu(col(x))) - row.bias)
    torch.testing.assert_close(sum(parts) + proj.bias, full)


def test_vocab_parallel_embedding_partials_sum_to_the_full_lookup() -> None:
    torch.manual_seed(4)
    emb = torch.nn.Embedding(10, 3).double()
    idx = torch.tensor([[0, 4, 5, 9]])
    parts = [VocabParallelEmbedding(emb, _LocalComm(), _group(r, 2))(idx) for r in range(2)]
    torch.testing.assert_close(parts[0] + parts[1], emb(idx))


def test_vocab_parallel_cross_entropy_on_one_rank_matches_torch() -> None:
    torch.manual_seed(5)
    logits = torch.randn(6, 11, dtype=torch.float64, requires_grad=True)
    target = torch.randint(0, 11, (6,))
    ours = vocab_parallel_cross_entropy(logits, target, 0, _LocalComm(), _group())
    (g_ours,) = torch.autograd.grad(ours.mean(), logits)
    ref = F.cross_entropy(logits, target)
    (g_ref,) = torch.autograd.grad(ref, logits)
    assert float(ours.detach().mean()) == pytest.approx(float(ref.detach()), rel=1e-13)
    torch.testing.assert_close(g_ours, g_ref, rtol=1e-12, atol=1e-15)


# ---- ZeRO ------------------------------------------------------------------------------------
def test_zero_shards_tile_every_parameter_exactly_once() -> None:
    params = [torch.nn.Parameter(torch.zeros(n, dtype=torch.float64)) for n in (5, 3, 7)]
    for size in (2, 3, 4):
        shards = [ZeroShard(params, None, _group(r, size, "dp"), 2, size, 1e-3) for r in range(size)]
        for i, p in enumerate(params):
            covered = []
            for z in shards:
                z.grad_shard = torch.arange(z.lo, z.lo + z.shard, dtype=torch.float64)
                piece = z.grad_piece(i)
                if piece is not None:
                    covered += list(range(piece[1], piece[2]))
            assert covered == list(range(p.numel()))


def test_sharded_adamw_on_one_rank_equals_plain_adamw() -> None:
    torch.manual_seed(6)
    a = [torch.nn.Parameter(torch.randn(n, 2, dtype=torch.float64)) for n in (3, 4)]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opt = torch.optim.AdamW(a, lr=0.1, weight_decay=0.0)
    zero = ZeroShard(b, Comm(NullRecorder(0, 1), 0, 1), _group(0, 1, "dp"), 2, 1, 0.1)   # one rank: no comm
    for _ in range(3):
        grads = [torch.randn_like(p) for p in a]
        for p, q, g in zip(a, b, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        zero.reduce(None)
        zero.step(1.0)
    for p, q in zip(a, b):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


# ---- PP: the executor on one rank (virtual stages hand over locally) -------------------------
class _ContextRecorder(NullRecorder):
    """Records (span name, step context) so the test can see the tagging."""

    def __init__(self) -> None:
        super().__init__(0, 1)
        self.spans: list[tuple[str, int, int, int]] = []

    def span(self, name: str, *args, **kwargs):
        c = self.context
        self.spans.append((name, c.stage, c.chunk, c.microbatch))
        return super().span(name)


def test_executor_runs_virtual_stages_on_one_rank_like_the_reference() -> None:
    cfg = RunConfig(vpp=2, schedule="interleaved", n_layer=3, pp_layers=[1, 2], microbatches=2, steps=1,
                    batch_size=4, dtype="float64").validate()
    full = make_model(cfg)
    me, comm = _group(), Comm(NullRecorder(0, 1), 0, 1)           # one-rank groups: every op returns early
    lay = Layout(comm, me, me, me, list(range(cfg.block_size)))
    chunks = [ParallelStage(full, range(0, 1), True, False, lay), ParallelStage(full, range(1, 3), False, True, lay)]
    rec = _ContextRecorder()
    ex = PipelineExecutor(chunks, "interleaved", cfg.microbatches, comm, _group(0, 1, "pp"), rec)
    x, y = global_batch(cfg.seed, 0, cfg.batch_size, cfg.block_size)
    loss = ex.run(list(x.chunk(2)), list(y.chunk(2)), (2, cfg.block_size, cfg.n_embd), torch.float64)
    ref = run_reference(cfg)
    assert float(loss) == pytest.approx(ref.losses[0], rel=1e-12)
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            torch.testing.assert_close(p.grad, ref.grads[0][name], rtol=1e-10, atol=1e-14)
    want = [("forward" if a.kind == "F" else "backward", a.stage, a.stage, a.microbatch)   # chunk == stage: p = 1
            for a in build_schedule("interleaved", 1, 2, 2)[0]]
    assert rec.spans == want
    assert rec.context.stage == rec.context.microbatch == -1           # reset after the step


# ---- config rules added with these modes -----------------------------------------------------
def test_moe_does_not_combine_with_cp() -> None:
    with pytest.raises(ConfigError) as err:
        RunConfig(cp=2, n_experts=2).validate()
    assert str(err.value) == ("MoE (--n-experts 2) does not combine with --cp 2: routing groups are whole "
                              "sequences, which cp splits across ranks")


def test_ep_defaults_one_expert_per_rank_and_moe_model_has_expert_names() -> None:
    cfg = RunConfig(dp=2, ep=2).validate()
    assert cfg.n_experts == 2
    names = {n for n, _ in make_model(cfg).named_parameters()}
    assert "blocks.0.mlp.experts.1.fc.weight" in names and "blocks.1.mlp.router.weight" in names
    assert len(moe_blocks(make_model(cfg))) == cfg.n_layer
    assert math.isclose(cfg.aux_loss_coef, 0.01)
