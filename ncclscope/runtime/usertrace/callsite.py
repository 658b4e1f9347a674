"""The user's line: `file:line` of the first frame outside torch and ncclscope, and its user callers.

Every traced row carries the call site, so this runs on every op. A site is
the innermost user frame followed by up to two user frames that called it,
joined by " < " (`train.py:20 < train.py:58`, ncclscope/sites.py reads it):
a helper shared by several lines of a loop body issues every op from its
one line, and only its caller tells them apart (the line a verdict must name).
It is a frame walk (never `inspect.stack()`, which reads source files) with
two caches: whether a code object is a library's (by filename), and the
rendered text (by the frames' code objects and bytecode offsets).
"""
from __future__ import annotations

import functools
import os
import sys
import sysconfig
from typing import Any

import torch

# the tracer's own directory too: this package may live outside ncclscope's (runtime/ in a source
# checkout), and a wrapper that hands a call on to another (hotpath.py -> ops.py) adds a frame of its own
_PKG_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                  for m in (torch, sys.modules["ncclscope"])) + (os.path.dirname(os.path.abspath(__file__)) + os.sep,)


@functools.lru_cache(maxsize=4096)
def _is_library(filename: str) -> bool:
    if not filename or filename.startswith("<"):
        return True
    path = os.path.abspath(filename)
    return path.startswith(_PKG_DIRS) or os.sep + "runpy.py" in path or os.sep + "contextlib.py" in path


_STDLIB = tuple({os.path.abspath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")})


@functools.lru_cache(maxsize=4096)
def _is_installed(filename: str) -> bool:
    """An installed package's or the standard library's file: never a caller worth naming (a test
    runner, a launcher). Such a file can still be the innermost site (a library issuing the op)."""
    path = os.path.abspath(filename)
    return ("site-packages" + os.sep in path or "dist-packages" + os.sep in path or path.startswith(_STDLIB))


@functools.lru_cache(maxsize=4096)
def _short(filename: str) -> str:
    try:
        rel = os.path.relpath(filename)
        return filename if rel.startswith("..") else rel
    except ValueError:
        return filename


# code object -> True when it is library code (torch, ncclscope, runpy, contextlib). Public: the fast
# wrapper (hotpath.py) reads it inline, without a call to `call_site`
LIB_CODE: dict[Any, bool] = {}
# ((code object, bytecode offset), ...) of the user frames, innermost first -> the site text (the
# offset is free to read; line numbers come from the code's line table: read once per site)
_SITES: dict[tuple[Any, ...], str] = {}
CALLERS = 2           # user frames kept above the innermost one
SEP = " < "           # innermost first: "a.py:20 < a.py:58" is line 20, called from line 58
# "file:line" -> (function name, its def line), for rank.json `call_sites`: the analyzer tells from an
# exception's frames whether a rank went past the line of a collective it never issued
_FUNCS: dict[str, tuple[str, int]] = {}


def call_site(depth: int = 2) -> str:
    """The user's line and up to CALLERS user frames that called it ("" when no user frame).

    `depth` 2: the caller of the function that calls this (a wrapper's caller). Library frames
    between user frames (a module's __call__ around a user forward) are stepped over."""
    f: Any = sys._getframe(depth)
    lib = LIB_CODE
    key: tuple[Any, ...] = ()
    frames = []
    while f is not None:
        code = f.f_code
        is_lib = lib.get(code)
        if is_lib is None:
            is_lib = lib[code] = _is_library(code.co_filename)
        if not is_lib:
            if frames and _is_installed(code.co_filename):
                break                   # above the user's code: a runner, a launcher
            key += (code, f.f_lasti)
            frames.append(f)
            if len(frames) > CALLERS:
                break
        f = f.f_back
    if not frames:
        return ""
    site = _SITES.get(key)
    if site is None:
        site = _SITES[key] = SEP.join(f"{_short(g.f_code.co_filename)}:{g.f_lineno}" for g in frames)
        inner = frames[0].f_code
        _FUNCS[site] = (inner.co_name, inner.co_firstlineno)
    return site


def site_functions() -> dict[str, list]:
    """{call site: [function name, def line]} of every user call site seen so far."""
    return {s: [name, first] for s, (name, first) in _FUNCS.items()}


def text_of(exc: BaseException) -> str:
    """`Type: first line of the message`, at most 500 characters (what a row's message holds)."""
    s = str(exc).strip()
    return (f"{type(exc).__name__}: {s.splitlines()[0] if s else ''}")[:500]
