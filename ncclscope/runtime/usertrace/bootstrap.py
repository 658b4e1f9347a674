"""The per-rank bootstrap: trace a user's script without changing it.

    python -m ncclscope.run [--out DIR] [--timeout-s T] SCRIPT [ARGS...]
    torchrun --nnodes 2 --nproc-per-node 8 ... -m ncclscope.run train.py --lr 3e-4
    srun python -m ncclscope.run train.py          (RANK etc. from SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID)

Order of events in each rank: Flight Recorder settings into the environment
(before any process group exists), `import torch` and the modules our threads
would otherwise import lazily (`warm_imports`: torch._dynamo), the recorder (heartbeats, suspect
watchdog, stacks on SIGUSR1 and fatal signals), host/NVML samples, the tracer
(torch.distributed patched, optimizer step hook), then the script through
`runpy.run_path(SCRIPT, run_name="__main__")` with `sys.argv = [SCRIPT, *ARGS]`.
The script's exceptions and exit code are its own: they are recorded, then
re-raised unchanged.

Every rank must agree on the run directory: `--out` / NCCLSCOPE_OUT, else
runs/run-<torchrun run id | Slurm job id | UTC minute>.
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import runpy
import sys
import time
from pathlib import Path
from typing import Any

from ncclscope import schema as S

USAGE = ("usage: python -m ncclscope.run [--out DIR] [--timeout-s T] [--nan-check auto|on|off] [--no-nan-check] "
         "[--] SCRIPT [ARGS...]")
DEFAULT_TIMEOUT_S = 60.0


class UsageError(ValueError):
    pass


def parse_args(argv: list[str]) -> tuple[dict[str, Any], str, list[str]]:
    """ncclscope's own options come before SCRIPT; everything after SCRIPT is the script's, unparsed."""
    from ncclscope.runtime.usertrace.nancheck import MODES, mode_from_env
    opts: dict[str, Any] = {"out": os.environ.get("NCCLSCOPE_OUT", ""),
                            "timeout_s": float(os.environ.get("NCCLSCOPE_TIMEOUT_S", DEFAULT_TIMEOUT_S)),
                            "nan_check": mode_from_env()}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            i += 1
            break
        if a in ("-h", "--help"):
            raise UsageError(USAGE)
        if a in ("--no-nan-check", "--nan-check"):   # bare --nan-check: on every device (CUDA syncs)
            opts["nan_check"] = "off" if a == "--no-nan-check" else "on"
            i += 1
            continue
        if a.startswith("--nan-check="):
            val = a.partition("=")[2]
            if val not in MODES:
                raise UsageError(f"--nan-check {val!r}: one of {', '.join(MODES)}")
            opts["nan_check"] = val
            i += 1
            continue
        if a.startswith("--out") or a.startswith("--timeout-s"):
            key, _, val = a.partition("=")
            if not val:
                if i + 1 >= len(argv):
                    raise UsageError(f"{key} needs a value\n{USAGE}")
                val = argv[i + 1]
                i += 1
            if key == "--out":
                opts["out"] = val
            elif key == "--timeout-s":
                try:
                    opts["timeout_s"] = float(val)
                except ValueError:
                    raise UsageError(f"--timeout-s {val!r}: not a number") from None
            else:
                raise UsageError(f"unknown option {key}\n{USAGE}")
            i += 1
            continue
        if a.startswith("-") and a != "-":
            raise UsageError(f"unknown option {a} (ncclscope's options go before SCRIPT)\n{USAGE}")
        break
    if i >= len(argv):
        raise UsageError(f"no SCRIPT given\n{USAGE}")
    return opts, argv[i], argv[i + 1:]


def rank_env() -> tuple[int, int, int, str]:
    """(rank, world size, local rank, launcher) from torchrun's or Slurm's variables.
    Under srun the RANK/WORLD_SIZE/LOCAL_RANK the script reads are filled in from
    SLURM_* when absent (MASTER_ADDR/MASTER_PORT stay the script's business)."""
    env = os.environ
    if "RANK" in env or "TORCHELASTIC_RUN_ID" in env:
        launcher = "torchrun" if "TORCHELASTIC_RUN_ID" in env else "env"
        return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0)), launcher
    if "SLURM_PROCID" in env:
        env.setdefault("RANK", env["SLURM_PROCID"])
        env.setdefault("WORLD_SIZE", env.get("SLURM_NTASKS", "1"))
        env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
        return int(env["RANK"]), int(env["WORLD_SIZE"]), int(env["LOCAL_RANK"]), "slurm"
    return 0, 1, 0, "none"


def default_out() -> str:
    env = os.environ
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        tag = run_id[:12]
    elif "SLURM_JOB_ID" in env:
        tag = "slurm" + env["SLURM_JOB_ID"] + ("." + env["SLURM_STEP_ID"] if "SLURM_STEP_ID" in env else "")
    else:
        tag = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M")
    return os.path.join("runs", "run-" + tag)


def flight_recorder_env(rank_dir: Path) -> None:
    """Flight Recorder on for every process group this rank will create (the
    user's own settings win), NCCL's dump on timeout into the rank directory."""
    env = os.environ
    env.setdefault("TORCH_FR_BUFFER_SIZE", "2000")
    env.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")
    from ncclscope.load.fr_merge import FR_NCCL_PREFIX
    env.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(rank_dir / FR_NCCL_PREFIX))


def warm_imports() -> None:
    """Import, in the main thread and before any thread of ours starts, every
    module those threads would otherwise import lazily.

    Why: Flight Recorder's `_dump_fr_trace()` (the tracer's watch thread calls
    it for an op in flight FR_EARLY_S, and with the idle / timeout evidence)
    imports torch._inductor, hence torch._dynamo, the first time it runs. The
    script's main thread imports torch._dynamo too, lazily, the first time it
    builds a DTensor or an optimizer (torch/_compile.py). Two threads importing
    one package at once: a submodule of a package still being initialised is
    imported without waiting for the package, so each thread can hold a module
    lock the other needs; Python breaks that deadlock by handing one of them a
    partially initialised module, and the script died with `ImportError: cannot
    import name 'counters' from partially initialized module
    'torch._dynamo.utils'` (about one run in three of examples/dtensor_tp.py
    with --timeout-s 3: the idle evidence fired while DTensor() was importing
    torch._dynamo). Importing it here first costs ~2.5 s per rank once, which a
    script with an optimizer pays anyway (runtime/train.py warm_imports, the
    same reason). ctypes (the SIGTERM path) and pyarrow's pandas (the flusher)
    likewise."""
    import ctypes  # noqa: F401

    from ncclscope.runtime.recorder import warm_pyarrow

    from ncclscope.runtime.usertrace.evidence import warm_fr_dump
    warm_fr_dump()
    warm_pyarrow()


def write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        opts, script, script_args = parse_args(argv)
    except UsageError as exc:
        print(f"ncclscope: {exc}", file=sys.stderr)
        return 2
    if not os.path.isfile(script):
        print(f"ncclscope: {script}: no such script", file=sys.stderr)
        return 2
    rank, world, local_rank, launcher = rank_env()
    out = Path(opts["out"] or default_out())
    out.mkdir(parents=True, exist_ok=True)
    flight_recorder_env(out / S.rank_dir_name(rank))

    import torch   # noqa: F401  (only now: the environment above must be set first)
    warm_imports()   # before the recorder's, the sampler's and the tracer's threads start
    from ncclscope.runtime.recorder import Recorder
    from ncclscope.runtime.telemetry import Sampler

    from ncclscope.runtime.usertrace import tracer as T
    from ncclscope.runtime.usertrace.callsite import site_functions

    rec = Recorder(out, rank, world)
    rec.context.step = 0
    rec.write_meta(local_rank=local_rank, launcher=launcher, script=script, argv=[script, *script_args], cwd=os.getcwd(),
                   config={"script": script, "args": script_args, "timeout_s": opts["timeout_s"],
                           "nan_check": opts["nan_check"]})
    if rank == 0 and not (out / S.RUN_JSON).exists():
        import ncclscope
        write_json(out / S.RUN_JSON, {
            "schema": S.SCHEMA_VERSION, "launcher": launcher, "world_size": world,
            "config": {"script": script, "args": script_args, "timeout_s": opts["timeout_s"],
                       "nan_check": opts["nan_check"]},
            "versions": {"ncclscope": ncclscope.__version__, "torch": torch.__version__,
                         "python": sys.version.split()[0], "schema": S.SCHEMA_VERSION},
            "argv": sys.argv, "started": _dt.datetime.now().isoformat(timespec="seconds"),
            "end_reason": "running"})
        print(f"ncclscope: tracing {script} on {world} rank(s) into {out}", file=sys.stderr, flush=True)
    sampler = None
    try:
        sampler = Sampler(rec, local_rank, announce=False).start()
    except Exception as exc:   # telemetry must never stop the job
        print(f"ncclscope: rank {rank}: telemetry off: {exc}", file=sys.stderr)
    tracer = T.Tracer(rec, rank, world, timeout_s=opts["timeout_s"], nan_check=opts["nan_check"]).install()
    tracer.watch_sigterm()
    tracer.watch_exit()

    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    status, message = "ok", ""
    t0 = time.time()
    try:
        runpy.run_path(script, run_name="__main__")
    except BaseException as exc:
        exiting = isinstance(exc, SystemExit)
        if not exiting or exc.code not in (None, 0):
            # a failure (sys.exit(N) too): where the script raised or exited is the user's line
            status, message = "error", f"SystemExit({exc.code!r})" if exiting else T.text_of(exc)
            tracer.evidence(f"uncaught {type(exc).__name__} in {script}", stacks=False)
            rec.dump_exception(exc)
        raise
    finally:
        try:
            tracer.close()
            if sampler is not None:
                sampler.stop()
            rec.write_meta(duration_s=round(time.time() - t0, 3), call_sites=site_functions())
            rec.close(status, message)
        except Exception as exc:   # the script's outcome wins over ours
            print(f"ncclscope: rank {rank}: closing the trace failed: {exc}", file=sys.stderr)
    return 0
