"""Flight Recorder dumps: finding them, reading them, and reducing their entries to columns.

Every file goes through `ncclscope.safe_io` (regular files only, size limit);
a pickle through the restricted unpickler, JSON through the guarded parser,
and either is then checked for depth and lone surrogates (`safe_io.sanitize`).
`Entries.add` reduces one dump's entries to arrays, coercing every field to
the type it should have (a hostile `state: []` becomes a string, a 10**30
time a default), and adds nothing when a dump fails part-way.
"""
from __future__ import annotations

import functools
import json
import operator
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from .. import safe_io
from .errors import TraceError
from .safe_pickle import safe_loads
from .vocab import dtype_itemsize, normalize_dtype

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
    if text.startswith(b"{") and b'"entries"' in head and b'"traceEvents"' not in head:
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


def dump_files(directory: Path, warnings: list[str] | None = None) -> dict[int, tuple[Path, str]]:
    """rank -> (file, "pickle" | "json") for every dump in `directory` (not recursive).
    Where a rank has both, the pickle wins (only it carries stack frames)."""
    warn = warnings if warnings is not None else []
    found: dict[int, tuple[Path, str]] = {}
    try:
        entries = sorted(directory.iterdir())
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


def read_dump(path: Path, fmt: str | None = None) -> dict[str, Any]:
    """One dump as a dict. Pickles go through the restricted unpickler
    (UnsafePickleError for anything but plain data); TraceError if unreadable."""
    fmt = fmt or sniff(path)
    try:
        data = safe_io.read_bytes(path, safe_io.DUMP_LIMIT)
        # No walk over the entries (it would cost more than the parse): Entries.add
        # coerces every field it uses and is all-or-nothing per dump.
        dump = safe_io.loads(data, path, walk=False) if fmt == "json" else safe_loads(data, str(path))
        del data
        if not isinstance(dump, dict) or not isinstance(dump.get("entries", None), list):
            raise TraceError(f"{path}: not a Flight Recorder dump (no 'entries' list)")
        safe_io.sanitize({k: v for k, v in dump.items() if k != "entries"}, path)   # pg_config, version, ...
    except safe_io.InputError as exc:
        raise TraceError(str(exc)) from None
    return dump


# --------------------------------------------------------------------------
# Entries -> columns
# --------------------------------------------------------------------------
def _int(value: Any, default: int = -1) -> int:
    """An int64 from a dump field (None, junk, inf, 10**30 -> default)."""
    return safe_io.to_int(value, default)


def _text(value: Any) -> str:
    """A dump's string field as a str, whatever the dump put there."""
    if type(value) is str:
        return value
    if value is None:
        return ""
    return safe_io.clean_text(value)[:200]     # "?" when too deep to print


_LIB_MARKERS = ("/torch/", "\\torch\\", "typing_extensions", "/site-packages/apex/")
_STDLIB_RE = re.compile(r"[/\\]lib[/\\]python\d+(\.\d+)?[/\\](?!site-packages|dist-packages)")


@functools.lru_cache(maxsize=65536)
def _is_library(filename: str) -> bool:
    return (not filename or filename.startswith("<") or any(m in filename for m in _LIB_MARKERS)
            or bool(_STDLIB_RE.search(filename)))


def _short_path(filename: str) -> str:
    parts = re.split(r"[/\\]", filename)
    return "/".join(parts[-2:]) if filename.startswith(("/", "\\")) or ":" in filename[:3] else filename


def call_site(frames: Any) -> str:
    """file:line of the first frame (innermost first, as FR stores them) outside torch and the stdlib."""
    if not isinstance(frames, (list, tuple)):
        return ""
    for fr in frames:
        if isinstance(fr, dict):
            fn = fr.get("filename", "")
            fn = fn if type(fn) is str else _text(fn)
            if not _is_library(fn):
                return _site(fn, _int(fr.get("line"), 0))
    return ""


@functools.lru_cache(maxsize=65536)
def _site(filename: str, line: Any) -> str:
    return f"{_short_path(filename)}:{_int(line, 0)}"


def _call_sites(all_frames: Any) -> list[str]:
    """call_site of each entry's frames; once per frames object (a dump that shares one stack
    list between entries, or repeats a stack object, costs one walk per distinct object)."""
    seen: dict[int, str] = {}
    out = []
    for f in all_frames:
        k = id(f)
        site = seen.get(k)
        if site is None:
            site = seen[k] = call_site(f)
        out.append(site)
    return out


def _objects(values: Any) -> np.ndarray:
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
            lines.append(f'  File "{_text(fr.get("filename", "?"))}", line {_int(fr.get("line"), 0)}, '
                         f'in {_text(fr.get("name", "?"))}')
    return safe_io.clean_text("\n".join(lines) + "\n") if lines else "  (no frames recorded)\n"


def _ints(values: list[Any] | tuple[Any, ...], default: int) -> np.ndarray:
    """Ints (None / junk -> default) as int64; fast when they are ints or None."""
    try:
        return np.array(values, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        pass
    try:
        return pd.array(list(values), dtype="Int64").fillna(default).to_numpy(np.int64)
    except (TypeError, ValueError, OverflowError):
        return np.array([_int(v, default) for v in values], dtype=np.int64)


_KEYS = ("record_id", "process_group", "collective_seq_id", "p2p_seq_id", "profiling_name", "input_sizes",
         "input_dtypes", "state", "time_created_ns", "time_discovered_started_ns", "time_discovered_completed_ns",
         "timeout_ms", "is_p2p", "thread_id", "frames")
_GET_ALL = operator.itemgetter(*_KEYS)


def _rows(entries: list[Any]) -> list[tuple[Any, ...]]:
    """One tuple of _KEYS values per entry: one C call each when every key is there
    (format 2.x as torch writes it), else a tolerant per-key path (older versions)."""
    try:
        return [_GET_ALL(e) for e in entries]
    except (KeyError, TypeError):
        out = []
        for e in entries:
            if isinstance(e, dict):
                row = [e.get(k) for k in _KEYS]
                if row[2] is None:
                    row[2] = e.get("seq_id")
                out.append(tuple(row))
        return out


def _factorize(values: list[Any]) -> tuple[np.ndarray, list[str]]:
    """Codes and distinct strings of a list of str-ish values (None -> ""), each
    distinct string safe to write (no lone surrogates)."""
    arr = np.empty(len(values), dtype=object)
    arr[:] = values
    codes, uniq = pd.factorize(arr, use_na_sentinel=False)
    return codes.astype(np.int64), ["" if u is None else safe_io.clean_text(u) for u in uniq]


_CODED = ("pg_name", "pg_desc", "pname", "state", "thread", "site", "size_text", "dtype_text")


class Entries:
    """All entries of all ranks as columns: numbers as int64 arrays, strings as
    codes into small tables (a job has few distinct group names, op names,
    states, threads, call sites, shapes), no pandas string columns (they are
    what would make a million-entry load slow).

    Dumps are added one at a time (`add`) and reduced right away: one C-level
    tuple per entry, one transpose, call site and payload size worked out, and
    the stack frames kept only for entries that had not completed (the stacks
    a person reads). So peak memory is one unpickled dump plus compact arrays,
    not every dump's objects at once."""

    def __init__(self) -> None:
        self._parts: dict[str, list[Any]] = {k: [] for k in (
            "rank", "record_id", "cseq", "created", "started", "completed_ns", "timeout_ms", "is_p2p", "pg_name",
            "pg_desc", "pname", "state", "thread", "site", "size_text", "dtype_text", "nbytes")}
        self.frames: dict[tuple[int, int], Any] = {}     # (rank, record_id) -> frames, unfinished entries only
        self._bytes_cache: dict[tuple[str, str], tuple[str, int]] = {}
        # string fields are coded per dump as it is added (codes into one table per field, in order of first
        # appearance over all dumps, as one factorize of everything would number them): what stays between
        # dumps is int codes, not millions of str objects (1,024 dumps x 2,000 entries: ~1 GB of them)
        self._tables: dict[str, dict[Any, int]] = {k: {} for k in _CODED}

    def add(self, rank: int, entries: list[Any]) -> None:
        """Reduce one rank's entries. All or nothing: a dump that fails part-way
        (an exception from a hostile field) adds no row, so the columns of the
        other ranks stay aligned; the caller reports it."""
        rows = _rows(entries)
        n = len(rows)
        if not n:
            return
        c = dict(zip(_KEYS, zip(*rows)))
        del rows
        pgs = c["process_group"]
        try:
            pg_name, pg_desc = zip(*pgs)
            if len(pg_name) != n:
                raise ValueError
        except (TypeError, ValueError):
            fixed = [pg if isinstance(pg, (list, tuple)) and len(pg) >= 2 else (_text(pg), "") for pg in pgs]
            pg_name, pg_desc = tuple(p[0] for p in fixed), tuple(p[1] for p in fixed)
        new: dict[str, list[Any]] = {k: [] for k in self._parts}
        new["rank"].append(np.full(n, rank, np.int64))
        record = _ints(c["record_id"], -1)
        new["record_id"].append(record)
        new["cseq"].append(_ints(c["collective_seq_id"], -1))
        new["created"].append(_ints(c["time_created_ns"], -1))   # -1: no time (the analyses then say none)
        new["started"].append(_ints(c["time_discovered_started_ns"], 0))
        new["completed_ns"].append(_ints(c["time_discovered_completed_ns"], 0))
        new["timeout_ms"].append(_ints(c["timeout_ms"], -1))
        flags = c["is_p2p"]
        try:
            plain = {type(v) for v in set(flags)} <= {bool, type(None)}      # as torch writes it
        except TypeError:                                                  # an unhashable flag
            plain = False
        new["is_p2p"].append(_objects(flags).astype(bool) if plain else
                             np.array([bool(v) for v in flags], dtype=bool))
        states = _texts(c["state"])
        for key, values in (("pg_name", pg_name), ("pg_desc", pg_desc), ("pname", c["profiling_name"]),
                            ("state", states), ("thread", c["thread_id"])):
            new[key].extend(_texts(values))
        new["site"].extend(_call_sites(c["frames"]))
        texts = [_size_text(sz) for sz in c["input_sizes"]]
        # bytes and dtypes once per distinct (sizes text, dtypes) pair, not once per entry
        dts = c["input_dtypes"]
        dkeys = [tuple(dt) if type(dt) is list else dt for dt in dts]
        try:
            pair_code, pairs = pd.factorize(_objects(list(zip(texts, dkeys))))
            n_pairs = len(pairs)
        except (TypeError, ValueError):            # an unhashable dtype field: one key per entry
            pair_code, n_pairs = np.arange(n), n
        cache = self._bytes_cache
        firsts = np.full(n_pairs, -1, np.int64)
        firsts[pair_code[::-1]] = np.arange(n - 1, -1, -1)          # first entry of each distinct pair
        hits = []
        for i in firsts.tolist():
            text, sz, dt = texts[i], c["input_sizes"][i], dts[i]
            key = (text, _text(dt) if not isinstance(dt, (list, tuple)) else _size_text(dt))
            hit = cache.get(key)
            if hit is None:
                hit = cache[key] = _dtype_and_bytes(sz, tuple(dt) if isinstance(dt, (list, tuple)) else (dt,))
            hits.append(hit)
        dtypes_out = np.array([h[0] for h in hits], dtype=object)[pair_code].tolist()
        nbytes = np.array([h[1] for h in hits], dtype=np.int64)[pair_code]
        new["size_text"].extend(texts)
        new["dtype_text"].extend(dtypes_out)
        new["nbytes"].append(nbytes)
        frames = {}
        pending = np.flatnonzero(_objects(states) != "completed")       # the frames kept: unfinished entries only
        all_frames = c["frames"]
        for i in pending.tolist():
            fr = all_frames[i]
            if fr:
                frames[(rank, int(record[i]))] = fr
        local = {key: pd.factorize(_objects(new[key]), use_na_sentinel=False) for key in _CODED}
        for key, values in new.items():     # nothing failed: commit
            if key in local:
                codes, uniq = local[key]
                table = self._tables[key]
                lut = np.array([table.setdefault(u, len(table)) for u in uniq], dtype=np.int64)
                self._parts[key].append(lut[codes] if len(codes) else np.zeros(0, np.int64))
            else:
                self._parts[key].extend(values)
        self.frames.update(frames)

    def finish(self) -> "Entries":
        parts = self._parts
        self.n = sum(len(a) for a in parts["rank"])

        def cat(key: str, dtype: Any) -> np.ndarray:
            return np.concatenate(parts[key]) if parts[key] else np.zeros(0, dtype)

        self.rank, self.record_id, self.cseq = cat("rank", np.int64), cat("record_id", np.int64), cat("cseq", np.int64)
        self.created, self.started = cat("created", np.int64), cat("started", np.int64)
        self.completed_ns, self.timeout_ms = cat("completed_ns", np.int64), cat("timeout_ms", np.int64)
        self.is_p2p, self.nbytes = cat("is_p2p", bool), cat("nbytes", np.int64)
        def codes(key: str) -> tuple[np.ndarray, list[str]]:
            table = ["" if u is None else safe_io.clean_text(u) for u in self._tables[key]]
            return cat(key, np.int64), table

        self.pg_code, self.pg_names = codes("pg_name")
        self.desc_code, self.descs = codes("pg_desc")
        self.pn_code, self.pnames = codes("pname")
        self.state_code, self.states = codes("state")
        self.thread_code, self.threads = codes("thread")
        self.site_code, self.sites = codes("site")
        self.size_code, self.size_texts = codes("size_text")
        self.dtype_code, self.dtype_texts = codes("dtype_text")
        self._tables = {}
        self._parts = {}
        return self


def _texts(values: Any) -> Any:
    """The values as they are when they are str / int / None (what _factorize
    handles at C speed), else each coerced to a str."""
    try:
        kinds = {type(v) for v in set(values)}
    except TypeError:          # unhashable: a list or dict where a name should be
        kinds = {list}
    if kinds <= {str, int, type(None)}:
        return values
    return tuple(_text(v) if not isinstance(v, (str, int)) or isinstance(v, bool) else v for v in values)


def _size_text(sz: Any) -> str:
    """input_sizes as text (the key that groups identical shapes)."""
    if type(sz) is list:
        try:
            return str(sz)
        except (RecursionError, ValueError):
            return "?"
    try:
        return json.dumps(sz, default=str)
    except (ValueError, TypeError, RecursionError):   # a circular or exotic value
        return _text(sz)


def _dtype_and_bytes(sz: Any, dt: tuple[Any, ...]) -> tuple[str, int]:
    names = [normalize_dtype(d) for d in dt if _text(d)]
    items = [dtype_itemsize(x) for x in names]
    total = 0
    if isinstance(sz, (list, tuple)):
        for j, shape in enumerate(sz):
            if isinstance(shape, (list, tuple)):
                m = 1
                for d in shape:
                    m = min(m * max(_int(d, 0), 0), 2**62)
                total = min(total + m * (items[j] if j < len(items) else (items[0] if items else 0)), 2**62)
    # a corrupt or hostile dump must not overflow the int64 column
    return ",".join(dict.fromkeys(names)), min(max(total, 0), 2**62)

