"""Pure-logic tests of the runtime's building blocks: config, mesh grid, fault specs."""
from __future__ import annotations

import pytest

from ncclscope.runtime.config import ConfigError, RunConfig
from ncclscope.runtime.faults import FaultSpecError, parse_spec
from ncclscope.runtime.mesh import Grid, fingerprint

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize("kwargs, message", [
    (dict(tp=2, pp=2, dp=2, nproc=6), "tp*pp*dp*cp = 2*2*2*1 = 8, but --nproc is 6"),
    (dict(tp=3, n_head=2), "--n-head 2 is not divisible by --tp 3"),
    (dict(n_embd=30, n_head=4), "--n-embd 30 is not divisible by --n-head 4"),
    (dict(dp=4, ep=3), "--dp 4 is not divisible by --ep 3 (experts are sharded across data-parallel ranks)"),
    (dict(pp=2, n_layer=3), "--n-layer 3 is not divisible by --pp 2 (give another --n-layer, or --pp-layers)"),
    (dict(pp=2, pp_layers=[1, 2], n_layer=4), "--pp-layers 1,2 sums to 3, but --n-layer is 4"),
    (dict(pp=2, pp_layers=[4], n_layer=4), "--pp-layers has 1 entries, but --pp 2 makes 2 stages"),
    (dict(pp=2, vpp=2, schedule="interleaved", microbatches=3, batch_size=6),
     "--schedule interleaved needs --microbatches divisible by --pp: --microbatches 3 is not divisible by --pp 2"),
    (dict(vpp=2, schedule="1f1b"), "--vpp 2 needs --schedule interleaved (got 1f1b)"),
    (dict(dp=3, batch_size=8), "--batch-size 8 is not divisible by --dp 3"),
    (dict(dp=2, batch_size=8, microbatches=3), "--batch-size 8 / --dp 2 = 4 sequences per replica is not divisible by --microbatches 3"),
    (dict(cp=3, block_size=32), "--block-size 32 is not divisible by 2 x --cp 3 = 6 (zig-zag chunks)"),
    (dict(tp=0), "--tp must be a positive integer, got 0"),
    (dict(schedule="zb"), "--schedule must be one of gpipe, 1f1b, interleaved, got 'zb'"),
])
def test_config_errors_show_the_numbers(kwargs, message):
    with pytest.raises(ConfigError) as err:
        RunConfig(**kwargs).validate()
    assert str(err.value) == message


def test_config_defaults_nproc_to_product():
    cfg = RunConfig(tp=2, pp=2, dp=2).validate()
    assert cfg.nproc == 8 and cfg.world_size == 8


def test_grid_is_megatron_ordered():
    g = Grid(tp=2, cp=1, dp=2, pp=2)
    assert [g.coords(r)["tp"] for r in range(8)] == [0, 1] * 4
    assert g.coords(5) == {"tp": 1, "cp": 0, "dp": 0, "pp": 1, "ep": 0}
    plan = {name: members for name, _, members in g.plan()}
    assert plan["tp0"] == [0, 1] and plan["dp0"] == [0, 2] and plan["dp1"] == [1, 3]
    assert plan["pp0"] == [0, 4] and plan["pp3"] == [3, 7]


@pytest.mark.parametrize("tp,cp,dp,pp,ep", [(2, 1, 2, 2, 1), (1, 2, 2, 1, 1), (1, 1, 4, 1, 2), (2, 2, 2, 1, 2)])
def test_groups_of_a_kind_partition_the_world(tp, cp, dp, pp, ep):
    g = Grid(tp=tp, cp=cp, dp=dp, pp=pp, ep=ep)
    by_kind: dict[str, list[list[int]]] = {}
    for _, kind, members in g.plan():
        by_kind.setdefault(kind, []).append(members)
    for kind, groups in by_kind.items():
        flat = sorted(r for m in groups for r in m)
        assert flat == list(range(g.world_size)), kind
    # orthogonal: a tp group and a dp group share at most one rank
    for a in by_kind["tp"]:
        for b in by_kind["dp"]:
            assert len(set(a) & set(b)) <= 1
    if ep > 1:
        for e in by_kind["ep"]:
            assert len(e) == ep and any(set(e) <= set(d) for d in by_kind["dp"])


def test_fingerprint_sees_order():
    plan = Grid(dp=2, pp=2).plan()
    assert fingerprint(plan) != fingerprint(list(reversed(plan)))
    assert 0 <= fingerprint(plan) < 2**63


def test_fault_specs():
    f = parse_spec("skip:rank=1,step=2,op=all_reduce,group=dp")
    assert (f.kind, f.rank, f.step, f.params) == ("skip", 1, 2, {"op": "all_reduce", "group": "dp"})
    assert str(f) == "skip:rank=1,step=2,op=all_reduce,group=dp"
    for bad, text in [("explode:rank=1", "unknown kind 'explode'"), ("skip:rank=1", "skip needs step"),
                      ("skip:rank=1,step=x", "must be integers"), ("slow:rank=1,factor=0.5", "factor must be"),
                      ("mismatch:rank=0,step=1,what=color", "what must be size, dtype or type"),
                      ("hang:rank=1,step=1,use=dp", "unknown key 'use'; hang takes rank, step"), ("kill:rank", "key=value")]:
        with pytest.raises(FaultSpecError) as err:
            parse_spec(bad)
        assert text in str(err.value)
