"""What a begin row says about the call, cheaply: the user's call site (the
first frame outside comm.py, formatted once per file:line) and a tensor's
sizes, dtype and bytes (formatted once per shape and dtype). Both run on
every traced op, so both are caches.
"""
from __future__ import annotations

import functools
import os
import sys
from typing import Any

import torch

# the wrapper's frames (Comm's methods, in comm.py) are skipped: the row names the user's line
_WRAPPER_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "comm.py")


@functools.lru_cache(maxsize=4096)
def _short_path(filename: str) -> str:
    """Path as a person would quote it: relative to the package or cwd."""
    marker = os.sep + "runtime" + os.sep
    if marker in filename:
        return "runtime/" + filename.split(marker, 1)[1]
    try:
        rel = os.path.relpath(filename)
        return filename if rel.startswith("..") else rel
    except ValueError:
        return filename


_SITES: dict[tuple[str, int], str] = {}
# site -> (function name, its def line): lets the analyzer tell whether a crash traceback's frame is
# in the function that issues a call site, past its line (a rank that went past a collective)
_FUNCS: dict[str, tuple[str, int]] = {}


def call_site() -> str:
    """file:line of the first caller outside comm.py (cheap: a few frames,
    and the formatted string is cached per call site)."""
    f: Any = sys._getframe(1)
    while f is not None and f.f_code.co_filename == _WRAPPER_FILE:
        f = f.f_back
    if f is None:
        return ""
    key = (f.f_code.co_filename, f.f_lineno)
    site = _SITES.get(key)
    if site is None:
        site = _SITES[key] = f"{_short_path(key[0])}:{key[1]}"
        _FUNCS[site] = (f.f_code.co_name, f.f_code.co_firstlineno)
    return site


def site_functions() -> dict[str, list]:
    """{call site: [function name, def line]} of every call site seen so far (for rank.json)."""
    return {s: [name, first] for s, (name, first) in _FUNCS.items()}


# (shape, dtype) -> tensor_meta's answer. Public: the tracer's fast wrapper (usertrace/hotpath.py)
# reads it directly, one dict hit per call instead of a function call.
META_CACHE: dict[tuple[Any, Any], tuple[str, str, int]] = {}


def tensor_meta(t: torch.Tensor) -> tuple[str, str, int]:
    """(input_sizes, input_dtypes, bytes) of a tensor, cached per (shape, dtype):
    the same few shapes recur every step, and formatting them is the costliest
    part of a begin row. Public: comm.py's `Comm` and the tracer of unmodified
    scripts (usertrace/) share it, so both write the same text for a tensor."""
    key = (t.shape, t.dtype)
    meta = META_CACHE.get(key)
    if meta is None:
        meta = META_CACHE[key] = ("[" + str(list(t.shape)) + "]", str(t.dtype).replace("torch.", ""),
                             t.numel() * t.element_size())
    return meta


# tensor_meta of an op without a tensor (barrier); public: `Comm._begin` writes it
NO_TENSOR = ("[]", "", 0)
