"""`ncclscope run` pieces without spawning ranks: argument pass-through, rank
environment, the Flight Recorder merge, the tracer on a one-rank gloo world,
NCCL's GPU-completion ends with fake CUDA events, and the import rule that keeps
the tracer's threads from racing the script's imports (clock offsets:
test_run_clock.py)."""
from __future__ import annotations

import datetime
import json
import pickle
import sys

import pytest

from ncclscope import schema as S
from ncclscope.runtime.usertrace import bootstrap as B
from ncclscope.load import fr_merge


# ---- arguments ------------------------------------------------------------------------
def test_bootstrap_options_stop_at_the_script_whose_args_pass_through_unparsed():
    opts, script, args = B.parse_args(["--out", "runs/x", "--timeout-s=3", "train.py", "--out", "y", "--lr", "1"])
    assert opts["out"] == "runs/x" and opts["timeout_s"] == 3.0
    assert script == "train.py" and args == ["--out", "y", "--lr", "1"]
    opts, script, args = B.parse_args(["--", "t.py", "--", "-x"])
    assert script == "t.py" and args == ["--", "-x"]
    with pytest.raises(B.UsageError):
        B.parse_args(["--nproc", "2", "t.py"])
    with pytest.raises(B.UsageError):
        B.parse_args(["--out", "x"])


def test_cli_run_passes_the_script_args_through():
    from ncclscope.cli.parser import build_parser
    ns = build_parser().parse_args(["run", "--nproc", "2", "--", "examples/ddp.py", "--steps", "3", "--nproc", "9"])
    assert ns.nproc == 2 and ns.command == "run" and ns.script_argv == ["--", "examples/ddp.py", "--steps", "3", "--nproc", "9"]


def test_rank_environment_from_slurm(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_PROCID", "5")
    monkeypatch.setenv("SLURM_NTASKS", "8")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert B.rank_env() == (5, 8, 1, "slurm")
    import os
    assert os.environ["RANK"] == "5" and os.environ["WORLD_SIZE"] == "8"


def test_package_api_is_a_no_op_without_ncclscope_run_and_needs_no_torch():
    import subprocess
    code = "import sys, ncclscope; ncclscope.step(); ncclscope.annotate('eval'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr


# ---- Flight Recorder merge --------------------------------------------------------------------
def _fr_entry(seq: int, op: str, t: int, pg: str = "0", sizes=((4,),)) -> dict:
    return {"record_id": seq - 1, "pg_id": 0, "process_group": (pg, "default_pg"), "collective_seq_id": seq,
            "p2p_seq_id": 0, "op_id": seq, "profiling_name": f"gloo:{op}", "input_sizes": [list(s) for s in sizes],
            "input_dtypes": ["Float"], "output_sizes": [], "output_dtypes": [], "state": "scheduled",
            "retired": False, "time_created_ns": t, "time_discovered_started_ns": None,
            "time_discovered_completed_ns": None, "timeout_ms": 5000, "is_p2p": False, "thread_id": "1",
            "thread_name": "main",
            "frames": [{"name": "backward", "filename": "/x/site-packages/torch/autograd/__init__.py", "line": 3},
                       {"name": "main", "filename": "/home/u/train.py", "line": 42}]}


def test_flight_recorder_only_ops_become_rows_without_duplicating_traced_ones(tmp_path):
    from ncclscope.runtime.recorder import Recorder
    rec = Recorder(tmp_path, 0, 1)
    rec.context.step = 0
    rec.write_meta(groups=[{"name": "world", "kind": "world", "ranks": [0], "creation_order": 0, "backend": "gloo"}],
                   fr_pg_names={"0": "world"})
    base = rec.meta["started_ns"]
    op = rec.begin(S.KIND_COLLECTIVE, "all_reduce", group="world", seq=3, nbytes=4, call_site="train.py:50")
    rec.end(op)
    rec.close("error", "died")                     # not a clean end: the last FR op stays in flight
    entries = [_fr_entry(1, "all_gather", base + 10), _fr_entry(2, "all_reduce", base + 20),
               _fr_entry(3, "all_reduce", base + 30), _fr_entry(4, "all_reduce", base + 2 * 10**12)]
    (tmp_path / "rank-00000" / fr_merge.FR_FILE).write_bytes(pickle.dumps(
        {"version": "2.10", "pg_config": {}, "pg_status": {}, "entries": entries}))
    from ncclscope.load.trace import load
    t = load(tmp_path)
    coll = t.ops[t.ops["kind"] == S.KIND_COLLECTIVE].sort_values("collective_seq_id")
    assert list(coll["collective_seq_id"]) == [1, 2, 3, 4]
    assert list(coll["process_group"]) == ["world"] * 4
    assert list(coll["status"]) == ["ok", "ok", "ok", "inflight"]
    assert list(coll["call_site"])[0].endswith("train.py:42") and list(coll["call_site"])[2] == "train.py:50"
    assert (coll["op_id"] >= fr_merge.OP_ID_BASE).tolist() == [True, True, False, True]


def test_no_dump_leaves_the_events_untouched(tmp_path):
    import pyarrow as pa
    table = S.EVENTS_SCHEMA.empty_table()
    (tmp_path / "rank-00000").mkdir()
    assert fr_merge.merge_rank(tmp_path / "rank-00000", table, []) is table
    assert isinstance(table, pa.Table)


# ---- the tracer, in this process, on a one-rank gloo world --------------------------------------
def test_tracer_rows_groups_and_errors_on_one_rank(tmp_path):
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from ncclscope.runtime.recorder import Recorder
    from ncclscope.runtime.usertrace.tracer import Tracer
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    orig = dist.all_reduce
    rec = Recorder(tmp_path, 0, 1)
    rec.context.step = 0
    tracer = Tracer(rec, 0, 1, timeout_s=30).install()
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=30))
        t = torch.ones(4)
        dist.all_reduce(t); line = sys._getframe().f_lineno   # noqa: E702
        w = dist.all_reduce(t, async_op=True)
        w.wait()
        g = dist.new_group([0])
        dist.all_reduce(t, group=g)
        out = [None]
        dist.all_gather_object(out, {"a": 1})           # one row, not its inner all_gathers
        with pytest.raises(TypeError):
            dist.all_reduce("not a tensor")             # the user's error, unchanged
        opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
        opt.step()
        opt.step()
        dist.destroy_process_group()
    finally:
        tracer.close()
        rec.close()
    assert dist.all_reduce is orig   # uninstalled: torch.distributed is as it was
    from ncclscope.load.trace import load
    ops = load(tmp_path).ops
    ops = ops[ops["op_id"] < fr_merge.OP_ID_BASE]
    assert list(ops["op_name"]) == ["all_reduce", "all_reduce", "all_reduce", "all_gather_object", "all_reduce"]
    assert list(ops["status"]) == ["ok", "ok", "ok", "ok", "error"]
    assert ops["call_site"].iloc[0] == f"tests/test_run_units.py:{line}"
    assert list(ops["process_group"])[:3] == ["world", "world", "g1"]
    assert list(ops["collective_seq_id"])[:2] == [1, 2] and ops["collective_seq_id"].iloc[2] == 1
    assert ops["bytes"].iloc[0] == 16 and ops["input_dtypes"].iloc[0] == "float32"
    groups = json.loads((tmp_path / "rank-00000" / "groups.json").read_text())
    assert [(x["name"], x["ranks"], x["creation_order"]) for x in groups] == [("world", [0], 0), ("g1", [0], 1)]
    metrics = load(tmp_path).metrics
    assert list(metrics["step"]) == [0, 1]


# ---- NCCL ends at GPU completion (runtime/usertrace/gpu.py), with fake CUDA events -----------------
class _FakeEvent:
    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done


class _FakeCudaTensor:
    is_cuda = True


def test_gpu_end_waits_for_the_event_and_a_never_completing_op_stays_open(tmp_path):
    from ncclscope.runtime.recorder import Recorder
    from ncclscope.runtime.usertrace.gpu import GpuEnds
    rec = Recorder(tmp_path, 0, 1)
    rec.context.step = 0
    events: list[_FakeEvent] = []

    def event_after(tensor):
        assert tensor.is_cuda
        events.append(_FakeEvent())
        return events[-1]
    inflight: dict = {}
    gpu = GpuEnds(rec, inflight, event_after=event_after)
    woken = []
    gpu.wake = lambda: woken.append(1)
    ops = []
    for _ in range(3):
        op = rec.begin(S.KIND_COLLECTIVE, "all_reduce", group="world", seq=len(ops) + 1)
        inflight[op] = (0.0, "all_reduce", "world", len(ops) + 1)
        assert gpu.track(op, _FakeCudaTensor())
        ops.append(op)
    assert woken == [1]                        # the poller is woken once, for the first pending event
    assert gpu.poll() == 3                     # nothing completed on the GPU yet: no end rows
    events[1].done = True                      # out of order (another stream): asked anyway
    assert gpu.poll() == 2 and set(inflight) == {ops[0], ops[2]}
    events[0].done = True
    assert gpu.poll() == 1
    rec.close()
    from ncclscope.load.trace import load
    t = load(tmp_path).ops
    t = t[t["op_id"] < fr_merge.OP_ID_BASE].set_index("op_id")
    assert list(t.loc[ops, "status"]) == ["ok", "ok", "inflight"]   # op 3 never completed: an open begin row


def test_gpu_end_falls_back_to_the_call_return_when_events_fail(tmp_path, capsys):
    from ncclscope.runtime.recorder import Recorder
    from ncclscope.runtime.usertrace.gpu import GpuEnds
    rec = Recorder(tmp_path, 0, 1)

    def broken(tensor):
        raise RuntimeError("CUDA driver gone")
    gpu = GpuEnds(rec, {}, event_after=broken)
    assert not gpu.track(1, _FakeCudaTensor()) and not gpu.track(2, _FakeCudaTensor())
    assert capsys.readouterr().err.count("GPU completion times off") == 1
    rec.close()


def test_cpu_ops_never_touch_cuda(tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from ncclscope.runtime.recorder import Recorder
    from ncclscope.runtime.usertrace.tracer import Tracer
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")

    def no_cuda(*a, **k):
        raise AssertionError("torch.cuda touched on a CPU op")
    for name in ("Event", "current_stream", "is_available", "synchronize", "init"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    rec = Recorder(tmp_path, 0, 1)
    rec.context.step = 0
    tracer = Tracer(rec, 0, 1, timeout_s=30).install()
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=30))
        t = torch.ones(4)
        dist.all_reduce(t)
        dist.all_gather([torch.zeros(4)], t)
        dist.all_reduce(t, async_op=True).wait()
        dist.barrier()
        dist.destroy_process_group()
    finally:
        tracer.close()
        rec.close()
    assert len(tracer._gpu) == 0 and tracer.ops == 4


def test_flight_recorder_dump_imports_nothing_once_the_tracer_is_installed(tmp_path):
    """The cause of `ImportError ... partially initialized module 'torch._dynamo.utils'`:
    `_dump_fr_trace()` imports torch._inductor / torch._dynamo on first use, and the watch
    thread calling it while the script's main thread imported torch._dynamo handed one of them
    a half-initialised module. After install (bootstrap: before any thread starts) a dump
    from a thread must import nothing."""
    import subprocess
    code = f"""
import datetime, sys, threading
import torch, torch.distributed as dist
from ncclscope.runtime.recorder import Recorder
from ncclscope.runtime.usertrace.tracer import Tracer
rec = Recorder({str(tmp_path)!r}, 0, 1)
tracer = Tracer(rec, 0, 1).install()
dist.init_process_group("gloo", init_method="file://{tmp_path}/store", rank=0, world_size=1,
                        timeout=datetime.timedelta(seconds=30))
dist.all_reduce.__ncclscope_orig__(torch.ones(2))   # an FR entry, without the traced path's own dump
before = set(sys.modules)
th = threading.Thread(target=tracer.dump_fr)
th.start(); th.join()
print(sorted(set(sys.modules) - before))
dist.destroy_process_group(); tracer.close(); rec.close()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def _sigterm_inside_the_dump(out: str) -> None:
    """A rank whose main thread holds the dump lock when SIGTERM comes (run in a fresh process)."""
    import os
    import signal
    import time

    from ncclscope.runtime.recorder import Recorder
    from ncclscope.runtime.usertrace.tracer import Tracer
    rec = Recorder(out, 0, 1)
    tracer = Tracer(rec, 0, 1).install()
    tracer.watch_sigterm()              # what the bootstrap does
    with tracer._fr_lock:              # as if writing the dump when the signal comes
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1.0)
    time.sleep(30)


def test_sigterm_while_the_main_thread_holds_the_dump_lock_still_ends_the_rank(tmp_path, zygote):
    """torchrun's SIGTERM can land while the main thread is inside the Flight Recorder dump
    (an uncaught gloo error's evidence): the dump then ran again inside the handler, on the
    same thread, and waited for its own lock; the rank hung until the agent's SIGKILL with no
    end record. Now the reader thread dumps and ends the process once the lock is free.
    The rank is a fork of the suite's warm zygote (conftest: torch imported, no tracer yet; its own
    session, killed past 60 s), not a fresh interpreter importing torch (~2 s)."""
    import signal
    import time
    t0 = time.monotonic()
    out = zygote.call("sigterm-in-dump", "test_run_units:_sigterm_inside_the_dump", [str(tmp_path)], timeout=60)
    assert out.returncode == -signal.SIGTERM, out.stderr[-2000:]
    assert time.monotonic() - t0 < 20
    end = json.loads((tmp_path / S.rank_dir_name(0) / S.RANK_JSON).read_text())["end"]
    assert end["message"] == "terminated by SIGTERM"


def _rank_json(run_dir, r, end=None):
    d = run_dir / S.rank_dir_name(r)
    d.mkdir(parents=True, exist_ok=True)
    (d / S.RANK_JSON).write_text(json.dumps({"rank": r, "pid": 100 + r, **({"end": end} if end else {})}))


def test_rank_records_from_the_agent_and_the_ranks_own_end_records(tmp_path):
    """run.json's account of each rank: the agent's failures where it saw them, the rank's end
    record where it did not (the launcher itself stopped mid-shutdown), and a SIGTERM that reached
    every rank is the job being stopped from outside, not a rank's death."""
    import signal
    from types import SimpleNamespace as F

    from ncclscope.runtime.usertrace.launcher import rank_records
    term = {"status": "error", "message": "terminated by SIGTERM", "time_ns": 1}
    for r, end in enumerate([term, None, {"status": "error", "message": "aborted (SIGABRT)"},
                             {"status": "error", "message": "RuntimeError: boom"}]):
        _rank_json(tmp_path, r, end)
    # the launcher was stopped (SignalException) while the agent was stopping the job: no failures known
    ranks, reason, code = rank_records(tmp_path, 4, {}, "terminated", int(signal.SIGTERM))
    assert (reason, code) == ("terminated", 143)
    assert [ranks[str(r)]["stopped_by_launcher"] for r in range(4)] == [True, True, False, False]
    assert [ranks[str(r)]["signal"] for r in range(4)] == ["SIGTERM", "SIGTERM", "SIGABRT", None]
    # the agent saw rank 2 abort first, then stopped the others
    fails = {2: F(exitcode=-6, pid=7, timestamp=10), 0: F(exitcode=-15, pid=5, timestamp=11),
             1: F(exitcode=-15, pid=6, timestamp=11)}
    ranks, reason, code = rank_records(tmp_path, 4, fails, "rank_failed", 0)
    assert (reason, code) == ("rank_failed", 134)
    assert ranks["2"] == {"exitcode": None, "signal": "SIGABRT", "pid": 7, "stopped_by_launcher": False}
    assert ranks["0"]["stopped_by_launcher"] and ranks["1"]["stopped_by_launcher"]
    # a scheduler's SIGTERM to every process: the agent saw ranks end by SIGTERM before its own came
    fails = {r: F(exitcode=-15, pid=5 + r, timestamp=20 + r) for r in range(4)}
    ranks, reason, code = rank_records(tmp_path, 4, fails, "rank_failed", 0)
    assert (reason, code) == ("terminated", 143)
    assert ranks["0"]["stopped_by_launcher"] and ranks["1"]["stopped_by_launcher"]
    assert not ranks["2"]["stopped_by_launcher"] and not ranks["3"]["stopped_by_launcher"]   # they ended first


def _sigterm_before_the_agent(out: str) -> None:
    """`ncclscope run`'s launcher, SIGTERMed before torchrun's agent is up (run in a fresh process)."""
    import os
    import signal
    import time

    import torch.distributed.launcher.api as api

    def early(cfg, entry):            # the agent's handler is not installed yet when the signal lands
        def call(*args):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(10)
        return call
    api.elastic_launch = early
    from ncclscope.runtime.usertrace.launcher import launch
    run_dir, run, rc = launch("script.py", [], nproc=2, out=out)
    print(rc)


def test_a_sigterm_to_the_launcher_before_the_agent_is_up_ends_the_run_as_terminated(tmp_path, zygote):
    """Between run.json's first write and torchrun's agent installing its own handler, SIGTERM used
    to kill `ncclscope run` outright, leaving run.json 'running' with no ranks. The launcher is a fork
    of the suite's warm zygote (conftest: its own session, killed past 60 s; its main thread, as in
    `ncclscope run`), not a fresh interpreter importing torch (~2 s)."""
    out = zygote.call("sigterm-early", "test_run_units:_sigterm_before_the_agent", [str(tmp_path / "r")],
                      timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "143"
    run = json.loads((tmp_path / "r" / S.RUN_JSON).read_text())
    assert run["end_reason"] == "terminated" and set(run["ranks"]) == {"0", "1"}
