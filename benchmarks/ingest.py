"""Ingest benchmark: ncclscope vs PyTorch's fr_trace and vs Holistic Trace Analysis.

    OMP_NUM_THREADS=1 python benchmarks/ingest.py                 # defaults: 32 FR dumps, 8 profiler traces
    python benchmarks/ingest.py --fr-ranks 64 --fr-entries 2000 --prof-ranks 8 --prof-events 200000
    # the 1,024-rank Flight Recorder case (issue 11): fr_trace killed if it runs past 120 s
    OMP_NUM_THREADS=1 python benchmarks/ingest.py --only fr --fr-ranks 1024 --fr-entries 2000 \
        --fr-skip all_reduce --fr-trace-timeout 120 --max-rss-mib 8000 [--inputs /tmp/fr-inputs]

What it measures, in one run on the same inputs (written to a temp dir first):

1. Flight Recorder: a hung 3D-parallel job (tp x pp x dp, NCCL format 2.10,
   full 2000-entry ring buffers that wrapped, p2p between pipeline stages), where
   one rank skipped a data-parallel all_gather (or, `--fr-skip all_reduce`, the
   DDP gradient all_reduce) in its last step. A measurement that runs past its
   time limit (`--fr-trace-timeout` for fr_trace) or `--max-rss-mib` is killed
   with its process group and reported as such, never waited on. Each tool starts in
   its own fresh process; we time reading the dumps and naming the culprit
   (imports excluded), and check the culprit each one names:
   - ncclscope: `ingest.load_any` + `analysis.diagnose.diagnose`
   - PyTorch: `torch.distributed.flight_recorder.fr_trace.main([dir])`
     (`python -m torch.distributed.flight_recorder.fr_trace DIR`), culprit taken
     from its "missing ranks" / "Culprit rank" log lines.
2. Profiler traces: per-rank kineto Chrome traces of a GPU job (cpu ops, CUDA
   launches, kernels, NCCL kernels with record_param_comms args, ProfilerStep
   spans). Time and peak RSS of loading them:
   - ncclscope: `ingest.profiler.load_profiler`
   - HTA: `hta.trace_analysis.TraceAnalysis(trace_dir=...)` (if installed;
     `pip install HolisticTraceAnalysis`). HTA keeps every event; ncclscope
     keeps the communication, step and microbatch rows its analyses use.

CPU time (time.process_time of the measured call) is the headline figure:
unlike wall time it does not depend on what else the machine runs. Peak RSS
is the child's ru_maxrss; "over imports" subtracts the RSS after imports.
Nothing is cached between tools: every measurement is a new process.
"""
from __future__ import annotations

import argparse
import json
import os
import pickle
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
T0 = 1_700_000_000 * 10**9
MS = 1_000_000


# --------------------------------------------------------------------------
# Inputs
# --------------------------------------------------------------------------
def _mesh(world: int) -> tuple[int, int, int]:
    """(tp, pp, dp) with dp >= 2 so that a skipped dp collective hangs someone."""
    if world < 4 or world % 4:
        raise SystemExit("--fr-ranks must be a multiple of 4 (tp x pp 2 x dp >= 2)")
    tp = max(t for t in (1, 2, 4, 8) if world % (t * 4) == 0)
    return tp, 2, world // (tp * 2)


def make_fr_dumps(out: Path, world: int, entries: int, culprit: int, seed: int = 0, skip: str = "all_gather") -> dict:
    """NCCL-style dumps of a hang: `culprit` skips the dp all_gather of the last step (ZeRO-style
    reduce_scatter + all_gather on dp), or with skip="all_reduce" its last DP all_reduce (DDP-style: one
    gradient all_reduce on dp per step)."""
    dp_ops = ["all_reduce"] if skip == "all_reduce" else ["_reduce_scatter_base", "_all_gather_base"]
    skipped = dp_ops[-1]
    rng = random.Random(seed)
    tp, pp, dp = _mesh(world)
    coords = {r: (r % tp, (r // tp) % dp, r // (tp * dp)) for r in range(world)}   # (tp, dp, pp) Megatron order

    groups: dict[str, tuple[str, tuple[int, ...]]] = {"0": ("default_pg", tuple(range(world)))}

    def add_groups(desc: str, key) -> dict[int, str]:
        by: dict = {}
        for r in range(world):
            by.setdefault(key(r), []).append(r)
        out_map = {}
        for members in by.values():
            name = str(len(groups))
            groups[name] = (desc, tuple(members))
            for r in members:
                out_map[r] = name
        return out_map

    tp_of = add_groups("TENSOR_MODEL_PARALLEL_GROUP", lambda r: (coords[r][1], coords[r][2]))
    dp_of = add_groups("DATA_PARALLEL_GROUP", lambda r: (coords[r][0], coords[r][2]))
    pp_of = add_groups("PIPELINE_MODEL_PARALLEL_GROUP", lambda r: (coords[r][0], coords[r][1]))
    per_step = 4 + (1 if pp > 1 else 0) + len(dp_ops)
    steps = entries // per_step + 2
    frames = [{"name": "all_reduce", "filename": "/opt/torch/distributed/distributed_c10d.py", "line": 2801},
              {"name": "train_step", "filename": "/workspace/megatron/training/training.py", "line": 612},
              {"name": "pretrain", "filename": "/workspace/megatron/training/training.py", "line": 401}]
    dumps: dict[int, list[dict]] = {r: [] for r in range(world)}
    cseq: dict[tuple[int, str], int] = {}
    pseq: dict[tuple[int, str], int] = {}
    for r in range(world):
        stage = coords[r][2]
        rec = 0
        for s in range(steps):
            base = T0 + s * 50 * MS + r * 1000
            last = s == steps - 1
            plan = [(tp_of[r], "all_reduce", 1), (tp_of[r], "all_reduce", 2), (tp_of[r], "all_reduce", 3),
                    (tp_of[r], "all_reduce", 4)]
            if pp > 1:
                plan.append((pp_of[r], "send" if stage == 0 else "recv", 5))
            plan += [(dp_of[r], op, 6 + i) for i, op in enumerate(dp_ops)]
            for pg, op, k in plan:
                on_dp = pg == dp_of[r] and op == skipped
                if last and r == culprit and on_dp:
                    continue
                members = groups[pg][1]
                if op in ("send", "recv"):
                    pseq[(r, pg)] = pseq.get((r, pg), 0) + 1
                    me = members.index(r)
                    prof = f"nccl:send {me}->{1 - me}" if op == "send" else f"nccl:recv {me}<-{1 - me}"
                else:
                    cseq[(r, pg)] = cseq.get((r, pg), 0) + 1
                    prof = f"nccl:{op}"
                t = base + k * 2 * MS + rng.randint(0, 50_000)
                n = len(members)
                n_in, n_out = {"_reduce_scatter_base": (1024 * n, 1024),
                               "_all_gather_base": (1024, 1024 * n)}.get(op, (1024, 1024))
                stuck = last and on_dp and coords[r][0] == coords[culprit][0] \
                    and coords[r][2] == coords[culprit][2]
                state = "started" if stuck else "completed"
                dumps[r].append({
                    "record_id": rec, "pg_id": int(pg), "process_group": (pg, groups[pg][0]),
                    "collective_seq_id": cseq.get((r, pg), 0), "p2p_seq_id": pseq.get((r, pg), 0),
                    "op_id": cseq.get((r, pg), 0) + pseq.get((r, pg), 0), "profiling_name": prof,
                    "time_created_ns": t, "time_discovered_started_ns": t + 100_000,
                    "time_discovered_completed_ns": None if stuck else t + MS, "duration_ms": None if stuck else 0.9,
                    "input_sizes": [[n_in, 4096]], "input_dtypes": ["BFloat16"], "output_sizes": [[n_out, 4096]],
                    "output_dtypes": ["BFloat16"], "state": state, "retired": not stuck, "timeout_ms": 600000,
                    "is_p2p": op in ("send", "recv"), "thread_id": "140000000000000", "thread_name": "pt_main",
                    "frames": frames})
                rec += 1
    out.mkdir(parents=True, exist_ok=True)
    pg_config = {name: {"name": name, "desc": desc, "ranks": str(list(members))}
                 for name, (desc, members) in groups.items()}
    for r in range(world):
        cfg = {k: v for k, v in pg_config.items() if r in groups[k][1]}
        dump = {"version": "2.10", "comm_lib_version": "2.21.5", "pg_config": cfg, "pg_status": {},
                "entries": dumps[r][-entries:]}
        (out / f"nccl_trace_rank_{r}").write_bytes(pickle.dumps(dump, protocol=2))
    return {"world": world, "tp": tp, "pp": pp, "dp": dp, "entries": entries, "culprit": culprit, "skip": skipped,
            "wrapped": steps * per_step > entries}


def make_profiler_traces(out: Path, ranks: int, events: int, seed: int = 0) -> dict:
    """Kineto-layout GPU traces: ~70% cpu ops, 10% launches, 15% kernels, a few % NCCL."""
    rng = random.Random(seed)
    out.mkdir(parents=True, exist_ok=True)
    steps = 10
    per_step = max(events // steps, 100)
    total_bytes = 0
    for r in range(ranks):
        pid = 1000 + r
        parts = [
            '{\n  "schemaVersion": 1,\n  "deviceProperties": [{"id": 0, "name": "NVIDIA H100 80GB HBM3", '
            '"totalGlobalMem": 85000000000, "computeMajor": 9, "computeMinor": 0}],\n'
            f'  "distributedInfo": {{"backend": "nccl", "rank": {r}, "world_size": {ranks}, "pg_count": 1, '
            f'"pg_config": [{{"pg_name": "0", "pg_desc": "default_pg", "backend_config": "cuda:nccl", '
            f'"pg_size": {ranks}, "ranks": {list(range(ranks))}}}]}},\n'
            '  "displayTimeUnit": "ms",\n  "baseTimeNanoseconds": 1700000000000000000,\n  "traceEvents": [\n']
        evs = []

        def x(cat: str, name: str, tid: int, ts: float, dur: float, args: str, p: int = pid) -> None:
            evs.append(f'  {{\n    "ph": "X",\n    "cat": "{cat}",\n    "name": "{name}",\n    "pid": {p},\n'
                       f'    "tid": {tid},\n    "ts": {ts:.3f},\n    "dur": {dur:.3f}\n    ,\n'
                       f'    "args": {{\n      {args}\n    }}\n  }}')
        evs.append(f'  {{\n    "ph": "M",\n    "name": "process_name",\n    "ts": 0.0,\n    "pid": {pid},\n'
                   f'    "tid": 0,\n    "args": {{\n      "name": "python"\n    }}\n  }}')
        ts = 1_000_000.0
        ext = corr = 0
        for s in range(steps):
            step_start = ts
            x("user_annotation", f"ProfilerStep#{s}", pid, ts, 0.0, '"External id": 0')
            step_idx = len(evs) - 1
            for i in range(per_step):
                ext += 1
                u = rng.random()
                if u < 0.70:
                    x("cpu_op", rng.choice(("aten::mm", "aten::add", "aten::empty", "aten::copy_", "aten::view")),
                      pid, ts, 3.0, f'"External id": {ext},"Record function id": 0, "Sequence number": {ext}, '
                                    f'"Fwd thread id": 0, "Ev Idx": {ext}')
                elif u < 0.80:
                    corr += 1
                    x("cuda_runtime", "cudaLaunchKernel", pid, ts, 4.0,
                      f'"External id": {ext},"cbid": 211, "correlation": {corr}')
                elif u < 0.97:
                    x("kernel", "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", 0, ts + 20, 15.0,
                      f'"External id": {ext},"queued": 0, "device": 0, "context": 1, "stream": 7, '
                      f'"correlation": {corr}, "registers per thread": 168, "shared memory": 0, "blocks per SM": 1.2, '
                      f'"warps per SM": 4.0, "grid": [132, 1, 1], "block": [384, 1, 1], "est. achieved occupancy %": 0')
                else:
                    x("cpu_op", "record_param_comms", pid, ts, 5.0,
                      f'"External id": {ext},"Record function id": 0, "Collective name": "allreduce", '
                      f'"dtype": "BFloat16", "In msg nelems": 16777216, "Out msg nelems": 16777216, '
                      f'"Group size": {ranks}, "Process Group Name": "0", "Process Group Description": "default_pg", '
                      f'"Process Group Ranks": "{list(range(ranks))}", "Rank": {r}, "Seq": {s * per_step + i}')
                    x("kernel", "ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 0,
                      ts + 30, 250.0 + rng.random() * 50,
                      f'"External id": {ext},"queued": 0, "device": 0, "context": 1, "stream": 20, '
                      f'"correlation": {corr}, "Collective name": "allreduce", "dtype": "BFloat16", '
                      f'"In msg nelems": 16777216, "Out msg nelems": 16777216, "Group size": {ranks}, '
                      f'"Process Group Name": "0", "Process Group Description": "default_pg", '
                      f'"Process Group Ranks": "{list(range(ranks))}", "Rank": {r}, "Seq": {s * per_step + i}')
                ts += 5.0
            evs[step_idx] = evs[step_idx].replace('"dur": 0.000', f'"dur": {ts - step_start:.3f}')
        parts.append(",\n".join(evs))
        parts.append('\n  ],\n  "traceName": "rank%d.pt.trace.json"\n}\n' % r)
        text = "".join(parts)
        (out / f"rank{r}.pt.trace.json").write_text(text)
        total_bytes += len(text)
    return {"ranks": ranks, "events_per_rank": events, "mib": round(total_bytes / 2**20, 1)}


# --------------------------------------------------------------------------
# Children (one fresh process per measurement)
# --------------------------------------------------------------------------
def _rss_mib() -> float:
    """Peak resident memory of this process. VmHWM, not ru_maxrss: Linux carries ru_maxrss over exec, so a
    child started by a parent that had just written 3 GB of dumps would report the parent's size."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _cpu() -> float:
    """CPU seconds of this process plus any worker processes it waited for (HTA parses in a pool)."""
    ch = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + ch.ru_utime + ch.ru_stime


def _child(kind: str, path: str) -> dict:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if kind == "ncclscope-fr":
        from ncclscope.verdict.diagnose import diagnose
        from ncclscope.load.foreign import load_any
        base = _rss_mib()
        t, c = time.perf_counter(), _cpu()
        d = diagnose(load_any(path))
        dt, dc = time.perf_counter() - t, _cpu() - c
        culprit = d.headline.ranks if d.headline else []
        return {"time_s": dt, "cpu_s": dc, "culprit": culprit, "verdict": d.verdict[:160], "base_mib": base}
    if kind == "fr_trace":
        import io
        import logging
        from torch.distributed.flight_recorder.fr_trace import main
        from torch.distributed.flight_recorder.components.fr_logger import FlightRecorderLogger
        buf = io.StringIO()
        lg = FlightRecorderLogger().logger
        for h in list(lg.handlers):
            lg.removeHandler(h)
        h = logging.StreamHandler(buf)
        h.setFormatter(logging.Formatter("%(message)s"))
        lg.addHandler(h)
        base = _rss_mib()
        t, c = time.perf_counter(), _cpu()
        err = ""
        try:
            main([path])
        except SystemExit:
            pass
        except Exception as exc:      # noqa: BLE001 - report whatever the baseline does
            err = f"{type(exc).__name__}: {str(exc)[:120]}"
        dt, dc = time.perf_counter() - t, _cpu() - c
        culprit: list[int] = []
        for line in buf.getvalue().splitlines():
            if line.startswith("missing ranks:") and not culprit:
                culprit = sorted(int(x) for x in line.split(":", 1)[1].strip(" {}").split(",") if x.strip())
            elif "Culprit rank" in line and not culprit:
                culprit = [int(line.split("Culprit rank", 1)[1].split(";")[0].strip())]
        return {"time_s": dt, "cpu_s": dc, "culprit": culprit, "error": err, "base_mib": base,
                "log_lines": len(buf.getvalue().splitlines())}
    if kind == "ncclscope-prof":
        from ncclscope.load.foreign.profiler import load_profiler
        base = _rss_mib()
        t, c = time.perf_counter(), _cpu()
        tr = load_profiler(path)
        dt, dc = time.perf_counter() - t, _cpu() - c
        return {"time_s": dt, "cpu_s": dc, "rows": int(len(tr.ops)), "base_mib": base}
    if kind == "hta":
        from hta.trace_analysis import TraceAnalysis
        base = _rss_mib()
        t, c = time.perf_counter(), _cpu()
        ta = TraceAnalysis(trace_dir=path)
        dt, dc = time.perf_counter() - t, _cpu() - c
        try:
            rows = sum(len(df) for df in ta.t.traces.values())
        except Exception:             # noqa: BLE001 - HTA's internals move between versions
            rows = -1
        workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024.0
        return {"time_s": dt, "cpu_s": dc, "rows": int(rows), "base_mib": base, "worker_peak_mib": workers}
    raise SystemExit(f"unknown child kind {kind}")


def _vm_rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def run_child(kind: str, path: Path, timeout: float, max_rss_mib: float = 0.0) -> dict:
    """Run one measurement in a fresh process group; past `timeout` s (or `max_rss_mib` of resident memory,
    when set) the whole group is SIGKILLed, so a baseline that hangs or swells never holds the benchmark."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    # the child measures this checkout's ncclscope, whatever an installed copy points at
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    proc = subprocess.Popen([sys.executable, __file__, "--child", kind, str(path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT, start_new_session=True)
    t0 = time.perf_counter()
    peak = 0.0
    while True:
        try:
            out, err = proc.communicate(timeout=0.25)
            break
        except subprocess.TimeoutExpired:
            peak = max(peak, _vm_rss_mib(proc.pid))
            over = max_rss_mib and peak > max_rss_mib
            if over or time.perf_counter() - t0 > timeout:
                os.killpg(proc.pid, 9)
                proc.communicate()
                why = (f"killed at {peak:.0f} MiB resident (limit {max_rss_mib:.0f})" if over
                       else f"did not finish within {timeout:.0f} s (killed)")
                return {"error": why, "killed_after_s": time.perf_counter() - t0, "peak_seen_mib": peak}
    wall = time.perf_counter() - t0
    try:
        res = json.loads(out.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = (err.strip().splitlines() or ["no output"])[-1]
        return {"error": tail[:200]}
    res["wall_s"] = wall
    return res


def _fmt(res: dict) -> str:
    if "time_s" not in res:
        seen = f" (resident memory when stopped: {res['peak_seen_mib']:.0f} MiB)" if res.get("peak_seen_mib") else ""
        return f"FAILED: {res.get('error', '?')}{seen}"
    extra = res["peak_mib"] - res["base_mib"]
    return (f"CPU {res['cpu_s']:7.2f} s  wall {res['time_s']:7.2f} s   peak RSS {res['peak_mib']:6.0f} MiB "
            f"(+{extra:.0f} over imports)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fr-ranks", type=int, default=32)
    ap.add_argument("--fr-entries", type=int, default=2000)
    ap.add_argument("--prof-ranks", type=int, default=8)
    ap.add_argument("--prof-events", type=int, default=100_000)
    ap.add_argument("--fr-skip", choices=("all_gather", "all_reduce"), default="all_gather",
                    help="the dp collective the culprit skips in its last step: a ZeRO all_gather, or the DDP "
                         "gradient all_reduce (then dp runs one all_reduce per step)")
    ap.add_argument("--timeout", type=float, default=600, help="per-measurement limit for ncclscope (killed past it)")
    ap.add_argument("--fr-trace-timeout", type=float, default=None,
                    help="limit for PyTorch's fr_trace (default: --timeout); it is killed past it, never waited on; "
                         "0: do not run fr_trace (while iterating on ncclscope)")
    ap.add_argument("--max-rss-mib", type=float, default=0, help="kill a measurement past this resident memory")
    ap.add_argument("--inputs", default="", help="write the inputs here and reuse them on the next run "
                                                 "(default: a temporary directory, deleted)")
    ap.add_argument("--only", choices=("fr", "prof"), help="run one half of the benchmark")
    ap.add_argument("--child", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        res = _child(*ns.child)
        res["peak_mib"] = _rss_mib()
        print(json.dumps(res))
        return 0

    culprit = ns.fr_ranks // 2 + 1
    if ns.inputs:
        tmpd = Path(ns.inputs)
        tmpd.mkdir(parents=True, exist_ok=True)
        if ns.only != "prof":
            bench_fr(tmpd, ns, culprit)
        if ns.only != "fr":
            bench_prof(tmpd, ns)
        return 0
    with tempfile.TemporaryDirectory(prefix="ncclscope-bench-") as tmp:
        tmpd = Path(tmp)
        if ns.only != "prof":
            bench_fr(tmpd, ns, culprit)
        if ns.only != "fr":
            bench_prof(tmpd, ns)
    return 0


def bench_fr(tmpd: Path, ns: argparse.Namespace, culprit: int) -> None:
    t = time.perf_counter()
    fr_dir = tmpd / f"fr-{ns.fr_ranks}-{ns.fr_entries}-{ns.fr_skip}"
    stamp = fr_dir / "inputs.json"
    if stamp.exists():
        fr = json.loads(stamp.read_text())
        made = "reused"
    else:
        fr = make_fr_dumps(fr_dir, ns.fr_ranks, ns.fr_entries, culprit, skip=ns.fr_skip)
        stamp.write_text(json.dumps(fr))
        made = f"made in {time.perf_counter() - t:.1f} s"
    print(f"Flight Recorder: {fr['world']} ranks (tp {fr['tp']} x pp {fr['pp']} x dp {fr['dp']}), "
          f"{fr['entries']} entries per dump ({'wrapped ring buffer' if fr.get('wrapped') else 'not wrapped'}), "
          f"culprit rank {culprit} skips its last dp {fr.get('skip', '_all_gather_base')} ({made})", flush=True)
    ours = run_child("ncclscope-fr", fr_dir, ns.timeout, ns.max_rss_mib)
    if ns.fr_trace_timeout == 0:
        theirs: dict = {"error": "not run (--fr-trace-timeout 0)"}
    else:
        theirs = run_child("fr_trace", fr_dir, ns.fr_trace_timeout or ns.timeout, ns.max_rss_mib)
    for name, res in (("ncclscope", ours), ("fr_trace ", theirs)):
        named = res.get("culprit")
        verdict = ("names rank " + ",".join(map(str, named)) + (" (correct)" if named == [culprit] else " (WRONG)")
                   if named else "names no culprit")
        print(f"  {name} {_fmt(res)}   {verdict if 'time_s' in res else ''}", flush=True)
        if res.get("error") and "time_s" in res:
            print(f"            error: {res['error']}")
    if "time_s" in ours and "time_s" in theirs:
        print(f"  speed-up: {theirs['cpu_s'] / ours['cpu_s']:.1f}x CPU time, "
              f"{theirs['time_s'] / ours['time_s']:.1f}x wall time")
    elif "time_s" in ours and theirs.get("killed_after_s"):
        print(f"  speed-up: more than {theirs['killed_after_s'] / ours['wall_s']:.1f}x wall time "
              f"(fr_trace killed unfinished)")


def bench_prof(tmpd: Path, ns: argparse.Namespace) -> None:
    t = time.perf_counter()
    pr = make_profiler_traces(tmpd / "prof", ns.prof_ranks, ns.prof_events)
    print(f"\nProfiler traces: {pr['ranks']} ranks x {pr['events_per_rank']} events "
          f"({pr['mib']} MiB of JSON; made in {time.perf_counter() - t:.1f} s)")
    ours = run_child("ncclscope-prof", tmpd / "prof", ns.timeout)
    print(f"  ncclscope {_fmt(ours)}   {ours.get('rows', '?')} op rows")
    try:
        import importlib.util
        has_hta = importlib.util.find_spec("hta") is not None
    except (ImportError, ValueError):
        has_hta = False
    if not has_hta:
        print("  HTA       not installed (pip install HolisticTraceAnalysis): no comparison figure")
        return
    theirs = run_child("hta", tmpd / "prof", ns.timeout)
    print(f"  HTA       {_fmt(theirs)}   {theirs.get('rows', '?')} event rows")
    if theirs.get("worker_peak_mib"):
        print(f"            (HTA worker processes: largest peak RSS {theirs['worker_peak_mib']:.0f} MiB; their CPU "
              "time is included above)")
    if "time_s" in ours and "time_s" in theirs:
        print(f"  speed-up: {theirs['cpu_s'] / ours['cpu_s']:.1f}x CPU time, "
              f"{theirs['time_s'] / ours['time_s']:.1f}x wall time; "
              f"peak memory {theirs['peak_mib'] / ours['peak_mib']:.1f}x less")


if __name__ == "__main__":
    sys.exit(main())
