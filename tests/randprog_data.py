"""The random-program benchmark's Flight Recorder dumps kept as fixtures (tests/data/randprog/*_fr).

Each fixture holds the dumps as the tracer wrote them, `dump_times.json` (the time each file was written: a
clone does not keep file times, and the loader reads a dump's time from its file's mtime) and the program
(`program.py.txt`)."""
from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

DATA = Path(__file__).parent / "data" / "randprog"


def timed_dumps(name: str, tmp_path: Path, gap_s: dict[int, float] | None = None, data: Path = DATA) -> Path:
    """The fixture's dumps (`data / name`) in a fresh directory, each file timed as written, or `gap_s[rank]`
    seconds after its last entry was created."""
    src, dst = data / name, tmp_path / name
    dst.mkdir(parents=True)
    timed = src / "dump_times.json"          # a fixture without it is timed by `gap_s` only
    times = json.loads(timed.read_text()) if timed.exists() or gap_s is None else {}
    for f in sorted(src.glob("nccl_trace_rank_*")):
        shutil.copyfile(f, dst / f.name)
        t = times.get(f.name, 0)
        if gap_s is not None:
            entries = pickle.loads(f.read_bytes())["entries"]
            last = max(e.get(k) or 0 for e in entries for k in ("time_created_ns", "time_discovered_started_ns",
                                                                 "time_discovered_completed_ns"))
            t = last + int(gap_s[int(f.name.rsplit("_", 1)[1])] * 1e9)
        os.utime(dst / f.name, ns=(t, t))
    return dst
