"""What runs on a worker around a stage's own function: in the driver's working directory (`working_dir`), its
result left as a file in the scratch directory (`run_to_file`) and read back by the driver (`load_result`).
A leaf: the stage modules (rank_chunks.py, dump_chunks.py) and the engine (cluster.py) import it.
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator


class ScratchError(RuntimeError):
    """A scratch file that is not what its worker should have left (one line)."""


def run_to_file(fn: Callable[..., Any], path: str, *args: Any) -> str:
    """fn(*args) pickled to `path` (runs on a worker; written under a temporary name, then renamed)."""
    import pickle
    result = fn(*args)
    tmp = f"{path}.part"
    with open(tmp, "wb") as f:
        pickle.dump(result, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, path)
    return path


def load_result(path: str, kind: type) -> Any:
    """A result `run_to_file` wrote: only ever a file this run's own workers wrote into its own scratch
    directory (a fresh mkdtemp, mode 0700), never user input; deleted once read."""
    import pickle
    with open(path, "rb") as f:
        result = pickle.load(f)
    os.unlink(path)
    if not isinstance(result, kind):
        raise ScratchError(f"{path}: a worker left {type(result).__name__}, expected {kind.__name__}")
    return result


@contextmanager
def working_dir(cwd: str | None) -> Iterator[None]:
    """Run a task in the driver's working directory (on a worker): relative input paths then name the same
    files, and every warning reads word for word as in one process. A worker runs one task at a time
    (one thread), so changing its directory for the task's length touches nothing else it does."""
    if not cwd or cwd == os.getcwd():
        yield
        return
    old = os.getcwd()
    os.chdir(cwd)
    try:
        yield
    finally:
        os.chdir(old)
