"""NCCL Inspector output (the profiler plugin of NCCL 2.28-2.30) read into one record table.

    ncclscope analyze nccl-inspector-<jobid>/    # <hostname>-pid<pid>.log, one file per process

What the plugin writes (plugins/profiler/inspector in NVIDIA/nccl, JSON mode, the default): one file
per process, one compact JSON object per line and per *completed* operation (format "v4.0"):

  header    id         the communicator's hash, printf "0x%lx" cut to 14 hex digits
            comm_name  the name the application gave the communicator (2.29+; "unknown" when none)
            rank       the rank *in that communicator*, n_ranks, nnodes
  metadata  inspector_output_format_version, git_rev, rec_mechanism, hostname, pid,
            dump_timestamp_us (when the line was written, not when the op ran)
  coll_perf coll (AllReduce, AllGather, ReduceScatter, Broadcast, Reduce, All2All, AllGatherV),
            coll_sn (NCCL's sequence number, counted per communicator *and per function*, from 0),
            coll_msg_size_bytes, coll_exec_time_us (the longest kernel channel; GPU clock when
            coll_timing_source is kernel_gpu), coll_timing_source, coll_algobw_gbs, coll_busbw_gbs;
            with NCCL_INSPECTOR_DUMP_VERBOSE=1 also event_trace_sn / event_trace_ts (coll_start_ts,
            coll_stop_ts, and kernel_events: per channel kernel_start_ts / kernel_stop_ts /
            kernel_record_ts, each gettimeofday microseconds of the writing host)
  p2p_perf  p2p (Send, Recv), p2p_sn (this rank's own p2p counter on the communicator), p2p_peer (the
            peer's rank in the communicator), p2p_msg_size_bytes, p2p_exec_time_us, ... as above

Format v4.3 moves header and metadata out of the op lines: each communicator's dump starts with a
`dump_stats` marker (header, metadata, coll_records / p2p_records / proxy_records, and the ring's
*_dropped_total counts), and the lines after it are bare `{"coll_perf": ...}` / `{"p2p_perf": ...}` /
`{"proxy_trace": ...}` objects that belong to it. So the reader keeps, per file, the last marker's
context; a bare op line with no marker before it is skipped (it would otherwise be read as a rank it
is not). Records the ring overwrote before a dump (`*_dropped_total`) are named in one warning: a gap
in a rank's sequence there is the plugin's loss, not the rank's absence.

No dtype is recorded (the plugin turns count and dtype into bytes). A double the plugin prints with
"%lf" can be "inf", which is not JSON: such a value reads as null ("nan" it prints quoted). A line
that is not a record (torn at the end of a killed process, or garbage) is skipped; each file says in
one warning how many and where the first was. `proxy_trace` lines (CPU proxy timing) are not read.

Prometheus mode (NCCL_INSPECTOR_PROM_DUMP=1) writes nccl_inspector_metrics_<gpu uuid>.prom instead:
per (node, GPU, comm_name, collective, message-size bucket, algo_proto) the mean execution time and
the geometric-mean bus bandwidth of the last interval. No rank, no sequence number, no time: nothing
to align across ranks, so `prom_summary` only recognises and sizes it (see docs/ingest.md).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from ncclscope.load import safe_io

SNIFF_BYTES = 65536
KNOWN_MAJOR = "4"
_INF = re.compile(rb'(?<=[:\[,])\s*-?inf\b')
_PROM_LINE = re.compile(r'^(nccl_[a-z_]+)\{(.*)\}\s+(\S+)\s*$')
_PROM_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
PROM_METRICS = ("nccl_bus_bandwidth_gbs", "nccl_collective_exec_time_microseconds", "nccl_p2p_bus_bandwidth_gbs",
                "nccl_p2p_exec_time_microseconds")

COLUMNS = ("file", "line", "host", "pid", "comm", "comm_name", "comm_rank", "n_ranks", "p2p", "func", "sn", "peer",
           "bytes", "exec_us", "timing", "algobw_gbs", "busbw_gbs", "dump_us", "start_us", "end_us", "channels")


def sniff_head(head: bytes) -> str | None:
    """"inspector" (JSON lines) or "inspector_prom" when the first bytes of a file are Inspector output."""
    text = head.lstrip()
    if text.startswith(b"{") and b'"header"' in head and b'"inspector_output_format_version"' in head and (
            b'"coll_perf"' in head or b'"p2p_perf"' in head or b'"dump_stats"' in head):
        return "inspector"
    if any(text.startswith(m.encode() + b"{") for m in PROM_METRICS):
        return "inspector_prom"
    return None


@dataclass
class InspectorRead:
    """Every readable record of the files given, and what could not be read."""

    records: pd.DataFrame                                   # one row per record, COLUMNS
    files: list[Path] = field(default_factory=list)          # the files that held at least one record
    versions: set[str] = field(default_factory=set)
    warnings: list[str] = field(default_factory=list)
    dropped: dict[tuple[str, int, str], int] = field(default_factory=dict)   # (host, pid, comm) -> ring losses


def read_inspector(paths: list[Path]) -> InspectorRead:
    """Read Inspector JSON files; a file or a line that cannot be read costs only itself (one warning)."""
    rows: list[tuple[Any, ...]] = []
    out = InspectorRead(records=pd.DataFrame(columns=list(COLUMNS)))
    for path in paths:
        try:
            data = safe_io.read_bytes(path, safe_io.DUMP_LIMIT)
        except safe_io.InputError as exc:
            out.warnings.append(f"{exc}; its NCCL Inspector records are not read")
            continue
        n = len(rows)
        _read_lines(path, data, rows, out)
        if len(rows) > n:
            out.files.append(path)
    if rows:
        out.records = pd.DataFrame(rows, columns=list(COLUMNS))
    _drop_warning(out)
    return out


def _read_lines(path: Path, data: bytes, rows: list[tuple[Any, ...]], out: InspectorRead) -> None:
    """Each line one record (v4.3: a marker sets the context of the op lines after it); the skipped
    ones are counted and the first named in one warning."""
    bad, first_bad = 0, ""
    context: tuple[dict[str, Any], dict[str, Any]] | None = None
    for no, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        obj, why = _object(path, no, raw)
        if obj is not None and isinstance(obj.get("dump_stats"), dict):
            context = _marker(obj, out)
            why = "" if context is not None else "a dump_stats marker with no header or metadata"
            if context is not None:
                continue
        elif obj is not None and "proxy_trace" in obj:
            continue
        row = None
        if obj is not None:
            row, why = _record(path, no, obj, context, out.versions)
        if row is None:
            bad += 1
            first_bad = first_bad or f"line {no} ({why})"
            continue
        rows.append(row)
    if bad:
        more = f" and {bad - 1} more" if bad > 1 else ""
        out.warnings.append(f"{path}: {first_bad}{more} not an NCCL Inspector record; skipped, the rest read")


def _object(path: Path, no: int, raw: bytes) -> tuple[dict[str, Any] | None, str]:
    """One line as a JSON object, or (None, why not)."""
    try:
        obj = safe_io.loads(raw, f"{path}:{no}", walk=False)
    except safe_io.InputError:
        if not _INF.search(raw):
            return None, "not JSON: cut off or garbage"
        try:        # the plugin prints an infinite bandwidth as inf (printf "%lf"): read it as null
            obj = safe_io.loads(_INF.sub(b"null", raw), f"{path}:{no}", walk=False)
        except safe_io.InputError:
            return None, "not JSON: cut off or garbage"
    return (obj, "") if isinstance(obj, dict) else (None, "not a JSON object")


def _marker(obj: dict[str, Any], out: InspectorRead) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """A v4.3 `dump_stats` marker: the (header, metadata) of the op lines after it; its ring losses
    counted per (host, pid, communicator), the cumulative total kept (never summed across markers)."""
    head, meta, stats = obj.get("header"), obj.get("metadata"), obj["dump_stats"]
    if not (isinstance(head, dict) and isinstance(meta, dict)):
        return None
    key = (_text(meta.get("hostname"), 256), _int(meta.get("pid")), _text(head.get("id"), 24).lower())
    lost = sum(max(_int(stats.get(k), 0), 0) for k in ("coll_dropped_total", "p2p_dropped_total"))
    if lost:
        out.dropped[key] = max(out.dropped.get(key, 0), lost)
    return head, meta


def _drop_warning(out: InspectorRead) -> None:
    """One line for every record the plugin's rings overwrote before they were written."""
    if not out.dropped:
        return
    (host, pid, comm), n = max(out.dropped.items(), key=lambda kv: kv[1])
    out.warnings.append(f"NCCL Inspector dropped {sum(out.dropped.values())} record(s) before writing them (ring "
                        f"overflow; most: {n} of communicator {comm} in process {pid} on {host}): a gap in a rank's "
                        "sequence there is the plugin's loss, not the rank's absence")


def _record(path: Path, no: int, obj: dict[str, Any], context: tuple[dict[str, Any], dict[str, Any]] | None,
            versions: set[str]) -> tuple[tuple[Any, ...] | None, str]:
    """One op object -> a row of COLUMNS, or (None, why not). Its own header and metadata (v4.0-4.2)
    win over the marker's (v4.3)."""
    head, meta = obj.get("header"), obj.get("metadata")
    if head is None and meta is None and context is not None:
        head, meta = context
    perf = obj.get("coll_perf") if isinstance(obj.get("coll_perf"), dict) else obj.get("p2p_perf")
    if not isinstance(perf, dict):
        return None, "no coll_perf / p2p_perf"
    if not (isinstance(head, dict) and isinstance(meta, dict)):
        return None, "no header and metadata (and no dump_stats marker before it)"
    p2p = "p2p" in perf and "coll" not in perf
    pre = "p2p" if p2p else "coll"
    comm = _text(head.get("id"), 24).lower()
    rank, n_ranks = _int(head.get("rank")), _int(head.get("n_ranks"))
    sn, host, pid = _int(perf.get(f"{pre}_sn")), _text(meta.get("hostname"), 256), _int(meta.get("pid"))
    if not comm or not 0 <= rank < n_ranks <= safe_io.MAX_RANK or sn < 0 or pid < 0:
        return None, "no communicator, rank, sequence number or pid"
    versions.add(_text(meta.get("inspector_output_format_version"), 16))
    start, end, channels = _event_times(perf, pre)
    row = (str(path), no, host, pid, comm, _text(head.get("comm_name"), 256), rank, n_ranks, p2p,
           _text(perf.get(pre), 32), sn, _int(perf.get("p2p_peer")) if p2p else -1,
           max(_int(perf.get(f"{pre}_msg_size_bytes"), 0), 0), max(_int(perf.get(f"{pre}_exec_time_us"), 0), 0),
           _text(perf.get(f"{pre}_timing_source"), 32), _float(perf.get(f"{pre}_algobw_gbs")),
           _float(perf.get(f"{pre}_busbw_gbs")), _int(meta.get("dump_timestamp_us")), start, end, channels)
    return row, ""


def _event_times(perf: dict[str, Any], pre: str) -> tuple[int, int, int]:
    """(start, end, channels) in host microseconds from the verbose event trace; -1 where absent.

    The start is the earliest kernel channel start the host saw (the GPU began this op on this rank:
    a rank whose GPU is late arrives late here, whatever its CPU did), else the op's own start (when it
    was enqueued); the end the latest kernel channel stop, else -1 (then start + exec time is used)."""
    ts = perf.get("event_trace_ts")
    if not isinstance(ts, dict):
        return -1, -1, 0
    kernels = ts.get("kernel_events") if isinstance(ts.get("kernel_events"), list) else []
    starts = [_int(k.get("kernel_start_ts")) for k in kernels if isinstance(k, dict)]
    stops = [_int(k.get("kernel_stop_ts")) for k in kernels if isinstance(k, dict)]
    starts, stops = [t for t in starts if t > 0], [t for t in stops if t > 0]
    start = min(starts) if starts else _int(ts.get(f"{pre}_start_ts"))
    end = max(stops) if stops and start > 0 and max(stops) >= start else -1
    return (start if start > 0 else -1), end, len(kernels)


def _int(value: Any, default: int = -1) -> int:
    return safe_io.trace_int(value, default)


def _float(value: Any) -> float:
    return safe_io.to_float(value, float("nan"))


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _text(value: Any, limit: int) -> str:
    """A name from the file: bounded, no lone surrogate, no control character (U+FFFD instead)."""
    return _CONTROL.sub("\ufffd", safe_io.clean_text(value)[:limit]) if isinstance(value, str) else ""


# --------------------------------------------------------------------------
# Prometheus mode
# --------------------------------------------------------------------------
@dataclass
class PromSummary:
    """What a set of Inspector Prometheus files holds: series per metric, the GPUs and communicators."""

    series: int = 0
    gpus: set[tuple[str, str]] = field(default_factory=set)      # (node, gpu)
    comms: set[str] = field(default_factory=set)
    warnings: list[str] = field(default_factory=list)

    def words(self) -> str:
        return (f"{self.series} NCCL Inspector Prometheus series from {len(self.gpus)} GPU(s) on "
                f"{len(self.comms)} communicator(s)")


def prom_summary(paths: list[Path]) -> PromSummary:
    """Count the series of Inspector Prometheus files (each line `metric{labels} value`); a line that is
    none is counted and named once per file."""
    out = PromSummary()
    for path in paths:
        try:
            text = safe_io.read_text(path, safe_io.JSON_LIMIT)
        except safe_io.InputError as exc:
            out.warnings.append(f"{exc}; not read")
            continue
        bad = [no for no, line in enumerate(text.splitlines(), 1) if line.strip() and not line.startswith("#")
               and not _prom_line(line, out)]
        if bad:
            out.warnings.append(f"{path}: line {bad[0]}{f' and {len(bad) - 1} more' if len(bad) > 1 else ''} "
                                "not a Prometheus sample; skipped")
    return out


def _prom_line(line: str, out: PromSummary) -> bool:
    m = _PROM_LINE.match(line.strip())
    if not m or m.group(1) not in PROM_METRICS or math.isnan(safe_io.to_float(m.group(3), float("nan"))):
        return False
    labels = dict(_PROM_LABEL.findall(m.group(2)))
    out.series += 1
    out.gpus.add((labels.get("node", "?")[:256], labels.get("gpu", "?")[:32]))
    out.comms.add(labels.get("comm_name", "?")[:256])
    return True
