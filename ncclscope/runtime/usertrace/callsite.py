"""The user's line: `file:line` of the first frame outside torch and ncclscope.

Every traced row carries the call site, so this runs on every op. It is a
frame walk (never `inspect.stack()`, which reads source files) with two
caches: whether a file is a library's (by filename), and the rendered
`file:line` text (by code object and bytecode offset). A script calling
`dist.all_reduce` directly costs one frame step, two dict hits.
"""
from __future__ import annotations

import functools
import os
import sys
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
# (code object, bytecode offset) -> "file:line" (the offset is free to read; the line number
# is computed from the code's line table, so it is read once per site, not once per call)
_SITES: dict[tuple[Any, int], str] = {}
# "file:line" -> (function name, its def line), for rank.json `call_sites`: the analyzer tells from an
# exception's frames whether a rank went past the line of a collective it never issued
_FUNCS: dict[str, tuple[str, int]] = {}


def call_site(depth: int = 2) -> str:
    """file:line of the first frame outside torch and ncclscope (the user's line).

    `depth` 2: the caller of the function that calls this (a wrapper's caller)."""
    f: Any = sys._getframe(depth)
    lib = LIB_CODE
    while f is not None:
        code = f.f_code
        is_lib = lib.get(code)
        if is_lib is None:
            is_lib = lib[code] = _is_library(code.co_filename)
        if not is_lib:
            key = (code, f.f_lasti)
            site = _SITES.get(key)
            if site is None:
                site = _SITES[key] = f"{_short(code.co_filename)}:{f.f_lineno}"
                _FUNCS[site] = (code.co_name, code.co_firstlineno)
            return site
        f = f.f_back
    return ""


def site_functions() -> dict[str, list]:
    """{call site: [function name, def line]} of every user call site seen so far."""
    return {s: [name, first] for s, (name, first) in _FUNCS.items()}


def text_of(exc: BaseException) -> str:
    """`Type: first line of the message`, at most 500 characters (what a row's message holds)."""
    s = str(exc).strip()
    return (f"{type(exc).__name__}: {s.splitlines()[0] if s else ''}")[:500]
