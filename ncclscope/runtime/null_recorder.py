"""`--no-trace`: a recorder with Recorder's interface that writes nothing.

Kept beside recorder.py, not in it: the training loop and the comm layer call the
same methods either way, so turning tracing off changes no code path but this one.
"""
from __future__ import annotations

import faulthandler
import sys
from typing import Any, Iterable

from ncclscope.runtime.recorder import Context


class NullRecorder:
    """`--no-trace`: the same interface, no rows, no files, no threads."""

    enabled = False

    def __init__(self, rank: int = 0, world_size: int = 1) -> None:
        self.rank = rank
        self.world_size = world_size
        self.context = Context()
        self.meta: dict[str, Any] = {}

    def begin(self, *args: Any, **kwargs: Any) -> int:
        return -1

    def end(self, *args: Any, **kwargs: Any) -> None:
        pass

    def instant(self, *args: Any, **kwargs: Any) -> None:
        pass

    def span(self, *args: Any, **kwargs: Any) -> "_NullSpan":
        return _NULL_SPAN

    def metric(self, **values: Any) -> None:
        pass

    def sample(self, row: Iterable[Any]) -> None:
        pass

    def write_meta(self, **updates: Any) -> None:
        self.meta.update(updates)

    def dump_stacks(self, reason: str) -> None:
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)

    def dump_exception(self, exc: BaseException) -> None:
        pass                                       # train.py prints the traceback to stderr itself

    def flush(self) -> None:
        pass

    def request_flush(self) -> None:
        pass

    def close(self, status: str = "ok", message: str = "") -> None:
        pass


class _NullSpan:
    def __enter__(self) -> int:
        return -1

    def __exit__(self, *exc: Any) -> None:
        return None


_NULL_SPAN = _NullSpan()
