"""Guarded reading of input files that may be torn, hostile or not files at all.

Everything the analyzer reads comes from somebody else's dying job, so every
read goes through here:

- `open_regular(path)` opens with O_NONBLOCK and checks, on the open
  descriptor, that it is a regular file: a named pipe never blocks, a link to
  /dev/zero or /dev/urandom is refused instead of read until memory runs out,
  a directory is refused instead of raising IsADirectoryError somewhere deep.
- `read_bytes(path, limit)` / `read_text(path, limit)` read at most `limit`
  bytes and refuse a larger file.
- `loads(data)` is the one JSON parser for input: NaN, ±Infinity, floats
  that overflow and integers of more than 40 digits read as null, nesting at most MAX_DEPTH deep (a RecursionError is
  turned into a one-line error), lone surrogates ("\\ud800", which cannot be
  encoded and break every writer downstream) replaced by U+FFFD.
- `to_int` / `to_float` convert numbers from input with bounds: never an
  OverflowError, never an infinity, never a 30-digit rank;
  `plausible_world` bounds a declared world size by what is on disk.

Every refusal is an `InputError` (a ValueError), whose message is one line
naming the file and what is wrong with it.
"""
from __future__ import annotations

import json
import math
import os
import re
import stat
from pathlib import Path
from typing import Any, BinaryIO

INT64_MAX = 2**63 - 1
INT64_MIN = -(2**63)
MAX_DEPTH = 64                     # real inputs nest < 10 deep
JSON_LIMIT = 256 * 2**20           # run.json, rank.json, groups.json
TEXT_LIMIT = 64 * 2**20            # stacks.txt
DUMP_LIMIT = 4 * 2**30             # a Flight Recorder dump or a profiler trace
MAX_RANK = 1 << 20                 # no job has a million ranks; a bigger number is junk


class InputError(ValueError):
    """A file that cannot be read safely; the message is one line."""


def file_kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a named pipe"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "not a regular file"


def is_regular(path: str | os.PathLike[str]) -> bool:
    """True when `path` (links followed) is a regular file; never blocks."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except (OSError, ValueError):
        return False


def check_regular(path: str | os.PathLike[str]) -> os.stat_result:
    """os.stat of a regular file, or InputError saying what it is instead."""
    try:
        st = os.stat(path)
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: unreadable ({_oserror(exc)})") from None
    if not stat.S_ISREG(st.st_mode):
        raise InputError(f"{path}: {file_kind(st.st_mode)}, not a regular file; not read")
    return st


def _open_checked(path: str | os.PathLike[str], limit: int | None) -> tuple[int, os.stat_result]:
    """(descriptor, its stat) of a regular file of at most `limit` bytes, opened without ever blocking on
    a FIFO; InputError (and nothing left open) otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except (OSError, ValueError) as exc:
        raise InputError(f"{path}: unreadable ({_oserror(exc)})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{path}: {file_kind(st.st_mode)}, not a regular file; not read")
        if limit is not None and st.st_size > limit:
            raise InputError(f"{path}: {st.st_size} bytes, over the {limit}-byte limit for this file; not read")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def open_regular(path: str | os.PathLike[str], limit: int | None = None) -> BinaryIO:
    """Open a regular file for binary reading without ever blocking on a FIFO;
    InputError for anything else, or for a file over `limit` bytes."""
    fd, _ = _open_checked(path, limit)
    try:
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bytes(path: str | os.PathLike[str], limit: int = JSON_LIMIT) -> bytes:
    """The content of a regular file of at most `limit` bytes (InputError otherwise).

    `open_regular`'s checks on a bare descriptor (no file object: the loader reads two small JSON files
    per rank, 32,768 at 16,384 ranks, and the buffered reader's setup was most of each read)."""
    fd, st = _open_checked(path, limit)
    try:
        parts: list[bytes] = []
        got = 0
        try:
            while got <= limit:          # a regular file: O_NONBLOCK does not apply, reads block as usual
                part = os.read(fd, min(limit + 1 - got, max(st.st_size - got, 0) + (1 << 16)))
                if not part:
                    break
                parts.append(part)
                got += len(part)
        except (OSError, MemoryError) as exc:
            raise InputError(f"{path}: unreadable ({_oserror(exc)})") from None
    finally:
        os.close(fd)
    if got > limit:     # grew while we read it
        raise InputError(f"{path}: over the {limit}-byte limit for this file; not read")
    return parts[0] if len(parts) == 1 else b"".join(parts)


def read_text(path: str | os.PathLike[str], limit: int = TEXT_LIMIT) -> str:
    """`read_bytes` decoded as UTF-8, undecodable bytes replaced."""
    return read_bytes(path, limit).decode("utf-8", errors="replace")


# --------------------------------------------------------------------------
# JSON
# --------------------------------------------------------------------------
def _no_constant(name: str) -> None:
    return None          # NaN, Infinity, -Infinity: not a number anything here can use


def _bounded_int(text: str) -> int | None:
    if len(text) > 40:   # int() of thousands of digits is slow, and no field holds one
        return None
    return int(text)     # range is checked where it is used (to_int)


def _finite_float(text: str) -> float | None:
    value = float(text)
    return value if math.isfinite(value) else None


_DECODER = json.JSONDecoder(parse_constant=_no_constant, parse_int=_bounded_int, parse_float=_finite_float)
# the same parser with the C scanner's own integers, for a text with no run of 40 digits (so no integer
# `_bounded_int` would refuse): a Python call per integer was a third of parsing 16,384 groups.json files
_DECODER_INTS = json.JSONDecoder(parse_constant=_no_constant, parse_float=_finite_float)
_LONG_DIGITS = re.compile(r"\d{40}")


def loads(data: bytes | str, where: Any = "<input>", walk: bool = True) -> Any:
    """Parse JSON from input (see module docstring); InputError with one line.
    `walk=False` skips the depth and surrogate walk (`sanitize`) for bulk
    documents whose parts the caller sanitizes where it uses them (a Flight
    Recorder dump: the walk would cost more than the parse); the parser
    itself still refuses nesting deeper than the interpreter allows."""
    try:
        text = data.decode("utf-8", errors="replace") if isinstance(data, (bytes, bytearray, memoryview)) else data
        decoder = _DECODER if _LONG_DIGITS.search(text) else _DECODER_INTS
        obj, end = decoder.raw_decode(text, _skip_ws(text, 0))
        if _skip_ws(text, end) != len(text):
            raise InputError(f"extra data at character {end}")
    except InputError as exc:
        raise InputError(f"{where}: unreadable JSON ({exc})") from None
    except RecursionError:
        raise InputError(f"{where}: unreadable JSON (nested too deeply)") from None
    except (ValueError, MemoryError) as exc:
        raise InputError(f"{where}: unreadable JSON ({_first_line(exc)})") from None
    if not walk:
        return obj
    has_surrogates = "\\ud" in text or "\\uD" in text
    if not has_surrogates and text.count("[") + text.count("{") <= MAX_DEPTH:
        return obj       # nothing to fix, too few brackets to nest past MAX_DEPTH: the walk would change nothing
    return sanitize(obj, where, has_surrogates=has_surrogates)


def raw_decode(text: str, idx: int, where: Any = "<input>") -> Any:
    """One JSON value starting at `idx` of `text` (the rest is ignored), guarded like `loads`."""
    try:
        obj, _ = _DECODER.raw_decode(text, idx)
    except RecursionError:
        raise InputError(f"{where}: unreadable JSON (nested too deeply)") from None
    except (ValueError, MemoryError) as exc:
        raise InputError(f"{where}: unreadable JSON ({_first_line(exc)})") from None
    return sanitize(obj, where)


def _skip_ws(text: str, i: int) -> int:
    n = len(text)
    while i < n and text[i] in " \t\n\r":
        i += 1
    return i


_SURROGATE = re.compile("[\ud800-\udfff]")


def _fix_str(s: str) -> str:
    """`s` itself when it encodes as UTF-8, else a copy with lone surrogates as U+FFFD."""
    try:
        s.encode("utf-8")
        return s
    except UnicodeEncodeError:
        return _SURROGATE.sub("\ufffd", s)


def clean_text(s: Any) -> str:
    """str(s) that is safe to write anywhere (no lone surrogates); "?" for a
    value too deeply nested to print."""
    if not isinstance(s, str):
        try:
            s = str(s)
        except (RecursionError, ValueError):
            return "?"
    return _fix_str(s)


def sanitize(obj: Any, where: Any = "<input>", has_surrogates: bool = True, max_depth: int = MAX_DEPTH) -> Any:
    """Check nesting depth (InputError past `max_depth`) and replace lone
    surrogates in strings (keys too) with U+FFFD, without recursion. Works on
    JSON results and on unpickled plain data (a container met again, shared or
    holding itself, is walked once)."""
    if not isinstance(obj, (dict, list, tuple)):
        return _fix_str(obj) if has_surrogates and isinstance(obj, str) else obj
    stack: list[tuple[Any, int]] = [(obj, 1)]
    seen: set[int] = set()
    while stack:
        node, depth = stack.pop()
        if depth > max_depth:
            raise InputError(f"{where}: nested more than {max_depth} deep; not read")
        if isinstance(node, dict):
            if id(node) in seen:     # shared or self-referencing: walked once
                continue
            seen.add(id(node))
            if has_surrogates:
                bad = [k for k in node if isinstance(k, str) and _fix_str(k) is not k]
                for k in bad:
                    node[_fix_str(k)] = node.pop(k)
            for k, v in node.items():
                if isinstance(v, (dict, list, tuple)):
                    stack.append((v, depth + 1))
                elif has_surrogates and isinstance(v, str):
                    fixed = _fix_str(v)
                    if fixed is not v:
                        node[k] = fixed
        elif isinstance(node, (list, tuple)):
            if id(node) in seen:
                continue
            seen.add(id(node))
            for i, v in enumerate(node):
                if isinstance(v, (dict, list, tuple)):
                    stack.append((v, depth + 1))
                elif has_surrogates and isinstance(v, str) and isinstance(node, list):
                    fixed = _fix_str(v)
                    if fixed is not v:
                        node[i] = fixed
    return obj


def read_json(path: str | os.PathLike[str], limit: int = JSON_LIMIT) -> Any:
    """`loads(read_bytes(path, limit))`."""
    return loads(read_bytes(path, limit), path)


def first_object(path: str | os.PathLike[str], limit: int = JSON_LIMIT) -> tuple[dict, str] | None:
    """(the JSON object a file starts with, a warning line that says so) where more follows that object;
    else None (read_json's error stands). Two writes of one file over each other leave the later, shorter
    document whole at the start and the tail of the earlier one after it (seed 20261217 #78, before the
    recorder wrote each document through a file of its own): the object is what was last written."""
    try:
        text = read_bytes(path, limit).decode("utf-8", errors="replace")
        _, end = _DECODER.raw_decode(text, _skip_ws(text, 0))      # where the first value ends
        data = loads(text[:end], path)                             # that value, guarded like any other
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    return data, (f"{path}: a complete JSON object, then {len(text) - end} characters of something else (two "
                  "writes over each other?); read the object, ignored the rest")


# --------------------------------------------------------------------------
# numbers
# --------------------------------------------------------------------------
def to_int(value: Any, default: int = -1, lo: int = INT64_MIN, hi: int = INT64_MAX) -> int:
    """An int in [lo, hi] from input (int, integral float, numeric string), else `default`."""
    try:
        if isinstance(value, bool):
            out = int(value)
        elif isinstance(value, int):
            out = value
        elif isinstance(value, float):
            if not math.isfinite(value):
                return default
            out = int(value)
        elif isinstance(value, (str, bytes)):
            text = value.strip()
            if len(text) > 24:
                return default
            out = int(text)
        else:
            return default
    except (TypeError, ValueError, OverflowError):
        return default
    return out if lo <= out <= hi else default


TRACE_INT_BOUND = 2**53      # no field of a trace needs more: a bigger rank, pid, offset or count is junk


def trace_int(value: Any, default: int = -1) -> int:
    """An int from a trace's metadata, bounded to |x| <= 2**53, else `default`."""
    return to_int(value, default, -TRACE_INT_BOUND, TRACE_INT_BOUND)


def to_float(value: Any, default: float = -1.0, limit: float = 1e300) -> float:
    """A finite float with |x| <= limit from input, else `default`."""
    try:
        out = float(value) if isinstance(value, (int, float, str, bytes)) else None
    except (TypeError, ValueError, OverflowError):
        return default
    if out is None or not math.isfinite(out) or abs(out) > limit:
        return default
    return out


def plausible_world(declared: int, on_disk: int, highest: int) -> int:
    """The largest world size worth believing when `on_disk` ranks are present,
    the highest being `highest`: a partial copy of a big job is plausible, a
    world of 2**31 ranks next to four directories is not."""
    return max(highest + 1, 8 * on_disk, 4096) if declared > 0 else highest + 1


def _oserror(exc: BaseException) -> str:
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return _first_line(exc)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:200] if text else type(exc).__name__


def short(exc: BaseException) -> str:
    """One line of an exception, for a warning."""
    return _first_line(exc)


def file_size(path: Path) -> int:
    """Size of a regular file, -1 when it is not one (never blocks)."""
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return -1
    return st.st_size if stat.S_ISREG(st.st_mode) else -1
