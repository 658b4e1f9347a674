"""The op table, its one wrapper and its hooks, without processes: a fake
process group whose issue returns a finished work, and a recorder that keeps
rows in lists. Also the NCCL completion poller, driven by fake works."""
from __future__ import annotations

import inspect
import threading
import time
from typing import Any

import pytest
import torch

from ncclscope import schema as S
from ncclscope.runtime import comm as C
from ncclscope.runtime import comm_nccl
from ncclscope.runtime.faults import FaultPlan
from ncclscope.runtime.recorder import Recorder

pytestmark = pytest.mark.timeout(60)


class Rec:
    def __init__(self) -> None:
        self.begins: list[tuple[str, dict[str, Any]]] = []
        self.ends: list[tuple[int, str, str]] = []
        self.context = type("Ctx", (), {"step": 0, "microbatch": -1, "stage": -1, "chunk": -1})()
        self.stacks = 0

    def begin(self, kind: str, op: str, *args: Any, **kw: Any) -> int:
        """Bound as Recorder.begin binds them (the wrapper passes them positionally on its hot path)."""
        bound = inspect.signature(Recorder.begin).bind(None, kind, op, *args, **kw).arguments
        self.begins.append((op, {k: v for k, v in bound.items() if k not in ("self", "kind", "op_name")}))
        return len(self.begins) - 1

    def end(self, op_id: int, status: str = S.STATUS_OK, message: str = "") -> None:
        self.ends.append((op_id, status, message))

    def flush(self) -> None:
        pass

    def dump_stacks(self, reason: str) -> None:
        self.stacks += 1


class Work:
    def __init__(self, done: bool = True) -> None:
        self.done, self.waited = done, 0

    def wait(self, timeout: Any = None) -> bool:
        self.waited += 1
        return True

    def is_completed(self) -> bool:
        return self.done

    def exception(self) -> Any:
        return None


def _comm(backend: str = "gloo") -> tuple[C.Comm, Rec, list[tuple[str, Any]]]:
    rec = Rec()
    comm = C.Comm(rec, 0, 4, timeout_s=5.0, backend=backend)
    issued: list[tuple[str, Any]] = []
    for name, ranks in (("world", (0, 1, 2, 3)), ("dp0", (0, 2)), ("tp0", (0, 1)), ("solo", (0,))):
        comm.groups[name] = C.Group(name, name.rstrip("0"), ranks, object(), len(comm.groups), 0)
    return comm, rec, issued


@pytest.fixture
def fake_issue(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, Any]]:
    """Every table row issues into a list instead of torch.distributed."""
    issued: list[tuple[str, str, Any]] = []
    for name, op in list(C.OPS.items()):
        def issue(pg: Any, t: Any, out: Any, a: Any, tag: int, _name: str = name) -> Work:
            issued.append((_name, pg, t))
            return Work()
        new = op._replace(issue=issue)
        monkeypatch.setattr(C, name.upper(), new)
        C.OPS[name] = new
    return issued


def test_every_public_op_is_one_table_row(fake_issue: list) -> None:
    comm, rec, _ = _comm()
    dp, t = comm.groups["dp0"], torch.ones(3)
    comm.all_reduce(t, dp, op="max")
    comm.broadcast(t, 2, dp)
    comm.all_gather([torch.zeros(3), torch.zeros(3)], t, dp)
    comm.all_gather_into_tensor(torch.zeros(6), t, dp)
    comm.reduce_scatter(torch.zeros(3), [t, t], dp)
    comm.reduce_scatter_tensor(torch.zeros(3), torch.ones(6), dp)
    comm.all_to_all_single(torch.zeros(4), torch.ones(4), dp)
    comm.barrier(dp)
    comm.send(t, 2, dp, tag=5)
    comm.recv(t, 2, dp, tag=5)
    comm.isend(t, 2, dp).wait()
    comm.irecv(t, 2, dp).wait()
    names = [b[0] for b in rec.begins]
    assert names == ["all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                     "reduce_scatter_tensor", "all_to_all_single", "barrier", "send", "recv", "isend", "irecv"]
    assert [n for n, _, _ in fake_issue] == names
    by = dict(rec.begins)
    assert by["all_reduce"]["reduce_op"] == "max" and by["all_reduce"]["seq"] == 1
    assert by["broadcast"]["peer"] == 2 and by["broadcast"]["seq"] == 2
    assert by["reduce_scatter"]["sizes"] == "[[3]]"          # the list form is described by its first input
    assert by["send"]["p2p_seq"] == 1 and by["isend"]["p2p_seq"] == 2 and by["recv"]["tag"] == 5
    assert all(status == S.STATUS_OK for _, status, _ in rec.ends) and len(rec.ends) == len(names)


def test_a_group_of_one_returns_early_without_rows(fake_issue: list) -> None:
    comm, rec, _ = _comm()
    solo = comm.groups["solo"]
    out = torch.zeros(3)
    comm.all_gather_into_tensor(out, torch.full((3,), 2.0), solo)
    comm.reduce_scatter(out, [torch.full((3,), 5.0)], solo)
    comm.barrier(solo)
    assert out.tolist() == [5.0, 5.0, 5.0] and not rec.begins and not fake_issue


def test_hooks_may_skip_redirect_replace_or_delay(fake_issue: list) -> None:
    comm, rec, _ = _comm()
    dp, tp, t = comm.groups["dp0"], comm.groups["tp0"], torch.ones(2)
    seen: list[str] = []

    def hook(comm_: C.Comm, call: C.Call) -> None:
        seen.append(call.op.name)
        if call.op.name == "barrier":
            call.skip = True
        elif call.op.name == "all_gather_into_tensor":
            call.group = tp
        elif call.op.name == "all_reduce":
            call.op, call.arg = C.OPS["broadcast"], call.group.ranks[0]
        elif call.op.name == "reduce_scatter_tensor":
            call.timeout_s = 0.5
            time.sleep(0.01)

    comm.add_hook(hook)
    comm.barrier(dp)
    comm.all_gather_into_tensor(torch.zeros(4), t, dp)
    assert comm.all_reduce(t, dp) is t
    comm.reduce_scatter_tensor(torch.zeros(1), t, dp)
    assert seen == ["barrier", "all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor"]
    assert [(b[0], b[1]["group"]) for b in rec.begins] == [
        ("all_gather_into_tensor", "tp0"), ("broadcast", "dp0"), ("reduce_scatter_tensor", "dp0")]
    assert rec.begins[1][1]["peer"] == 0 and rec.begins[2][1]["timeout_ms"] == 500


def test_fault_plan_registers_comm_hooks_that_fire_once_at_their_step(fake_issue: list) -> None:
    comm, rec, _ = _comm()
    plan = FaultPlan(["skip:rank=0,step=1,group=dp", "mismatch:rank=0,step=2,what=size",
                      "wrong_group:rank=0,step=3,use=tp", "skip:rank=1,step=1"], 0, rec)
    plan.install(comm=comm)
    assert len(comm.hooks) == 3                     # rank 1's drill is not this rank's
    dp, t = comm.groups["dp0"], torch.ones(2)
    for step in range(5):
        rec.context.step = step
        comm.all_reduce(t, dp)
        comm.all_reduce(t, dp)
    groups = [b[1]["group"] for b in rec.begins]
    sizes = [b[1]["sizes"] for b in rec.begins]
    assert len(rec.begins) == 9                     # one skipped, at step 1
    assert sizes[3] == "[[3]]" and sizes[4] == "[[2]]"   # step 2: the first all_reduce is one element longer
    assert groups[5] == "tp0" and groups[6] == "dp0"     # step 3: the first one on the wrong group
    assert t.tolist() == [1.0, 1.0]


def test_no_hooks_no_fault_branch_on_the_hot_path() -> None:
    """The production wrapper names no drill: faults attach only via hooks."""
    import inspect
    src = inspect.getsource(C)
    for word in ("self.faults", "tamper", "FaultPlan", "mismatch", "wrong_group", "p2p_order"):
        assert word not in src, word


# ---- NCCL: end rows at GPU completion ------------------------------------------------
def test_nccl_end_row_is_written_when_the_work_completes(fake_issue: list, monkeypatch) -> None:
    comm, rec, _ = _comm("nccl")
    work = Work(done=False)
    monkeypatch.setattr(C, "ALL_REDUCE", C.ALL_REDUCE._replace(issue=lambda *a: work))
    comm.all_reduce(torch.ones(2), comm.groups["dp0"])
    assert work.waited == 1                         # the stream was ordered after it; the CPU went on
    time.sleep(0.05)
    assert rec.ends == []                           # not completed on the GPU: an open begin row
    work.done = True
    deadline = time.monotonic() + 5
    while not rec.ends and time.monotonic() < deadline:
        time.sleep(0.005)
    assert rec.ends == [(0, S.STATUS_OK, "")]


def test_nccl_timeout_row_then_the_training_thread_raises(fake_issue: list, monkeypatch) -> None:
    comm, rec, _ = _comm("nccl")
    stuck = threading.Event()
    comm.on_stuck = lambda err: stuck.set()
    monkeypatch.setattr(comm_nccl, "STUCK_GRACE_S", 0.05)
    monkeypatch.setattr(C, "ALL_REDUCE", C.ALL_REDUCE._replace(issue=lambda *a: Work(done=False)))
    comm.all_reduce(torch.ones(2), comm.groups["dp0"], timeout_s=0.1)
    deadline = time.monotonic() + 5
    while not rec.ends and time.monotonic() < deadline:
        time.sleep(0.005)
    (op_id, status, message), = rec.ends
    assert status == S.STATUS_TIMEOUT and "all_reduce #1 on dp0[0,2] timed out after 0.1 s" in message
    assert rec.stacks == 1
    assert stuck.wait(5)                            # nobody raised it yet: the rank is stuck in a GPU wait
    with pytest.raises(C.CommTimeoutError) as err:  # any later op, on any group, raises it
        comm.barrier(comm.groups["tp0"])
    assert err.value.op == "all_reduce" and err.value.seq == 1 and comm.failure_seen


def test_nccl_error_on_the_gpu_is_an_error_row_and_fails_the_rank(fake_issue: list, monkeypatch) -> None:
    comm, rec, _ = _comm("nccl")

    class Broken(Work):
        def exception(self) -> Any:
            return RuntimeError("NCCL error: remote process exited or there was a network error")

    monkeypatch.setattr(C, "ALL_REDUCE", C.ALL_REDUCE._replace(issue=lambda *a: Broken()))
    comm.all_reduce(torch.ones(2), comm.groups["dp0"])
    deadline = time.monotonic() + 5
    while not rec.ends and time.monotonic() < deadline:
        time.sleep(0.005)
    (_, status, message), = rec.ends
    assert status == S.STATUS_ERROR and "failed on the GPU: NCCL error: remote process exited" in message
    with pytest.raises(C.CommError):
        comm.all_reduce(torch.ones(2), comm.groups["tp0"])
