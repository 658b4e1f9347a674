"""Flight Recorder dumps: finding them, reading them, and the helpers that coerce their fields.

Every file goes through `ncclscope.load.safe_io` (regular files only, size limit);
a pickle through the restricted unpickler, JSON through the guarded parser,
and either is then checked for depth and lone surrogates (`safe_io.sanitize`).
`fr_entries.Entries` reduces each dump's entries to arrays with the field
helpers here, coercing every field to the type it should have (a hostile
`state: []` becomes a string, a 10**30 time a default).
"""
from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ncclscope import sites
from ncclscope.load import safe_io
from ncclscope.load.foreign.errors import TraceError
from ncclscope.load.foreign.safe_pickle import safe_loads
from ncclscope.load.foreign.vocab import dtype_itemsize, normalize_dtype

SUPPORTED_MAJOR = "2"
SNIFF_BYTES = 65536
_RANK_RE = re.compile(r"(\d+)$")
_SUFFIXES = (".json", ".pkl", ".pickle", ".bin")


# --------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------
def sniff(path: Path) -> str | None:
    """"pickle" or "json" when the file looks like a Flight Recorder dump, else None.
    Reads the first 64 KiB only; nothing is unpickled."""
    try:
        with safe_io.open_regular(path) as fh:
            head = fh.read(SNIFF_BYTES)
    except (OSError, safe_io.InputError):
        return None
    if len(head) > 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        if b"version" in head or b"entries" in head or b"pg_config" in head:
            return "pickle"
        return None
    text = head.lstrip()
    # torch's JSON writer leaves "entries" out when there are none (a rank that recorded nothing yet)
    if text.startswith(b"{") and b'"traceEvents"' not in head and (
            b'"entries"' in head or (b'"pg_config"' in head and b'"version"' in head)):
        return "json"
    if head[:1] in (b"(", b"}", b"c") and b"entries" in head and (b"version" in head or b"pg_config" in head):
        return "pickle"            # protocol 0/1: no header; torch never writes these, an attacker might
    return None


def rank_from_name(name: str) -> int | None:
    """The rank in a dump's file name: trailing digits, as torch writes <prefix><rank>."""
    stem = name
    for suffix in _SUFFIXES:
        if stem.lower().endswith(suffix):
            stem = stem[: -len(suffix)]
            break
    m = _RANK_RE.search(stem)
    if not m or len(m.group(1)) > 12:
        return None
    return int(m.group(1))


def node_dirs(entries: list[Path], limit: int = 4096) -> list[Path]:
    """The subdirectories among `entries` that hold dumps: jobs often give each node its own dump folder
    (TORCH_FR_DUMP_TEMP_FILE=/shared/fr/$HOSTNAME/rank_). A folder counts when one of its first 16 regular,
    visible files (by name) is a dump (a node's folder may hold its logs too); hidden folders and rank-NNNNN/
    (a run directory's) never do. At most `limit` folders."""
    out = []
    for d in entries:
        if d.name.startswith((".", "rank-")) or d.is_symlink() or not d.is_dir():
            continue
        try:
            with os.scandir(d) as it:
                names = sorted(e.name for e in it if not e.name.startswith(".") and e.is_file(follow_symlinks=False))
        except OSError:
            continue
        if any(sniff(d / n) for n in names[:16]):
            out.append(d)
            if len(out) >= limit:
                break
    return out


def dump_files(directory: Path, warnings: list[str] | None = None) -> dict[int, tuple[Path, str]]:
    """rank -> (file, "pickle" | "json") for every dump in `directory` and in its per-node subdirectories
    (`node_dirs`; one level). Where a rank has both, the pickle wins (only it carries stack frames); a rank
    found twice in one format keeps the first file by path, with a warning."""
    warn = warnings if warnings is not None else []
    found: dict[int, tuple[Path, str]] = {}
    try:
        entries = sorted(directory.iterdir())
        for d in node_dirs(entries):
            entries += sorted(d.iterdir())
    except OSError as exc:
        raise TraceError(f"{directory}: cannot list ({safe_io.short(exc)})") from None
    for entry in entries:
        if entry.name.startswith(".") or not safe_io.is_regular(entry):
            continue
        fmt = sniff(entry)
        if fmt is None:
            continue
        rank = rank_from_name(entry.name)
        if rank is None:
            warn.append(f"{entry}: looks like a Flight Recorder dump but its name carries no rank; skipped")
            continue
        if rank in found:
            old_path, old_fmt = found[rank]
            if old_fmt == "json" and fmt == "pickle":
                found[rank] = (entry, fmt)
            elif old_fmt == fmt:
                warn.append(f"{entry}: a second dump for rank {rank} (also {old_path.name}); using {old_path.name}")
            continue
        found[rank] = (entry, fmt)
    limit = max(8 * len(found), 4096)
    for rank in sorted(r for r in found if r >= limit or r > safe_io.MAX_RANK):
        warn.append(f"{found[rank][0]}: rank {rank} (from the file name) is far beyond the {len(found)} dumps here; "
                    "skipped")
        del found[rank]
    return found


class DumpBuffer:
    """One buffer that a load reads its pickled dumps into, one after the other.

    Why: `safe_io.read_bytes` makes a fresh bytes object per dump (0.4 MB at 2,000 entries), new pages
    to fault in for each of 1,024 dumps. This buffer grows to the largest dump and is reused. The
    unpickler copies what it keeps, so nothing of one dump outlives the read of the next."""

    __slots__ = ("_buf",)

    def __init__(self) -> None:
        self._buf = bytearray()

    def read(self, path: Path, limit: int) -> bytes | memoryview:
        """The file's content as `safe_io.read_bytes(path, limit)` gives it (the same checks and errors:
        where the read fails, or the file grew since it was opened, that function decides)."""
        with safe_io.open_regular(path, limit) as fh:
            size = os.fstat(fh.fileno()).st_size
            if len(self._buf) < size + 1:         # one byte more: a file that grew shows
                self._buf = bytearray(size + 1 + size // 8)   # a new one: views of the old may be alive
            view = memoryview(self._buf)[:size + 1]
            try:
                n = fh.readinto(view)
            except (OSError, MemoryError):
                n = None
        if n is None or n > size:
            return safe_io.read_bytes(path, limit)
        return view[:n]


def read_dump(path: Path, fmt: str | None = None, buffer: DumpBuffer | None = None) -> dict[str, Any]:
    """One dump as a dict. Pickles go through the restricted unpickler
    (UnsafePickleError for anything but plain data); TraceError if unreadable.
    `buffer`: read a pickle into it rather than into a new bytes object."""
    fmt = fmt or sniff(path)
    try:
        if buffer is not None and fmt != "json":
            data: bytes | memoryview = buffer.read(path, safe_io.DUMP_LIMIT)
        else:
            data = safe_io.read_bytes(path, safe_io.DUMP_LIMIT)
        # No walk over the entries (it would cost more than the parse): Entries.add
        # coerces every field it uses and is all-or-nothing per dump.
        dump = safe_io.loads(data, path, walk=False) if fmt == "json" else safe_loads(data, str(path))
        del data
        if isinstance(dump, dict) and "entries" not in dump and "version" in dump and "pg_config" in dump:
            dump["entries"] = []      # written without its (empty) entries: the rank recorded nothing
        if not isinstance(dump, dict) or not isinstance(dump.get("entries", None), list):
            raise TraceError(f"{path}: not a Flight Recorder dump (no 'entries' list)")
        safe_io.sanitize({k: v for k, v in dump.items() if k != "entries"}, path)   # pg_config, version, ...
    except safe_io.InputError as exc:
        raise TraceError(str(exc)) from None
    return dump


# --------------------------------------------------------------------------
# Field helpers (fr_entries.Entries uses them)
# --------------------------------------------------------------------------
def field_int(value: Any, default: int = -1) -> int:
    """An int64 from a dump field (None, junk, inf, 10**30 -> default)."""
    return safe_io.to_int(value, default)


def field_text(value: Any) -> str:
    """A dump's string field as a str, whatever the dump put there."""
    if type(value) is str:
        return value
    if value is None:
        return ""
    return safe_io.clean_text(value)[:200]     # "?" when too deep to print


# ncclscope's own runtime: a job run under `ncclscope run` has its wrappers' frames in every dump
_LIB_MARKERS = ("/torch/", "\\torch\\", "typing_extensions", "/site-packages/apex/", "/ncclscope/runtime/",
                "\\ncclscope\\runtime\\", "/ncclscope/run.py", "/ncclscope/__main__.py")
_STDLIB_RE = re.compile(r"[/\\]lib[/\\]python\d+(\.\d+)?[/\\](?!site-packages|dist-packages)")


@functools.lru_cache(maxsize=65536)
def _is_library(filename: str) -> bool:
    return (not filename or filename.startswith("<") or any(m in filename for m in _LIB_MARKERS)
            or bool(_STDLIB_RE.search(filename)))


def _short_path(filename: str) -> str:
    parts = re.split(r"[/\\]", filename)
    return "/".join(parts[-2:]) if filename.startswith(("/", "\\")) or ":" in filename[:3] else filename


CALLERS = 2     # user frames kept above the innermost one (as the run tracer keeps: ncclscope/sites.py)


def call_site(frames: Any) -> str:
    """file:line of the first frame (innermost first, as FR stores them) outside torch and the stdlib,
    then up to CALLERS user frames that called it (" < "-joined; installed packages end the chain)."""
    if not isinstance(frames, (list, tuple)):
        return ""
    out: list[str] = []
    for fr in frames:
        if isinstance(fr, dict):
            fn = fr.get("filename", "")
            fn = fn if type(fn) is str else field_text(fn)
            if not _is_library(fn):
                if out and _is_installed(fn):
                    break
                out.append(_site(fn, field_int(fr.get("line"), 0)))
                if len(out) > CALLERS:
                    break
    return sites.SEP.join(out)


def _is_installed(filename: str) -> bool:
    return "site-packages" in filename or "dist-packages" in filename


@functools.lru_cache(maxsize=65536)
def _site(filename: str, line: Any) -> str:
    return f"{_short_path(filename)}:{field_int(line, 0)}"


def object_array(values: Any) -> np.ndarray:
    """A 1-d object array of `values` (tuples stay elements, not rows)."""
    arr = np.empty(len(values), dtype=object)
    arr[:] = values
    return arr


def format_stack(frames: Any) -> str:
    """A Python-traceback-style rendering (outermost first) of FR frames."""
    if not isinstance(frames, (list, tuple)):
        return "  (no frames recorded)\n"
    lines = []
    for fr in reversed(frames):
        if isinstance(fr, dict):
            lines.append(f'  File "{field_text(fr.get("filename", "?"))}", line {field_int(fr.get("line"), 0)}, '
                         f'in {field_text(fr.get("name", "?"))}')
    return safe_io.clean_text("\n".join(lines) + "\n") if lines else "  (no frames recorded)\n"


def field_ints(values: list[Any] | tuple[Any, ...], default: int) -> np.ndarray:
    """Ints (None / junk -> default) as int64; fast when they are ints or None."""
    try:
        return np.array(values, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        pass
    try:
        with np.errstate(invalid="ignore"):     # inf / huge floats raise below and take the slow path
            return pd.array(list(values), dtype="Int64").fillna(default).to_numpy(np.int64)
    except (TypeError, ValueError, OverflowError):
        return np.array([field_int(v, default) for v in values], dtype=np.int64)


def factorize_texts(values: list[Any]) -> tuple[np.ndarray, list[str]]:
    """Codes and distinct strings of a list of str-ish values (None -> ""), each
    distinct string safe to write (no lone surrogates)."""
    arr = np.empty(len(values), dtype=object)
    arr[:] = values
    codes, uniq = pd.factorize(arr, use_na_sentinel=False)
    return codes.astype(np.int64), ["" if u is None else safe_io.clean_text(u) for u in uniq]


def size_text(sz: Any) -> str:
    """input_sizes as text (the key that groups identical shapes)."""
    if type(sz) is list:
        try:
            return str(sz)
        except (RecursionError, ValueError):
            return "?"
    try:
        return json.dumps(sz, default=str)
    except (ValueError, TypeError, RecursionError):   # a circular or exotic value
        return field_text(sz)


IO_SEP = " -> "        # "[[8]] -> [[16]]": an op's input shapes, then the output's where they say more
NO_OUTPUT = frozenset({"", "null", "[]", "None"})     # output texts of an op that recorded no output


def with_output(inputs: str, outputs: str, always: bool) -> str:
    """An op's sizes (or dtypes) text: the input's, then IO_SEP and the output's where the output was
    recorded and differs from the input, or where `always` (an op whose output is shaped by the group: an
    all_gather that equals its input is worth saying). Inputs and outputs both empty: nothing to compare."""
    if outputs in NO_OUTPUT or (not always and outputs == inputs) or inputs in ("", "null"):
        return inputs
    return f"{inputs}{IO_SEP}{outputs}"


def dtype_and_bytes(sz: Any, dt: tuple[Any, ...]) -> tuple[str, int]:
    names = [normalize_dtype(d) for d in dt if field_text(d)]
    items = [dtype_itemsize(x) for x in names]
    total = 0
    if isinstance(sz, (list, tuple)):
        for j, shape in enumerate(sz):
            if isinstance(shape, (list, tuple)):
                m = 1
                for d in shape:
                    m = min(m * max(field_int(d, 0), 0), 2**62)
                total = min(total + m * (items[j] if j < len(items) else (items[0] if items else 0)), 2**62)
    # a corrupt or hostile dump must not overflow the int64 column
    return ",".join(dict.fromkeys(names)), min(max(total, 0), 2**62)

