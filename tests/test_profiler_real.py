"""Profiler traces in libkineto's own text layout (issue 26, items 1, 5, 6, 7, 8).

The traces here are written by `KinetoRank`, a small writer that follows
libkineto's `ChromeTraceLogger` (`output_json.cpp`) field for field: the
header (schemaVersion, deviceProperties, metadata such as distributedInfo,
displayTimeUnit, baseTimeNanoseconds) then `"traceEvents": [`, one event per
block from "\\n  {" to "\\n  }" with "ph", "cat", "name", "pid", "tid" on its
first line, ts and dur as "<µs>.<ns:03>" relative to baseTimeNanoseconds,
CPU ops and annotations carrying an "External id", kernels the launching op's
"External id" and the CUPTI "correlation" shared with their
cudaLaunchKernel event, ac2g flow events between the two, and the closing
"Record Window End" event. `old=True` writes the tail of PyTorch <= 2.4
(traceName, displayTimeUnit and baseTimeNanoseconds after traceEvents).

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_profiler_real.py
"""
from __future__ import annotations

import gzip
import json
import re
from pathlib import Path
from typing import Any

import pytest

from conftest import cli_in_process
from ncclscope import schema as S
from ncclscope.load.foreign.detect import load_any
from ncclscope.load.foreign.prof_rows import kernel_info

NS, US = 10**9, 1000
BASE = 1_714_000_000 * NS               # 2024-04-24, the first rank's process start
STEP_NS = 10_000 * US                   # a 10 ms step
ALLREDUCE = "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
SENDRECV = "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)"


def _ts(ns: int) -> str:
    """A time as libkineto prints it: microseconds, a dot, the nanoseconds as three digits."""
    return f"{ns // US}.{ns % US:03d}"


def _ranks_arg(ranks: list[int]) -> str:
    """"Process Group Ranks" as torch's record_param_comms writes it: the first 30, then "..."."""
    return "[" + ", ".join(map(str, ranks[:30])) + (", ...]" if len(ranks) > 30 else "]")


def _args(args: dict[str, Any]) -> str:
    """An event's args block (none when empty, as libkineto leaves it out)."""
    if not args:
        return ""
    return ',\n    "args": {\n      ' + ", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in args.items()) + "\n    }"


class KinetoRank:
    """One rank's trace, written as libkineto writes it. Times are ns since the rank's baseTimeNanoseconds."""

    def __init__(self, rank: int, world: int, groups: list[dict[str, Any]] | None = None, base_ns: int = BASE,
                 backend: str = "nccl", dist: bool = True) -> None:
        self.rank, self.world, self.base = rank, world, base_ns
        self.pid, self.ext, self.corr, self.end = 4000 + rank, 0, 0, 0
        self.groups = groups if groups is not None else [
            {"pg_name": "0", "pg_desc": "default_pg", "backend_config": "cuda:nccl", "pg_size": world,
             "ranks": list(range(world))}]
        self.backend, self.dist = backend, dist
        self.blocks = [self._meta("process_name", self.pid, 0, {"name": "python"}),
                       self._meta("process_name", 0, 0, {"name": "python"}),
                       self._meta("thread_name", self.pid, self.pid, {"name": "thread 1 (python)"})]

    def _meta(self, name: str, pid: int, tid: int, args: dict[str, Any]) -> str:
        return (f'  {{\n    "name": "{name}", "ph": "M", "ts": {_ts(0)}, "pid": {pid}, "tid": {tid},\n'
                f'    "args": {{\n      {", ".join(f"{json.dumps(k)}: {json.dumps(v)}" for k, v in args.items())}\n'
                "    }\n  }")

    def x(self, cat: str, name: str, t: int, dur: int, args: dict[str, Any], pid: int | None = None,
          tid: int | None = None) -> None:
        pid = self.pid if pid is None else pid
        tid = self.pid if tid is None else tid
        self.end = max(self.end, t + dur)
        self.blocks.append(f'  {{\n    "ph": "X", "cat": "{cat}", "name": {json.dumps(name)}, "pid": {pid}, '
                           f'"tid": {tid},\n    "ts": {_ts(t)}, "dur": {_ts(dur)}{_args(args)}\n  }}')

    def op(self, name: str, t: int, dur: int, cat: str = "cpu_op", **args: Any) -> int:
        """A CPU op or annotation on the main thread; its External id."""
        self.ext += 1
        self.x(cat, name, t, dur, {"External id": self.ext, **args})
        return self.ext

    def kernel(self, name: str, t_launch: int, t_gpu: int, dur: int, ext: int | None, stream: int = 20,
               **copied: Any) -> None:
        """cudaLaunchKernel at t_launch (linked to the op `ext`), the ac2g flow, the kernel on `stream`."""
        self.corr += 1
        own = {"External id": ext} if ext is not None else {}
        self.x("cuda_runtime", "cudaLaunchKernel", t_launch, 5 * US, {**own, "cbid": 211, "correlation": self.corr})
        self.blocks.append(f'  {{\n    "ph": "s", "id": {self.corr}, "pid": {self.pid}, "tid": {self.pid}, '
                           f'"ts": {_ts(t_launch)},\n    "cat": "ac2g", "name": "ac2g"\n  }}')
        self.x("kernel", name, t_gpu, dur, {**own, "queued": 0, "device": 0, "context": 1, "stream": stream,
                                            "correlation": self.corr, "registers per thread": 96,
                                            "grid": [32, 1, 1], "block": [640, 1, 1], **copied}, pid=0, tid=stream)
        self.blocks.append(f'  {{\n    "ph": "f", "id": {self.corr}, "pid": 0, "tid": {stream}, "ts": {_ts(t_gpu)},'
                           '\n    "cat": "ac2g", "name": "ac2g", "bp": "e"\n  }')

    def step(self, s: int) -> None:
        self.op(f"ProfilerStep#{s}", s * STEP_NS, STEP_NS - 100 * US, cat="user_annotation")

    def collective(self, t: int, c10d: str, coll: str, kernel: str, group: dict[str, Any], nelems: int = 1024,
                   dtype: str = "BFloat16", copy: bool = True, gpu_dur: int = 200 * US, **extra: Any) -> None:
        """One c10d call as ProcessGroupNCCL runs it: the c10d op, record_param_comms inside it, the nccl:*
        annotation inside that, the launch inside all three. With `copy`, libkineto linked the kernel to
        record_param_comms and copied its args onto it; without, the innermost op (the annotation) is its link."""
        comm = {"Collective name": coll, "dtype": dtype, "In msg nelems": nelems, "Out msg nelems": nelems,
                "Group size": group["pg_size"], "Process Group Name": group["pg_name"],
                "Process Group Description": group["pg_desc"], "Process Group Ranks": _ranks_arg(group["ranks"]),
                "Rank": self.rank, **extra}
        self.op(c10d, t, 60 * US)
        param = self.op("record_param_comms", t + 5 * US, 50 * US, **comm)
        note = self.op(f"nccl:{coll}", t + 10 * US, 40 * US, cat="user_annotation")
        self.kernel(kernel, t + 20 * US, t + 40 * US, gpu_dur, param if copy else note,
                    **({k: comm[k] for k in comm if k != "Rank"} if copy else {}))

    def text(self, old: bool = False) -> str:
        """The file: the header fields before traceEvents; with `old`, baseTimeNanoseconds after them."""
        dev = ('\n    {\n      "id": 0, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85032697856,\n'
               '      "computeMajor": 9, "computeMinor": 0, "numSms": 132\n    }')
        info = {"backend": self.backend, "rank": self.rank, "world_size": self.world, "pg_count": len(self.groups),
                "pg_config": self.groups, "nccl_version": "2.21.5"}
        meta = (f'\n      "distributedInfo": {json.dumps(info)},' if self.dist else "") + '\n      "record_shapes": 1,'
        base = f'\n  "displayTimeUnit": "ms",\n  "baseTimeNanoseconds": {self.base},'
        head = f'\n  {{\n    "schemaVersion": 1,\n    "deviceProperties": [{dev}\n    ],{meta}'
        head += ("" if old else base) + '\n  "traceEvents": [\n'
        last = (f'  {{\n    "name": "Record Window End", "ph": "i", "s": "g",\n    "pid": "", "tid": "", '
                f'"ts": {_ts(self.end + US)}\n  }}\n  ],')
        tail = (f'\n  "traceName": "rank{self.rank}.pt.trace.json",\n  "displayTimeUnit": "ms",\n'
                f'  "baseTimeNanoseconds": {self.base}\n}}' if old else '\n  "traceName": "x.pt.trace.json"\n}')
        return head + ",\n".join(self.blocks) + ",\n" + last + tail

    def write(self, directory: Path, old: bool = False, gz: bool = False) -> Path:
        """`<host>_<pid>.<ns>.pt.trace.json[.gz]`, tensorboard_trace_handler's name (no rank in it)."""
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"node{self.rank // 8}_{self.pid}.{self.base}.pt.trace.json"
        data = self.text(old).encode()
        if gz:
            path = path.with_name(path.name + ".gz")
            path.write_bytes(gzip.compress(data))
        else:
            path.write_bytes(data)
        json.loads(data)          # the writer's own check: what it writes is JSON
        return path


def _healthy(rank: int, world: int, steps: int = 3, **kw: Any) -> KinetoRank:
    """A rank of a data-parallel job: per step two all_reduces on the world group, skewed by a few µs."""
    k = KinetoRank(rank, world, **kw)
    pg = k.groups[0]
    for s in range(steps):
        k.step(s)
        for i in range(2):
            k.collective(s * STEP_NS + (1 + 3 * i) * 1_000 * US + rank * 3 * US, "c10d::allreduce_", "allreduce",
                         ALLREDUCE, pg)
    return k


def _analyze(path: Path, *extra: str) -> Any:
    return cli_in_process(["analyze", str(path), *extra])


# --------------------------------------------------------------------------
# item 1: a sample of ranks traced
# --------------------------------------------------------------------------
@pytest.mark.parametrize("world,traced", [(8, (0, 5)), (128, (0, 77))])
def test_sampled_ranks_are_untraced_not_dead(tmp_path, world, traced):
    for r in traced:
        _healthy(r, world).write(tmp_path)
    res = _analyze(tmp_path)
    assert res.returncode == 0, (res.stdout, res.stderr)
    verdict = res.stdout.splitlines()[0]
    assert verdict.startswith("OK") and "rank" not in verdict.lower(), verdict
    # the untraced ranks are counted, not listed (even 6 of them: the table has nothing to say of them), and
    # never called finished nor dead
    assert f"2 of {world} ranks traced; the {world - 2} untraced are not shown" in res.stdout, res.stdout
    assert not re.search(r"\bdead\b|finished ranks|missing", res.stdout), res.stdout
    assert res.stderr == "", res.stderr          # a sample of ranks is how profiling is done: nothing to warn of
    rows = [ln.split()[0] for ln in res.stdout.split("Ranks")[1].splitlines()[2:] if ln.strip()[:1].isdigit()]
    assert [int(r) for r in rows] == list(traced)
    doc = json.loads(_analyze(tmp_path, "--json").stdout)
    assert doc["world_size"] == world and doc["traced_ranks"] == 2 and doc["findings"] == []
    assert doc["level"] == "ok"


def test_ranks_table_note_names_what_it_leaves_out():
    """Over 64 rows, the ranks that need a look come first and the note counts the rest by their state:
    a left-out rank is never called "finished" unless it is."""
    import pandas as pd

    from ncclscope.cli.output import MAX_RANK_ROWS, _rows_shown
    table = pd.DataFrame({"rank": range(100), "state": ["failed" if r % 10 == 3 else "finished" for r in range(100)]})
    shown, note = _rows_shown(table)
    assert len(shown) == MAX_RANK_ROWS and list(shown["rank"]) == sorted(shown["rank"])
    assert set(shown[shown["state"] == "failed"]["rank"]) == set(range(3, 100, 10))
    assert note == "36 ranks not shown: 36 finished"
    assert _rows_shown(table.head(64))[1] == ""


# --------------------------------------------------------------------------
# item 5: baseTimeNanoseconds after traceEvents (PyTorch <= 2.4)
# --------------------------------------------------------------------------
@pytest.mark.parametrize("gz", [False, True])
def test_base_time_after_trace_events_is_read(tmp_path, gz):
    """Rank 1's process started 7 s after rank 0's, so its ts are 7 s smaller for the same wall time: only
    with each rank's own baseTimeNanoseconds (written at the end of the file) do their collectives line up."""
    late = 7 * NS
    r1 = KinetoRank(1, 2, base_ns=BASE + late)
    for s in range(3):           # the same wall times as rank 0, as ts relative to rank 1's later base
        r1.op(f"ProfilerStep#{s}", s * STEP_NS + 20 * NS - late, STEP_NS - 100 * US, cat="user_annotation")
        for i in range(2):
            r1.collective(s * STEP_NS + 20 * NS - late + (1 + 3 * i) * 1_000 * US + 3 * US, "c10d::allreduce_",
                          "allreduce", ALLREDUCE, r1.groups[0])
    r0 = KinetoRank(0, 2)
    for s in range(3):
        r0.op(f"ProfilerStep#{s}", s * STEP_NS + 20 * NS, STEP_NS - 100 * US, cat="user_annotation")
        for i in range(2):
            r0.collective(s * STEP_NS + 20 * NS + (1 + 3 * i) * 1_000 * US, "c10d::allreduce_", "allreduce",
                          ALLREDUCE, r0.groups[0])
    text = r0.text(old=True)
    assert text.index('"baseTimeNanoseconds"') > text.rindex('"Record Window End"')
    r0.write(tmp_path, old=True, gz=gz)
    r1.write(tmp_path, old=True, gz=gz)
    trace = load_any(tmp_path)
    assert not trace.warnings, trace.warnings
    coll = trace.ops[trace.ops["kind"] == S.KIND_COLLECTIVE]
    assert len(coll) == 12
    starts = coll.pivot(index="collective_seq_id", columns="rank", values="start_ns")
    assert ((starts[1] - starts[0]).abs() < 10 * US).all(), starts     # 3 µs of skew, not 7 s
    assert int(starts[0].min()) == BASE + 20 * NS + 1_000 * US + 40 * US
    res = _analyze(tmp_path)
    assert res.returncode == 0 and res.stderr == "", (res.stdout, res.stderr)


# --------------------------------------------------------------------------
# item 6: old-style kernel names
# --------------------------------------------------------------------------
@pytest.mark.parametrize("token,dtype", [
    ("int8_t", "int8"), ("uint8_t", "uint8"), ("int32_t", "int32"), ("uint32_t", "uint32"), ("int64_t", "int64"),
    ("uint64_t", "uint64"), ("half", "float16"), ("float", "float32"), ("double", "float64"),
    ("__nv_bfloat16", "bfloat16")])
def test_old_kernel_names_dtype_from_the_type_token(token, dtype):
    name = f"ncclKernel_AllReduce_RING_LL_Sum_{token}(ncclDevComm*, unsigned long, ncclWork*)"
    assert kernel_info(name) == ("all_reduce", "sum", dtype)
    assert kernel_info(f"ncclKernel_ReduceScatter_RING_SIMPLE_Max_{token}(ncclDevComm*, unsigned long, ncclWork*)"
                       ) == ("reduce_scatter", "max", dtype)


def test_old_kernel_names_in_a_trace(tmp_path):
    """Kernels without copied args (no record_param_comms in the trace): op, reduce op and dtype from the
    name before its parameter list; "unsigned long" there is no dtype, and a copying kernel (all_gather,
    compiled once for bytes) has none."""
    assert kernel_info("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == ("all_gather", "", "")
    assert kernel_info("ncclKernel_AllGather_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)") == (
        "all_gather", "", "")
    assert kernel_info("ncclKernel_Broadcast_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)")[2] == ""
    for r in (0, 1):
        k = KinetoRank(r, 2)
        k.step(0)
        k.kernel("ncclKernel_AllReduce_RING_LL_Sum_int8_t(ncclDevComm*, unsigned long, ncclWork*)", 1_000 * US,
                 1_050 * US, 100 * US, None)
        k.kernel("ncclKernel_AllReduce_RING_LL_Sum_double(ncclDevComm*, unsigned long, ncclWork*)", 2_000 * US,
                 2_050 * US, 100 * US, None)
        k.kernel("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 3_000 * US, 3_050 * US,
                 100 * US, None)
        k.write(tmp_path)
    ops = load_any(tmp_path).ops
    got = sorted(set(zip(ops["op_name"].astype(str), ops["input_dtypes"].astype(str), ops["reduce_op"].astype(str))))
    assert got == [("all_gather", "", ""), ("all_reduce", "float64", "sum"), ("all_reduce", "int8", "sum")]
    assert (ops["process_group"] == "default_pg").all() and (ops["kind"] == S.KIND_COLLECTIVE).all()


# --------------------------------------------------------------------------
# item 7: SendRecv kernels launched by a collective
# --------------------------------------------------------------------------
EP = {"pg_name": "3", "pg_desc": "ep", "backend_config": "cuda:nccl", "pg_size": 2, "ranks": [0, 1]}


def _moe_rank(rank: int, link: str) -> KinetoRank:
    """A rank with the world group and an expert group: per step an all_to_all (SendRecv kernel), an uneven
    all_gather (SendRecv kernel too) and a real send/recv pair (SendRecv kernel: p2p). `link` says how the
    trace ties the kernel to its CPU op: "external" (the kernel's External id is the nccl:* annotation's:
    no args copied), "correlation" (the kernel has no External id; its cudaLaunchKernel has it)."""
    world = {"pg_name": "0", "pg_desc": "default_pg", "backend_config": "cuda:nccl", "pg_size": 2, "ranks": [0, 1]}
    k = KinetoRank(rank, 2, groups=[world, EP])
    for s in range(2):
        k.step(s)
        t = s * STEP_NS + 1_000 * US
        for c10d, coll, pg, t_off in (("c10d::alltoall_base_", "all_to_allv", EP, 0),
                                      ("c10d::_allgather_base_", "_allgather_base", world, 2_000 * US)):
            k.op(c10d, t + t_off, 60 * US)
            k.op("record_param_comms", t + t_off + 5 * US, 50 * US, **{
                "Collective name": coll, "dtype": "Float", "In msg nelems": 4096, "Out msg nelems": 4096,
                "Group size": 2, "Process Group Name": pg["pg_name"], "Process Group Description": pg["pg_desc"],
                "Process Group Ranks": "[0, 1]", "Rank": rank, "In split size": "[2048, 2048]",
                "Out split size": "[2048, 2048]"})
            note = k.op(f"nccl:{coll}", t + t_off + 10 * US, 40 * US, cat="user_annotation")
            k.kernel(SENDRECV, t + t_off + 20 * US, t + t_off + 40 * US, 300 * US,
                     note if link == "external" else None)
        p2p = "c10d::send" if rank == 0 else "c10d::recv_"
        k.op(p2p, t + 4_000 * US, 60 * US)
        k.op("record_param_comms", t + 4_005 * US, 50 * US, **{
            "Collective name": "send" if rank == 0 else "recv", "dtype": "Float", "In msg nelems": 256,
            "Out msg nelems": 256, "Group size": 2, "Process Group Name": "0",
            "Process Group Description": "default_pg", "Process Group Ranks": "[0, 1]",
            ("Dst Rank" if rank == 0 else "Src Rank"): 1 - rank})
        note = k.op(f"nccl:{'send' if rank == 0 else 'recv'} {rank}->{1 - rank}", t + 4_010 * US, 40 * US,
                    cat="user_annotation")
        k.kernel(SENDRECV, t + 4_020 * US, t + 4_040 * US, 50 * US, note if link == "external" else None, stream=24)
    return k


@pytest.mark.parametrize("link", ["external", "correlation"])
def test_sendrecv_kernels_of_a_collective_are_that_collective(tmp_path, link):
    for r in (0, 1):
        _moe_rank(r, link).write(tmp_path)
    trace = load_any(tmp_path)
    ops = trace.ops
    coll = ops[ops["kind"] == S.KIND_COLLECTIVE]
    got = sorted(set(zip(coll["op_name"].astype(str), coll["process_group"].astype(str))))
    assert got == [("all_gather_into_tensor", "default_pg"), ("all_to_all_single", "ep")], got
    assert len(coll) == 2 * 2 * 2 and (coll["bytes"] == 4096 * 4).all()
    assert set(coll["input_dtypes"].astype(str)) == {"float32"}
    assert (coll.groupby(["rank", "process_group"], observed=True)["collective_seq_id"].max() == 2).all()
    p2p = ops[ops["kind"] == S.KIND_P2P]
    assert sorted(zip(p2p["rank"], p2p["op_name"].astype(str), p2p["peer"], p2p["process_group"].astype(str))) == [
        (0, "send", 1, "default_pg"), (0, "send", 1, "default_pg"), (1, "recv", 0, "default_pg"),
        (1, "recv", 0, "default_pg")]
    assert "unknown" not in set(ops["process_group"].astype(str))
    res = _analyze(tmp_path)
    assert res.returncode == 0, (res.stdout, res.stderr)


# --------------------------------------------------------------------------
# item 8: traces taken days apart
# --------------------------------------------------------------------------
def test_traces_days_apart_warn_once_and_are_analyzed(tmp_path):
    _healthy(0, 4).write(tmp_path)
    _healthy(1, 4).write(tmp_path)
    for r in (2, 3):      # a later run of the same script, into the same folder: same ts, bases 3 days later
        _healthy(r, 4, base_ns=BASE + 3 * 86400 * NS).write(tmp_path)
    res = _analyze(tmp_path)
    assert res.returncode in (0, 1) and res.stdout.splitlines()[0].split(":")[0].isupper(), res.stdout
    warned = [ln for ln in res.stderr.splitlines() if "warning:" in ln]
    assert len(warned) == 1, res.stderr
    assert "ranks 2,3" in warned[0] and "3.0 days" in warned[0] and "different" in warned[0], warned


def test_ranks_seconds_apart_are_one_job(tmp_path):
    """Profilers started a few seconds apart (ranks reaching the schedule's active steps at different times
    at startup) are one job: no warning."""
    for r in range(4):
        _healthy(r, 4, base_ns=BASE + r * 5 * NS).write(tmp_path)
    trace = load_any(tmp_path)
    assert not trace.warnings, trace.warnings


# --------------------------------------------------------------------------
# item 2 (of the list above): one GPU, no communication
# --------------------------------------------------------------------------
def test_single_gpu_trace_says_no_communication_first(tmp_path):
    k = KinetoRank(0, 1, dist=False)
    for s in range(2):
        k.step(s)
        ext = k.op("aten::mm", s * STEP_NS + 100 * US, 50 * US)
        k.kernel("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", s * STEP_NS + 110 * US,
                 s * STEP_NS + 150 * US, 400 * US, ext, stream=7)
    path = k.write(tmp_path / "single")
    for target in (path.parent, path):
        res = _analyze(target)
        assert res.returncode == 2 and res.stdout == "", (res.stdout, res.stderr)
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"ncclscope: {target}: no communication ops in "), lines
