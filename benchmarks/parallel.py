"""Step time of ncclscope's traced runtime per parallel layout, against plain PyTorch.

    python benchmarks/parallel.py                                  # all layouts, ~1.5 min on 2 cores
    python benchmarks/parallel.py --layouts dp2,pp2-1f1b --steps 80 --warmup 3

Layouts: dp2, pp2-1f1b, pp2-gpipe (microbatches 4), tp2, cp2, dp2-ep2 (2 ranks),
tp2-pp2-dp2 (8 ranks, 1f1b, microbatches 4). Model: 4 layers, 4 heads, n_embd
64, block 64, vocab 256, global batch 16, AdamW, grad clip 1.0, fp32.

For each layout one set of gloo ranks is forked (FileStore rendezvous). In those
processes, one call of the real trainer, `runtime.train.train`, runs with
tracing on as `run_rank` sets it up (a `Recorder` writing a temp run dir, the
wrapped `Comm`, `build_mesh`, the host `Sampler`); its step time is the
`step_time_s` it logs, read back from each rank's metrics.arrows. Where plain
PyTorch has an equivalent, the same processes train it on its own process
group with the same model (`reference.make_model`), global batch, AdamW and
global-norm clipping:

    dp2        DistributedDataParallel
    pp2-1f1b   torch.distributed.pipelining PipelineStage + Schedule1F1B
    pp2-gpipe  PipelineStage + ScheduleGPipe (same 2-stage split, 4 microbatches)

and the two alternate step by step: the recorder's `metric` is wrapped so that
after train() has taken step k's time, and before it starts timing step k+1,
the ranks meet at a barrier, run plain step k (timed with perf_counter over the
same span of work: batch, zero_grad, forward, backward, clip, optimizer step,
loss read) and meet again. Adjacent steps see the same machine load. Caveat: the
recorder's flusher thread (200 ms period) and the 10 Hz sampler keep running
during the plain steps, so a share of tracing's background cost (<= 3% of a
step in benchmarks/overhead.py) is charged to the baseline.

Per step, the time is the slowest rank's; the first --warmup steps of both
sides are dropped. Columns: median step time of each side; ratio = median over
steps k of (ncclscope step k / plain step k), which is steadier under a shared
machine's load swings than the ratio of the two medians. Layouts without a
plain-PyTorch equivalent print their step time with ratio "n/a".

Target (issue 3): traced ncclscope within 1.3x of plain PyTorch. Absolute times
on a shared 2-core machine are noise; the side-by-side ratios are what matter.
"""
from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

import argparse  # noqa: E402
import json  # noqa: E402
import multiprocessing as mp  # noqa: E402
import shlex  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

TARGET = 1.3
MODEL = dict(n_layer=4, n_head=4, n_embd=64, block_size=64, batch_size=16)

# name -> (RunConfig overrides, plain-PyTorch baseline or None)
LAYOUTS: dict[str, tuple[dict, str | None]] = {
    "dp2": (dict(dp=2), "ddp"),
    "pp2-1f1b": (dict(pp=2, schedule="1f1b", microbatches=4), "1f1b"),
    "pp2-gpipe": (dict(pp=2, schedule="gpipe", microbatches=4), "gpipe"),
    "tp2": (dict(tp=2), None),
    "cp2": (dict(cp=2), None),
    "dp2-ep2": (dict(dp=2, ep=2), None),
    "tp2-pp2-dp2": (dict(tp=2, pp=2, dp=2, schedule="1f1b", microbatches=4), None),
}
BASELINE_NAME = {"ddp": "DDP", "1f1b": "Schedule1F1B", "gpipe": "ScheduleGPipe"}


def make_cfg(name: str, steps: int, out: str):
    from ncclscope.runtime.config import RunConfig
    return RunConfig(**MODEL, **LAYOUTS[name][0], steps=steps, out=out).validate()


# ---- plain PyTorch ------------------------------------------------------------------
def _plain_ddp(cfg, rank: int, group):
    """DistributedDataParallel on the full model: this rank's dp slice of the
    global batch. Returns step(index) -> seconds."""
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ncclscope.runtime.corpus import global_batch, shard
    from ncclscope.runtime.reference import make_model

    model = DDP(make_model(cfg), process_group=group)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)

    def step(index: int) -> float:
        t0 = time.perf_counter()
        x, y = global_batch(cfg.seed, index, cfg.batch_size, cfg.block_size)
        x, y = shard(x, rank, cfg.dp), shard(y, rank, cfg.dp)
        opt.zero_grad(set_to_none=True)
        loss = model(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        loss.item()
        return time.perf_counter() - t0
    return step


def _plain_pipeline(cfg, rank: int, group, schedule: str):
    """torch.distributed.pipelining with the stage split ncclscope uses (layers
    cut evenly; stage 0 embeds, the last stage projects and owns the loss).
    Returns step(index) -> seconds."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from ncclscope.runtime.corpus import global_batch
    from ncclscope.runtime.reference import make_model

    full = make_model(cfg)
    per = cfg.layers_per_stage()
    lo = sum(per[:rank])
    first, last = rank == 0, rank == cfg.pp - 1

    class Stage(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            if first:
                self.wte, self.wpe = full.wte, full.wpe
            self.blocks = nn.ModuleList(full.blocks[i] for i in range(lo, lo + per[rank]))
            if last:
                self.ln_f, self.head = full.ln_f, full.head

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if first:
                x = self.wte(x) + self.wpe(torch.arange(x.shape[1]))
            for block in self.blocks:
                x = block(x)
            return self.head(self.ln_f(x)) if last else x

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    mod = Stage()
    stage = PipelineStage(mod, rank, cfg.pp, torch.device("cpu"), group=group)
    cls = Schedule1F1B if schedule == "1f1b" else ScheduleGPipe
    sched = cls(stage, n_microbatches=cfg.microbatches, loss_fn=loss_fn)
    params = list(mod.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)

    def step(index: int) -> float:
        t0 = time.perf_counter()
        x, y = global_batch(cfg.seed, index, cfg.batch_size, cfg.block_size)
        opt.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if first:
            sched.step(x, return_outputs=False)
        else:
            sched.step(target=y, losses=losses, return_outputs=False)
        grads = [p.grad for p in params if p.grad is not None]
        norm_sq = torch.nn.utils.get_total_norm(grads).double().pow(2).reshape(1)
        torch.distributed.all_reduce(norm_sq, group=group)      # global norm over the stages
        torch.nn.utils.clip_grads_with_norm_(params, cfg.grad_clip, norm_sq.sqrt().float().reshape(()))
        opt.step()
        if last:
            float(torch.stack(losses).detach().sum())
        return time.perf_counter() - t0
    return step


# ---- one rank -----------------------------------------------------------------------
def _rank(name: str, rank: int, world: int, init: str, run_dir: str, warmup: int, steps: int) -> None:
    code = 0
    try:
        import torch
        import torch.distributed as dist

        from ncclscope.runtime.comm import Comm
        from ncclscope.runtime.faults import FaultPlan
        from ncclscope.runtime.mesh import build_mesh
        from ncclscope.runtime.recorder import Recorder
        from ncclscope.runtime.telemetry import Sampler
        from ncclscope.runtime.train import train

        torch.set_num_threads(1)
        cfg = make_cfg(name, warmup + steps, run_dir)
        baseline = LAYOUTS[name][1]
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
        # as run_rank sets it up: a real Recorder, the wrapped Comm, the mesh, the sampler
        rec = Recorder(run_dir, rank, world)
        comm = Comm(rec, rank, world, timeout_s=cfg.timeout_s)
        comm.register_world()
        mesh = build_mesh(cfg, comm)
        plain: list[float] = []
        if baseline:   # every baseline is 2 ranks: its own torch group, created in the same order everywhere
            group = dist.new_group(list(range(world)))
            plain_step = (_plain_ddp(cfg, rank, group) if baseline == "ddp"
                          else _plain_pipeline(cfg, rank, group, baseline))
            record = rec.metric

            def metric(**values) -> None:
                """train() calls this after it has taken step k's step_time_s and
                before it starts timing step k+1: run plain step k in between."""
                record(**values)
                dist.barrier(group)
                plain.append(plain_step(int(values["step"])))
                dist.barrier(group)

            rec.metric = metric
        sampler = Sampler(rec, rank, announce=False).start()
        try:
            train(cfg, comm, mesh, rec, FaultPlan([], rank, rec))
        finally:
            sampler.stop()
            rec.close()
        Path(f"{run_dir}/plain-{rank}.json").write_text(json.dumps(plain))
        dist.barrier()
    except Exception:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)   # skip interpreter teardown (gloo pairs)


def _metrics_step_times(path: Path) -> list[float]:
    import pyarrow as pa
    with pa.OSFile(str(path), "rb") as f:
        table = pa.ipc.open_stream(f).read_all()
    return [float(v) for v in table.column("step_time_s").to_pylist()]


def _slowest(per_rank: list[list[float]], warmup: int) -> list[float]:
    """Per measured step (after warm-up), the slowest rank's time."""
    return [max(ts) for ts in zip(*(r[warmup:] for r in per_rank))]


def run_layout(name: str, warmup: int, steps: int, timeout_s: float) -> dict:
    from ncclscope import schema as S

    world = make_cfg(name, 1, "").world_size
    ctx = mp.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="ncclscope-bench-") as tmp:
        init, run_dir = f"file://{tmp}/store", f"{tmp}/run"
        procs = [ctx.Process(target=_rank, args=(name, r, world, init, run_dir, warmup, steps))
                 for r in range(world)]
        t0 = time.monotonic()
        for p in procs:
            p.start()
        try:
            for p in procs:
                p.join(max(1.0, timeout_s - (time.monotonic() - t0)))
        finally:
            for p in procs:                          # reap every child, killing stragglers
                if p.exitcode is None:
                    p.kill()
                p.join()
        codes = [p.exitcode for p in procs]
        if any(c != 0 for c in codes):
            return {"error": f"rank exit codes {codes}"}
        traced = _slowest([_metrics_step_times(Path(run_dir) / S.rank_dir_name(r) / S.METRICS_FILE)
                           for r in range(world)], warmup)
        out = {"world": world, "wall_s": time.monotonic() - t0, "traced_s": statistics.median(traced)}
        if LAYOUTS[name][1]:
            plain = _slowest([json.loads(Path(f"{run_dir}/plain-{r}.json").read_text()) for r in range(world)],
                             warmup)
            out["plain_s"] = statistics.median(plain)
            out["paired"] = statistics.median(t / p for t, p in zip(traced, plain))
        return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layouts", default=",".join(LAYOUTS),
                   help=f"comma-separated, from: {', '.join(LAYOUTS)} (default: all)")
    p.add_argument("--steps", type=int, default=40, help="measured steps per side (default 40)")
    p.add_argument("--warmup", type=int, default=3, help="steps discarded first (default 3)")
    p.add_argument("--timeout-s", type=float, default=300.0, help="per layout (default 300)")
    args = p.parse_args()
    names = [n.strip() for n in args.layouts.split(",") if n.strip()]
    unknown = [n for n in names if n not in LAYOUTS]
    if unknown:
        p.error(f"unknown layout(s) {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    if not names or args.steps < 1 or args.warmup < 0:
        p.error("need at least one layout, --steps >= 1 and --warmup >= 0")

    import torch

    from ncclscope.runtime.train import warm_imports
    torch.set_num_threads(1)
    warm_imports()
    import torch.distributed.pipelining  # noqa: F401  (pay imports once, before forking)
    import torch.nn.parallel  # noqa: F401

    cmd = "python " + " ".join(shlex.quote(a) for a in sys.argv)
    print(f"ncclscope parallel benchmark: torch {torch.__version__}, {os.cpu_count()} cores, "
          f"OMP_NUM_THREADS=1, gloo, forked ranks")
    print(f"command: {cmd}")
    print(f"model: n_layer {MODEL['n_layer']}, n_head {MODEL['n_head']}, n_embd {MODEL['n_embd']}, "
          f"block {MODEL['block_size']}, vocab 256, global batch {MODEL['batch_size']}, AdamW, clip 1.0, fp32; "
          f"{args.warmup} warm-up + {args.steps} measured steps, ncclscope and plain steps alternating")
    print("ms/step: median over steps of the slowest rank; ratio: median over steps k of ncclscope k / plain k",
          flush=True)
    head = (f"{'layout':<12}{'ranks':>6} | {'ncclscope traced ms/step':>24} | {'plain PyTorch ms/step':>26} | "
            f"{'ratio':>6} | target (<=1.3x)")
    print(head)
    print("-" * len(head), flush=True)
    t_all = time.monotonic()
    for name in names:
        world = make_cfg(name, 1, "").world_size
        res = run_layout(name, args.warmup, args.steps, args.timeout_s)
        if "error" in res:
            print(f"{name:<12}{world:>6} | failed: {res['error']}", flush=True)
            continue
        base = LAYOUTS[name][1]
        plain, r_txt, verdict = "n/a", "n/a", "n/a"
        if base:
            ratio = res["paired"]
            plain = f"{res['plain_s'] * 1e3:.1f} ({BASELINE_NAME[base]})"
            r_txt, verdict = f"{ratio:.2f}x", ("ok" if ratio <= TARGET else "MISSED")
        print(f"{name:<12}{world:>6} | {res['traced_s'] * 1e3:>24.1f} | {plain:>26} | {r_txt:>6} | {verdict}",
              flush=True)
    print(f"total wall time {time.monotonic() - t_all:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
