"""The torch debug server's periodic dumps (`torch.distributed.debug.start_debug_server(dump_dir=...)`).

    ncclscope analyze debug_dumps/          # stacks_20251206_101500.txt, fr_trace_20251206_101500.txt, ...

What the server writes (torch/distributed/debug/_frontend.py `PeriodicDumper`, _debug_handlers.py):
every `dump_interval` seconds, rank 0's frontend asks every rank's worker and writes one file per
handler, `<handler>_<%Y%m%d_%H%M%S>.txt` in local time:

- `stacks_*`: for each rank `=== Rank <i>: <worker url> ===` and that worker's `dump_traceback`
  answer (faulthandler's all-thread dump), or `Error: <HTTP status>` when the worker did not answer;
  newer versions start with `PARTIAL DATA: k/n workers responded` and a line per silent rank.
- `fr_trace_*`: Flight Recorder's *analysis* of the dumps (torch's fr_trace tables: groups,
  memberships, collectives, NCCL calls) as plain text, not the dumps. Its table columns hold Python
  reprs with spaces, so it is recognised, not parsed: Flight Recorder dumps saved beside it
  (TORCH_FR_DUMP_TEMP_FILE pointed at the same folder) are read by the Flight Recorder reader.
- `pyspy_dump_*`, `wait_counters_*`, `tcpstore_*`: recognised, not read.

Stacks become each rank's `Trace.stacks` in ncclscope's own stacks.txt form (one
`=== ncclscope rank <r>: ... at <ns> ns ===` header per dump, then the dump), so the stack
excerpts the verdict quotes read them as they read a run directory's. Only the newest
`MAX_DUMPS` stacks files are kept (a job dumps every minute for days). A rank that did not answer
is one warning line per file: the server could not reach its worker, which is evidence, not proof,
that it is stuck with the GIL held or gone.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from ncclscope.load import safe_io

NAME = re.compile(r"^(stacks|fr_trace|pyspy_dump|wait_counters|tcpstore|torchcomms_fr_trace)_(\d{8}_\d{6})\.txt$")
_SECTION = re.compile(r"^=== Rank (\d+): (.*) ===\s*$", re.M)
MAX_DUMPS = 4


def debug_kind(path: Path) -> str | None:
    """The handler that wrote `path` ("stacks", "fr_trace", ...) from its name, else None; a stacks
    file must also hold a `=== Rank N: ... ===` section (a user's own stacks_x.txt is not ours)."""
    m = NAME.match(path.name)
    if not m:
        return None
    if m.group(1) != "stacks":
        return m.group(1)
    try:
        with safe_io.open_regular(path) as fh:
            head = fh.read(65536)
    except (OSError, safe_io.InputError):
        return None
    return "stacks" if _SECTION.search(head.decode("utf-8", "replace")) else None


@dataclass
class DebugDumps:
    """Per rank, its stacks in stacks.txt form; the files read; what could not be used."""

    stacks: dict[int, str] = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def read_debug_dumps(paths: list[Path], world: int) -> DebugDumps:
    """The newest stacks files' sections, per rank below `world` (0: any plausible rank)."""
    out = DebugDumps()
    by_kind: dict[str, list[Path]] = {}
    for p in paths:
        kind = debug_kind(p)
        if kind:
            by_kind.setdefault(kind, []).append(p)
    for p in sorted(by_kind.get("stacks", []), key=lambda q: q.name)[-MAX_DUMPS:]:
        _stacks_file(p, world, out)
    tables = by_kind.get("fr_trace", []) + by_kind.get("torchcomms_fr_trace", [])
    if tables:
        out.warnings.append(f"{len(tables)} torch debug server fr_trace file(s) (e.g. {tables[0].name}) hold Flight "
                            "Recorder's analysis tables, not its dumps: not read (the dumps themselves, "
                            "TORCH_FR_DUMP_TEMP_FILE, are read when they are in the same folder)")
    return out


def _stacks_file(path: Path, world: int, out: DebugDumps) -> None:
    """One stacks dump: each rank's section appended to its stacks under a dated header."""
    try:
        text = safe_io.read_text(path)
    except safe_io.InputError as exc:
        out.warnings.append(f"{exc}; its stacks are not read")
        return
    at_ns = _name_time_ns(path)
    heads = list(_SECTION.finditer(text))
    silent = []
    for i, h in enumerate(heads):
        r = int(h.group(1)) if len(h.group(1)) <= 7 else -1
        body = text[h.end(): heads[i + 1].start() if i + 1 < len(heads) else len(text)].strip("\n")
        if r < 0 or r > safe_io.MAX_RANK or (world and r >= world):
            continue
        if re.fullmatch(r"Error: \d+", body.strip()):
            silent.append(f"{r} ({body.strip()})")
            continue
        out.stacks[r] = out.stacks.get(r, "") + f"=== ncclscope rank {r}: torch debug server {path.name} at " \
                                                 f"{at_ns} ns ===\n{body}\n"
    if heads:
        out.files.append(path)
    if silent:
        out.warnings.append(f"{path.name}: rank(s) {', '.join(silent[:8])} did not answer the torch debug server's "
                            "stack request (worker unreachable, or stuck holding the GIL)")


def _name_time_ns(path: Path) -> int:
    """The dump's time from its name (the frontend's local time, read in this machine's zone); its
    mtime when the name cannot be read as a date."""
    m = NAME.match(path.name)
    try:
        return int(time.mktime(time.strptime(m.group(2), "%Y%m%d_%H%M%S")) * 1e9) if m else 0
    except (ValueError, OverflowError):
        try:
            return path.stat().st_mtime_ns
        except OSError:
            return 0
