"""Foreign traces -> Trace: Flight Recorder dumps, PyTorch profiler traces, detection.

    OMP_NUM_THREADS=1 python -m pytest tests/test_ingest.py -q

Real inputs are produced here with plain PyTorch: one 3-rank gloo job (forks of
a clean fork server, never of this process) runs two profiled steps (forward/backward per
microbatch, a send/recv, gradient all-reduces), takes a healthy Flight
Recorder snapshot (pickle and JSON), then rank 1 skips an all_reduce and every
rank dumps again. The NCCL case is a hand-made dump in the exact 2.10 layout
(p2p entries, five process groups, wrapped ring buffers), since this machine
has no GPU. Nothing here unpickles with `pickle.load`: the loaders must cope.
"""
from __future__ import annotations

import datetime
import gzip
import json
import multiprocessing as mp
import os
import pickle
import shutil
import socket
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.ipc
import pytest

from ncclscope import schema as S
from ncclscope.load.foreign import GroupNamer, group_kind, normalize_dtype, normalize_op, parse_ranks
from ncclscope.load.foreign.detect import detect, load_any
from ncclscope.load.foreign.flight_recorder import load_flight_recorder, rank_from_name
from ncclscope.load.foreign.prof_rows import kernel_info
from ncclscope.load.foreign.profiler import load_profiler
from ncclscope.load.foreign.safe_pickle import UnsafePickleError, safe_load, safe_loads
from ncclscope.load.trace import TraceError

from fr_jobs import clean_context

pytestmark = pytest.mark.timeout(240)

WORLD = 3
SKIPPER = 1


# --------------------------------------------------------------------------
# The gloo job (one per module)
# --------------------------------------------------------------------------
def _job(rank: int, world: int, port: int, out: str, done) -> None:  # runs in a child of the fork server
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function, schedule, tensorboard_trace_handler
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=60))
    model = torch.nn.Linear(8, 8)
    handler = tensorboard_trace_handler(os.path.join(out, "profiler"), worker_name=f"worker{rank}", use_gzip=True)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, on_trace_ready=handler,
                 schedule=schedule(wait=0, warmup=0, active=2, repeat=1)) as prof:
        for _step in range(2):
            for mb in range(2):
                with record_function(f"forward_mb{mb}"):
                    loss = model(torch.randn(4, 8)).sum()
                with record_function(f"backward_mb{mb}"):
                    loss.backward()
            if rank == 0:
                dist.send(torch.ones(4), 1)
            elif rank == 1:
                dist.recv(torch.zeros(4), 0)
            for p in model.parameters():
                dist.all_reduce(p.grad)
            prof.step()
    dist.barrier()
    c10d = torch._C._distributed_c10d
    for sub, data in (("healthy", c10d._dump_fr_trace(includeStackTraces=False)),
                      ("healthy_json", c10d._dump_fr_trace_json())):
        os.makedirs(os.path.join(out, sub), exist_ok=True)
        name = f"nccl_trace_rank_{rank}" + (".json" if sub.endswith("json") else "")
        with open(os.path.join(out, sub, name), "wb") as fh:
            fh.write(data)
    t = torch.ones(16)
    dist.all_reduce(t)
    dist.all_reduce(t)
    if rank != SKIPPER:   # the skipping rank goes straight to its dump
        try:
            dist.all_reduce(t, async_op=True).wait(timeout=datetime.timedelta(seconds=3))
        except RuntimeError:
            pass          # timed out waiting for rank 1: the hang we want to diagnose
    data = c10d._dump_fr_trace()            # with stack frames, as the watchdog writes it
    skip = os.path.join(out, "skip")
    os.makedirs(skip, exist_ok=True)
    with open(os.path.join(skip, f".tmp{rank}"), "wb") as fh:
        fh.write(data)
    os.rename(os.path.join(skip, f".tmp{rank}"), os.path.join(skip, f"nccl_trace_rank_{rank}"))
    done.wait(60)
    os._exit(0)


@pytest.fixture(scope="module")
def gloo_job(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("gloo_job")
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    # not a fork of this process: Flight Recorder's buffer is one per process, and a fork inherits the entries
    # of whatever earlier tests ran here (test_run_units and test_user_nan initialise gloo in-process: the job's
    # dumps then held their group "1" beside default_pg); each rank must be the plain torch job a user runs
    ctx = clean_context()
    done = ctx.Event()
    procs = [ctx.Process(target=_job, args=(r, WORLD, port, str(out), done), daemon=True) for r in range(WORLD)]
    for p in procs:
        p.start()
    deadline = time.time() + 150
    try:
        while time.time() < deadline:
            if all((out / "skip" / f"nccl_trace_rank_{r}").exists() for r in range(WORLD)):
                break
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.1)
    finally:
        done.set()
        for p in procs:
            p.join(20)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    missing = [r for r in range(WORLD) if not (out / "skip" / f"nccl_trace_rank_{r}").exists()]
    assert not missing, f"gloo job did not produce dumps for ranks {missing}: exit codes {[p.exitcode for p in procs]}"
    return out


def _diagnose(trace):
    from ncclscope.verdict.diagnose import diagnose
    return diagnose(trace)


# --------------------------------------------------------------------------
# Restricted unpickler
# --------------------------------------------------------------------------
class _Evil:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class _EvilEval:
    def __reduce__(self):
        return (eval, ("__import__('os').system('true')",))


@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
def test_malicious_pickle_is_refused_and_runs_nothing(tmp_path, protocol):
    marker = tmp_path / "PWNED"
    payload = pickle.dumps({"version": "2.10", "entries": [_Evil(marker)]}, protocol=protocol)
    with pytest.raises(UnsafePickleError, match=r"'(posix|nt|os)\.system'.*nothing in it was executed"):
        safe_loads(payload)
    # the same through the directory loader and load_any: refused, not skipped, nothing run
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    (dumps / "nccl_trace_rank_0").write_bytes(pickle.dumps({"version": "2.10", "pg_config": {}, "entries": []}))
    (dumps / "nccl_trace_rank_1").write_bytes(payload)
    with pytest.raises(UnsafePickleError, match="nccl_trace_rank_1"):
        load_any(dumps)
    assert not marker.exists()


def test_other_globals_and_persistent_ids_are_refused():
    with pytest.raises(UnsafePickleError, match="builtins.eval"):
        safe_loads(pickle.dumps(_EvilEval()))
    # a bare GLOBAL opcode is enough to be refused, before anything is called
    with pytest.raises(UnsafePickleError, match="subprocess.Popen"):
        safe_loads(b"csubprocess\nPopen\n.")
    with pytest.raises(UnsafePickleError, match="persistent"):
        safe_loads(b"P1\n.")
    with pytest.raises(TraceError, match="not a readable pickle"):
        safe_loads(b"\x80\x02}q\x00(X\x07")


def test_plain_containers_are_admitted():
    data = {"a": [1, 2.5, None, True], "b": (1, "x"), "c": {1, 2}, "d": frozenset({3}), "e": b"\x00\xff"}
    for protocol in range(0, pickle.HIGHEST_PROTOCOL + 1):
        assert safe_loads(pickle.dumps(data, protocol=protocol)) == data


def test_real_dump_loads_identically(gloo_job):
    for f in sorted((gloo_job / "skip").iterdir()):
        assert safe_load(f) == pickle.loads(f.read_bytes())   # our own dump: trusted here


# --------------------------------------------------------------------------
# Flight Recorder on gloo (dumps made by the job above)
# --------------------------------------------------------------------------
def test_gloo_healthy_dump_is_ok(gloo_job):
    trace = load_any(gloo_job / "healthy")
    assert trace.run.source == "flight_recorder" and trace.run.backend == "gloo"
    assert trace.present_ranks == [0, 1, 2]
    assert trace.group_members() == {"default_pg": [0, 1, 2]}   # rebuilt: gloo's pg_config is empty
    coll = trace.ops[trace.ops["kind"] == S.KIND_COLLECTIVE]
    assert len(coll) == 5 * WORLD                                  # 4 all_reduce + 1 barrier per rank
    assert (coll["status"].astype(str) == "ok").all()             # inferred: every member entered each one
    assert coll.groupby("rank")["collective_seq_id"].apply(list).map(tuple).nunique() == 1
    assert set(coll["op_name"].astype(str)) == {"all_reduce", "barrier"}
    assert (coll[coll["op_name"] == "all_reduce"]["input_dtypes"].astype(str) == "float32").all()
    assert any("inferred" in w for w in trace.warnings)
    d = _diagnose(trace)
    assert d.ok, d.verdict


def test_gloo_json_dump_matches_pickle(gloo_job):
    a = load_any(gloo_job / "healthy").ops
    b = load_any(gloo_job / "healthy_json").ops
    cols = ["rank", "op_id", "op_name", "process_group", "collective_seq_id", "status", "start_ns", "end_ns", "bytes"]
    pd.testing.assert_frame_equal(a[cols].astype(str).reset_index(drop=True), b[cols].astype(str).reset_index(drop=True))


def test_gloo_skip_diagnosis_names_the_skipping_rank(gloo_job):
    trace = load_any(gloo_job / "skip")
    inflight = trace.ops[trace.ops["status"].astype(str) == "inflight"]
    assert sorted(inflight["rank"]) == [0, 2]                      # the waiters, in the skipped all_reduce
    assert inflight["call_site"].astype(str).str.contains("test_ingest.py").all()
    assert "test_ingest.py" in trace.stacks[0]
    d = _diagnose(trace)
    assert not d.ok
    assert d.headline is not None and d.headline.ranks == [SKIPPER], d.verdict
    assert f"rank {SKIPPER}" in d.verdict


@pytest.mark.e2e
def test_cli_analyze_dump_dir_names_the_skipping_rank(gloo_job):
    # the CLI's `main` in this process (the analyzer never imports torch; `python -m ncclscope analyze`
    # itself runs in test_samples.py and test_engine.py)
    from conftest import cli_in_process
    res = cli_in_process(["analyze", str(gloo_job / "skip")])
    assert res.returncode == 1, res.stderr
    first = res.stdout.splitlines()[0]
    assert f"rank {SKIPPER}" in first and "all_reduce" in first, res.stdout
    res = cli_in_process(["analyze", str(gloo_job / "healthy"), "--json"])
    assert res.returncode == 0, res.stdout + res.stderr
    assert json.loads(res.stdout)["verdict"].startswith("OK")


def test_gloo_missing_dump_is_a_dead_rank(gloo_job, tmp_path):
    part = tmp_path / "partial"
    part.mkdir()
    for r in (0, 2):
        shutil.copy(gloo_job / "skip" / f"nccl_trace_rank_{r}", part)
    trace = load_flight_recorder(part, world_size=3)
    assert trace.present_ranks == [0, 2] and trace.ranks[1].state == "missing"
    assert any("rank 1: no Flight Recorder dump" in w for w in trace.warnings)
    d = _diagnose(trace)
    assert d.headline is not None and d.headline.ranks == [1], d.verdict


# --------------------------------------------------------------------------
# Flight Recorder, NCCL style (hand-made, format 2.10)
# --------------------------------------------------------------------------
T0 = 1_700_000_000 * 10**9
STEP = 100_000_000     # 100 ms per step
MS = 1_000_000
PGS = {"0": ("default_pg", (0, 1, 2, 3)), "1": ("tp", (0, 1)), "2": ("tp", (2, 3)),
       "3": ("pp", (0, 2)), "4": ("pp", (1, 3))}
TP = {0: "1", 1: "1", 2: "2", 3: "2"}
PP = {0: "3", 2: "3", 1: "4", 3: "4"}
STEPS = 20
CULPRIT = 3
KEEP = {0: 50, 3: 41}            # ring buffers that wrapped: keep only the newest entries


def _frames(line: int) -> list[dict]:
    return [{"name": "all_reduce", "filename": "/usr/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py",
             "line": 2800},
            {"name": "wrapper", "filename": "/usr/lib/python3.11/site-packages/torch/distributed/c10d_logger.py",
             "line": 83},
            {"name": "train_step", "filename": "/workspace/megatron/training.py", "line": line},
            {"name": "<module>", "filename": "/workspace/megatron/pretrain_gpt.py", "line": 12}]


def _nccl_dumps(out: Path, fmt: str = "pickle", drop: tuple[int, ...] = ()) -> Path:
    """4 ranks = 2 pipeline stages x tp 2. Per step, stage 0: tp all_reduce x2,
    send to stage 1 on its pp group, world all_reduce; stage 1: recv, tp all_reduce
    x2, world all_reduce. In the last step rank 3 posts nothing (stuck before
    its recv): rank 1's send never completes and its world all_reduce stays
    `scheduled` behind it, rank 2 waits in tp all_reduce, rank 0 in the world one."""
    ops: dict[int, list[dict]] = {r: [] for r in range(4)}
    coll_seq: dict[tuple[int, str], int] = {}
    p2p_seq: dict[tuple[int, str], int] = {}

    def add(rank, pg, name, t, kind="coll", peer_local=None, line=100):
        key = (rank, pg)
        if kind == "coll":
            coll_seq[key] = coll_seq.get(key, 0) + 1
        else:
            p2p_seq[key] = p2p_seq.get(key, 0) + 1
        members = PGS[pg][1]
        me = members.index(rank)
        prof = {"coll": f"nccl:{name}", "send": f"nccl:send {me}->{peer_local}",
                "recv": f"nccl:recv {me}<-{peer_local}"}[kind]
        e = {"record_id": len(ops[rank]), "pg_id": int(pg), "process_group": (pg, PGS[pg][0]),
             "collective_seq_id": coll_seq.get(key, 0), "p2p_seq_id": p2p_seq.get(key, 0),
             "op_id": coll_seq.get(key, 0) + p2p_seq.get(key, 0), "profiling_name": prof,
             "time_created_ns": t + rank * 7_000, "time_discovered_started_ns": None,
             "time_discovered_completed_ns": None, "duration_ms": None, "input_sizes": [[4096, 1024]],
             "input_dtypes": ["BFloat16"], "output_sizes": [[4096, 1024]], "output_dtypes": ["BFloat16"],
             "state": "scheduled", "retired": False, "timeout_ms": 600_000, "is_p2p": kind != "coll",
             "thread_id": "139900000000000", "thread_name": "pt_main_thread", "frames": _frames(line)}
        ops[rank].append(e)
        return e

    instances: dict[tuple, list[dict]] = {}
    for s in range(STEPS):
        base = T0 + s * STEP
        last = s == STEPS - 1
        for r in (0, 1):
            instances.setdefault(("tp", TP[r], s, 1), []).append(add(r, TP[r], "all_reduce", base + 1 * MS, line=110))
            instances.setdefault(("tp", TP[r], s, 2), []).append(add(r, TP[r], "all_reduce", base + 3 * MS, line=111))
            instances.setdefault(("p2p", r, s), []).append(add(r, PP[r], "send", base + 5 * MS, "send", 1, line=120))
            instances.setdefault(("world", s), []).append(add(r, "0", "all_reduce", base + 20 * MS, line=130))
        for r in (2, 3):
            if last and r == CULPRIT:
                continue
            instances.setdefault(("p2p", r - 2, s), []).append(add(r, PP[r], "recv", base + 4 * MS, "recv", 0, line=121))
            instances.setdefault(("tp", TP[r], s, 1), []).append(add(r, TP[r], "all_reduce", base + 8 * MS, line=110))
            instances.setdefault(("tp", TP[r], s, 2), []).append(add(r, TP[r], "all_reduce", base + 10 * MS, line=111))
            instances.setdefault(("world", s), []).append(add(r, "0", "all_reduce", base + 21 * MS, line=130))
    # complete every instance all of whose participants arrived (and that is not stuck behind one that is not)
    for key, entries in sorted(instances.items(), key=lambda kv: min(e["time_created_ns"] for e in kv[1])):
        full = 2 if key[0] in ("tp", "p2p") else 4
        arrived = max(e["time_created_ns"] for e in entries)
        for e in entries:
            e["time_discovered_started_ns"] = arrived
        if len(entries) == full:
            for e in entries:
                e["state"], e["retired"] = "completed", True
                e["time_discovered_completed_ns"] = arrived + MS // 2
                e["duration_ms"] = 0.5
        else:
            for e in entries:
                e["state"] = "started"
    # per rank, the first op that cannot complete is `started` (its kernel runs and waits); the CPU has
    # already enqueued the ones after it, which stay `scheduled` behind it on the stream
    for r in range(4):
        stuck = False
        for e in sorted(ops[r], key=lambda e: e["record_id"]):
            if e["state"] == "started" and stuck:
                e.update(state="scheduled", time_discovered_started_ns=None)
            stuck = stuck or e["state"] != "completed"
    for r in range(4):
        ops[r].sort(key=lambda e: e["record_id"])
        if r in KEEP:
            ops[r] = ops[r][-KEEP[r]:]
    out.mkdir(parents=True, exist_ok=True)
    pg_config = {pg: {"name": pg, "desc": desc, "ranks": str(list(members))} for pg, (desc, members) in PGS.items()}
    for r in range(4):
        if r in drop:
            continue
        cfg = {pg: c for pg, c in pg_config.items() if r in PGS[pg][1]}
        dump = {"version": "2.10", "comm_lib_version": "2.21.5", "pg_config": cfg,
                "pg_status": {pg: {"last_enqueued_collective": 0, "last_started_collective": 0,
                                   "last_completed_collective": 0} for pg in cfg},
                "entries": ops[r]}
        if fmt == "json":
            data = json.dumps({**dump, "entries": [{k: (0 if v is None and k.startswith("time_") else v)
                                                    for k, v in e.items() if k != "frames"}
                                                   for e in dump["entries"]]}).encode()
            (out / f"nccl_trace_rank_{r}.json").write_bytes(data)
        else:
            (out / f"nccl_trace_rank_{r}").write_bytes(pickle.dumps(dump, protocol=2))
    return out


def _step(t_ns) -> np.ndarray:
    return (np.asarray(t_ns, np.int64) - T0) // STEP


def test_nccl_dump_groups_and_mapping(tmp_path):
    trace = load_any(_nccl_dumps(tmp_path / "fr"))
    assert trace.world_size == 4 and trace.present_ranks == [0, 1, 2, 3]
    assert trace.group_members() == {"default_pg": [0, 1, 2, 3], "tp:1": [0, 1], "tp:2": [2, 3],
                                     "pp:3": [0, 2], "pp:4": [1, 3]}
    kinds = dict(zip(trace.groups["process_group"], trace.groups["group_kind"]))
    assert kinds == {"default_pg": "world", "tp:1": "tp", "tp:2": "tp", "pp:3": "pp", "pp:4": "pp"}
    ops = trace.ops
    p2p = ops[ops["kind"] == S.KIND_P2P]
    assert set(p2p["op_name"].astype(str)) == {"send", "recv"} and (p2p["collective_seq_id"] == -1).all()
    peers = p2p.groupby("rank")["peer"].agg(lambda s: set(s)).to_dict()
    assert peers == {0: {2}, 1: {3}, 2: {0}, 3: {1}}                # local "0->1" mapped to global ranks
    row = ops[ops["kind"] == S.KIND_COLLECTIVE].iloc[0]
    assert row["input_dtypes"] == "bfloat16" and row["bytes"] == 4096 * 1024 * 2
    # the innermost user frame, then its user callers (" < "): the caller tells shared helpers' calls apart
    inner = str(row["call_site"]).split(" < ")[0]
    assert row["input_sizes"] == "[[4096, 1024]]" and inner in ("megatron/training.py:110",
                                                                "megatron/training.py:111",
                                                                "megatron/training.py:130")
    # `scheduled` and `started` entries have no end row: in flight
    inflight = ops[ops["status"].astype(str) == "inflight"]
    assert sorted(zip(inflight["rank"], inflight["op_name"].astype(str))) == [
        (0, "all_reduce"), (1, "all_reduce"), (1, "send"), (2, "all_reduce"), (2, "all_reduce"), (2, "all_reduce")]
    assert "stuck" not in "".join(trace.warnings)
    assert "megatron/training.py" in trace.stacks[1] and "state scheduled" in trace.stacks[1]


def test_nccl_wrapped_buffers_align_per_group(tmp_path):
    trace = load_any(_nccl_dumps(tmp_path / "fr"))
    ops = trace.ops
    members = trace.group_members()
    coll = ops[(ops["kind"] == S.KIND_COLLECTIVE) & (ops["status"].astype(str) == "ok")]
    # every completed instance still in the trace is held by all its members: an entry evicted
    # from one rank's ring buffer never reads as "that rank did not join"
    n = coll.groupby(["process_group", "collective_seq_id"], observed=True)["rank"].nunique()
    size = n.index.get_level_values(0).map(lambda g: len(members[str(g)]))
    assert (n.to_numpy() == np.asarray(size)).all()
    # ... and instance #k is the same step on every member (aligned by sequence, not record id)
    steps = coll.assign(step_=_step(coll["start_ns"])).groupby(
        ["process_group", "collective_seq_id"], observed=True)["step_"].nunique()
    assert (steps == 1).all()
    # the wrapped ranks lost their oldest ops; what survived is the newest, on both sides
    assert ops[ops["rank"] == 0]["op_id"].min() > 0 and ops[ops["rank"] == 3]["op_id"].min() > 0
    assert any("wrapped" in w for w in trace.warnings)
    # p2p: one send per step per pair, so send/recv #k must be step k-1 on both sides even
    # though rank 0 (a sender) and rank 3 (a receiver) lost their first ones
    p2p = ops[ops["kind"] == S.KIND_P2P]
    assert (p2p["p2p_seq_id"].to_numpy() == _step(p2p["start_ns"]) + 1).all()
    sends = p2p[p2p["op_name"] == "send"]
    recvs = p2p[p2p["op_name"] == "recv"]
    m = sends.merge(recvs, left_on=["rank", "peer", "p2p_seq_id"], right_on=["peer", "rank", "p2p_seq_id"])
    assert len(m) == len(recvs)                                   # every recv found its send


def test_nccl_hang_diagnosis(tmp_path):
    trace = load_any(_nccl_dumps(tmp_path / "fr"))
    d = _diagnose(trace)
    assert d.headline is not None and d.headline.ranks == [CULPRIT], d.verdict
    assert f"rank {CULPRIT}" in d.verdict
    for f in d.findings:    # nobody is blamed for what a wrapped ring buffer no longer shows
        assert set(f.ranks) <= {CULPRIT}, (f.kind, f.title)


def test_nccl_json_variant_and_missing_dump(tmp_path):
    a = load_any(_nccl_dumps(tmp_path / "pkl")).ops
    b = load_any(_nccl_dumps(tmp_path / "json", fmt="json")).ops
    cols = ["rank", "op_id", "kind", "op_name", "process_group", "collective_seq_id", "p2p_seq_id", "peer",
            "status", "start_ns", "end_ns"]
    pd.testing.assert_frame_equal(a[cols].astype(str).reset_index(drop=True), b[cols].astype(str).reset_index(drop=True))
    # rank 3's dump is missing: pg_config still says the world is 4 ranks, and rank 3 is the dead one
    trace = load_any(_nccl_dumps(tmp_path / "partial", drop=(3,)))
    assert trace.world_size == 4 and trace.ranks[3].state == "missing"
    d = _diagnose(trace)
    assert d.headline is not None and d.headline.ranks == [3], d.verdict


def test_fr_edge_cases(tmp_path):
    d = tmp_path / "dumps"
    d.mkdir()
    entry = {"record_id": 0, "process_group": ("0", "default_pg"), "collective_seq_id": 1, "p2p_seq_id": 0,
             "profiling_name": "nccl:_allgather_base", "time_created_ns": T0, "state": "completed",
             "time_discovered_completed_ns": T0 + MS, "input_sizes": [[8]], "input_dtypes": ["Float"]}
    (d / "trace_0").write_bytes(pickle.dumps({"version": "2.4", "pg_config": {}, "entries": [entry]}))
    (d / "trace_1").write_bytes(pickle.dumps({"version": "3.0", "pg_config": {}, "entries": [dict(entry)]}))
    (d / "trace_2").write_bytes(b"\x80\x02}q\x00(X\x07\x00\x00\x00version")     # torn by a dying rank
    (d / "notes.txt").write_text("not a dump")
    trace = load_flight_recorder(d)
    assert trace.present_ranks == [0, 1] and trace.ranks[2].state == "missing"
    assert trace.ops["op_name"].astype(str).tolist() == ["all_gather_into_tensor"] * 2
    assert (trace.ops["status"].astype(str) == "ok").all()
    text = "\n".join(trace.warnings)
    assert "trace_2: not a readable pickle" in text and "version 3.0" in text
    # junk values where numbers and strings belong: read what can be read, never crash
    junk = tmp_path / "junk"
    junk.mkdir()
    weird = [{"record_id": "7", "process_group": ["0"], "collective_seq_id": None, "profiling_name": 42,
              "state": None, "time_created_ns": "soon", "input_sizes": [[10**30, 10**30]], "input_dtypes": "Float",
              "is_p2p": "yes", "frames": "not a list"},
             {"record_id": 1, "process_group": ("1", "tp"), "collective_seq_id": 3, "profiling_name": "nccl:recv 9<-8",
              "state": "completed", "time_created_ns": T0, "time_discovered_completed_ns": T0 + 1,
              "input_sizes": [[2]], "input_dtypes": ["Float"], "is_p2p": True, "frames": [{"filename": 3}]},
             ["not", "a", "dict"]]
    (junk / "d_0").write_bytes(pickle.dumps({"version": "2.10", "pg_config": {"1": {"ranks": "[0, x]"}},
                                             "entries": weird}))
    jt = load_flight_recorder(junk)
    assert len(jt.ops) == 2 and (jt.ops["bytes"] >= 0).all()
    assert rank_from_name("nccl_trace_rank_12") == 12 and rank_from_name("rank_3.json") == 3
    assert rank_from_name("dump") is None
    # a folder whose subfolders hold dumps reads them as per-node folders (fr_read.node_dirs) ...
    nodes = load_flight_recorder(tmp_path / "dumps" / ".." / "dumps" / "..")
    assert any("a second dump for rank 0" in w for w in nodes.warnings)    # dumps/ and junk/ both have rank 0
    # ... and one whose subfolders hold none is still no input
    (tmp_path / "empty" / "node-a").mkdir(parents=True)
    (tmp_path / "empty" / "node-a" / "notes.txt").write_text("no dump here")
    with pytest.raises(TraceError, match="no Flight Recorder dumps"):
        load_flight_recorder(tmp_path / "empty")


def _entry_columns(ents) -> dict:
    names = ("n", "rank", "record_id", "cseq", "created", "started", "completed_ns", "timeout_ms", "is_p2p", "nbytes",
             "pg_code", "pg_names", "desc_code", "descs", "pn_code", "pnames", "state_code", "states", "thread_code",
             "threads", "site_code", "sites", "size_code", "size_texts", "dtype_code", "dtype_texts", "rank_stats")
    out = {k: (getattr(ents, k).tolist() if isinstance(getattr(ents, k), np.ndarray) else getattr(ents, k))
           for k in names}
    out["frames"] = {k: repr(v) for k, v in ents.frames.items()}
    return out


def test_fr_column_reader_fast_path_matches_the_per_entry_path(tmp_path):
    """Entries.add transposes a dump in C-level passes (fr_entries); the per-entry (tolerant) path
    must give the very same columns, code tables, kept frames and per-rank stats."""
    import sys
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from ingest import make_fr_dumps

    from ncclscope.load.foreign.fr_entries import Entries
    from ncclscope.load.foreign.fr_read import read_dump
    dirs = [_nccl_dumps(tmp_path / "nccl"), tmp_path / "bench"]
    make_fr_dumps(dirs[1], 8, 120, 5, skip="all_reduce")
    odd = [dict(e) for e in pickle.loads((dirs[0] / "nccl_trace_rank_1").read_bytes())["entries"]]
    odd[3]["input_dtypes"] = ("BFloat16",)          # a tuple next to lists of the same dtype
    odd[4]["input_sizes"] = ((4096, 1024),)           # tuples: their text is JSON's, as before
    odd[5]["state"], odd[6]["thread_id"], odd[7]["profiling_name"] = None, 7, None
    odd[8]["frames"] = odd[9]["frames"]               # one stack object shared by two entries
    odd[10]["input_dtypes"] = [["nested"]]            # unhashable as a key: one key per entry
    dumps = [read_dump(f)["entries"] for d in dirs for f in sorted(d.iterdir()) if f.name != "inputs.json"]
    a, b = Entries(), Entries()
    for r, entries in enumerate(dumps + [odd]):
        a.add(r, entries)
        b.add(r, entries, fast=False)
    assert _entry_columns(a.finish()) == _entry_columns(b.finish())
    assert a.n == sum(len(x) for x in dumps) + len(odd)
    # rank_stats = what a groupby over the columns gives
    df = pd.DataFrame({"r": a.rank, "rec": a.record_id, "t": a.created, "to": a.timeout_ms})
    g = df.groupby("r")
    want = {int(r): (int(g["rec"].min()[r]), int(g["t"].min()[r]), int(g["t"].max()[r]), int(g["to"].max()[r]),
                     int(g["rec"].max()[r])) for r in g.groups}
    assert a.rank_stats == want


def test_fr_missing_state_and_thread_read_as_unknown_not_nan(tmp_path):
    d = _nccl_dumps(tmp_path / "d")
    f = d / "nccl_trace_rank_2"
    dump = pickle.loads(f.read_bytes())
    for e in dump["entries"]:
        e["thread_id"] = None
        if e["state"] != "completed":
            e["state"] = None
    f.write_bytes(pickle.dumps(dump, protocol=2))
    stack = load_flight_recorder(d).stacks[2]
    assert "nan" not in stack and "state ?, thread ?" in stack


def test_shared_vocabulary():
    assert normalize_op("nccl:_reduce_scatter_base") == "reduce_scatter_tensor"
    assert normalize_op("c10d::allreduce_") == "all_reduce" and normalize_op("gloo:all_gather") == "all_gather"
    assert normalize_op("nccl:send 0->1") == "send"
    assert normalize_dtype("BFloat16") == "bfloat16" and normalize_dtype("c10::Half") == "float16"
    assert normalize_dtype("f32") == "float32" and normalize_dtype("long int") == "int64"
    assert group_kind("TENSOR_MODEL_PARALLEL_GROUP") == "tp" and group_kind("mesh_dp_shard") == "dp"
    assert group_kind("EXPERT_DATA_PARALLEL_GROUP") == "edp" and group_kind("default_pg") == "world"
    assert group_kind("DATA_PARALLEL_GROUP_WITH_CP") == "dp_cp" and group_kind("EMBEDDING_GROUP") == "custom"
    assert parse_ranks("[0, 1, 2]") == (0, 1, 2) and parse_ranks("[]") is None
    assert parse_ranks("[0, 8, ..., 56]") == tuple(range(0, 64, 8))
    namer = GroupNamer([("1", "tp", (0, 1)), ("2", "tp", (2, 3)), ("0", "default_pg", (0, 1, 2, 3)),
                        ("5", "", (0,)), ("7", "ep", (0, 1)), ("7", "ep", (2, 3))])
    assert namer("0", "default_pg", (0, 1, 2, 3)) == "default_pg" and namer("1", "tp", (0, 1)) == "tp:1"
    assert namer("5", "", (0,)) == "5" and namer("7", "ep", (2, 3)) == "ep:7[2,3]"
    assert kernel_info("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == (
        "all_reduce", "sum", "float32")
    assert kernel_info("ncclKernel_AllGather_RING_LL_Sum_bf16")[0] == "all_gather"
    assert kernel_info("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)")[0] == "sendrecv"


# --------------------------------------------------------------------------
# Profiler traces
# --------------------------------------------------------------------------
def test_profiler_gloo_traces_give_communication_tables(gloo_job, tmp_path):
    from ncclscope.perf.comm_stats import analyze_comm
    from ncclscope.perf.stragglers import analyze_stragglers
    trace = load_any(gloo_job / "profiler")          # worker<r>.<ts>.pt.trace.json.gz: rank from distributedInfo
    assert trace.run.source == "torch_profiler" and trace.present_ranks == [0, 1, 2]
    ops = trace.ops
    coll = ops[ops["kind"] == S.KIND_COLLECTIVE]
    assert len(coll) == 2 * 2 * WORLD                               # weight + bias grads, 2 steps, 3 ranks
    assert set(coll["op_name"].astype(str)) == {"all_reduce"} and set(coll["process_group"]) == {"default_pg"}
    assert sorted(coll["bytes"].unique()) == [32, 256]               # float32 bias [8], weight [8, 8]
    assert (coll.groupby("rank")["collective_seq_id"].max() == 4).all()
    p2p = ops[ops["kind"] == S.KIND_P2P]
    assert sorted(zip(p2p["rank"], p2p["op_name"].astype(str), p2p["peer"], p2p["p2p_seq_id"])) == [
        (0, "send", 1, 1), (0, "send", 1, 2), (1, "recv", 0, 1), (1, "recv", 0, 2)]
    comp = ops[ops["kind"] == S.KIND_COMPUTE]
    assert len(comp) == 2 * 2 * 2 * WORLD and set(comp["microbatch"]) == {0, 1}
    assert set(ops["step"]) == {0, 1} and len(trace.metrics) == 2 * WORLD
    comm = analyze_comm(trace)
    assert len(comm.instances) == 4 and len(comm.by_op) >= 1
    assert len(comm.p2p) >= 1 and set(zip(comm.p2p["src"], comm.p2p["dst"])) == {(0, 1)}
    strag = analyze_stragglers(trace)
    assert len(strag.instances) == 4
    # the whole performance pass and the HTML report run on it
    from ncclscope.perf.performance import analyze_performance
    from ncclscope.report.html import write_report
    perf = analyze_performance(trace)
    assert not perf.errors, perf.errors
    stats = write_report(trace, tmp_path / "report.html")
    assert not stats["failed"] and {"timeline", "collectives"} <= set(stats["sections"])


def test_profiler_plain_json_rank_from_file_name(gloo_job, tmp_path):
    d = tmp_path / "plain"
    d.mkdir()
    for f in sorted((gloo_job / "profiler").glob("*.json.gz")):
        doc = json.loads(gzip.open(f).read())
        rank = doc["distributedInfo"]["rank"]
        del doc["distributedInfo"]
        (d / f"rank{rank}_trace.json").write_text(json.dumps(doc))   # compact: not kineto's layout
    trace = load_profiler(d)
    ref = load_any(gloo_job / "profiler")
    cols = ["rank", "kind", "op_name", "collective_seq_id", "p2p_seq_id", "peer", "start_ns", "end_ns", "step"]
    pd.testing.assert_frame_equal(trace.ops[cols].reset_index(drop=True).astype(str),
                                  ref.ops[cols].reset_index(drop=True).astype(str))
    # a profiler killed while writing leaves a truncated file: the complete events are still read
    cut = tmp_path / "cut"
    cut.mkdir()
    raw = gzip.open(sorted((gloo_job / "profiler").glob("worker0*.json.gz"))[0]).read()
    (cut / "rank0.pt.trace.json").write_bytes(raw[: int(len(raw) * 0.9)])
    part = load_profiler(cut)
    assert 0 < len(part.ops) <= len(ref.ops[ref.ops["rank"] == 0])


def _gpu_trace(rank: int, with_args: bool = True) -> dict:
    base_ts = 1_000_000.0
    events = [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "pid": 100 + rank, "tid": 1,
               "ts": base_ts + s * 10_000, "dur": 9_000, "args": {}} for s in range(2)]
    events += [{"ph": "X", "cat": "gpu_user_annotation", "name": f"ProfilerStep#{s}", "pid": 0, "tid": 7,
                "ts": base_ts + s * 10_000 + 500, "dur": 9_000, "args": {}} for s in range(2)]
    for s in range(2):
        t = base_ts + s * 10_000 + 1_000 + rank * 50
        args = {"Collective name": "allreduce", "dtype": "BFloat16", "In msg nelems": 1024, "Out msg nelems": 1024,
                "Group size": 2, "Process Group Name": "0", "Process Group Description": "default_pg",
                "Process Group Ranks": "[0, 1]", "stream": 7, "correlation": 10 + s}
        events.append({"ph": "X", "cat": "kernel",
                       "name": "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)",
                       "pid": 0, "tid": 7, "ts": t, "dur": 300.0, "args": args if with_args else {"stream": 7}})
        p2p = {"Collective name": "send" if rank == 0 else "recv", "dtype": "Float", "In msg nelems": 256,
               "Group size": 2, "Process Group Name": "0", "Process Group Description": "default_pg",
               "Process Group Ranks": "[0, 1]", ("Dst Rank" if rank == 0 else "Src Rank"): 1 - rank}
        events.append({"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
                       "pid": 0, "tid": 9, "ts": t + 2_000, "dur": 100.0, "args": p2p if with_args else {}})
        events.append({"ph": "X", "cat": "kernel", "name": "void at::native::vectorized_elementwise_kernel<4>",
                       "pid": 0, "tid": 7, "ts": t + 3_000, "dur": 50.0, "args": {}})
    return {"schemaVersion": 1, "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3"}],
            "distributedInfo": {"backend": "nccl", "rank": rank, "world_size": 2,
                                "pg_config": [{"pg_name": "0", "pg_desc": "default_pg", "ranks": [0, 1]}]},
            "baseTimeNanoseconds": 1_700_000_000 * 10**9, "traceEvents": events}


def test_profiler_nccl_kernels(tmp_path):
    d = tmp_path / "gpu"
    d.mkdir()
    for r in (0, 1):
        (d / f"host_{100 + r}.pt.trace.json").write_text(json.dumps(_gpu_trace(r), indent=2))
    trace = load_any(d)
    ops = trace.ops
    coll = ops[ops["kind"] == S.KIND_COLLECTIVE]
    assert len(coll) == 4 and set(coll["op_name"].astype(str)) == {"all_reduce"}
    assert (coll["bytes"] == 2048).all() and set(coll["input_dtypes"].astype(str)) == {"bfloat16"}
    assert (coll.groupby("rank")["collective_seq_id"].apply(list).map(tuple) == (1, 2)).all()
    assert set(coll["step"]) == {0, 1} and trace.ranks[0].device.startswith("NVIDIA")
    p2p = ops[ops["kind"] == S.KIND_P2P]
    assert sorted(zip(p2p["rank"], p2p["op_name"].astype(str), p2p["peer"])) == [
        (0, "send", 1), (0, "send", 1), (1, "recv", 0), (1, "recv", 0)]
    # without the record_param_comms args, the kernel name still says what it was
    for r in (0, 1):
        (d / f"host_{100 + r}.pt.trace.json").write_text(json.dumps(_gpu_trace(r, with_args=False)))
    ops = load_any(d).ops
    kinds = sorted(set(zip(ops["kind"].astype(str), ops["op_name"].astype(str))))
    assert kinds == [("collective", "all_reduce"), ("p2p", "sendrecv")]
    assert set(ops[ops["op_name"] == "all_reduce"]["input_dtypes"].astype(str)) == {"bfloat16"}


# --------------------------------------------------------------------------
# Detection
# --------------------------------------------------------------------------
def _run_dir(root: Path) -> Path:
    rd = root / "rank-00000"
    rd.mkdir(parents=True)
    (root / "run.json").write_text(json.dumps({"world_size": 1}))
    (rd / "rank.json").write_text(json.dumps({"rank": 0}))
    cols = {f.name: pa.nulls(2, f.type) for f in S.EVENTS_SCHEMA}
    cols.update(rank=pa.array([0, 0], pa.int32()), op_id=pa.array([1, 1], pa.int64()),
                phase=pa.array(["begin", "end"]), time_ns=pa.array([T0, T0 + MS], pa.int64()),
                kind=pa.array(["compute"] * 2), op_name=pa.array(["forward"] * 2), status=pa.array(["", "ok"]))
    table = pa.Table.from_pydict(cols, schema=S.EVENTS_SCHEMA)
    with pa.OSFile(str(rd / S.EVENTS_FILE), "wb") as sink, pa.ipc.new_stream(sink, S.EVENTS_SCHEMA) as w:
        w.write_table(table)
    return root


def test_detect_by_content(tmp_path, gloo_job):
    assert detect(_run_dir(tmp_path / "run")) == "run"
    assert len(load_any(tmp_path / "run").ops) == 1
    assert detect(gloo_job / "skip") == "flight_recorder"
    assert detect(gloo_job / "healthy_json") == "flight_recorder"
    assert detect(gloo_job / "profiler") == "profiler"
    single = next((gloo_job / "skip").iterdir())
    assert detect(single) == "flight_recorder" and load_any(single).present_ranks == [rank_from_name(single.name)]
    other = tmp_path / "other"
    other.mkdir()
    (other / "a.txt").write_text("hello")
    (other / "b.json").write_text('{"hello": 1}')
    with pytest.raises(TraceError) as exc:
        load_any(other)
    assert "\n" not in str(exc.value) and "Flight Recorder" in str(exc.value) and "2 files" in str(exc.value)
    with pytest.raises(TraceError, match="no such file"):
        load_any(tmp_path / "nope")


def _pp_trace(rank: int, steps: int = 3, m: int = 4) -> dict:
    """A CPU trace as torch.distributed.pipelining annotates a GPipe step: PP:<stage><F|B><mb>."""
    events = []
    t0 = 1_000_000.0
    for s in range(steps):
        base = t0 + s * 20_000.0
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "pid": 1, "tid": 1,
                       "ts": base, "dur": 19_000.0, "args": {}})
        for i in range(m):   # forward: 1 ms each, stage 1 one slot behind stage 0
            events.append({"ph": "X", "cat": "user_annotation", "name": f"PP:{rank}F{i}", "pid": 1, "tid": 1,
                           "ts": base + 100 + (i + rank) * 1_000.0, "dur": 1_000.0, "args": {}})
        for i in range(m):   # backward: 2 ms each, stage 1 first
            start = base + 100 + (m + 1) * 1_000.0 + (i * 2 + (1 - rank) * 2) * 1_000.0
            events.append({"ph": "X", "cat": "user_annotation", "name": f"PP:{rank}B{i}", "pid": 1, "tid": 1,
                           "ts": start, "dur": 2_000.0, "args": {}})
    return {"schemaVersion": 1, "traceEvents": events, "baseTimeNanoseconds": 1_700_000_000 * 10**9,
            "distributedInfo": {"backend": "gloo", "rank": rank, "world_size": 2,
                                "pg_config": [{"pg_name": "0", "pg_desc": "default_pg", "ranks": [0, 1]}]}}


def test_profiler_pipeline_annotations_feed_bubble_analysis(tmp_path):
    from ncclscope.perf.bubbles import analyze_bubbles
    for r in (0, 1):
        (tmp_path / f"rank{r}.json").write_text(json.dumps(_pp_trace(r)))
    trace = load_profiler(tmp_path)
    comp = trace.ops[trace.ops["kind"] == S.KIND_COMPUTE]
    assert len(comp) == 2 * 3 * 8 and set(comp["stage"]) == {0, 1} and set(comp["microbatch"]) == {0, 1, 2, 3}
    assert set(comp["op_name"].astype(str)) == {"forward", "backward"} and set(comp["step"]) == {0, 1, 2}
    assert trace.group_members()["pp"] == [0, 1] and trace.ranks[1].coords == {"pp": 1}
    res = analyze_bubbles(trace)
    assert res.p == 2 and res.m == 4 and len(res.steps) == 3
    assert 0.0 < res.measured < 1.0


def test_the_loader_and_its_flight_recorder_merge_import_one_way():
    # trace.load -> usertrace.fr_merge -> ingest.{fr_read, vocab, errors}: none of those imports the loader back
    # (a lazy trace -> fr_merge -> ingest -> trace cycle was here); TraceError is one class wherever it is imported
    import subprocess
    import sys
    code = ("import sys, ncclscope.load.fr_merge\n"
            "bad = sorted(m for m in sys.modules if m in ('ncclscope.load.trace', 'ncclscope.load.foreign.detect',"
            " 'ncclscope.load.foreign.flight_recorder'))\n"
            "assert not bad, bad\n"
            "import ncclscope.load.trace as t, ncclscope.load.foreign.errors as e, ncclscope.load.foreign.safe_pickle as p\n"
            "assert t.TraceError is e.TraceError and issubclass(p.UnsafePickleError, t.TraceError)\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parent.parent)
