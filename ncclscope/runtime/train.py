"""The per-rank training loop, and its command-line entry point.

Run under ncclscope's own launcher (`ncclscope train --dp 2 --steps 5 --out runs/a`)
or unchanged under torchrun:

    torchrun --standalone --nproc-per-node 2 -m ncclscope.runtime.train --dp 2 --steps 5 --out runs/a

Any layout of the mesh trains the same model, e.g.

    ncclscope train --tp 2 --pp 2 --dp 2 --microbatches 2 --out runs/b
    ncclscope train --dp 2 --ep 2 --zero 2 --out runs/c
    ncclscope train --cp 2 --tp 2 --out runs/d

Each rank builds its pipeline stage(s) of the model by slicing the full model
initialised from the seed (model.ParallelStage), runs its action list
(pipeline/executor.py), reduces gradients and steps (parallel/data.py).

Each rank writes runs/a/rank-NNNNN/ (events, metrics, samples, stacks); rank 0
writes run.json when there is no ncclscope launcher to do it.

`--dump-grads DIR` saves DIR/rank-R.pt: {"grads": {step: {name: reduced grad
before clipping}}, "params": {name: after the last step}, "shard": {name:
{"dim", "index"}} for tp shards (the rows/columns of the full tensor held),
"grad_range": {name: [start, stop)} under ZeRO-2 (the flattened piece of the
local gradient held), "losses", "grad_norms", "coords"}. Names are the
reference model's.

`--device cuda` runs the same loop on NCCL, one GPU per local rank
(LOCAL_RANK under torchrun, the rank itself under ncclscope's launcher);
docs/nccl.md says how op ends and timeouts map onto NCCL's.

Drills and other tools attach through `StepHooks` (the loop), the executor's
`before_remote_send` and `Comm.add_hook` (every op); runtime/faults.py
registers the `--inject` drills there. The loop itself knows no drill.

Exit codes: 0 ok, 3 comm timeout, 4 comm error, 5 other exception,
6 the ranks disagree on process groups, 7 bad configuration.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import psutil
import torch
import torch.distributed as dist

from ncclscope import schema as S

from ncclscope.runtime import config as C
from ncclscope.runtime.comm import Comm, CommError, CommTimeoutError
from ncclscope.runtime.comm_site import site_functions
from ncclscope.runtime.corpus import global_batch, shard
from ncclscope.runtime.faults import FaultPlan
from ncclscope.runtime.mesh import MeshError, build_mesh
from ncclscope.runtime.model import Layout, ParallelStage, grad_norm_sq, moe_blocks, param_checksum
from ncclscope.runtime.parallel.context import zigzag_index
from ncclscope.runtime.parallel.data import DataParallel, ParamSet
from ncclscope.runtime.pipeline.executor import PipelineExecutor
from ncclscope.runtime.null_recorder import NullRecorder
from ncclscope.runtime.recorder import Recorder
from ncclscope.runtime.reference import make_model
from ncclscope.runtime.telemetry import Sampler, measure_clock_offsets

EXIT_OK, EXIT_TIMEOUT, EXIT_COMM, EXIT_OTHER, EXIT_MESH, EXIT_CONFIG = 0, 3, 4, 5, 6, 7


def versions() -> dict[str, str]:
    import ncclscope
    return {"ncclscope": ncclscope.__version__, "torch": torch.__version__,
            "python": sys.version.split()[0], "schema": S.SCHEMA_VERSION}


def warm_imports() -> None:
    """Pay once, in the launcher before it forks, for what every rank would
    otherwise import or load on its own: constructing a torch optimizer imports
    torch._dynamo (~3 s on this machine), and the corpus is read from disk."""
    import torch._dynamo  # noqa: F401  (imported lazily by torch.optim)
    from ncclscope.runtime.recorder import warm_pyarrow
    warm_pyarrow()
    from ncclscope.runtime.corpus import corpus
    corpus()
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])


def _memory_bytes() -> int:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.memory_allocated())
    return int(psutil.Process().memory_info().rss)


class StepHooks:
    """Points of the training loop where drills (runtime/faults.py) or other
    tools attach; each is a list of callables run in order (empty: nothing)."""

    def __init__(self) -> None:
        self.step_start: list[Callable[[int], None]] = []                  # (step)
        self.after_compute: list[Callable[[int, float], None]] = []        # (step, forward+backward seconds)
        self.after_backward: list[Callable[[int, list[torch.nn.Parameter]], None]] = []   # (step, params)
        self.reduce_options: list[Callable[[int], dict[str, Any]]] = []    # (step) -> DataParallel.reduce kwargs


def _host() -> Any:
    """Where seeded host-side work runs (model init, batches): the CPU, also when
    the default device is a GPU, so every device sees the same numbers."""
    return torch.device("cpu") if torch.get_default_device().type != "cpu" else contextlib.nullcontext()


def build_stages(cfg: C.RunConfig, comm: Comm, mesh: Any) -> list[ParallelStage]:
    """This rank's model chunks (one per virtual stage it owns: stage c*pp + pp_rank),
    sliced from the full reference model initialised from the seed."""
    with _host():
        full = make_model(cfg)
    if torch.get_default_device().type != "cpu":
        full.to(torch.get_default_device())
    cp = mesh.group("cp")
    lay = Layout(comm, mesh.group("tp"), cp, mesh.group("ep"), zigzag_index(cp.rank, cp.size, cfg.block_size))
    per_stage = cfg.layers_per_stage()
    starts = [sum(per_stage[:s]) for s in range(cfg.n_stages)]
    chunks = []
    for c in range(cfg.vpp):
        s = c * cfg.pp + mesh.coords["pp"]
        chunks.append(ParallelStage(full, range(starts[s], starts[s] + per_stage[s]), s == 0,
                                    s == cfg.n_stages - 1, lay))
    return chunks


def build_data_parallel(cfg: C.RunConfig, comm: Comm, mesh: Any,
                        named: list[tuple[str, torch.nn.Parameter]]) -> DataParallel:
    """Dense parameters reduce over dp (dp x cp under CP); with ep > 1 the
    experts reduce over edp; both divide by dp (see parallel/data.py)."""
    tp = mesh.group("tp")
    is_expert = [cfg.ep > 1 and ".experts." in n for n, _ in named]
    counted = [hasattr(p, "tp_shard") or tp.rank == 0 for _, p in named]

    def param_set(want: bool, group: Any) -> ParamSet:
        pick = [i for i, e in enumerate(is_expert) if e == want]
        return ParamSet([named[i][1] for i in pick], [counted[i] for i in pick], comm, group, cfg.zero,
                        cfg.dp, cfg.lr, cfg.bucket_mb)

    dense = param_set(False, mesh.group("dp_cp") if cfg.cp > 1 else mesh.group("dp"))
    expert = param_set(True, mesh.group("edp")) if any(is_expert) else None
    return DataParallel(dense, expert, comm, tp, mesh.group("pp"), mesh.group("ep"))


def _grads_for_dump(dpar: DataParallel, named: list[tuple[str, torch.nn.Parameter]]) -> tuple[dict, dict]:
    """This rank's reduced gradients by full name; under ZeRO-2 only the
    flattened piece it holds, with its [start, stop) in `ranges`."""
    grads, ranges = {}, {}
    index = {id(p): n for n, p in named}
    for pset in (dpar.dense, dpar.expert):
        if pset is None:
            continue
        for i, p in enumerate(pset.params):
            name = index[id(p)]
            if pset.zero is not None and pset.zero.stage == 2:
                piece = pset.zero.grad_piece(i)
                if piece is not None:
                    grads[name], ranges[name] = piece[0].clone(), [piece[1], piece[2]]
            elif p.grad is not None:
                grads[name] = p.grad.detach().clone()
    return grads, ranges


def train(cfg: C.RunConfig, comm: Comm, mesh: Any, rec: Any, faults: FaultPlan | None = None, progress: Any = None,
          dump_grads: str = "") -> None:
    """Training on any layout of tp x cp x dp x pp (ep inside dp, ZeRO on dp).
    `faults` (a FaultPlan, possibly empty) installs its hooks on comm, loop and executor."""
    dp_index = mesh.coords["dp"]
    chunks = build_stages(cfg, comm, mesh)
    named = [(n, p) for chunk in chunks for n, p in chunk.named_parameters()]
    params = [p for _, p in named]
    moes = [m for chunk in chunks for m in moe_blocks(chunk)]
    for m in moes:
        m.grad_scale = 1.0 / cfg.microbatches          # the loss of each microbatch is divided by m
    dpar = build_data_parallel(cfg, comm, mesh, named)
    executor = PipelineExecutor(chunks, cfg.schedule, cfg.microbatches, comm, mesh.group("pp"), rec)
    hooks = StepHooks()
    if faults is not None:
        faults.install(comm=comm, steps=hooks, pipeline=executor)
    is_last = any(chunk.last for chunk in chunks)
    positions = chunks[0].positions
    dtype = getattr(torch, cfg.dtype)
    device = torch.get_default_device()
    dumped: dict[int, dict[str, torch.Tensor]] = {}
    ranges: dict[str, list[int]] = {}
    losses: dict[int, float] = {}
    norms: dict[int, float] = {}
    for step in range(cfg.steps):
        t_step = time.perf_counter()
        rec.context.step = step
        if progress is not None:
            progress[comm.rank] = step + 1
        for hook in hooks.step_start:
            hook(step)
        with _host():
            x, y = global_batch(cfg.seed, step, cfg.batch_size, cfg.block_size)
        if device.type != "cpu":
            x, y = x.to(device), y.to(device)
        x, y = shard(x, dp_index, cfg.dp)[:, positions], shard(y, dp_index, cfg.dp)[:, positions]  # [B/dp, T/cp]
        mb_shape = (x.shape[0] // cfg.microbatches, x.shape[1], cfg.n_embd)
        for p in params:
            p.grad = None
        t_compute = time.perf_counter()
        loss_sum = executor.run(list(x.chunk(cfg.microbatches)), list(y.chunk(cfg.microbatches)), mb_shape, dtype)
        compute_s = time.perf_counter() - t_compute
        for hook in hooks.after_compute:
            hook(step, compute_s)
        for hook in hooks.after_backward:
            hook(step, params)
        local_norm = math.sqrt(grad_norm_sq(params))
        if not math.isfinite(local_norm):
            # said at the origin, before the reduction spreads it to every replica
            rec.instant(S.KIND_MARKER, "nonfinite", message=f"local gradient norm {local_norm} before reduction")
        options: dict[str, Any] = {}
        for option in hooks.reduce_options:
            options.update(option(step))
        loss_avg = dpar.reduce(loss_sum.reshape(1), **options)
        # this rank's own gradient after the reduction: equal to local_norm only where it kept its own
        reduced_norm = (math.sqrt(grad_norm_sq(params)) if all(p.grad is not None for p in params)
                        else float("nan"))
        global_norm = dpar.global_norm()
        loss = float(loss_avg[0]) if is_last else float("nan")
        if dump_grads:
            dumped[step], ranges = _grads_for_dump(dpar, named)
            losses[step], norms[step] = loss, global_norm
        with rec.span("optimizer"):
            dpar.step(global_norm, cfg.grad_clip)
        moe_stats = [m.reset_stats() for m in moes]
        rec.metric(step=step, step_time_s=time.perf_counter() - t_step, loss=loss,
                   grad_norm_local=local_norm, grad_norm_global=global_norm, grad_norm_reduced=reduced_norm,
                   param_checksum=param_checksum(params), memory_bytes=_memory_bytes(),
                   tokens=int(x.numel()), **_moe_metrics(moes, moe_stats))
    if dump_grads:
        Path(dump_grads).mkdir(parents=True, exist_ok=True)
        shards = {n: {"dim": p.tp_shard[0], "index": p.tp_shard[1]} for n, p in named if hasattr(p, "tp_shard")}
        torch.save({"grads": dumped, "params": {n: p.detach().clone() for n, p in named}, "shard": shards,
                    "grad_range": ranges, "losses": losses, "grad_norms": norms, "coords": mesh.coords},
                   Path(dump_grads) / f"rank-{comm.rank}.pt")


train_dp = train   # the name DP-only callers (benchmarks) use


def _moe_metrics(moes: list[Any], stats: list[tuple[list[int], int]]) -> dict[str, Any]:
    """Tokens each local expert processed (summed over this rank's MoE layers)
    and assignments dropped by capacity; per-layer loads go in `extra`."""
    if not moes:
        return {}
    load = [sum(col) for col in zip(*(s[0] for s in stats))]
    by_layer = {str(i): s[0] for i, s in enumerate(stats)}
    return {"expert_load": load, "dropped_tokens": sum(s[1] for s in stats),
            "extra": json.dumps({"expert_load_by_layer": by_layer, "local_experts": list(moes[0].local)})}


def nccl_environment(cfg: C.RunConfig, rank_dir: Path | None) -> dict[str, str]:
    """NCCL's own failure handling, set (unless the user set them) before the
    process group exists. docs/nccl.md explains each choice."""
    env = {
        "TORCH_NCCL_BLOCKING_WAIT": "0",            # work.wait() must not block the CPU: the poller ends ops
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3",     # watchdog: abort communicators, tear down the process
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",     # Flight Recorder on (entries per rank)
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",          # ... and dumped by the watchdog on its timeout
    }
    if rank_dir is not None:
        env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(rank_dir / "nccl_trace_rank_")
    applied = {}
    for key, value in env.items():
        applied[key] = os.environ.setdefault(key, value)
    return applied


def _select_device(cfg: C.RunConfig, local_rank: int) -> torch.device:
    """cpu, or this rank's GPU (cuda:LOCAL_RANK), made current and default so
    every tensor the runtime creates lands there."""
    if cfg.device != "cuda":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise C.ConfigError(f"--device cuda needs one GPU per local rank: local rank {local_rank}, "
                            f"{count} GPU{'s' if count != 1 else ''} visible")
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    torch.set_default_device(device)
    return device


def run_rank(cfg: C.RunConfig, rank: int, world_size: int, init_method: str, local_rank: int = 0,
             progress: Any = None, dump_grads: str = "") -> int:
    """Everything one rank does, start to finish. Returns the process exit code."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    run_dir = Path(cfg.out)
    rec: Any = Recorder(run_dir, rank, world_size) if cfg.trace else NullRecorder(rank, world_size)
    faults = FaultPlan(cfg.inject, rank, rec)
    comm = Comm(rec, rank, world_size, timeout_s=cfg.timeout_s, backend=cfg.backend)
    sampler = None
    code, message = EXIT_OK, ""
    try:
        init: dict[str, Any] = {"timeout": _dt.timedelta(seconds=max(cfg.timeout_s, 30.0))}
        device = _select_device(cfg, local_rank)
        if cfg.backend == "nccl":
            env = nccl_environment(cfg, getattr(rec, "dir", None))
            init = {"timeout": _dt.timedelta(seconds=comm.pg_timeout_s()), "device_id": device}
            comm.on_stuck = lambda err: _exit_stuck(rec, sampler, err)
            rec.write_meta(device=str(device), nccl_env=env)
        dist.init_process_group(cfg.backend, init_method=init_method, rank=rank, world_size=world_size, **init)
        world = comm.register_world()
        offset, uncertainty = measure_clock_offsets(comm, world)
        rec.write_meta(clock_offset_ns=offset, clock_uncertainty_ns=uncertainty, local_rank=local_rank,
                       config=cfg.to_json())
        mesh = build_mesh(cfg, comm, reorder=faults.reorder_groups())
        if cfg.trace:
            sampler = Sampler(rec, local_rank, announce=(rank == 0)).start()
        train(cfg, comm, mesh, rec, faults, progress, dump_grads)
        rec.context.step = -1
        comm.barrier(world)   # nobody tears down while a peer still sends
        if device.type == "cuda":
            torch.cuda.synchronize()   # every op's completion seen before the trace closes
    except CommTimeoutError as exc:
        code, message = EXIT_TIMEOUT, str(exc)
    except CommError as exc:
        code, message = EXIT_COMM, str(exc)
    except MeshError as exc:
        code, message = EXIT_MESH, f"rank {rank}: {exc}"
    except C.ConfigError as exc:
        code, message = EXIT_CONFIG, f"rank {rank}: {exc}"
    except Exception as exc:  # the trace must still be closed and say why
        code, message = EXIT_OTHER, f"rank {rank}: {type(exc).__name__}: {exc}"
        traceback.print_exc()
        rec.dump_exception(exc)
    finally:
        rec.write_meta(call_sites=site_functions())
        if sampler is not None:
            sampler.stop()
        _drain_completions(comm)
        rec.close("ok" if code == EXIT_OK else "error", message)
    if message:
        print(f"ncclscope: {message}", file=sys.stderr, flush=True)
    if code == EXIT_OK:
        dist.destroy_process_group()
    return code


def _drain_completions(comm: Comm, wait_s: float = 2.0) -> None:
    """NCCL: give the poller a moment to write the end rows of ops that have
    completed on the GPU before the trace closes (gloo: nothing pending)."""
    pending = comm._completions.pending if comm._completions is not None else None
    deadline = time.monotonic() + wait_s
    while pending and time.monotonic() < deadline:
        time.sleep(0.005)


def _exit_stuck(rec: Any, sampler: Any, err: Exception) -> None:
    """NCCL: an op timed out and the training thread is blocked in a GPU wait
    that will not return; close the trace with the reason and exit with the
    timeout code (the evidence is written; NCCL's watchdog would abort later)."""
    try:
        if sampler is not None:
            sampler.stop()
        rec.close("error", str(err))
    finally:
        print(f"ncclscope: {err}", file=sys.stderr, flush=True)
        os._exit(EXIT_TIMEOUT)


def _write_run_json(cfg: C.RunConfig, world_size: int, launcher: str) -> None:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    data = {"schema": S.SCHEMA_VERSION, "launcher": launcher, "world_size": world_size, "config": cfg.to_json(),
            "versions": versions(), "started": _dt.datetime.now().isoformat(timespec="seconds")}
    tmp = out / (S.RUN_JSON + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, out / S.RUN_JSON)


def main(argv: list[str] | None = None) -> int:
    """Entry point under torchrun (reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT)."""
    p = argparse.ArgumentParser(prog="python -m ncclscope.runtime.train", description=__doc__.split("\n")[0])
    C.add_arguments(p)
    p.add_argument("--dump-grads", default="", help=argparse.SUPPRESS)
    ns = p.parse_args(argv)
    try:
        cfg = C.from_args(ns)
    except (C.ConfigError, ValueError) as exc:
        print(f"ncclscope: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if not cfg.out:
        print("ncclscope: --out RUN_DIR is required", file=sys.stderr)
        return EXIT_CONFIG
    rank = int(os.environ.get("RANK", "0"))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if world_size != cfg.world_size:
        print(f"ncclscope: tp*pp*dp*cp = {cfg.tp}*{cfg.pp}*{cfg.dp}*{cfg.cp} = {cfg.world_size}, "
              f"but WORLD_SIZE is {world_size}", file=sys.stderr)
        return EXIT_CONFIG
    if rank == 0 and not (Path(cfg.out) / S.RUN_JSON).exists():
        _write_run_json(cfg, world_size, "torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "env")
    code = run_rank(cfg, rank, world_size, "env://", local_rank, dump_grads=ns.dump_grads)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)   # after a gloo timeout, interpreter teardown can block on dead pairs


if __name__ == "__main__":
    sys.exit(main())
