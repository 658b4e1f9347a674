"""`load_any(path)`: whatever the user points at, by content, not by name.

    ncclscope analyze runs/run-20250101-120000   # our run directory
    ncclscope analyze /tmp/fr_dumps              # Flight Recorder dumps (pickle or JSON)
    ncclscope analyze ./profiler_traces          # torch.profiler Chrome traces (.json / .json.gz)
    ncclscope analyze ./export_parquet           # a dataset written by `ncclscope export --parquet`

Order of the checks: a run directory (run.json or rank-NNNNN/), an exported
Parquet dataset (its ncclscope_dataset.json), then the files themselves: a
file that starts like a pickle or a JSON object with "entries" is a Flight
Recorder dump, a JSON object with "traceEvents" is a profiler trace. Only
the first 64 KiB of each file is read to decide; nothing is unpickled.
When nothing fits, a TraceError says in one line what was looked for.

An input from which nothing could be read (every events file junk, every
dump or trace cut off before its first op) is a TraceError too, naming the
first thing that went wrong: an empty Trace would otherwise read as "OK".
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

from ncclscope.load import safe_io
from ncclscope import schema as S
from ncclscope.load.trace import Trace, TraceError, load
from ncclscope.load.foreign import fr_read as fr
from ncclscope.load.foreign import prof_read as prof

FORMATS = "a ncclscope run directory, Flight Recorder dumps or PyTorch profiler traces"
DATASET_MARKER = "ncclscope_dataset.json"      # = export.DATASET_MARKER (not imported: pyarrow.dataset is slow to load)


def detect(path: str | os.PathLike[str]) -> str:
    """"run" | "parquet" | "flight_recorder" | "profiler"; TraceError if none fits."""
    root = Path(path)
    try:
        st = os.stat(root)
    except FileNotFoundError:
        raise TraceError(f"{root}: no such file or directory") from None
    except (OSError, ValueError) as exc:
        raise TraceError(f"{root}: unreadable ({safe_io.short(exc)})") from None
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise TraceError(f"{root}: {safe_io.file_kind(st.st_mode)}, not {FORMATS}")
    if stat.S_ISREG(st.st_mode):
        if fr.sniff(root):
            return "flight_recorder"
        if prof.sniff(root):
            return "profiler"
        raise TraceError(f"{root}: not {FORMATS} (the file is neither a Flight Recorder dump nor a profiler trace)")
    try:
        entries = sorted(root.iterdir())
    except OSError as exc:
        raise TraceError(f"{root}: cannot list the directory ({safe_io.short(exc)})") from None
    if (root / S.RUN_JSON).exists() or any(p.name.startswith("rank-") and p.is_dir() for p in entries):
        return "run"
    if (root / DATASET_MARKER).exists():
        return "parquet"
    n_fr = n_prof = n_files = 0
    for p in entries:
        if p.name.startswith(".") or not safe_io.is_regular(p):
            continue
        n_files += 1
        if fr.sniff(p):
            n_fr += 1
        elif prof.sniff(p):
            n_prof += 1
    if n_fr and n_fr >= n_prof:
        return "flight_recorder"
    if n_prof:
        return "profiler"
    raise TraceError(f"{root}: not {FORMATS} (no rank-NNNNN/ directories, and none of its {n_files} files "
                     "is a Flight Recorder dump or a profiler trace)")


def load_any(path: str | os.PathLike[str]) -> Trace:
    """Load any input ncclscope understands into a Trace (see module docstring)."""
    kind = detect(path)
    if kind == "run":
        trace = load(path)
    elif kind == "parquet":
        from ncclscope.export import load_parquet
        trace = load_parquet(path)
    elif kind == "flight_recorder":
        from ncclscope.load.foreign.flight_recorder import load_flight_recorder
        trace = load_flight_recorder(path)
    else:
        from ncclscope.load.foreign.profiler import load_profiler
        trace = load_profiler(path)
    require_readable(trace, path)
    return trace


def require_readable(trace: Trace, path: str | os.PathLike[str]) -> None:
    """TraceError when no rank yielded a single readable event: analyzing an
    empty trace would say "OK" about input nobody could read."""
    if len(trace.events):
        return
    why = trace.warnings[0] if trace.warnings else "no rank recorded any event"
    more = f" (and {len(trace.warnings) - 1} more problems)" if len(trace.warnings) > 1 else ""
    raise TraceError(f"{path}: nothing readable: {why}{more}")
