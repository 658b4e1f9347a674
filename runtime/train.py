"""The per-rank training loop, and its command-line entry point.

Run under ncclscope's own launcher (`ncclscope train --dp 2 --steps 5 --out runs/a`)
or unchanged under torchrun:

    torchrun --standalone --nproc-per-node 2 -m ncclscope.runtime.train --dp 2 --steps 5 --out runs/a

Each rank writes runs/a/rank-NNNNN/ (events, metrics, samples, stacks); rank 0
writes run.json when there is no ncclscope launcher to do it.

Exit codes: 0 ok, 3 comm timeout, 4 comm error, 5 other exception,
6 the ranks disagree on process groups, 7 bad configuration.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import psutil
import torch
import torch.distributed as dist

from ncclscope import schema as S

from . import config as C
from .comm import Comm, CommError, CommTimeoutError
from .data import global_batch, shard
from .faults import FaultPlan
from .mesh import MeshError, build_mesh
from .model import clip_, grad_norm_sq, param_checksum
from .parallel.data import GradSync
from .recorder import NullRecorder, Recorder
from .reference import make_model
from .telemetry import Sampler, measure_clock_offsets

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
    from .data import corpus
    corpus()
    torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))])


def _memory_bytes() -> int:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return int(torch.cuda.memory_allocated())
    return int(psutil.Process().memory_info().rss)


def train_dp(cfg: C.RunConfig, comm: Comm, mesh: Any, rec: Any, faults: FaultPlan, progress: Any = None,
             dump_grads: str = "") -> None:
    """Data-parallel training (tp = pp = cp = 1)."""
    dp = mesh.group("dp")
    dp_index = mesh.coords["dp"]
    model = make_model(cfg)
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    sync = GradSync(params, comm, dp, cfg.bucket_mb)
    dtype = getattr(torch, cfg.dtype)
    slow = faults.slow_factor()
    dumped: dict[int, dict[str, torch.Tensor]] = {}
    for step in range(cfg.steps):
        t_step = time.perf_counter()
        rec.context.step = step
        if progress is not None:
            progress[comm.rank] = step + 1
        faults.at_step_start()
        x, y = global_batch(cfg.seed, step, cfg.batch_size, cfg.block_size)
        x, y = shard(x, dp_index, dp.size), shard(y, dp_index, dp.size)      # [B/dp, T]
        opt.zero_grad(set_to_none=True)
        loss_sum = torch.zeros((), dtype=dtype)
        t_compute = time.perf_counter()
        for mb, (xm, ym) in enumerate(zip(x.chunk(cfg.microbatches), y.chunk(cfg.microbatches))):
            rec.context.microbatch = mb
            with rec.span("forward"):
                loss = model(xm, ym) / cfg.microbatches
            with rec.span("backward"):
                loss.backward()
            loss_sum += loss.detach()
        rec.context.microbatch = -1
        compute_s = time.perf_counter() - t_compute
        if slow > 1:
            with rec.span("forward", message=f"slowed x{slow:g}"):
                time.sleep((slow - 1) * compute_s)
        local_norm = math.sqrt(grad_norm_sq(params))
        if faults.take("nan"):
            params[0].grad.view(-1)[0] = float("nan")
        loss_avg = sync.all_reduce(loss_sum.reshape(1), keep_local=faults.take("desync_grad"))
        global_norm = math.sqrt(grad_norm_sq(params))
        if dump_grads:
            dumped[step] = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        with rec.span("optimizer"):
            clip_(params, global_norm, cfg.grad_clip)
            opt.step()
        rec.metric(step=step, step_time_s=time.perf_counter() - t_step, loss=float(loss_avg[0]),
                   grad_norm_local=local_norm, grad_norm_global=global_norm,
                   param_checksum=param_checksum(params), memory_bytes=_memory_bytes(),
                   tokens=int(x.numel()))
    if dump_grads:
        Path(dump_grads).mkdir(parents=True, exist_ok=True)
        torch.save({"grads": dumped, "params": {n: p.detach().clone() for n, p in model.named_parameters()}},
                   Path(dump_grads) / f"rank-{comm.rank}.pt")


def run_rank(cfg: C.RunConfig, rank: int, world_size: int, init_method: str, local_rank: int = 0,
             progress: Any = None, dump_grads: str = "") -> int:
    """Everything one rank does, start to finish. Returns the process exit code."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    run_dir = Path(cfg.out)
    rec: Any = Recorder(run_dir, rank, world_size) if cfg.trace else NullRecorder(rank, world_size)
    faults = FaultPlan(cfg.inject, rank, rec)
    comm = Comm(rec, rank, world_size, timeout_s=cfg.timeout_s, faults=faults or None)
    sampler = None
    code, message = EXIT_OK, ""
    try:
        dist.init_process_group(cfg.backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=_dt.timedelta(seconds=max(cfg.timeout_s, 30.0)))
        world = comm.register_world()
        offset, uncertainty = measure_clock_offsets(comm, world)
        rec.write_meta(clock_offset_ns=offset, clock_uncertainty_ns=uncertainty, local_rank=local_rank,
                       config=cfg.to_json())
        mesh = build_mesh(cfg, comm, reorder=faults.reorder_groups())
        if cfg.trace:
            sampler = Sampler(rec, local_rank, announce=(rank == 0)).start()
        train_dp(cfg, comm, mesh, rec, faults, progress, dump_grads)
        rec.context.step = -1
        comm.barrier(world)   # nobody tears down while a peer still sends
    except CommTimeoutError as exc:
        code, message = EXIT_TIMEOUT, str(exc)
    except CommError as exc:
        code, message = EXIT_COMM, str(exc)
    except MeshError as exc:
        code, message = EXIT_MESH, f"rank {rank}: {exc}"
    except Exception as exc:  # the trace must still be closed and say why
        code, message = EXIT_OTHER, f"rank {rank}: {type(exc).__name__}: {exc}"
        traceback.print_exc()
    finally:
        if sampler is not None:
            sampler.stop()
        rec.close("ok" if code == EXIT_OK else "error", message)
    if message:
        print(f"ncclscope: {message}", file=sys.stderr, flush=True)
    if code == EXIT_OK:
        dist.destroy_process_group()
    return code


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
