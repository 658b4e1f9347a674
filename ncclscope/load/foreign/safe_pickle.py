"""A restricted unpickler for untrusted Flight Recorder dumps.

`pickle.load` on a file from someone else's job is arbitrary code execution:
a pickle may name any importable callable (`os.system`, `subprocess.Popen`,
`builtins.eval`) and have the unpickler call it. A Flight Recorder dump holds
only plain data (dicts, lists, tuples, strings, numbers, bools, None), which
pickle encodes with opcodes that never name a global. So this unpickler admits
no global at all except a handful of inert container constructors, and
refuses everything else *before* anything is looked up or called:

    >>> safe_loads(b"cos\\nsystem\\n(S'touch /tmp/x'\\ntR.")
    Traceback (most recent call last):
    ncclscope.load.foreign.safe_pickle.UnsafePickleError: refused to unpickle <bytes>: it names the global
    'os.system' ... nothing in it was executed

Persistent ids (`persistent_load`) are refused too. What is admitted, and why:
`set`/`frozenset` (protocol-2 pickles encode them as a call to the builtin),
`complex`, `collections.OrderedDict`, and `_codecs.encode` (protocol-2 bytes),
the last one replaced by a function that only re-encodes a str to latin-1.
"""
from __future__ import annotations

import collections
import os
import pickle
from pathlib import Path
from typing import Any

from ncclscope.load.foreign.errors import TraceError


class UnsafePickleError(TraceError):
    """The pickle names something other than plain data; nothing was executed."""


def _latin1_encode(obj: Any, encoding: str = "latin1", errors: str = "strict") -> bytes:
    """Stand-in for `_codecs.encode` as protocol-2 pickles use it for bytes objects."""
    if not isinstance(obj, str) or str(encoding).replace("-", "").lower() != "latin1" or errors != "strict":
        raise UnsafePickleError(f"refused _codecs.encode({type(obj).__name__}, {encoding!r}): "
                                "only str -> latin-1 (how pickle encodes bytes) is allowed")
    return obj.encode("latin-1")


# (module, name) -> the object the unpickler may use. Keys cover the Python 2
# module name too, since protocol <= 2 pickles may say `__builtin__`.
ALLOWED_GLOBALS: dict[tuple[str, str], Any] = {}
for _mod in ("builtins", "__builtin__"):
    ALLOWED_GLOBALS.update({(_mod, "set"): set, (_mod, "frozenset"): frozenset, (_mod, "complex"): complex})
ALLOWED_GLOBALS[("collections", "OrderedDict")] = collections.OrderedDict
ALLOWED_GLOBALS[("_codecs", "encode")] = _latin1_encode

PLAIN_TYPES = "dict, list, tuple, set, str, bytes, int, float, bool, None"


class RestrictedUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` that admits plain data only (see module docstring)."""

    def __init__(self, file: Any, source: str = "<bytes>") -> None:
        super().__init__(file, fix_imports=False, encoding="utf-8", errors="strict")
        self.source = source

    def find_class(self, module: str, name: str) -> Any:   # noqa: D401 - pickle API
        obj = ALLOWED_GLOBALS.get((module, name))
        if obj is None:
            raise UnsafePickleError(
                f"refused to unpickle {self.source}: it names the global '{module}.{name}', but a "
                f"Flight Recorder dump holds only plain data ({PLAIN_TYPES}); nothing in it was executed")
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"refused to unpickle {self.source}: it uses persistent ids, which a "
                                "Flight Recorder dump never does; nothing in it was executed")


class _Prefetched:
    """The whole pickle as a file that the C unpickler reads without copying it.

    Why not `io.BufferedReader(io.BytesIO(data))`: the unpickler prefetches through `peek`, and a
    BufferedReader copies the data into its buffer, again into each `peek` result, and again into the
    `read` that skips what was consumed: three fresh copies of a 0.4 MB dump, each one new pages to
    fault in (~300 page faults a dump). Here `peek` hands over the rest of the data and `read` a
    slice, both memoryviews of the caller's buffer. The unpickler copies what it keeps (strings,
    bytes), so nothing it builds refers to `data`. Bare `io.BytesIO` has no `peek`: the unpickler
    then calls `read` once per opcode, ~3x slower."""

    __slots__ = ("_view", "_pos")

    def __init__(self, data: Any) -> None:
        try:
            view = memoryview(data)
        except TypeError:        # the message io.BytesIO gives (part of the TraceError text)
            raise TypeError(f"a bytes-like object is required, not '{type(data).__name__}'") from None
        self._view = view.cast("B")
        self._pos = 0

    def peek(self, n: int = 0) -> memoryview:
        return self._view[self._pos:]

    def read(self, n: int = -1) -> memoryview:
        start, size = self._pos, len(self._view)
        self._pos = size if n is None or n < 0 else min(start + n, size)
        return self._view[start:self._pos]

    def readinto(self, buf: Any) -> int:
        out = memoryview(buf).cast("B")
        part = self.read(len(out))
        out[:len(part)] = part
        return len(part)

    def readline(self) -> bytes:
        """Up to and including the next newline (the unpickler asks only past what `peek` gave)."""
        view, start = self._view, self._pos
        end = start
        while end < len(view):
            chunk = bytes(view[end:end + 4096])
            i = chunk.find(b"\n")
            if i >= 0:
                end += i + 1
                break
            end += len(chunk)
        self._pos = end
        return bytes(view[start:end])


def safe_loads(data: bytes | bytearray | memoryview, source: str = "<bytes>") -> Any:
    """Unpickle bytes that may come from anyone. Raises UnsafePickleError for
    anything but plain data, TraceError for a corrupt pickle. `data` may be any
    bytes-like buffer (a dump read into a reused one); nothing returned refers to it."""
    try:
        return RestrictedUnpickler(_Prefetched(data), source).load()
    except UnsafePickleError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError, KeyError,
            UnicodeDecodeError, MemoryError, RecursionError) as exc:
        text = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise TraceError(f"{source}: not a readable pickle ({text})") from None


def safe_load(path: str | os.PathLike[str]) -> Any:
    """`safe_loads` of a file's content."""
    p = Path(path)
    return safe_loads(p.read_bytes(), str(p))
