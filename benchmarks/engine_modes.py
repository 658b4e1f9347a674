"""The three ways to run `ncclscope analyze` on one input, side by side in one run: time, peak memory of the
largest process (driver or worker), and whether the JSON documents are identical.

    python benchmarks/synth.py /tmp/s16k --ranks 16384 --events 32000000
    python benchmarks/engine_modes.py /tmp/s16k [--workers 0,2] [--scheduler tcp://host:8786] [--timeout-s 1800]

Why: the engine must pay for itself (wall time as a ratio to the in-process run measured here, in the same
run) without breaking the "one verdict" rule (the documents must be byte-identical). Memory is sampled every
0.2 s over the whole process tree (psutil), so a worker's peak counts as much as the driver's. Each run has a
hard timeout and its process group is killed past it: this benchmark cannot hang.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import signal
import subprocess
import sys
import threading
import time

import psutil


def _watch(proc: subprocess.Popen, peaks: dict[str, float], stop: threading.Event) -> None:
    """Peak RSS (MB) of the largest process in the tree, and of the tree's sum, until `stop`."""
    try:
        root = psutil.Process(proc.pid)
    except psutil.Error:
        return
    while not stop.is_set():
        try:
            procs = [root] + root.children(recursive=True)
            rss = []
            for p in procs:
                try:
                    rss.append(p.memory_info().rss / 2**20)
                except psutil.Error:
                    pass
            if rss:
                peaks["largest"] = max(peaks.get("largest", 0.0), max(rss))
                peaks["sum"] = max(peaks.get("sum", 0.0), sum(rss))
        except psutil.Error:
            pass
        stop.wait(0.2)


def measure(run_dir: str, extra: list[str], timeout_s: float) -> dict:
    cmd = [sys.executable, "-m", "ncclscope", "analyze", run_dir, "--json", *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True)
    peaks: dict[str, float] = {}
    stop = threading.Event()
    watcher = threading.Thread(target=_watch, args=(proc, peaks, stop), daemon=True)
    watcher.start()
    try:
        out, err = proc.communicate(timeout=timeout_s)
        rc = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        rc = None
    stop.set()
    watcher.join()
    wall = time.perf_counter() - t0
    verdict = ""
    for line in out.decode(errors="replace").splitlines():
        if line.startswith(' "verdict"'):
            verdict = line.split(":", 1)[1].strip()[1:90]
            break
    return {"wall": wall, "rc": rc, "largest": peaks.get("largest", 0.0), "sum": peaks.get("sum", 0.0),
            "digest": hashlib.sha256(out).hexdigest()[:12], "verdict": verdict,
            "error": (err.decode(errors="replace").strip().splitlines() or [""])[-1][:200]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--workers", default="0,2", help="comma-separated --workers values (0: in this process)")
    ap.add_argument("--scheduler", default="", help="also run on the Dask cluster at this address")
    ap.add_argument("--worker-memory", default="", help="--worker-memory for the local clusters (e.g. 8GB)")
    ap.add_argument("--timeout-s", type=float, default=1800)
    a = ap.parse_args()
    modes = [(f"--workers {w}" if int(w) else "in-process", ["--workers", w]) for w in a.workers.split(",")]
    if a.worker_memory:
        modes = [(n, x + (["--worker-memory", a.worker_memory] if x[1] != "0" else [])) for n, x in modes]
    if a.scheduler:
        modes.append((f"--scheduler {a.scheduler}", ["--scheduler", a.scheduler]))
    rows = []
    for name, extra in modes:
        r = measure(a.run_dir, extra, a.timeout_s)
        rows.append((name, r))
        print(f"{name}: {r['wall']:.1f} s, largest process {r['largest']:,.0f} MB, exit {r['rc']}", file=sys.stderr)
    base = rows[0][1]["wall"] if rows else float("nan")
    print(f"`ncclscope analyze {a.run_dir} --json`, {os.cpu_count()} CPUs, OMP_NUM_THREADS=1")
    print("| mode | wall s | x first row | largest process MB | all processes MB | exit | JSON sha256 | verdict |")
    print("|---|---:|---:|---:|---:|---:|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['wall']:.1f} | {r['wall'] / base:.2f} | {r['largest']:,.0f} | {r['sum']:,.0f} "
              f"| {r['rc']} | {r['digest']} | {r['verdict'] or r['error']} |")
    same = len({r["digest"] for _, r in rows}) == 1
    print("identical JSON in every mode" if same else "the JSON documents DIFFER between modes")
    return 0 if same and all(r["rc"] in (0, 1) for _, r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
