"""What `ncclscope run`'s tracer costs: per op, and per training step of the DDP example.

    OMP_NUM_THREADS=1 python benchmarks/run_overhead.py            # both figures
    OMP_NUM_THREADS=1 python benchmarks/run_overhead.py --ops 20000 --steps 100 --blocks 8
    OMP_NUM_THREADS=1 python benchmarks/run_overhead.py --baseline OLD/tracer.py   # before/after, one run

--baseline FILE: a tracer module from elsewhere (say, tracer.py of an earlier
commit, `git show REV:runtime/usertrace/tracer.py > /tmp/old_tracer.py`; a
single-file tracer, importable on its own) measured in the same run, its
blocks interleaved with the current tracer's and the untraced ones, so the
before and after figures see the same machine load.

1. Per-op: a tiny all_reduce (4 floats, one gloo rank so nothing but the call
   itself is timed) N times raw, then N times through the tracer (begin row,
   call site, group sequence number, end row); the difference per call.
   Interleaved blocks; the fastest block of each kind (least disturbed by
   other load), with the median alongside.
2. Per step: the model and loop of examples/ddp.py on 2 forked gloo ranks;
   blocks of steps alternate untraced / traced (the tracer installed and
   removed between blocks, the recorder kept open); fastest blocks' ratio,
   and the ratio of rank 0's median CPU time per step (all its threads:
   what tracing adds, hardly moved by other load on a shared machine).
Targets: <= 20 us per op, <= 1.02x per step.
"""
from __future__ import annotations

import argparse
import datetime
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _init(rank: int, world: int, store_dir: str) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))


def _tracer_classes(baseline: str) -> list[tuple[str, type]]:
    """[("current", Tracer)] and, with --baseline FILE, ("baseline", that file's Tracer)."""
    from ncclscope.runtime.usertrace.tracer import Tracer
    out: list[tuple[str, type]] = [("current", Tracer)]
    if baseline:
        import importlib.util
        spec = importlib.util.spec_from_file_location("ncclscope_baseline_tracer", baseline)
        assert spec is not None and spec.loader is not None, baseline
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        out.append(("baseline", mod.Tracer))
    return out


def _summary(raw: list[float], traced: list[float]) -> dict:
    # the fastest block: the least disturbed by whatever else the machine runs (2 shared cores here)
    r, tr = min(raw), min(traced)
    return {"raw_us": r * 1e6, "traced_us": tr * 1e6, "added_us": (tr - r) * 1e6,
            "median_added_us": (statistics.median(traced) - statistics.median(raw)) * 1e6}


def per_op(n: int, blocks: int, baseline: str = "") -> dict:
    import torch
    import torch.distributed as dist

    from ncclscope.runtime.recorder import Recorder
    tmp = tempfile.mkdtemp(prefix="ncclscope-bench-")
    _init(0, 1, tmp)
    rec = Recorder(Path(tmp) / "run", 0, 1)
    rec.context.step = 0
    t = torch.ones(4)
    tracers = [(name, cls(rec, 0, 1, timeout_s=60)) for name, cls in _tracer_classes(baseline)]
    raw: list[float] = []
    traced: dict[str, list[float]] = {name: [] for name, _ in tracers}
    for _ in range(200):
        dist.all_reduce(t)
    for b in range(blocks):
        t0 = time.perf_counter()
        for _ in range(n):
            dist.all_reduce(t)
        raw.append((time.perf_counter() - t0) / n)
        for name, tracer in (tracers if b % 2 == 0 else tracers[::-1]):
            tracer.install()
            dist.all_reduce(t)   # first call site: one-off flush, not part of the steady state
            t0 = time.perf_counter()
            for _ in range(n):
                dist.all_reduce(t)
            traced[name].append((time.perf_counter() - t0) / n)
            tracer.uninstall()
            rec.flush()
    rec.close()
    dist.destroy_process_group()
    return {"ops_per_block": n, "blocks": blocks, **{name: _summary(raw, v) for name, v in traced.items()}}


def _ddp_rank(rank: int, world: int, store_dir: str, steps: int, blocks: int, out: "mp.Queue",
              baseline: str = "") -> None:
    import torch
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ncclscope.runtime.recorder import Recorder
    _init(rank, world, store_dir)
    rec = Recorder(Path(store_dir) / "run", rank, world)
    rec.context.step = 0
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)
    tracers = [(name, cls(rec, rank, world, timeout_s=60)) for name, cls in _tracer_classes(baseline)]

    def run(n: int) -> tuple[float, float]:
        c0 = time.process_time()
        t0 = time.perf_counter()
        for _ in range(n):
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        import torch.distributed as dist
        dist.barrier()
        return (time.perf_counter() - t0) / n, (time.process_time() - c0) / n

    run(20)
    plain: list[tuple[float, float]] = []
    traced: dict[str, list[tuple[float, float]]] = {name: [] for name, _ in tracers}
    for b in range(blocks):
        plain.append(run(steps))
        for name, tracer in (tracers if b % 2 == 0 else tracers[::-1]):
            tracer.install()
            traced[name].append(run(steps))
            tracer.uninstall()
    rec.close()
    if rank == 0:
        out.put((plain, traced))


def _step_summary(plain: list[tuple[float, float]], traced: list[tuple[float, float]]) -> dict:
    """Wall time (fastest block) and rank 0's CPU time (process: all its threads) per step.
    CPU time hardly moves with other load on the machine, wall time does."""
    pw, pc = [p[0] for p in plain], [p[1] for p in plain]
    tw, tc = [t[0] for t in traced], [t[1] for t in traced]
    ratios = [t / p for p, t in zip(pw, tw)]
    return {"untraced_ms": min(pw) * 1e3, "traced_ms": min(tw) * 1e3, "ratio": min(tw) / min(pw),
            "median_ratio": statistics.median(ratios), "untraced_cpu_ms": statistics.median(pc) * 1e3,
            "traced_cpu_ms": statistics.median(tc) * 1e3, "cpu_ratio": statistics.median(tc) / statistics.median(pc)}


def per_step(steps: int, blocks: int, baseline: str = "") -> dict:
    import torch  # noqa: F401  (imported once, before forking)
    import torch.distributed  # noqa: F401
    import torch._dynamo  # noqa: F401  (the tracer imports it at install, as the bootstrap does: not mid-block)
    from ncclscope.runtime.recorder import warm_pyarrow
    warm_pyarrow()
    tmp = tempfile.mkdtemp(prefix="ncclscope-bench-")
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_ddp_rank, args=(r, 2, tmp, steps, blocks, q, baseline)) for r in range(2)]
    for p in procs:
        p.start()
    plain, traced = q.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    return {"steps_per_block": steps, "blocks": blocks,
            **{name: _step_summary(plain, v) for name, v in traced.items()}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", type=int, default=5000)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--only", choices=["op", "step"], default=None)
    ap.add_argument("--baseline", default="", metavar="FILE",
                    help="another tracer.py (an earlier version) measured in the same run, blocks interleaved")
    ns = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    if ns.baseline:
        ns.baseline = os.path.abspath(ns.baseline)
    if ns.only in (None, "step"):   # forks first: the per-op part initialises a process group in this process
        s = per_step(ns.steps, ns.blocks, ns.baseline)
        for name in ("current", "baseline"):
            if name in s:
                r = s[name]
                print(f"DDP example step (2 gloo ranks), {name} tracer: untraced {r['untraced_ms']:.3f} ms, traced "
                      f"{r['traced_ms']:.3f} ms, ratio {r['ratio']:.3f}x (fastest of {s['blocks']} blocks of "
                      f"{s['steps_per_block']} steps each; median of the block ratios {r['median_ratio']:.3f}x); "
                      f"rank 0 CPU per step (median) {r['untraced_cpu_ms']:.3f} -> {r['traced_cpu_ms']:.3f} ms, "
                      f"{r['cpu_ratio']:.3f}x")
    if ns.only in (None, "op"):
        o = per_op(ns.ops, ns.blocks, ns.baseline)
        for name in ("current", "baseline"):
            if name in o:
                r = o[name]
                print(f"tiny all_reduce (1 gloo rank), {name} tracer: raw {r['raw_us']:.1f} us, traced "
                      f"{r['traced_us']:.1f} us, added {r['added_us']:.1f} us per op (fastest of {o['blocks']} "
                      f"blocks of {o['ops_per_block']}; medians: {r['median_added_us']:.1f} us added)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
