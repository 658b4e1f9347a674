"""`load_any(path)`: whatever the user points at, by content, not by name.

    ncclscope analyze runs/run-20250101-120000   # our run directory
    ncclscope analyze /tmp/fr_dumps              # Flight Recorder dumps (pickle or JSON)
    ncclscope analyze ./profiler_traces          # torch.profiler Chrome traces (.json / .json.gz)
    ncclscope analyze ./export_parquet           # a dataset written by `ncclscope export --parquet`
    ncclscope analyze nccl-inspector-1234/       # NCCL Inspector JSON, NCCL RAS output (`ncclras -f json`),
                                                 # torch debug server dumps; alone or beside any of the above

Order of the checks: a run directory (run.json or rank-NNNNN/), an exported
Parquet dataset (its ncclscope_dataset.json), then the files themselves: a
file that starts like a pickle or a JSON object with "entries" is a Flight
Recorder dump, a JSON object with "traceEvents" is a profiler trace. Only
the first 64 KiB of each file is read to decide; nothing is unpickled.
When nothing fits, a TraceError says in one line what was looked for.

NCCL's own evidence (Inspector, RAS) and the torch debug server's dumps are looked for in the folder
and in its immediate subfolders (rank-NNNNN/ excepted), or given as further paths to `load_any`:
beside a source of ops they add what only they know, alone they are the trace
(`nccl_evidence.with_nccl_evidence`; docs/architecture.md, "Several sources, one trace").

An input from which nothing could be read (every events file junk, every
dump or trace cut off before its first op) is a TraceError too, naming the
first thing that went wrong: an empty Trace would otherwise read as "OK".
"""
from __future__ import annotations

import os
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ncclscope.load import safe_io
from ncclscope import schema as S
from ncclscope.load.trace import Trace, TraceError, load
from ncclscope.load.foreign import fr_read as fr
from ncclscope.load.foreign import prof_read as prof
from ncclscope.load.foreign.nccl_evidence import NcclFiles, nccl_kind, with_nccl_evidence

FORMATS = ("a ncclscope run directory, Flight Recorder dumps, PyTorch profiler traces, NCCL Inspector or RAS output "
           "or torch debug server dumps")
DATASET_MARKER = "ncclscope_dataset.json"      # = export.DATASET_MARKER (not imported: pyarrow.dataset is slow to load)
SNIFF_BYTES = 65536
MAX_SIDE_FILES = 4096                          # files looked at per subfolder for NCCL evidence
MAX_SUBDIRS = 64                               # subfolders looked into


@dataclass
class Inputs:
    """What an input holds: the one source that records ops (kind, path), if any, and the NCCL evidence."""

    primary: tuple[str, Path] | None = None
    nccl: NcclFiles = field(default_factory=NcclFiles)

    def merge(self, other: "Inputs") -> None:
        """Another path's sources into these: one source of ops at most (two would be two traces)."""
        if other.primary is not None and self.primary is not None:
            raise TraceError(f"{other.primary[1]}: a second source of ops ({other.primary[0]}) beside "
                             f"{self.primary[1]} ({self.primary[0]}); give one, with NCCL evidence beside it")
        self.primary = self.primary or other.primary
        for kind, paths in (("inspector", other.nccl.inspector), ("inspector_prom", other.nccl.prom),
                            ("ras", other.nccl.ras), ("debug", other.nccl.debug)):
            for p in paths:
                self.nccl.add(kind, p)


def detect(path: str | os.PathLike[str]) -> str:
    """"run" | "parquet" | "flight_recorder" | "profiler" | "nccl" (NCCL Inspector, RAS or torch debug
    server output and nothing else); TraceError if none fits."""
    inputs = survey(path)
    return inputs.primary[0] if inputs.primary else "nccl"


def survey(path: str | os.PathLike[str]) -> Inputs:
    """The sources in `path` (a file, or a folder and its immediate subfolders for NCCL evidence)."""
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
        return _survey_file(root)
    try:
        entries = sorted(root.iterdir())
    except OSError as exc:
        raise TraceError(f"{root}: cannot list the directory ({safe_io.short(exc)})") from None
    out = Inputs()
    if (root / S.RUN_JSON).exists() or any(p.name.startswith("rank-") and p.is_dir() for p in entries):
        out.primary = ("run", root)
        _nccl_files([p for p in entries if not p.name.startswith("rank-") and p.name != S.RUN_JSON], out.nccl)
    elif (root / DATASET_MARKER).exists():
        out.primary = ("parquet", root)          # its rank=N/ partitions are ours: nothing of NCCL's inside
        return out
    nodes = fr.node_dirs(entries) if out.primary is None else []     # per-node dump folders: dumps, not NCCL's
    _nccl_beside([e for e in entries if e not in nodes], out.nccl)
    if out.primary is not None:
        return out
    n_fr, n_prof, n_files = _count_files(entries, out.nccl)
    if (n_fr or nodes) and n_fr >= n_prof:
        out.primary = ("flight_recorder", root)
    elif n_prof:
        out.primary = ("profiler", root)
    elif not out.nccl:
        raise TraceError(f"{root}: not {FORMATS} (no rank-NNNNN/ directories, and none of its {n_files} files "
                         "is a Flight Recorder dump, a profiler trace or NCCL output)")
    return out


def _survey_file(path: Path) -> Inputs:
    """One file: a dump, a profiler trace or NCCL output; TraceError for anything else."""
    if fr.sniff(path):
        return Inputs(primary=("flight_recorder", path))
    if prof.sniff(path):
        return Inputs(primary=("profiler", path))
    out = Inputs()
    kind = nccl_kind(path, _head(path))
    if kind is None:
        raise TraceError(f"{path}: not {FORMATS} (the file is neither a Flight Recorder dump, a profiler trace "
                         "nor NCCL output)")
    out.nccl.add(kind, path)
    return out


def _count_files(entries: list[Path], nccl: NcclFiles) -> tuple[int, int, int]:
    """(Flight Recorder dumps, profiler traces, regular files) among `entries`; NCCL files into `nccl`."""
    n_fr = n_prof = n_files = 0
    for p in entries:
        if p.name.startswith(".") or not safe_io.is_regular(p):
            continue
        n_files += 1
        if fr.sniff(p):
            n_fr += 1
        elif prof.sniff(p):
            n_prof += 1
        else:
            kind = nccl_kind(p, _head(p))
            if kind:
                nccl.add(kind, p)
    return n_fr, n_prof, n_files


def _nccl_beside(entries: list[Path], nccl: NcclFiles) -> None:
    """NCCL evidence in the immediate subfolders (nccl-inspector-<jobid>/, a RAS folder), rank-NNNNN/ and
    hidden ones excepted; the folder's own files are looked at with its other files."""
    subdirs = [d for d in entries if not d.name.startswith((".", "rank-")) and d.is_dir() and not d.is_symlink()]
    for d in subdirs[:MAX_SUBDIRS]:
        try:
            files = sorted(d.iterdir())[:MAX_SIDE_FILES]
        except OSError:
            continue
        _nccl_files(files, nccl)


def _nccl_files(files: list[Path], nccl: NcclFiles) -> None:
    """The NCCL evidence among `files` (regular, not hidden, at most MAX_SIDE_FILES looked at)."""
    for p in files[:MAX_SIDE_FILES]:
        if not p.name.startswith(".") and safe_io.is_regular(p):
            kind = nccl_kind(p, _head(p))
            if kind:
                nccl.add(kind, p)


def _head(path: Path) -> bytes:
    """The first SNIFF_BYTES of a file (b"" when it cannot be read)."""
    try:
        with safe_io.open_regular(path) as fh:
            return fh.read(SNIFF_BYTES)
    except (OSError, safe_io.InputError):
        return b""


def load_any(path: str | os.PathLike[str], *more: str | os.PathLike[str], engine: Any = None,
             world_size: int | None = None, ops_only: bool = False) -> Trace:
    """Load any input ncclscope understands into one Trace (see module docstring); `more`: further
    paths of the same job (NCCL evidence, or the one source of ops); `engine`: read run directories and
    Flight Recorder dumps on its workers (ncclscope.engine), the same Trace as without it; `world_size`:
    the job's number of ranks, for Flight Recorder dumps (the highest ranks may have left none, and gloo's
    dumps list no group members); other inputs say their own, and a warning says it was not used.
    `ops_only`: a run directory read on an engine brings its ops and marks, not its event rows, to this
    process (load.trace.load), unless NCCL evidence is merged into it by event rows."""
    inputs = survey(path)
    for m in more:
        inputs.merge(survey(m))
    trace = _load_primary(*inputs.primary, engine=engine, world_size=world_size,
                          ops_only=ops_only and not inputs.nccl) if inputs.primary else None
    if trace is not None and inputs.nccl:
        require_readable(trace, path)
    if inputs.nccl:
        trace = with_nccl_evidence(trace, inputs.nccl, inputs.primary[1] if inputs.primary else Path(path))
    require_readable(trace, path)
    return trace


def _load_primary(kind: str, path: Path, engine: Any = None, world_size: int | None = None,
                  ops_only: bool = False) -> Trace:
    if kind == "flight_recorder":
        from ncclscope.load.foreign.flight_recorder import load_flight_recorder
        return load_flight_recorder(path, world_size=world_size, engine=engine)
    if kind == "run":
        trace = load(path, engine=engine, ops_only=ops_only)
    elif kind == "parquet":
        from ncclscope.export import load_parquet
        trace = load_parquet(path)
    else:
        from ncclscope.load.foreign.profiler import load_profiler
        trace = load_profiler(path)
    if world_size:
        trace.warnings.append(f"world size {world_size} given: it applies to Flight Recorder dumps only; this "
                              f"input says {int(trace.world_size)}, and that is used")
    return trace


def require_readable(trace: Trace | None, path: str | os.PathLike[str]) -> None:
    """TraceError when no rank yielded a single readable event: analyzing an
    empty trace would say "OK" about input nobody could read."""
    if trace is not None and (len(trace.events) or len(trace.ops)):
        return
    if trace is None:
        raise TraceError(f"{path}: nothing readable")
    why = trace.warnings[0] if trace.warnings else "no rank recorded any event"
    more = f" (and {len(trace.warnings) - 1} more problems)" if len(trace.warnings) > 1 else ""
    raise TraceError(f"{path}: nothing readable: {why}{more}")
