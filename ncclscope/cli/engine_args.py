"""The three ways to run an analysis, as the CLI offers them: in this process, on a local cluster of worker
processes (`--workers N`), or on a Dask cluster someone started (`--scheduler ADDRESS`).

Without either flag the choice is automatic: inputs of at least AUTO_BYTES on disk are read on every core of
this machine, smaller ones in this process (start-up of the workers costs about a second; benchmarks/engine_modes.py
measures where the workers start to pay). Every mode gives the same analysis (tests/test_engine.py).
"""
from __future__ import annotations

import argparse
from contextlib import contextmanager
from typing import Any, Iterator

from ncclscope.cli.inputs import UsageError, first_line
from ncclscope.cli.memory_guard import input_bytes

# 2 GiB of rank streams or dumps. Measured (analyze --json, in-process vs --workers 2, the join on the workers,
# benchmarks/engine_modes.py, modes alternating): at 1.6 GB (1,024 ranks, 10 M events) 17.4 vs 19.0 s (1.09x;
# largest process 1,704 vs 1,211 MB); at 5.5 GB (16,384 ranks) 0.82-0.91x, 6.0 vs 3.7-3.8 GB
AUTO_BYTES = 2 << 30


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine (large inputs)")
    g.add_argument("--workers", type=int, default=None, metavar="N",
                   help="read the input on N local worker processes (0: in this process; default: every core "
                        "for inputs of 2 GiB or more, else in this process)")
    g.add_argument("--scheduler", default="", metavar="ADDRESS",
                   help="use the Dask cluster at ADDRESS (tcp://host:8786), e.g. one started in a SLURM "
                        "allocation (docs/scale.md)")
    g.add_argument("--worker-memory", default="", metavar="SIZE",
                   help="memory limit of each local worker, enforced by Dask (e.g. 8GB; default: the machine's "
                        "memory shared among the workers)")
    g.add_argument("--scratch", default="", metavar="DIR",
                   help="where workers leave their results for this process (default: a temporary directory; "
                        "with --scheduler, a path every worker and this process share)")


def engine_wanted(ns: argparse.Namespace | None, size: int) -> bool:
    """Whether `engine_for` opens an engine for an input of `size` bytes (the flags, else the size)."""
    workers = getattr(ns, "workers", None) if ns is not None else None
    scheduler = getattr(ns, "scheduler", "") if ns is not None else ""
    return bool(scheduler) or bool(workers) or (workers is None and size >= AUTO_BYTES)


@contextmanager
def engine_for(ns: argparse.Namespace | None, path: str, quiet: bool, size: int | None = None) -> Iterator[Any]:
    """The engine `ns` asks for (None: read in this process); a UsageError (exit 2) when it cannot start.
    `size`: the input's bytes when the caller has counted them (memory_guard.check_fits), else counted here."""
    workers = getattr(ns, "workers", None) if ns is not None else None
    scheduler = getattr(ns, "scheduler", "") if ns is not None else ""
    if workers is not None and workers < 0:
        raise UsageError(f"--workers {workers}: give 0 (this process) or more")
    if scheduler and workers:
        raise UsageError("--workers and --scheduler: give one (the cluster at --scheduler has its own workers)")
    if size is None and workers is None and not scheduler:
        size = input_bytes(path, AUTO_BYTES)
    if not engine_wanted(ns, size or 0):
        yield None
        return
    from ncclscope.engine.cluster import EngineError, open_engine, stderr_progress
    try:
        ctx = open_engine(workers=workers or None, scheduler=scheduler or None,
                          memory_limit=getattr(ns, "worker_memory", "") or None,
                          scratch=getattr(ns, "scratch", "") or None, progress=stderr_progress(quiet))
        engine = ctx.__enter__()
    except EngineError as exc:
        raise UsageError(str(exc)) from None
    try:
        yield engine
    except Exception as exc:
        if type(exc).__name__ != "KilledWorker":     # dask.distributed's, when a worker died past its tries
            raise
        raise UsageError(f"{path}: a worker died while reading it, past its memory limit or killed; give each "
                         f"worker more (--worker-memory) or use more workers (Dask: {first_line(exc)[:120]})")
    finally:
        ctx.__exit__(None, None, None)
