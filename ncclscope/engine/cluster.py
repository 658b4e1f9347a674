"""The engine: a Dask cluster (local worker processes, or a scheduler someone started) and the one way the
analyzer hands it work (`Engine.map_ordered`).

Why Dask (docs/architecture.md has the measurement): on the per-rank stage it is about as fast as Ray, with a
fraction of its install and start-up, and `dask-jobqueue` starts its workers inside a SLURM or PBS allocation; results the
driver needs whole are moved as files in a scratch directory (`Engine.scratch`), not through its TCP comm.

Nothing here is a global: the CLI opens one Engine per command (`open_engine`, a context manager) and passes it
down to the loader explicitly; closing it stops the workers it started (never those of a cluster it joined).
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
import warnings
from collections import deque
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

from ncclscope.engine.tasks import load_result, run_to_file

Progress = Callable[[str, int, int], None]      # (what, done, total)
CONNECT_TIMEOUT_S = 10                          # --scheduler: a cluster that has not answered by then is not there


class EngineError(RuntimeError):
    """The engine could not be started or reached (one line, says what and where)."""


class Engine:
    """A connected Dask client, the number of workers it may use, and a scratch directory for large results."""

    def __init__(self, client: Any, workers: int, scratch: str | None, progress: Progress | None = None,
                 own: Any = None) -> None:
        self.client, self.workers, self.scratch = client, workers, scratch
        self.progress = progress
        self._own = own                  # the LocalCluster this Engine started (closed with it), else None

    def map_ordered(self, fn: Callable[..., Any], args: Sequence[tuple[Any, ...]], what: str,
                    sizes: Sequence[int] | None = None, ahead: int | None = None) -> Iterator[Any]:
        """fn(*a) for every a in `args`, on the workers, yielded in the order of `args`.

        At most `ahead` tasks (default: two per worker) are submitted beyond the one the caller is waiting for,
        so neither the workers nor the driver ever hold more than that many results: memory stays bounded by
        the chunk size, not the input size. Progress: (what, done, total) after each result, counted in
        `sizes` (e.g. the ranks of each chunk) when given, else in tasks."""
        counts = list(sizes) if sizes is not None else [1] * len(args)
        total = sum(counts)
        window = ahead if ahead is not None else max(2 * self.workers, 2)
        pending: deque[Any] = deque()
        it = iter(args)
        for a in it:
            pending.append(self.client.submit(fn, *a, pure=False))
            if len(pending) >= window:
                break
        done = 0
        for count in counts:
            fut = pending.popleft()
            try:
                result = fut.result()
            finally:
                fut.release()
            nxt = next(it, None)
            if nxt is not None:
                pending.append(self.client.submit(fn, *nxt, pure=False))
            done += count
            if self.progress is not None:
                self.progress(what, done, total)
            yield result

    def map_large(self, fn: Callable[..., Any], args: Sequence[tuple[Any, ...]], what: str,
                  sizes: Sequence[int] | None, kind: type) -> Iterator[Any]:
        """`map_ordered` for results the driver needs whole (a chunk's columns): with a scratch directory each
        result is written there by its worker and read back here (deleted once read), and only its path
        travels. Why: measured (benchmarks/engine_choice.py), Dask's TCP comm moves a chunk's columns at
        ~140 MB/s on this machine, a file in the page cache or on the cluster's shared filesystem at memory
        or disk speed."""
        if not self.scratch:
            yield from self.map_ordered(fn, args, what, sizes)
            return
        paths = [(fn, f"{self.scratch}/{what.split()[0]}-{i:06d}.pkl", *a) for i, a in enumerate(args)]
        for path in self.map_ordered(run_to_file, paths, what, sizes):
            yield load_result(path, kind)

    def read_rank_dirs(self, loader: Any, dirs: Any, joined: bool = False) -> None:
        """Stage 1 for a run directory (`load.trace.load` calls this when given an engine); `joined`: the
        begin/end join too, on the workers, and no event rows to the driver (engine/ops_chunks.py)."""
        if joined:
            from ncclscope.engine.ops_chunks import read_rank_dirs_joined
            read_rank_dirs_joined(self, loader, dirs)
            return
        from ncclscope.engine.rank_chunks import read_rank_dirs
        read_rank_dirs(self, loader, dirs)

    def read_dumps(self, items: Any, ents: Any, dumps: Any, versions: Any, warnings: Any) -> None:
        """Stage 1 for Flight Recorder dumps (`flight_recorder._read` calls this when given an engine)."""
        from ncclscope.engine.dump_chunks import read_dumps
        read_dumps(self, items, ents, dumps, versions, warnings)

    def close(self) -> None:
        try:
            self.client.close()
        finally:
            if self._own is not None:
                self._own.close()


def default_workers() -> int:
    """Cores this process may use (the local cluster's default size)."""
    try:
        return max(len(os.sched_getaffinity(0)), 1)
    except (AttributeError, OSError):
        return max(os.cpu_count() or 1, 1)


@contextmanager
def open_engine(workers: int | None = None, scheduler: str | None = None, memory_limit: str | None = None,
                scratch: str | None = None, progress: Progress | None = None) -> Iterator[Engine]:
    """A local cluster of `workers` processes (one thread each), or the cluster at `scheduler`.

    `memory_limit` (e.g. "8GB") is each local worker's limit, enforced by Dask (a worker past it is restarted
    and its task fails, never the machine). `scratch`: where workers leave large results for the driver; for a
    local cluster a fresh temporary directory, for a remote one it must be a path every worker and the driver
    share (without one, results travel through Dask itself)."""
    try:
        from dask.distributed import Client, LocalCluster
    except ImportError as exc:     # pragma: no cover - dask is a dependency
        raise EngineError(f"--workers/--scheduler need dask[distributed] ({exc})") from None
    own = None
    made: str | None = None
    # Dask reports a worker it restarts or loses with tracebacks on stderr; what the user needs is the one line
    # the CLI prints when the task fails for good (engine_args.engine_for)
    import logging
    quiet = [(name, logging.getLogger(name).level) for name in ("distributed", "tornado")]
    for name, _ in quiet:
        logging.getLogger(name).setLevel(logging.CRITICAL + 1)
    try:
        if scheduler:
            try:
                client = Client(scheduler, timeout=f"{CONNECT_TIMEOUT_S}s")
            except (OSError, TimeoutError) as exc:
                raise EngineError(f"--scheduler {scheduler}: cannot reach it ({exc})") from None
            n = max(len(client.scheduler_info().get("workers", {})), 1)
        else:
            n = workers or default_workers()
            if n < 1:
                raise EngineError(f"--workers {n}: needs at least 1")
            if memory_limit:
                from dask.utils import parse_bytes
                try:
                    parse_bytes(memory_limit)
                except (ValueError, TypeError) as exc:
                    raise EngineError(f"--worker-memory {memory_limit}: not a size ({exc})") from None
            try:
                with warnings.catch_warnings():          # "port 8787 is in use, using another": not the user's news
                    warnings.simplefilter("ignore")
                    own = LocalCluster(n_workers=n, threads_per_worker=1, processes=True, dashboard_address=None,
                                       memory_limit=memory_limit or "auto", silence_logs=logging.CRITICAL + 1)
                client = Client(own)
            except (OSError, ValueError, TimeoutError) as exc:      # no ports, no processes, ...
                raise EngineError(f"--workers {n}: the local workers could not start ({exc})") from None
        if scratch is None and not scheduler:
            scratch = made = tempfile.mkdtemp(prefix="ncclscope-scratch-")
        elif scratch is not None:
            os.makedirs(scratch, exist_ok=True)
            scratch = made = tempfile.mkdtemp(prefix="ncclscope-scratch-", dir=scratch)
        engine = Engine(client, n, scratch, progress, own)
    except EngineError:
        if own is not None:
            own.close()
        _restore(quiet)
        raise
    try:
        yield engine
    finally:
        engine.close()
        if made:
            shutil.rmtree(made, ignore_errors=True)
        _restore(quiet)


def _restore(levels: list[tuple[str, int]]) -> None:
    import logging
    for name, level in levels:
        logging.getLogger(name).setLevel(level)


def stderr_progress(quiet: bool = False, every_s: float = 1.0) -> Progress | None:
    """Per-stage progress on stderr ("ranks read 4,096/16,384 (12 s)"), at most one line a second and the
    last one always; None (no output) when `quiet`."""
    if quiet:
        return None
    t0 = time.monotonic()
    last = [0.0]

    def show(what: str, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - last[0] < every_s:
            return
        last[0] = now
        print(f"ncclscope: {what} {done:,}/{total:,} ({now - t0:.0f} s)", file=sys.stderr, flush=True)
    return show
