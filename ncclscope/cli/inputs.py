"""Where the CLI touches the file system: reading any supported input (with a
spinner on a terminal and a one-line error otherwise), checking output paths
before any work starts, and the exit codes and `UsageError` those checks end in.
"""
from __future__ import annotations

import os
import sys
import traceback
from contextlib import nullcontext
from typing import Any

from ncclscope.cli.output import clean

EXIT_OK, EXIT_PROBLEMS, EXIT_UNREADABLE, EXIT_INTERNAL = 0, 1, 2, 3


class UsageError(Exception):
    """A command line that cannot work (an output path that cannot be written); exit 2, one line."""


def load_input(path: str, engine: Any = None, world_size: int | None = None, ops_only: bool = False) -> Any:
    """Any supported input (run directory, Flight Recorder dumps, profiler
    traces), or None after a one-line error on stderr. A spinner on stderr
    (only when stderr is a terminal) shows a load that takes a while; with an
    `engine` (engine_args.engine_for) it prints its own progress instead.
    Public: every analyzer subcommand (`commands.py`) reads its input here."""
    from ncclscope.load.foreign import load_any
    from ncclscope.load.trace import TraceError
    try:
        with progress(f"reading {path}") if engine is None else nullcontext():
            return load_any(path, engine=engine, world_size=world_size, ops_only=ops_only)
    except TraceError as exc:
        print(f"ncclscope: {clean(exc)}", file=sys.stderr)
    except (OSError, ValueError, RecursionError, MemoryError) as exc:   # a reader that did not word its error
        print(f"ncclscope: {clean(path)}: unreadable input ({type(exc).__name__}: {clean(first_line(exc))})",
              file=sys.stderr)
        if debug_wanted():
            traceback.print_exc()
    return None


class progress:
    """A transient spinner on stderr for slow steps, shown after one second and
    only when stderr is a terminal (never in pipes, logs or tests). Public: the
    subcommands (`commands.py`) wrap their slow writes in it; lower-case because
    it is used like a function, `with progress("writing x"):`."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._status: Any = None
        self._timer: Any = None

    def __enter__(self) -> "progress":
        if not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
            return self
        import threading

        from rich.console import Console

        def show() -> None:
            self._status = Console(stderr=True, highlight=False, markup=False).status(clean(self.what) + " ...")
            self._status.start()

        self._timer = threading.Timer(1.0, show)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer.join()
        if self._status is not None:
            self._status.stop()


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (at most 300 characters), or its
    type's name: every one-line error of the CLI, the runtime's job commands
    (`ncclscope.runtime.commands`) and `main`'s exit-3 line is worded from it."""
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


_DEBUG = [False]   # set once per command by `set_debug` (the --debug flag)


def set_debug(on: bool) -> None:
    """Record the command's --debug flag; `main` calls it before running the command."""
    _DEBUG[0] = bool(on)


def debug_wanted() -> bool:
    """Whether a traceback should follow a one-line error: --debug, or NCCLSCOPE_DEBUG set.
    Public: `main` asks it before printing an internal error's traceback."""
    return bool(os.environ.get("NCCLSCOPE_DEBUG")) or _DEBUG[0]


def writable_file(path: str, flag: str) -> str:
    """`path` when a file can be written there, else UsageError naming why
    (a directory in its place, a parent that is missing or a file). Public: the
    commands check their output paths with it before any slow work starts."""
    target = os.path.abspath(path)
    if os.path.isdir(target):
        raise UsageError(f"{flag} {path}: is a directory; give a file name")
    _writable_parent(os.path.dirname(target) or ".", path, flag)
    return path


def writable_dir(path: str, flag: str) -> str:
    """`path` when a directory can be created or written there, else UsageError.
    Public: `export --parquet` and the runtime's `train --out` check with it."""
    target = os.path.abspath(path)
    if os.path.lexists(target) and not os.path.isdir(target):
        raise UsageError(f"{flag} {path}: exists and is not a directory")
    _writable_parent(target if os.path.isdir(target) else os.path.dirname(target), path, flag)
    return path


def _writable_parent(parent: str, path: str, flag: str) -> None:
    probe = parent
    while not os.path.lexists(probe):          # the nearest existing ancestor decides
        up = os.path.dirname(probe)
        if up == probe:
            break
        probe = up
    if not os.path.isdir(probe):
        raise UsageError(f"{flag} {path}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: {probe} is not writable")
