"""What `ncclscope run`'s tracer costs: per DDP example step, and per tiny all_reduce.

    OMP_NUM_THREADS=1 python benchmarks/run_overhead.py                     # both, ~3 min
    OMP_NUM_THREADS=1 python benchmarks/run_overhead.py --pairs 200 --only step
    OMP_NUM_THREADS=1 python benchmarks/run_overhead.py --baseline /tmp/old_usertrace   # before/after, one run
    OMP_NUM_THREADS=1 python benchmarks/run_overhead.py --only nan --pairs 80 --ops 5000   # the NaN check's cost

Targets: DDP example step traced / untraced <= 1.02x; <= 20 us added per tiny all_reduce.

Built for a shared, loaded machine (2 cores, other jobs' load changing within a second):

- Blocks alternate U T U T ... U (with --baseline, U C B U B C U ...); each traced
  block is paired with the untraced blocks either side: ratio T / sqrt(U_before *
  U_after) (per op: T - mean(U_before, U_after)), which cancels load that drifts
  slower than a block. The figure is the median paired ratio with a 95% interval
  from a moving-block bootstrap (neighbouring pairs share an untraced block, so
  they are resampled in runs of 3). The verdict comes from the interval: "met"
  when all of it is within the target, "NOT met" when all of it is beyond it,
  else "cannot be resolved at this noise" (more --pairs, or a quieter machine).
- Step (the model and loop of examples/ddp.py, 2 gloo ranks): one pair of ranks
  runs every block, so neighbouring blocks are a fraction of a second apart. A
  traced block gets what the bootstrap sets up in a rank, built before the block
  and torn down after it, outside the timed window: recorder (flusher thread),
  telemetry sampler, tracer (patches, step hook, watch thread), SIGTERM watcher.
  Not per block: the one-off clock exchange (at startup only), and Flight
  Recorder, which cannot be switched in a live process: it is on (the
  bootstrap's setting) in untraced blocks too; its cost per collective is in the
  per-op figure (DDP issues one collective per step here).
- Per op (4 floats, one gloo rank: nothing but the call is timed): every block
  is a fresh process forked from this warm one, untraced a plain job, traced
  with the bootstrap's whole setup, Flight Recorder included.
- NaN check (`--only nan`; also in the full run): the per-op blocks again, with
  two traced kinds, the tracer as `ncclscope run` installs it (its finiteness
  check of each reducing op's input on, runtime/usertrace/nancheck.py) and the
  same tracer with `--no-nan-check`, interleaved U C N U N C U ...; each against
  its untraced neighbours, and the check's own cost: in each round, the checked
  block minus the unchecked one (healthy tensors: the check never fires).
- Each step (op) is timed. Figures per block: the mean (everything, other load
  included: the direct figure, whose interval gives the verdict), and a
  conservative one: the 10th percentile step (an undisturbed step: the
  tracer's inline costs are in every step) plus the CPU time of ncclscope's
  threads per step, both ranks' (their periodic work, counted as if every ns
  of it delayed the job), which can prove the target met, never not met. Beside wall
  time, each rank's process CPU time (all threads) per step. After the
  schedule, one more traced block per tracer times the tracer's step hook in
  the training thread (in situ), for the components line: hook + ncclscope
  threads' CPU per rank per step, directly measured, next to the step time.

Nothing can hang: every child is joined with a deadline and killed past it (its
figures are then reported lost); each child writes its result to its own file
(tmp + rename) before any teardown, and the parent reads the files after the
join: no result can be left in a queue's feeder thread by an exiting child.

--baseline PATH: another tracer measured in the same run, its blocks interleaved
with the current tracer's: a copy of an earlier runtime/usertrace/ directory
(`cp -r runtime/usertrace /tmp/old` before a change), or an earlier commit's
single-file tracer.py.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from overhead_stats import (BLOCK_TIMEOUT_S, LEVEL, OP_TARGET_US, STEP_TARGET, bound_verdict,  # noqa: E402
                            diff_summary, field_of, paired, ratio_summary, verdict)


# ---- children ----------------------------------------------------------------------------------
def _child(fn: Callable[..., tuple[dict[str, Any], Callable[[], None]]], args: tuple[Any, ...],
           result_path: str) -> None:
    """In the forked child: run, write the result (durable once renamed), tear down, exit."""
    code = 0
    try:
        result, teardown = fn(*args)
        tmp = result_path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, result_path)
        try:
            teardown()
        except Exception:
            traceback.print_exc()
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stderr.flush()
        os._exit(code)   # the result is on disk already: nothing is waiting in a queue's feeder thread


def run_block(fn: Callable[..., Any], world: int, args: tuple[Any, ...], timeout_s: float = BLOCK_TIMEOUT_S
              ) -> list[dict[str, Any]] | None:
    """One block: `world` forked ranks running fn(rank, world, store_dir, *args); their results, or None
    when any rank failed or ran past the deadline (stragglers are killed)."""
    ctx = mp.get_context("fork")
    tmp = tempfile.mkdtemp(prefix="ncclscope-bench-")
    paths = [os.path.join(tmp, f"result{r}.json") for r in range(world)]
    procs = [ctx.Process(target=_child, args=(fn, (r, world, tmp, *args), paths[r]), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout_s
    for p in procs:
        p.join(max(0.1, deadline - time.monotonic()))
    lost = False
    for p in procs:
        if p.is_alive():
            lost = True
            p.kill()
            p.join(5)
    out = []
    for path in paths:
        try:
            with open(path) as f:
                out.append(json.load(f))
        except (OSError, ValueError):
            lost = True
    shutil.rmtree(tmp, ignore_errors=True)
    if lost or len(out) != world:
        print(f"run_overhead: a block was lost (exit codes {[p.exitcode for p in procs]})", file=sys.stderr)
        return None
    return out


# ---- what runs in a rank -----------------------------------------------------------------------
def _init(rank: int, world: int, store_dir: str) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))


def _tracer_class(kind: str, baseline: str) -> type:
    """The current Tracer, or --baseline's: a single-file tracer.py, or a copy of the whole
    runtime/usertrace/ package (a directory), imported under a name of its own."""
    if kind != "baseline":   # current, nocheck (the current tracer with its NaN check off)
        from ncclscope.runtime.usertrace.tracer import Tracer
        return Tracer
    import importlib
    import importlib.util
    name = "ncclscope_baseline_tracer"
    if name in sys.modules:
        mod = sys.modules[name]
    elif os.path.isdir(baseline):
        spec = importlib.util.spec_from_file_location(name, os.path.join(baseline, "__init__.py"),
                                                      submodule_search_locations=[baseline])
        assert spec is not None and spec.loader is not None, baseline
        pkg = importlib.util.module_from_spec(spec)
        sys.modules[name] = pkg
        spec.loader.exec_module(pkg)
        mod = importlib.import_module(name + ".tracer")
        sys.modules[name] = mod
    else:
        spec = importlib.util.spec_from_file_location(name, baseline)
        assert spec is not None and spec.loader is not None, baseline
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sys.modules[name] = mod
    return mod.Tracer


def _setup(kind: str, rank: int, world: int, store_dir: str, baseline: str) -> Callable[[], None]:
    """What the bootstrap sets up in a rank before the script runs (nothing when untraced), then the
    process group; returns the teardown."""
    import torch
    torch.set_num_threads(1)
    if kind == "untraced":
        _init(rank, world, store_dir)
        return lambda: None
    from ncclscope import schema as S
    from ncclscope.runtime.recorder import Recorder
    from ncclscope.runtime.telemetry import Sampler
    from ncclscope.runtime.usertrace.bootstrap import flight_recorder_env
    out = Path(store_dir) / "run"
    flight_recorder_env(out / S.rank_dir_name(rank))
    rec = Recorder(out, rank, world)
    rec.context.step = 0
    rec.write_meta(local_rank=rank, launcher="bench", script="bench", argv=["bench"], config={})
    sampler = Sampler(rec, rank, announce=False).start()
    extra = {"nan_check": "off"} if kind == "nocheck" else {}
    tracer = _tracer_class(kind, baseline)(rec, rank, world, timeout_s=60, **extra).install()
    if hasattr(tracer, "watch_sigterm"):
        tracer.watch_sigterm()
    _init(rank, world, store_dir)   # through the tracer's wrapper, as the script's own call would be
    if hasattr(tracer, "wait_clock"):
        tracer.wait_clock(5.0)      # the one-off clock exchange: not part of the steady state

    def teardown() -> None:
        tracer.close()
        sampler.stop()
        rec.close()
    return teardown


def _bg_cpu_ns() -> int:
    """CPU time so far of this process's ncclscope threads (flusher, sampler, watch, SIGTERM reader)."""
    import threading
    total = 0
    for t in threading.enumerate():
        if t.name.startswith("ncclscope") and t.ident is not None:
            try:
                total += time.clock_gettime_ns(time.pthread_getcpuclockid(t.ident))
            except (OSError, AttributeError):
                pass
    return total


def _measured(body: Callable[[int], None], n: int) -> dict[str, Any]:
    """Run body(i) n times, each timed: wall and process CPU (all threads) per iteration.

    Returned per iteration: the median (what a typical step costs: a burst of other load that hits
    some steps does not move it) and the mean (everything, bursts included), and `bg`, the CPU time
    of ncclscope's own threads over the window. Their work is periodic (a flush every 0.2 s, a
    sample every 0.1 s), so it lands in a few steps, which the median leaves out: the robust figure
    adds it back, as if every ns of it had delayed the training thread (cores saturated)."""
    pc, pt = time.perf_counter_ns, time.process_time_ns
    walls = [0] * n
    cpus = [0] * n
    bg0 = _bg_cpu_ns()
    w0, c0 = pc(), pt()
    wp, cp = w0, c0
    for i in range(n):
        body(i)
        w, c = pc(), pt()
        walls[i], cpus[i] = w - wp, c - cp
        wp, cp = w, c
    bg = _bg_cpu_ns() - bg0
    walls.sort()
    cpus.sort()
    return {"wall_q10": walls[n // 10] * 1e-9, "wall_q25": walls[n // 4] * 1e-9,
            "cpu_q10": cpus[n // 10] * 1e-9, "cpu_q25": cpus[n // 4] * 1e-9,
            "wall_med": statistics.median(walls) * 1e-9, "wall_mean": (wp - w0) / n * 1e-9,
            "cpu_med": statistics.median(cpus) * 1e-9, "cpu_mean": (cp - c0) / n * 1e-9, "bg": bg / n * 1e-9}


def _stack(kind: str, rank: int, world: int, out: Path, baseline: str) -> tuple[Callable[[], None], Any]:
    """In a live process (its group initialised): what the bootstrap sets up in a rank; returns the
    teardown and the tracer. No clock exchange (the bootstrap's is a one-off at startup, and it would reuse keys)."""
    from ncclscope.runtime.recorder import Recorder
    from ncclscope.runtime.telemetry import Sampler
    rec = Recorder(out, rank, world)
    rec.context.step = 0
    rec.write_meta(local_rank=rank, launcher="bench", script="bench", argv=["bench"], config={})
    sampler = Sampler(rec, rank, announce=False).start()
    cls = _tracer_class(kind, baseline)
    try:
        tracer = cls(rec, rank, world, timeout_s=60, clock_sync=False)
    except TypeError:   # an older tracer without the argument
        tracer = cls(rec, rank, world, timeout_s=60)
    tracer.install()
    if hasattr(tracer, "watch_sigterm"):
        tracer.watch_sigterm()

    def teardown() -> None:
        tracer.close()
        sampler.stop()
        rec.close()
        shutil.rmtree(rec.dir, ignore_errors=True)   # this rank's directory only: the other may still write
    return teardown, tracer


def _probe_hook(tracer: Any, step: Callable[[int], None], steps: int) -> float | None:
    """Median time of the tracer's optimizer-step hook in the training thread, in real steps (in situ:
    caches cold from the step around it, several times its cost in a tight loop)."""
    hook = getattr(tracer, "_hook", None)
    fn = getattr(tracer, "_optimizer_stepped", None)
    if hook is None or fn is None:
        return None
    from torch.optim.optimizer import register_optimizer_step_post_hook
    hook.remove()
    times: list[int] = []
    pc = time.perf_counter_ns

    def timed(opt: Any, args: Any, kwargs: Any) -> None:
        t0 = pc()
        fn(opt, args, kwargs)
        times.append(pc() - t0)
    tracer._hook = register_optimizer_step_post_hook(timed)
    for i in range(steps):
        step(i)
    return statistics.median(times) * 1e-9 if times else None


def step_session(rank: int, world: int, store_dir: str, order: list[str], steps: int, warmup: int,
                 baseline: str) -> tuple[dict[str, Any], Callable[[], None]]:
    """All the step blocks, in `order`, in this one rank: the model and loop of examples/ddp.py."""
    from ncclscope import schema as S
    from ncclscope.runtime.usertrace.bootstrap import flight_recorder_env
    flight_recorder_env(Path(store_dir) / "fr" / S.rank_dir_name(rank))   # before the group: see the docstring
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.set_num_threads(1)
    _init(rank, world, store_dir)
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    xs = [(torch.randn(8, 16, generator=gen), torch.randn(8, 4, generator=gen)) for _ in range(8)]
    mse = nn.functional.mse_loss

    def step(i: int) -> None:
        x, y = xs[i & 7]
        loss = mse(model(x), y)
        opt.zero_grad()
        loss.backward()                  # DDP's gradient all-reduce, inside the C++ reducer
        opt.step()                       # the tracer's step hook

    for i in range(warmup * 4):
        step(i)
    blocks = []
    for b, kind in enumerate(order):
        teardown, _ = (None, None) if kind == "untraced" else \
            _stack(kind, rank, world, Path(store_dir) / f"run{b}", baseline)
        for i in range(warmup):
            step(i)
        dist.barrier()
        blocks.append(_measured(step, steps))
        dist.barrier()
        if teardown is not None:
            teardown()
    hook_s = {}
    for kind in dict.fromkeys(k for k in order if k != "untraced"):   # after the schedule: not in its figures
        teardown, tracer = _stack(kind, rank, world, Path(store_dir) / f"probe-{kind}", baseline)
        dist.barrier()
        hook_s[kind] = _probe_hook(tracer, step, steps * 2)
        dist.barrier()
        teardown()
    return {"blocks": blocks, "hook_s": hook_s}, lambda: None


def op_block(rank: int, world: int, store_dir: str, kind: str, ops: int, warmup: int,
             baseline: str) -> tuple[dict[str, Any], Callable[[], None]]:
    """A tiny all_reduce (4 floats) on one gloo rank, so nothing but the call itself is timed."""
    teardown = _setup(kind, rank, world, store_dir, baseline)
    import torch
    import torch.distributed as dist
    t = torch.ones(4)

    def op(i: int) -> None:
        dist.all_reduce(t)

    for i in range(warmup):
        op(i)    # the first call from this site pays a one-off flush + FR snapshot: here
    return _measured(op, ops), teardown


# ---- the experiment ----------------------------------------------------------------------------
def schedule(pairs: int, kinds: list[str]) -> list[str]:
    """U T U T ... U; with two traced kinds, their order alternates round by round (U C B U B C U ...)."""
    out = []
    for i in range(pairs):
        out.append("untraced")
        out.extend(kinds if i % 2 == 0 else kinds[::-1])
    out.append("untraced")
    return out


def experiment(fn: Callable[..., Any], world: int, pairs: int, kinds: list[str], args: tuple[Any, ...],
               label: str) -> list[dict[str, Any]]:
    """Per-op: one fresh block (process) per entry of the schedule."""
    blocks = []
    order = schedule(pairs, kinds)
    t0 = time.monotonic()
    for i, kind in enumerate(order):
        blocks.append({"kind": kind, "result": run_block(fn, world, (kind, *args))})
        if sys.stderr.isatty():
            print(f"\r{label}: block {i + 1}/{len(order)} ({time.monotonic() - t0:.0f} s)", end="",
                  file=sys.stderr, flush=True)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    return blocks


def step_experiment(pairs: int, kinds: list[str], steps: int, warmup: int, baseline: str
                    ) -> list[dict[str, Any]]:
    """Step: every block in one pair of ranks (a deadline for the whole session, generous for a slow
    machine); a lost session loses every block."""
    order = schedule(pairs, kinds)
    timeout = 120 + len(order) * (steps + warmup) * 0.02
    res = run_block(step_session, 2, (order, steps, warmup, baseline), timeout_s=timeout)
    if res is None:
        return [{"kind": k, "result": None} for k in order]
    return [{"kind": k, "result": [res[0]["blocks"][i], res[1]["blocks"][i]]} for i, k in enumerate(order)] + \
        [{"kind": "hook-probe", "hook_s": [res[0]["hook_s"], res[1]["hook_s"]]}]


def _fmt_ratio(s: dict[str, float]) -> str:
    return f"{s['median']:.3f}x [{s['lo']:.3f}, {s['hi']:.3f}]"


def _warm_parent(baseline: str) -> None:
    """Import in this process what every child needs, before forking: children start warm."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401
    import torch.nn  # noqa: F401
    from torch.nn.parallel import DistributedDataParallel  # noqa: F401

    from ncclscope.runtime.telemetry import Sampler  # noqa: F401
    from ncclscope.runtime.usertrace import bootstrap
    from ncclscope.runtime.usertrace import tracer
    bootstrap.warm_imports()   # torch._dynamo, torch._inductor, pyarrow: as each traced rank does at start
    if baseline:
        _tracer_class("baseline", baseline)


def _median_of(blocks: list[dict[str, Any]], kind: str, field: str) -> float:
    vals = [field_of(b, field) for b in blocks if b["kind"] == kind and b["result"]]
    return statistics.median(vals) if vals else math.nan


def _report_step(blocks: list[dict[str, Any]], kinds: list[str], ns: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in kinds:
        fig = {f: ratio_summary(paired(blocks, kind, f))
               for f in ("wall", "robust", "cpu0", "cpu1", "cpu_robust0", "cpu_robust1")}
        bgs = [[b["result"][r]["bg"] for b in blocks if b["kind"] == kind and b["result"]] for r in (0, 1)]
        bg = [statistics.median(v) if v else math.nan for v in bgs]
        out[kind] = {**fig, "ncclscope_threads_cpu_per_step_s": bg}
        w, rb = fig["wall"], fig["robust"]
        print(f"DDP example step (2 gloo ranks, {kind} tracer): {w['n']} pairs of blocks of {ns.steps} steps; "
              f"target <= {STEP_TARGET:.2f}x")
        print(f"  step time (block mean, everything): {_median_of(blocks, 'untraced', 'wall') * 1e3:.3f} -> "
              f"{_median_of(blocks, kind, 'wall') * 1e3:.3f} ms, traced / untraced {_fmt_ratio(w)} -> "
              f"{verdict(w['lo'], w['hi'], STEP_TARGET)}")
        print(f"  undisturbed step (10th percentile) + ncclscope threads' CPU (conservative): "
              f"{_median_of(blocks, 'untraced', 'robust') * 1e3:.3f} -> {_median_of(blocks, kind, 'robust') * 1e3:.3f}"
              f" ms, {_fmt_ratio(rb)} -> {bound_verdict(rb['lo'], rb['hi'], STEP_TARGET)}")
        for r in (0, 1):
            c, cr = fig[f"cpu{r}"], fig[f"cpu_robust{r}"]
            print(f"  rank {r} CPU per step (process, all threads): {_median_of(blocks, 'untraced', f'cpu{r}') * 1e3:.3f}"
                  f" -> {_median_of(blocks, kind, f'cpu{r}') * 1e3:.3f} ms, {_fmt_ratio(c)} -> "
                  f"{verdict(c['lo'], c['hi'], STEP_TARGET)}; 10th percentile + ncclscope threads {_fmt_ratio(cr)}")
        probe = next((b["hook_s"] for b in blocks if b["kind"] == "hook-probe"), None)
        hook = [p.get(kind) for p in probe] if probe else [None, None]
        out[kind]["hook_in_situ_s"] = hook
        u_mean, u_q10 = _median_of(blocks, "untraced", "wall"), \
            statistics.median(max(x["wall_q10"] for x in b["result"]) for b in blocks
                              if b["kind"] == "untraced" and b["result"])
        per_rank = [(h or 0.0) + g for h, g in zip(hook, bg)]
        hook_txt = ", ".join("n/a" if h is None else f"{h * 1e6:.1f}" for h in hook)
        print(f"  components, per rank per step: step hook (in situ) {hook_txt} us + ncclscope threads' CPU "
              f"{bg[0] * 1e6:.1f}, {bg[1] * 1e6:.1f} us = {max(per_rank) * 1e6:.1f} us at most: "
              f"{max(per_rank) / u_mean:.1%} of the untraced block-mean step, {max(per_rank) / u_q10:.1%} of its "
              f"undisturbed step (plus torch's own dispatch of a global optimizer hook, ~2-3 us)")
    return out


def _report_op(blocks: list[dict[str, Any]], kinds: list[str], ns: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for kind in kinds:
        fig = {f: diff_summary([d * 1e6 for d in paired(blocks, kind, f, ratio=False)])
               for f in ("wall", "robust", "cpu0")}
        out[kind] = fig
        w, rb, c = fig["wall"], fig["robust"], fig["cpu0"]
        print(f"tiny all_reduce (1 gloo rank, {kind} tracer): {w['n']} pairs of blocks of {ns.ops} ops, "
              f"a fresh process each; target <= {OP_TARGET_US:g} us added")
        print(f"  per op (block mean, everything): {_median_of(blocks, 'untraced', 'wall') * 1e6:.1f} -> "
              f"{_median_of(blocks, kind, 'wall') * 1e6:.1f} us, added {w['median']:.1f} us [{w['lo']:.1f}, "
              f"{w['hi']:.1f}] -> {verdict(w['lo'], w['hi'], OP_TARGET_US)}")
        print(f"  undisturbed op (10th percentile) + ncclscope threads' CPU: added {rb['median']:.1f} us "
              f"[{rb['lo']:.1f}, {rb['hi']:.1f}] -> {verdict(rb['lo'], rb['hi'], OP_TARGET_US)}; process CPU "
              f"added {c['median']:.1f} us [{c['lo']:.1f}, {c['hi']:.1f}]")
    return out


def _report_nan(blocks: list[dict[str, Any]], ns: argparse.Namespace) -> dict[str, Any]:
    """The tracer with and without its NaN check against untraced, and the check's own cost per op: in
    each round (the traced blocks between two untraced ones) the checked block minus the unchecked one."""
    out = _report_op(blocks, ["current", "nocheck"], ns)
    rounds: list[dict[str, Any]] = []
    for b in blocks:
        if b["kind"] == "untraced":
            rounds.append({})
        elif rounds and b.get("result") is not None:
            rounds[-1][b["kind"]] = b
    for field in ("wall", "robust"):
        diffs = [(field_of(r["current"], field) - field_of(r["nocheck"], field)) * 1e6
                 for r in rounds if "current" in r and "nocheck" in r]
        out[f"check_{field}"] = diff_summary(diffs) if diffs else None
    w, rb = out["check_wall"], out["check_robust"]
    if w is not None:
        print(f"nan check (finiteness of a reducing op's input, 4 floats, healthy): {w['n']} rounds; added per "
              f"op {w['median']:.2f} us [{w['lo']:.2f}, {w['hi']:.2f}] over the tracer with --no-nan-check "
              f"(undisturbed op: {rb['median']:.2f} us [{rb['lo']:.2f}, {rb['hi']:.2f}])")
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=100, help="traced blocks per tracer, step part "
                    "(each between two untraced ones); the per-op part runs a quarter as many")
    ap.add_argument("--steps", type=int, default=150, help="timed DDP steps per block")
    ap.add_argument("--ops", type=int, default=20000, help="timed all_reduce calls per block")
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps (x25: ops) per block first")
    ap.add_argument("--only", choices=["op", "step", "nan"], default=None,
                    help="one part: the DDP step, the tiny all_reduce, or the NaN check's cost per all_reduce")
    ap.add_argument("--baseline", default="", metavar="PATH",
                    help="another tracer (a copy of runtime/usertrace/, or a single-file tracer.py) measured "
                    "in the same run, blocks interleaved")
    ap.add_argument("--json", default="", metavar="FILE", help="also write every block and summary here")
    ns = ap.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    for var in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        if var in os.environ:   # untraced per-op blocks must be plain jobs; traced ones get the bootstrap's
            print(f"run_overhead: ignoring {var}={os.environ.pop(var)} from the environment", file=sys.stderr)
    baseline = os.path.abspath(ns.baseline) if ns.baseline else ""
    kinds = ["current"] + (["baseline"] if baseline else [])
    _warm_parent(baseline)
    load0 = os.getloadavg()
    print(f"load average at start {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}, {os.cpu_count()} cores; "
          f"figures: medians of the paired blocks, [{LEVEL:.0%} interval] (moving-block bootstrap)")
    report: dict[str, Any] = {"args": vars(ns), "load_start": load0}
    status = 0
    for what in ("step", "op", "nan"):
        if ns.only not in (None, what):
            continue
        t0 = time.monotonic()
        part_kinds = ["current", "nocheck"] if what == "nan" else kinds
        if what == "step":
            blocks = step_experiment(ns.pairs, kinds, ns.steps, ns.warmup, baseline)
        else:
            blocks = experiment(op_block, 1, max(8, ns.pairs // 4), part_kinds, (ns.ops, ns.warmup * 25, baseline),
                                what)
        report[f"{what}_blocks"] = blocks
        lost = sum(b.get("result", 0) is None for b in blocks)
        if lost:
            print(f"{what}: {lost} of {len(blocks)} blocks lost (a rank failed or ran past its deadline)")
            status = 1
        if not any(b["result"] for b in blocks if b["kind"] == "untraced") or \
                not all(any(b["result"] for b in blocks if b["kind"] == k) for k in part_kinds):
            print(f"{what}: no complete blocks of some kind: no figure")
            continue
        if what == "nan":
            report[what] = _report_nan(blocks, ns)
        else:
            report[what] = (_report_step if what == "step" else _report_op)(blocks, kinds, ns)
        report[f"{what}_seconds"] = round(time.monotonic() - t0, 1)
    for kind in kinds:
        if "step" in report and kind in report["step"]:
            w, rb = report["step"][kind]["wall"], report["step"][kind]["robust"]
            print(f"VERDICT step <= {STEP_TARGET:.2f}x, {kind} tracer: {verdict(w['lo'], w['hi'], STEP_TARGET)} "
                  f"(block means {_fmt_ratio(w)}; conservative {_fmt_ratio(rb)}: "
                  f"{bound_verdict(rb['lo'], rb['hi'], STEP_TARGET)})")
        if "op" in report and kind in report["op"]:
            w = report["op"][kind]["wall"]
            print(f"VERDICT per op <= {OP_TARGET_US:g} us, {kind} tracer: {verdict(w['lo'], w['hi'], OP_TARGET_US)} "
                  f"({w['median']:.1f} us [{w['lo']:.1f}, {w['hi']:.1f}])")
    if report.get("nan", {}).get("check_wall"):
        w = report["nan"]["check_wall"]
        print(f"VERDICT nan check per op: {w['median']:.2f} us [{w['lo']:.2f}, {w['hi']:.2f}] on top of the tracer; "
              f"traced op with it {report['nan']['current']['wall']['median']:.1f} us added -> "
              f"{verdict(report['nan']['current']['wall']['lo'], report['nan']['current']['wall']['hi'], OP_TARGET_US)}")
    load1 = os.getloadavg()
    report["load_end"] = load1
    print(f"load average at end {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    if ns.json:
        Path(ns.json).write_text(json.dumps(report, indent=1, default=str))
    return status


if __name__ == "__main__":
    sys.exit(main())
