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
"""
from __future__ import annotations

import os
from pathlib import Path

from .. import schema as S
from ..trace import Trace, TraceError, load
from . import flight_recorder as fr
from . import profiler as prof

FORMATS = "a ncclscope run directory, Flight Recorder dumps or PyTorch profiler traces"
DATASET_MARKER = "ncclscope_dataset.json"      # = export.DATASET_MARKER (not imported: pyarrow.dataset is slow to load)


def detect(path: str | os.PathLike[str]) -> str:
    """"run" | "parquet" | "flight_recorder" | "profiler"; TraceError if none fits."""
    root = Path(path)
    if not root.exists():
        raise TraceError(f"{root}: no such file or directory")
    if root.is_file():
        if fr.sniff(root):
            return "flight_recorder"
        if prof.sniff(root):
            return "profiler"
        raise TraceError(f"{root}: not {FORMATS} (the file is neither a Flight Recorder dump nor a profiler trace)")
    if (root / S.RUN_JSON).exists() or any(p.is_dir() and p.name.startswith("rank-") for p in root.iterdir()):
        return "run"
    if (root / DATASET_MARKER).exists():
        return "parquet"
    n_fr = n_prof = n_files = 0
    for p in sorted(root.iterdir()):
        if not p.is_file() or p.name.startswith("."):
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
        return load(path)
    if kind == "parquet":
        from ..export import load_parquet
        return load_parquet(path)
    if kind == "flight_recorder":
        return fr.load_flight_recorder(path)
    return prof.load_profiler(path)
