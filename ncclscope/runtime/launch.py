"""Local multi-process launcher: `ncclscope train` owns the job from start to verdict.

It forks one process per rank (torch is imported once, here, before forking:
on 2 cores that is ~3 s for 8 ranks instead of ~20 s with spawn), rendezvous
through a FileStore in a private temp dir (no port to collide on), shows
progress, and ends the job by itself:
  - all ranks exit 0                     -> end reason "completed"
  - a rank fails; the rest get one op timeout + grace to finish recording
                                         -> "rank_failed"
  - the global deadline passes          -> "deadline"
  - Ctrl-C                               -> "interrupted"
Before terminating any live rank it sends SIGUSR1 (faulthandler dumps every
thread's stack into that rank's stacks.txt), then SIGTERM, then SIGKILL. Every
child is reaped; children also get PR_SET_PDEATHSIG so that even a SIGKILLed
launcher leaves no orphans. Finally it writes run.json (config, versions,
per-rank exit code or signal, end reason).

With `--device cuda` (NCCL) rank r uses GPU r of this host, and ranks are
started with `spawn`, not fork: CUDA cannot be used in a child forked from a
process that may have touched it, and the launcher asks whether CUDA is there.
"""
from __future__ import annotations

import ctypes
import datetime as _dt
import json
import multiprocessing as mp
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from ncclscope import schema as S

from ncclscope.runtime import config as C

GRACE_S = 5.0          # after a rank fails: extra time for peers to hit their own timeout and record it
STACK_DUMP_WAIT_S = 1.0
TERM_WAIT_S = 3.0


class RunDirError(RuntimeError):
    """The output directory cannot be used (it would overwrite a user's run)."""


def _set_pdeathsig() -> None:
    """Ask Linux to SIGKILL this child if the launcher dies (no orphans)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG = 1
    except OSError:
        pass


def _child(cfg: C.RunConfig, rank: int, world_size: int, init_method: str, progress: Any, lingering: Any,
           release: Any, dump_grads: str) -> None:
    _set_pdeathsig()
    signal.signal(signal.SIGINT, signal.SIG_IGN)   # the launcher decides how the job ends
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from ncclscope.runtime.train import EXIT_COMM, EXIT_TIMEOUT, run_rank
    code = run_rank(cfg, rank, world_size, init_method, local_rank=rank, progress=progress, dump_grads=dump_grads)
    sys.stdout.flush()
    sys.stderr.flush()
    if code in (EXIT_TIMEOUT, EXIT_COMM):
        # Keep this process (and its sockets) alive until the launcher releases
        # it: exiting now would hand every peer a "Connection closed by peer"
        # error instead of letting each one hit, and record, its own timeout.
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)   # stacks were dumped at the failure
        lingering[rank] = 1
        release.wait(cfg.timeout_s + GRACE_S)
    os._exit(code)


def prepare_run_dir(out: str) -> Path:
    """Create the run directory; refuse to reuse one that holds a run."""
    if not out:
        out = os.path.join("runs", "run-" + _dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise RunDirError(f"--out {path}: exists and is not a directory")
    if path.is_dir() and any(path.iterdir()):
        raise RunDirError(f"--out {path}: directory is not empty; choose a new run directory "
                          f"(ncclscope never overwrites a run)")
    path.mkdir(parents=True, exist_ok=True)
    return path


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def _signal_name(code: int | None) -> str | None:
    if code is not None and code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return None


class _Progress:
    """One status line: updated in place on a terminal, every 5 s otherwise."""

    def __init__(self, total_steps: int, stream: Any = sys.stderr) -> None:
        self.total = total_steps
        self.stream = stream
        self.tty = stream.isatty()
        self.last = 0.0

    def show(self, steps: list[int], alive: int, world: int, elapsed: float, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.last < (0.5 if self.tty else 5.0):
            return
        self.last = now
        lo, hi = (min(steps), max(steps)) if steps else (0, 0)
        text = (f"ncclscope train: step {lo}/{self.total}" + (f" (fastest {hi})" if hi != lo else "")
                + f" | ranks running {alive}/{world} | {elapsed:5.1f} s")
        if self.tty:
            self.stream.write("\r" + text.ljust(78) + ("\n" if final else ""))
        elif not final:
            self.stream.write(text + "\n")
        self.stream.flush()


def launch(cfg: C.RunConfig, dump_grads: str = "", quiet: bool = False) -> tuple[Path, dict[str, Any]]:
    """Run the job; return (run_dir, run.json contents). Never leaves a child behind."""
    cfg.validate()
    if cfg.device == "cuda":
        C.check_cuda(cfg.world_size)   # all ranks on this host (the CLI checked it already)
    run_dir = prepare_run_dir(cfg.out)
    cfg.out = str(run_dir)
    world = cfg.world_size
    from ncclscope.runtime.train import versions, warm_imports   # imports torch once, before forking
    warm_imports()

    started = time.time()
    run: dict[str, Any] = {
        "schema": S.SCHEMA_VERSION, "launcher": "ncclscope", "world_size": world, "config": cfg.to_json(),
        "versions": versions(), "argv": sys.argv, "started": _dt.datetime.now().isoformat(timespec="seconds"),
        "end_reason": "running",
    }
    _write_json(run_dir / S.RUN_JSON, run)
    ctx = mp.get_context("spawn" if cfg.device == "cuda" else "fork")
    progress = ctx.Array("i", world, lock=False)
    lingering = ctx.Array("i", world, lock=False)   # 1: failed, waiting so peers can time out on their own
    release = ctx.Event()
    store_dir = tempfile.mkdtemp(prefix="ncclscope-store-")
    init_method = f"file://{store_dir}/store"
    procs = [ctx.Process(target=_child, args=(cfg, r, world, init_method, progress, lingering, release, dump_grads),
                         name=f"ncclscope-rank-{r}", daemon=False) for r in range(world)]
    bar = _Progress(cfg.steps)
    end_reason = "completed"
    try:
        for p in procs:
            p.start()
        end_reason = _watch(cfg, procs, progress, lingering, release, started, None if quiet else bar)
    except KeyboardInterrupt:
        end_reason = "interrupted"
    finally:
        release.set()   # failed ranks waiting for their peers may exit now, with their own code
        for i, p in enumerate(procs):
            if lingering[i] and p.exitcode is None:
                p.join(timeout=2)
        stopped = _stop_all(procs)
        _remove_store(store_dir)
    if not quiet:
        bar.show(list(progress), 0, world, time.time() - started, final=True)
    if end_reason == "completed" and any(p.exitcode != 0 for p in procs):
        end_reason = "rank_failed"
    run.update(
        end_reason=end_reason, ended=_dt.datetime.now().isoformat(timespec="seconds"),
        duration_s=round(time.time() - started, 3),
        ranks={str(r): {"exitcode": p.exitcode if p.exitcode is not None and p.exitcode >= 0 else None,
                        "signal": _signal_name(p.exitcode), "pid": p.pid,
                        "stopped_by_launcher": p.pid in stopped} for r, p in enumerate(procs)},
    )
    _write_json(run_dir / S.RUN_JSON, run)
    return run_dir, run


def _watch(cfg: C.RunConfig, procs: list[Any], progress: Any, lingering: Any, release: Any, started: float,
           bar: _Progress | None) -> str:
    """Wait for the running ranks and return the end reason: all exited (completed, or rank_failed
    when one failed), every rank left has failed and lingers (rank_failed), the survivors of a failure
    had their timeout plus GRACE_S to fail too (rank_failed), or the deadline passed (deadline).
    `bar` (None when quiet) shows the progress on the way."""
    world = len(procs)
    first_failure: float | None = None
    while True:
        alive = [p for p in procs if p.exitcode is None]
        failed = [p for p in procs if p.exitcode not in (None, 0)]
        elapsed = time.time() - started
        if bar is not None:
            bar.show(list(progress), len(alive), world, elapsed)
        if not alive:
            return "completed" if not failed else "rank_failed"
        if all(lingering[procs.index(p)] for p in alive):
            release.set()   # everyone left has failed and recorded why
            for p in alive:
                p.join(timeout=5)
            return "rank_failed"
        if (failed or any(lingering)) and first_failure is None:
            first_failure = time.monotonic()
        if first_failure is not None and time.monotonic() - first_failure > cfg.timeout_s + GRACE_S:
            return "rank_failed"
        if cfg.deadline_s and elapsed > cfg.deadline_s:
            return "deadline"
        for p in alive:
            p.join(timeout=0.05)


def _remove_store(store_dir: str) -> None:
    """Delete the ranks' FileStore directory (what is left of it; errors ignored)."""
    try:
        for name in os.listdir(store_dir):
            os.unlink(os.path.join(store_dir, name))
        os.rmdir(store_dir)
    except OSError:
        pass


def _stop_all(procs: list[Any]) -> set[int]:
    """SIGUSR1 (stacks), then SIGTERM, then SIGKILL; reap everything.
    Returns the pids the launcher had to stop."""
    alive = [p for p in procs if p.pid is not None and p.exitcode is None]
    if alive:
        for p in alive:
            _kill(p.pid, signal.SIGUSR1)
        time.sleep(STACK_DUMP_WAIT_S)
        for p in alive:
            if p.exitcode is None:
                _kill(p.pid, signal.SIGTERM)
        deadline = time.monotonic() + TERM_WAIT_S
        for p in alive:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
        for p in alive:
            if p.exitcode is None:
                _kill(p.pid, signal.SIGKILL)
    for p in procs:
        if p.pid is not None:
            p.join(timeout=10)
    return {p.pid for p in alive}


def _kill(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
