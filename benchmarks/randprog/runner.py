"""Run one generated program under `ncclscope run` (hard deadline, whole process group reaped), then
make the Flight-Recorder-only evidence directory and analyze both.

A job ends by itself (a healthy program; a faulty one when its peers' gloo timeout fires and the
launcher stops the rest), or is stopped from outside: when nothing in its run directory has grown for
`stall_s` the whole job gets SIGTERM, the way a scheduler's time limit stops a hung job (the tracer
dumps stacks and Flight Recorder on SIGTERM); past `timeout_s` it gets SIGTERM, then SIGKILL.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .generator import Program

ROOT = Path(__file__).resolve().parents[2]
FR_SNAPSHOT = "flight_recorder.pkl"          # what `ncclscope run`'s tracer writes into each rank dir
FR_NCCL_PREFIX = "flight_recorder_nccl_"     # NCCL's own dump on timeout (TORCH_FR_DUMP_TEMP_FILE)
DIED_SIGNALS = ("SIGABRT", "SIGKILL", "SIGSEGV", "SIGBUS", "SIGFPE")


@dataclass
class JobResult:
    took_s: float
    stopped: str                      # "" | "stall" (SIGTERM like a scheduler) | "deadline"
    exits: dict[int, str] = field(default_factory=dict)   # rank -> "0" | "1" | "SIGTERM(launcher)" ...
    all_clean: bool = False           # every rank exited 0
    fr_ranks: list[int] = field(default_factory=list)      # ranks whose dump went into the FR directory
    fr_left_out: list[int] = field(default_factory=list)   # ranks left out (died: a killed process writes none)


def _events_size(run_dir: Path, world: int) -> int:
    total = 0
    for r in range(world):
        for name in ("events.arrows", "metrics.arrows"):
            try:
                total += (run_dir / f"rank-{r:05d}" / name).stat().st_size
            except OSError:
                pass
    return total


def _killpg(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def run_job(prog: Program, work: Path, timeout_s: float, log=None) -> JobResult:
    """Write the script and its truth into `work`, run it into `work/run`, return how it ended."""
    work.mkdir(parents=True, exist_ok=True)
    script = work / prog.filename
    script.write_text(prog.source)
    (work / "truth.json").write_text(json.dumps(prog.truth.to_json(), indent=1))
    run_dir = work / "run"
    t = prog.truth
    trace_timeout = max(2.0, round(t.pg_timeout_s * 0.5, 1))
    cmd = [sys.executable, "-m", "ncclscope", "run", "--nproc", str(t.world), "--timeout-s", f"{trace_timeout:g}",
           "--no-analyze", "--out", str(run_dir), "--", str(script)]
    (work / "repro.sh").write_text(
        "#!/bin/sh\n# rerun this program under ncclscope and print the verdict (from the repository root)\n"
        f"OMP_NUM_THREADS=1 python -m ncclscope run --nproc {t.world} --timeout-s {trace_timeout:g} "
        f"--out /tmp/{t.name}-run -- {script}\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    stall_s = t.pg_timeout_s * 2 + 20
    t0 = time.monotonic()
    stopped = ""
    with open(work / "job.log", "wb") as logf:
        proc = subprocess.Popen(cmd, stdout=logf, stderr=subprocess.STDOUT, env=env, cwd=str(ROOT),
                                start_new_session=True)
        try:
            last_size, last_change = -1, time.monotonic()
            while proc.poll() is None:
                now = time.monotonic()
                if now - t0 > timeout_s:
                    stopped = "deadline"
                    _killpg(proc.pid, signal.SIGTERM)
                    try:
                        proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        _killpg(proc.pid, signal.SIGKILL)
                    break
                started = all((run_dir / f"rank-{r:05d}" / "rank.json").exists() for r in range(t.world))
                size = _events_size(run_dir, t.world)     # not samples.arrows: it grows on a timer
                if size != last_size or not started:    # the stall clock runs once every rank traces
                    last_size, last_change = size, now
                elif now - last_change > stall_s and not stopped:
                    stopped = "stall"           # hung: stop it as a scheduler would
                    _killpg(proc.pid, signal.SIGTERM)
                    last_change = now
                time.sleep(0.25)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                _killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        finally:
            _killpg(proc.pid, signal.SIGKILL)     # reap anything left in the job's process group
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    res = JobResult(took_s=time.monotonic() - t0, stopped=stopped)
    try:
        info = json.loads((run_dir / "run.json").read_text())
        ranks = info.get("ranks", {})
    except (OSError, ValueError):
        ranks = {}
    died: list[int] = list(t.dies)
    for r in range(t.world):
        e = ranks.get(str(r), {})
        if e.get("signal"):
            res.exits[r] = f"{e['signal']}" + ("(launcher)" if e.get("stopped_by_launcher") else "")
            if e["signal"] in DIED_SIGNALS and not e.get("stopped_by_launcher"):
                died.append(r)
        else:
            res.exits[r] = str(e.get("exitcode"))
    res.all_clean = len(res.exits) == t.world and all(v == "0" for v in res.exits.values())
    extract_fr(run_dir, work / "fr", t.world, sorted(set(died)), res)
    return res


def extract_fr(run_dir: Path, fr_dir: Path, world: int, died: list[int], res: JobResult) -> None:
    """The Flight Recorder dumps a plain-torchrun user would have: one `nccl_trace_rank_N` per rank
    that was alive to write it (the newest dump in its rank directory), none for a rank that died."""
    fr_dir.mkdir(parents=True, exist_ok=True)
    for r in range(world):
        rd = run_dir / f"rank-{r:05d}"
        if r in died:
            res.fr_left_out.append(r)
            continue
        cands = [p for p in (rd.iterdir() if rd.is_dir() else [])
                 if p.name == FR_SNAPSHOT or (p.name.startswith(FR_NCCL_PREFIX) and not p.name.endswith(".tmp"))]
        if not cands:
            continue
        best = max(cands, key=lambda p: p.stat().st_mtime_ns)
        # copy2: a dump keeps the time torch wrote it (the analyzer reads a dump written long after its
        # last op as a job that stopped); a user reading dumps where the job left them sees that time too
        shutil.copy2(best, fr_dir / f"nccl_trace_rank_{r}")
        res.fr_ranks.append(r)


def analyze(path: Path, out_json: Path, timeout_s: float = 180.0,
            extra: tuple[str, ...] = ()) -> tuple[int, dict[str, Any]]:
    """`ncclscope analyze --json PATH [extra]` in its own process group; (exit code, report or {"no_json": ...})."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "ncclscope", "analyze", "--json", str(path), *extra], cwd=str(ROOT),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        rep = {"no_json": f"analyze timed out after {timeout_s:g} s", "findings": [], "verdict": ""}
        out_json.write_text(json.dumps(rep, indent=1))
        return -9, rep
    finally:
        _killpg(proc.pid, signal.SIGKILL)
    start = out.find("{") if out.startswith("{") else out.find("\n{") + 1
    try:
        rep = json.loads(out[start:]) if start >= 0 and out.strip() else None
    except json.JSONDecodeError:
        rep = None
    if not isinstance(rep, dict):
        rep = {"no_json": f"rc {proc.returncode}: {err.strip()[-300:]}", "findings": [], "verdict": ""}
    out_json.write_text(json.dumps(rep, indent=1))
    return proc.returncode, rep
