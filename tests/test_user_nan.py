"""A NaN from one rank's batch in a traced user job: the tracer marks the origin, the analyzer names it.

`ncclscope run` checks the input of every reducing collective, and each gradient of
a DDP module before its reducer sees it (runtime/usertrace/nancheck.py); the first
non-finite one on a rank is one `nonfinite` marker row. divergence.py names the
markers of the first step that no other marker happens-before (user traces have
no grad norms). Analyzer cases are hand-built traces; tracer cases run on a
one-rank gloo world in this process (FileStore), a few hundred ms.
"""
from __future__ import annotations

import datetime
import sys
import textwrap

import numpy as np
import pandas as pd
import pytest

from ncclscope.perf.divergence import analyze_divergence
from trace_builder import TraceBuilder

GRAD = "gradient of 0.weight (float32 [32, 16]) before DDP's all-reduce: 4 NaN, 0 Inf"


def _input(op: str = "all_reduce", seq: int = 5) -> str:
    return f"input to {op} on world #{seq} (float32 [16]): 1 NaN, 0 Inf, before the reduction"


def _nan(trace):
    found = [f for f in analyze_divergence(trace).findings if f.kind == "nan"]
    assert len(found) <= 1
    return found[0] if found else None


def _steps(b: TraceBuilder, world: int, steps: int, seq0: int = 1) -> int:
    """`steps` steps of one all_reduce on world per rank (seq seq0, seq0+1, ...), 1 s apart; next seq."""
    for s in range(steps):
        for r in range(world):
            b.marker(r, "step", s + 0.01, message=f"step {s} begins", step=s)
            b.collective(r, "world", seq0 + s, start=s + 0.5, end=s + 0.6, step=s)
    return seq0 + steps


# ---- analyzer: naming the origin ---------------------------------------------------------------
def test_the_first_step_marker_is_the_origin_and_later_ones_inherited():
    b = TraceBuilder(4, groups={"world": [0, 1, 2, 3]})
    _steps(b, 4, 4)
    b.marker(2, "nonfinite", 1.3, message=GRAD, step=1)          # its own batch, during backward
    for r in (0, 1, 3, 2):
        b.marker(r, "nonfinite", 2.3, message=GRAD, step=2)      # the next step: every rank (rank 2's is a repeat)
    f = _nan(b.build())
    assert f is not None and f.severity == "error"
    assert f.ranks == [2] and f.data["step"] == 1 and f.data["inherited"] == [0, 1, 3]
    assert f.title == ("first NaN/Inf at step 1 on rank 2, in its own gradient before any reduction; "
                       "it spread to 4 ranks")
    assert f.evidence[0].rank == 2 and "0.weight" in f.evidence[0].note


def test_a_marker_the_reduction_caused_at_the_same_step_is_not_an_origin():
    """Rank 1's Inf goes into all_reduce #1; ranks 0 and 2 put its result into all_reduce #2 at the
    same step: their markers follow #1, which rank 1 entered after its marker (happens-before)."""
    b = TraceBuilder(3, groups={"world": [0, 1, 2]})
    b.marker(1, "nonfinite", 0.10, message=_input(seq=1), step=0)
    for r in range(3):
        b.collective(r, "world", 1, start=0.2 + 0.01 * r, end=0.3, step=0)
    for r in (0, 2):   # earlier in aligned time than nothing: only the order through #1 says who came first
        b.marker(r, "nonfinite", 0.35, message=_input(seq=2), step=0)
    for r in range(3):
        b.collective(r, "world", 2, start=0.36, end=0.4, step=0)
    f = _nan(b.build())
    assert f.ranks == [1] and f.data["inherited"] == [0, 2]
    assert "in its own input to all_reduce before any reduction" in f.title


def test_p2p_carries_it_too():
    b = TraceBuilder(2, groups={"world": [0, 1]})
    b.marker(0, "nonfinite", 0.1, message=_input("reduce", 3), step=0)
    b.p2p(0, "send", peer=1, seq=1, start=0.2, end=0.3)
    b.p2p(1, "recv", peer=0, seq=1, start=0.15, end=0.3)
    b.marker(1, "nonfinite", 0.4, message=_input(seq=4), step=0)
    f = _nan(b.build())
    assert f.ranks == [0]
    assert "input to reduce" in f.title


def test_unrelated_nans_at_the_same_first_step_are_all_named():
    """Two corrupt batches in one step: neither marker follows the other through any op."""
    b = TraceBuilder(4, groups={"world": [0, 1, 2, 3]})
    _steps(b, 4, 2)
    b.marker(3, "nonfinite", 1.2, message=GRAD, step=1)
    b.marker(1, "nonfinite", 1.4, message=GRAD, step=1)   # later in time, but no op between them
    b.marker(0, "nonfinite", 1.7, message=GRAD, step=1)   # after all_reduce #2, which 1 and 3 entered after theirs
    f = _nan(b.build())
    assert f.ranks == [1, 3] and f.data["inherited"] == [0]
    assert f.title == ("first NaN/Inf at step 1 on ranks 1,3, in their own gradient before any reduction; "
                       "it spread to 3 ranks")


def test_the_step_decides_before_the_time():
    """An earlier step wins even when the clocks put its marker later (aligned time is only an estimate)."""
    b = TraceBuilder(2, groups={"world": [0, 1]})
    b.marker(0, "nonfinite", 5.0, message=GRAD, step=3)
    b.marker(1, "nonfinite", 4.0, message=GRAD, step=4)
    f = _nan(b.build())
    assert f.ranks == [0] and f.data["step"] == 3


# ---- analyzer: silence ---------------------------------------------------------------------------
def test_a_healthy_user_trace_is_silent():
    b = TraceBuilder(4, groups={"world": [0, 1, 2, 3]})
    _steps(b, 4, 5)
    b.marker(0, "annotation", 0.2, message="nonfinite")   # a user's own annotation is not the tracer's marker
    trace = b.build()
    assert _nan(trace) is None
    res = analyze_divergence(trace)
    assert not res.findings and not len(res.nonfinite)


def test_user_metrics_rows_without_norms_are_silent_and_markers_still_count():
    """`ncclscope run` writes a metrics row per step with every norm NaN ("not recorded"): not a NaN."""
    b = TraceBuilder(2, groups={"world": [0, 1]})
    _steps(b, 2, 3)
    trace = b.build()
    rows = [{"rank": r, "step": s, "time_ns": b.ns(s + 0.9), "step_time_s": 1.0, "loss": np.nan,
             "grad_norm_local": np.nan, "grad_norm_global": np.nan, "grad_norm_reduced": np.nan,
             "param_checksum": np.nan} for r in range(2) for s in range(3)]
    trace.metrics = pd.DataFrame(rows)
    assert not analyze_divergence(trace).findings
    b.marker(1, "nonfinite", 1.3, message=GRAD, step=1)
    trace = b.build()
    trace.metrics = pd.DataFrame(rows)
    f = _nan(trace)
    assert f is not None and f.ranks == [1] and f.data["step"] == 1


# ---- tracer: the check ----------------------------------------------------------------------------
torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from ncclscope import schema as S  # noqa: E402
from ncclscope.runtime.usertrace.nancheck import nonfinite_counts  # noqa: E402


def test_nonfinite_counts():
    assert nonfinite_counts(torch.ones(8)) is None
    t = torch.ones(8)
    t[1], t[5] = float("nan"), float("-inf")
    assert nonfinite_counts(t) == (1, 1)
    assert nonfinite_counts(t, nan_only=True) == (1, 0)
    only_inf = torch.tensor([float("-inf"), 1.0])
    assert nonfinite_counts(only_inf, nan_only=True) is None          # MAX's identity
    assert nonfinite_counts(torch.full((4,), 60000.0, dtype=torch.float16)) is None   # sum overflows fp16: finite
    assert nonfinite_counts(torch.full((4,), 3e38)) is None           # sum overflows fp32: finite all the same
    assert nonfinite_counts(torch.tensor([float("nan")], dtype=torch.bfloat16)) == (1, 0)
    assert nonfinite_counts(torch.arange(4)) is None                  # integers: nothing to check
    assert nonfinite_counts(torch.ones(3, requires_grad=True) * float("inf")) == (0, 3)
    assert nonfinite_counts(torch.empty(4, device="meta")) is None    # not readable: never an error


def _markers(rec) -> list[dict]:
    cols = S.EVENT_COLUMNS
    rows = [dict(zip(cols, r)) for r in rec.seen]
    return [r for r in rows if r["phase"] == S.PHASE_INSTANT and r["op_name"] == "nonfinite"]


@pytest.fixture()
def world(tmp_path, request):
    from ncclscope.runtime.recorder import Recorder
    from ncclscope.runtime.usertrace.tracer import Tracer
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    rec = Recorder(tmp_path, 0, 1)
    rec.context.step = 0
    rec.seen = []
    append = rec._append

    def seen(row):
        rec.seen.append(row)
        append(row)
    rec._append = seen
    tracer = Tracer(rec, 0, 1, timeout_s=30, clock_sync=False, nan_check=getattr(request, "param", "auto")).install()
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=30))
        yield rec, tracer
        dist.destroy_process_group()
    finally:
        tracer.close()
        rec.close()


def test_one_marker_at_the_first_nonfinite_input_then_no_more(world):
    rec, tracer = world
    t = torch.ones(16)
    dist.all_reduce(t)
    dist.all_reduce(torch.tensor([float("-inf"), 2.0]), op=dist.ReduceOp.MAX)   # a legitimate -inf
    dist.all_gather_into_tensor(torch.empty(1), torch.tensor([float("nan")]))   # not a reduction
    assert _markers(rec) == []
    rec.context.step = 3
    bad = torch.ones(16)
    bad[2] = float("nan")
    dist.all_reduce(bad); line = sys._getframe().f_lineno   # noqa: E702
    dist.all_reduce(bad)
    dist.reduce(torch.full((2,), float("inf")), dst=0)
    (m,) = _markers(rec)
    assert m["step"] == 3 and m["kind"] == S.KIND_MARKER
    assert m["call_site"] == f"tests/test_user_nan.py:{line}"
    assert m["message"] == "input to all_reduce on world #4 (float32 [16]): 1 NaN, 0 Inf, before the reduction"
    assert not tracer._nan_live


def test_the_general_wrapper_checks_lists_and_rooted_reductions(world):
    rec, _ = world
    dist.reduce_scatter(torch.empty(2), [torch.ones(2)])
    dist.reduce(torch.ones(3), dst=0)
    assert _markers(rec) == []
    dist.reduce_scatter(torch.empty(2), [torch.tensor([1.0, float("inf")])])
    (m,) = _markers(rec)
    assert m["message"].startswith("input to reduce_scatter on world") and "0 NaN, 1 Inf" in m["message"]


@pytest.mark.parametrize("world", ["off"], indirect=True)
def test_no_nan_check(world):
    rec, tracer = world
    from torch.nn.parallel import DistributedDataParallel as DDP
    assert getattr(DDP.__init__, "__wrapped__", None) is None   # nothing patched
    dist.all_reduce(torch.full((4,), float("nan")))
    assert _markers(rec) == []


def test_ddp_gradients_are_checked_before_the_reducer_and_a_users_comm_hook_still_runs(world):
    rec, tracer = world
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1)))
    hooked = []

    def my_hook(state, bucket):   # the user's own comm hook: must be called, and its result used
        hooked.append(1)
        fut = torch.futures.Future()
        fut.set_result(bucket.buffer() * 2)
        return fut
    model.register_comm_hook(None, my_hook)
    x = torch.randn(2, 4)
    model(x).sum().backward()
    grad = model.module[1].weight.grad.clone()
    plain = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    plain.load_state_dict(model.module.state_dict())
    plain(x).sum().backward()
    assert hooked and torch.allclose(grad, plain[1].weight.grad * 2)   # behaviour unchanged
    assert _markers(rec) == []
    rec.context.step = 2
    x[1, 2] = float("nan")
    model.zero_grad()
    model(x).sum().backward()
    model(x).sum().backward()
    (m,) = _markers(rec)
    assert m["step"] == 2 and m["message"].startswith("gradient of ") and "before DDP's all-reduce" in m["message"]
    assert m["call_site"].startswith("tests/test_user_nan.py:")


# ---- end to end: `ncclscope run` on a DDP job whose rank 1 reads a NaN at step 2 -------------------------
DDP_NAN = textwrap.dedent('''
    import datetime, torch, torch.distributed as dist, torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=30))
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for step in range(4):
        x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
        if rank == 1 and step == 2:
            x[3, 5] = float("nan")
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    dist.destroy_process_group()
''')


@pytest.mark.spawn
@pytest.mark.e2e
def test_ncclscope_run_names_the_rank_and_step_of_a_ddp_nan(tmp_path, zygote):
    """`ncclscope run` launched from a fork of the suite's warm zygote (conftest: the launcher does not
    import torch again; its own session, killed whole past the timeout and reaped); the ranks are fresh
    interpreters started by torch's elastic agent, as under a user's `ncclscope run`."""
    script = tmp_path / "ddp_nan.py"
    script.write_text(DDP_NAN)
    p = zygote.cli("user-nan", ["run", "--nproc", "2", "--out", str(tmp_path / "run"), "--", str(script)],
                   timeout=300)
    assert "NAN: first NaN/Inf at step 2 on rank 1, in its own gradient before any reduction" in p.stderr, p.stderr
