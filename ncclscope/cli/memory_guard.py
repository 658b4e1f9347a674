"""Never an out-of-memory kill: an input too big for this machine is a one-line error (exit 2), before the
load when its size on disk already says so, or while it runs when the machine is about to run out.

Why both: the size on disk is a lower bound only (the analysis has peaked at 1.2x the input's bytes or more:
16,384 synthetic ranks, 5.1 GiB of files, peak 6.1-6.3 GB; 1,024 ranks, 1.5 GiB, peak 3.4 GB; 65,536 ranks,
20.6 GiB, past 23.6 GB when the kernel killed it), so the check before the load refuses only what cannot fit;
the watchdog catches the rest. It keeps a wide margin (10 % of memory, polled five times a second): one
concatenation of a column at 125 M rows takes a gigabyte at once, and the kernel's OOM killer, not the
watchdog, ended a 65,536-rank analysis that a 3 % margin polled twice a second let through.

On an engine (`--workers`, `--scheduler`) a run directory's events are joined into ops on the workers and this
process holds the ops, not the event rows (engine/ops_chunks.py): 16,384 ranks peaked at 3.7-3.8 GB for 5.1 GiB
of files, so the check before the load asks for JOINED_DISK_TO_MEMORY per byte there. Flight Recorder dumps and
the commands that show events (tui, export) still hold every row in this process.
"""
from __future__ import annotations

import os
import sys
import threading
from typing import Any, Callable

import psutil

from ncclscope.cli.inputs import UsageError

DISK_TO_MEMORY = 1.2          # memory per byte of input, at least (measured, see the module docstring)
JOINED_DISK_TO_MEMORY = 0.7   # the same for a run directory joined on an engine's workers (0.68-0.69 measured)
RESERVE = 0.10                # the watchdog stops the analysis when less than this share of memory is left
POLL_S = 0.2
ADVICE = ("read a run directory with --workers N: its events are then joined into ops on the workers and this "
          "process holds about half as much (docs/scale.md); else use a machine with more memory")
JOINED_ADVICE = "this process holds every op of the run (docs/scale.md); use a machine with more memory"


def input_bytes(path: str, stop_at: float = float("inf")) -> int:
    """Bytes of the files in `path` and its immediate subdirectories (rank directories, per-node dump
    folders), counted until `stop_at` is reached (the automatic engine choice needs only to know that)."""
    total = 0
    try:
        with os.scandir(path) as top:
            for e in top:
                if e.is_file(follow_symlinks=False):
                    total += e.stat(follow_symlinks=False).st_size
                elif e.is_dir(follow_symlinks=False):
                    with os.scandir(e.path) as inner:
                        total += sum(f.stat(follow_symlinks=False).st_size for f in inner
                                     if f.is_file(follow_symlinks=False))
                if total >= stop_at:
                    break
    except OSError:
        pass
    return total


def check_fits(path: str, joined: Callable[[int], bool] | None = None) -> int:
    """The input's bytes (0 for a single file); UsageError (exit 2) when the input alone needs more memory
    than the machine has available now. `joined(size)`: whether this input of `size` bytes will be joined on
    an engine's workers (then it needs JOINED_DISK_TO_MEMORY per byte here, not DISK_TO_MEMORY)."""
    if not os.path.isdir(path):
        return 0
    size = input_bytes(path)
    on_workers = bool(joined is not None and joined(size) and run_directory(path))
    need = size * (JOINED_DISK_TO_MEMORY if on_workers else DISK_TO_MEMORY)
    have = psutil.virtual_memory().available
    if need > have:
        raise UsageError(f"{path}: needs at least {need / 2**30:.1f} GB of memory to analyze, "
                         f"{have / 2**30:.1f} GB are available; {JOINED_ADVICE if on_workers else ADVICE}")
    return size


def run_directory(path: str) -> bool:
    """Whether `path` holds rank directories (rank-NNNNN/): the input whose events an engine joins."""
    try:
        with os.scandir(path) as top:
            return any(e.name.startswith("rank-") and e.is_dir(follow_symlinks=False) for e in top)
    except OSError:
        return False


class Watchdog:
    """While the analysis runs, exit 2 with one line once available memory falls under RESERVE of the total
    and this process holds most of what is used (a thread polling every 0.5 s; the kernel's OOM killer would
    otherwise end the job with SIGKILL and no word)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "Watchdog":
        self._thread = threading.Thread(target=self._watch, name="ncclscope-memory-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()

    def _watch(self) -> None:
        me = psutil.Process()
        while not self._stop.wait(POLL_S):
            vm = psutil.virtual_memory()
            if vm.available >= RESERVE * vm.total:
                continue
            rss = me.memory_info().rss
            if rss < 0.5 * (vm.total - vm.available):
                continue                  # another process is the one eating the memory: not ours to stop
            print(f"ncclscope: {self.what}: out of memory ({rss / 2**30:.1f} GB held, "
                  f"{vm.available / 2**30:.1f} GB left of {vm.total / 2**30:.1f}); {ADVICE}",
                  file=sys.stderr, flush=True)
            os._exit(2)
            return                        # (os._exit does not return; a test's stand-in does)
