"""Profiler traces: finding them, reading them, and picking out the events that matter.

Files are read through `ncclscope.load.safe_io` (regular files only, a size
limit, a gzip stream read no further than that limit); every JSON parse goes
through its guarded parser (no NaN/Infinity, bounded depth, no lone
surrogates). A document whose `traceEvents` is not a list is read as having
no events.
"""
from __future__ import annotations

import gzip
import re
from pathlib import Path
from typing import Any, Iterator

from ncclscope.load import safe_io
from ncclscope.load.foreign.prof_links import Launches
from ncclscope.load.trace import TraceError

SNIFF_BYTES = 65536
UNKNOWN_GROUP = "unknown"
CUT_OFF = " cut off"      # a header key Kineto never writes: the file ends inside traceEvents

# Which events matter, decided from (cat, name) before anything is parsed.
C10D_P2P = {"c10d::send": "send", "c10d::recv_": "recv", "c10d::recv_any_source_": "recv"}
STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
_MB_RES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"^PP:(?P<stage>\d+)(?P<kind>[FBIW])(?P<mb>\d+)$"), "pp"),
    (re.compile(r"^(?P<kind>Forward|Backward) (?P<mb>\d+)$"), "gpipe"),
    (re.compile(r"(?i)^(?:.*[^a-z])?(?P<kind>forward|backward|fwd|bwd)[ _\-]?"
                r"(?:mb|microbatch|micro_batch|micro-batch)?[ _\-#]?(?P<mb>\d+)$"), "generic"),
]
_PP_KIND = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}
# libkineto's layout: each event a block from "\n  {" to "\n  }", its first key "ph" (X events, and every event
# of recent PyTorch) or "name" (libkineto's process_name / thread_name metadata, which come first)
_KINETO_LAYOUT = re.compile(rb'\[\s*\n  \{\n    "(?:ph|name)": "')


def microbatch_of(name: str) -> tuple[str, int, int] | None:
    """(compute op name, microbatch, stage) from an annotation name, else None."""
    for rx, style in _MB_RES:
        m = rx.match(name)
        if m:
            kind = m.group("kind")
            if style == "pp":
                return _PP_KIND[kind], safe_io.to_int(m.group("mb")), safe_io.to_int(m.group("stage"), -1, 0, 1 << 20)
            k = kind.lower()
            return ("forward" if k in ("forward", "fwd") else "backward"), safe_io.to_int(m.group("mb")), -1
    return None


def _interesting(cat: str, name: str) -> bool:
    if cat == "kernel":
        return name.startswith("nccl")
    if cat == "cpu_op":      # c10d calls and their record_param_comms: they say what an NCCL kernel was
        return name.startswith("c10d::") or name == "record_param_comms"
    return (name.startswith(("gloo:", "ProfilerStep#", "nccl:")) or microbatch_of(name) is not None)


# --------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------
def _head(path: Path) -> bytes:
    try:
        with safe_io.open_regular(path) as raw:
            if path.name.endswith(".gz"):
                with gzip.GzipFile(fileobj=raw, mode="rb") as fh:
                    return fh.read(SNIFF_BYTES)
            return raw.read(SNIFF_BYTES)
    except (OSError, EOFError, ValueError, gzip.BadGzipFile, safe_io.InputError):
        return b""


def sniff(path: Path) -> bool:
    """True when the file looks like a Chrome trace from torch.profiler."""
    if not (path.name.endswith(".json") or path.name.endswith(".json.gz")):
        return False
    head = _head(path)
    return head.lstrip().startswith(b"{") and (b'"traceEvents"' in head or b'"schemaVersion"' in head
                                               or b'"distributedInfo"' in head)


def trace_files(directory: Path) -> list[Path]:
    """The profiler traces in `directory` (regular files only, not recursive)."""
    try:
        entries = sorted(directory.iterdir())
    except OSError as exc:
        raise TraceError(f"{directory}: cannot list ({safe_io.short(exc)})") from None
    return [p for p in entries if not p.name.startswith(".") and safe_io.is_regular(p) and sniff(p)]


def read_trace_bytes(path: Path) -> bytes:
    """The (decompressed) trace; TraceError when it cannot be read or is over
    the size limit (a gzip bomb is cut at the limit, not inflated into memory)."""
    limit = safe_io.DUMP_LIMIT
    try:
        if not path.name.endswith(".gz"):
            return safe_io.read_bytes(path, limit)
        with safe_io.open_regular(path) as raw, gzip.GzipFile(fileobj=raw, mode="rb") as fh:
            data = fh.read(limit + 1)
    except safe_io.InputError as exc:
        raise TraceError(str(exc)) from None
    except (OSError, EOFError, ValueError, gzip.BadGzipFile, MemoryError) as exc:
        raise TraceError(f"{path}: unreadable ({safe_io.short(exc)})") from None
    if len(data) > limit:
        raise TraceError(f"{path}: decompresses to over {limit} bytes; not read")
    return data


_RANK_NAME_RES = [re.compile(r"(?i)rank[_\-]?(\d+)"), re.compile(r"(?:^|[^0-9])(\d{1,5})$")]


def rank_from_name(name: str) -> int | None:
    stem = name
    for suffix in (".gz", ".json", ".trace", ".pt"):
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
    for rx in _RANK_NAME_RES:
        m = rx.search(stem)
        if m:
            r = safe_io.to_int(m.group(1), -1, 0, safe_io.MAX_RANK)
            return r if r >= 0 else None
    return None


# --------------------------------------------------------------------------
# Event selection
# --------------------------------------------------------------------------
def header_and_events(text: bytes, path: Path) -> tuple[dict[str, Any], Iterator[dict[str, Any]], Launches]:
    """(top-level fields except traceEvents, the interesting X events, a lookup of kernel launch events by
    correlation id). The top-level fields are read before and after the events: older Kineto (PyTorch <= 2.4)
    writes baseTimeNanoseconds after them, on-demand traces their distributedInfo."""
    start = text.find(b'"traceEvents"')
    if start >= 0 and _KINETO_LAYOUT.search(text, start, start + 256):
        header = _fast_header(text, start)
        if header is not None:
            tail = _tail_fields(text, start)
            header = {**(tail if tail is not None else {CUT_OFF: True}), **header}
            return header, _fast_events(text, start), _fast_launches(text, start)
    try:
        doc = safe_io.loads(text, path, walk=False)     # the few events used are sanitized one by one
    except safe_io.InputError as exc:
        # A profiler killed mid-write leaves an unterminated array: keep what is complete, and say so.
        if start >= 0:
            header = {**(_fast_header(text, start) or {}), CUT_OFF: True}
            return header, _fast_events(text, start), _fast_launches(text, start)
        raise TraceError(str(exc)) from None
    if not isinstance(doc, dict):
        doc = {"traceEvents": doc} if isinstance(doc, list) else {}
    events = doc.pop("traceEvents", [])
    if not isinstance(events, list):    # {"traceEvents": 5}
        events = []
    try:
        safe_io.sanitize(doc, path)
    except safe_io.InputError as exc:
        raise TraceError(str(exc)) from None
    return doc, _selected(events), _listed_launches(events)


def _selected(events: list[Any]) -> Iterator[dict[str, Any]]:
    """The interesting X events of a parsed list, each checked by safe_io.sanitize."""
    for e in events:
        if (isinstance(e, dict) and e.get("ph") == "X"
                and _interesting(safe_io.clean_text(e.get("cat", "")), safe_io.clean_text(e.get("name", "")))):
            try:
                yield safe_io.sanitize(e)
            except safe_io.InputError:
                continue


_HEADER_KEYS = ("distributedInfo", "baseTimeNanoseconds", "deviceProperties", "host_name")


def _fast_header(text: bytes, start: int) -> dict[str, Any] | None:
    """Top-level fields: the text before "traceEvents", closed into an object."""
    head = text[:start].rstrip().rstrip(b",") + b"}"
    try:
        header = safe_io.loads(head)
    except safe_io.InputError:
        header = _known_keys(head)
    return header if isinstance(header, dict) else None


def _tail_fields(text: bytes, start: int) -> dict[str, Any] | None:
    """Top-level fields after the traceEvents array ("\n  ]," in Kineto's layout), opened into an object:
    only the tail is parsed, never the events again. None when the array is never closed (the file was cut
    off while being written)."""
    end = text.rfind(b"\n  ],", start)
    if end < 0 or not text.rstrip().endswith(b"}"):
        return None
    tail = b"{" + text[end + 5:]
    try:
        fields = safe_io.loads(tail)
    except safe_io.InputError:
        fields = _known_keys(tail)
    return fields if isinstance(fields, dict) else {}


def _known_keys(part: bytes) -> dict[str, Any]:
    """The fields the reader uses, each decoded on its own, from a part of the top level that does not parse
    whole (a hand-edited or cut file)."""
    found: dict[str, Any] = {}
    decoded = part.decode("utf-8", errors="replace")
    for key in _HEADER_KEYS:
        m = re.search(r'"%s":\s*' % key, decoded)
        if m:
            try:
                found[key] = safe_io.raw_decode(decoded, m.end())
            except safe_io.InputError:
                pass
    return found


# Kineto writes every event as "\n  {\n    ...\n  }" with "cat" just before "name", so
# the few events we need are found by plain substring search (C speed), and only they
# are parsed. Each needle is followed by the check of (cat, name) on the parsed event.
_NEEDLES = (b'"cat": "user_annotation"', b'"cat": "gpu_user_annotation"', b'"name": "nccl',
            b'"name": "record_param_comms"', b'"name": "c10d::')


def _fast_events(text: bytes, start: int) -> Iterator[dict[str, Any]]:
    starts: set[int] = set()
    for needle in _NEEDLES:
        find = text.find
        i = find(needle, start)
        while i >= 0:
            b = text.rfind(b"\n  {", start, i)
            if b >= 0:
                starts.add(b)
            i = find(needle, i + len(needle))
    for b in sorted(starts):
        e = text.find(b"\n  }", b + 4)
        if e < 0:
            continue
        try:
            ev = safe_io.loads(text[b + 1:e + 4])
        except safe_io.InputError:
            continue
        if isinstance(ev, dict) and ev.get("ph") == "X" and _interesting(str(ev.get("cat", "")), str(ev.get("name", ""))):
            yield ev


# Kernel launches (cudaLaunchKernel, cuLaunchKernelEx, ...) are as many as kernels: they are looked up only for
# the NCCL kernels whose External id does not say which CPU op launched them (prof_links.py), by correlation id.
_LAUNCH_NEEDLES = (b'"cat": "cuda_runtime"', b'"cat": "cuda_driver"')
_CORRELATION = re.compile(rb'"correlation": (\d{1,18})\b')
_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")


def _fast_launches(text: bytes, start: int) -> Launches:
    def launches(wanted: set[int]) -> dict[int, dict[str, Any]]:
        found: dict[int, dict[str, Any]] = {}
        for needle in _LAUNCH_NEEDLES:
            i = text.find(needle, start)
            while i >= 0 and len(found) < len(wanted):
                b, e = text.rfind(b"\n  {", start, i), text.find(b"\n  }", i)
                if e < 0:
                    break
                m = _CORRELATION.search(text, i, e)
                if b >= 0 and m and int(m.group(1)) in wanted:
                    try:
                        ev = safe_io.loads(text[b + 1:e + 4])
                    except safe_io.InputError:
                        ev = None
                    if isinstance(ev, dict):
                        found.setdefault(int(m.group(1)), ev)
                i = text.find(needle, e)
        return found
    return launches


def _listed_launches(events: list[Any]) -> Launches:
    def launches(wanted: set[int]) -> dict[int, dict[str, Any]]:
        found: dict[int, dict[str, Any]] = {}
        for e in events:
            if isinstance(e, dict) and e.get("cat") in _LAUNCH_CATS and isinstance(e.get("args"), dict):
                corr = safe_io.to_int(e["args"].get("correlation"), -1, 0, 2**62)
                if corr in wanted and corr not in found:
                    try:
                        found[corr] = safe_io.sanitize(e)
                    except safe_io.InputError:
                        continue
        return found
    return launches
