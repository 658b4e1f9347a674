"""Dask or Ray for the analyzer's engine: the same stage (read + per-rank columns) timed on both, in one run.

    python benchmarks/synth.py /tmp/s1024 --ranks 1024 --events 10000000
    python benchmarks/engine_choice.py /tmp/s1024 [--workers 2] [--chunk 64] [--ray-python /path/to/python]

Why: docs/architecture.md names the engine and why; this is the measurement behind it. Each engine runs in
its own child process (fresh imports, its own peak memory), with the same chunks of rank directories and the
same function (`ncclscope.engine.rank_chunks.read_chunk`). Printed per engine: start-up of the workers, the
stage with results kept on the workers (only row counts travel), then the same results brought to the driver and
merged (`merge_chunk`), each as a ratio to reading in one process. Ray is optional: `--ray-python` names an
interpreter that has it (it is not a dependency of ncclscope). Every child has a hard timeout.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def _chunks(root: str, size: int) -> list[list[tuple[int, str]]]:
    dirs = sorted((int(p.name.split("-")[1]), str(p)) for p in Path(root).iterdir()
                  if p.is_dir() and p.name.startswith("rank-"))
    return [dirs[i:i + size] for i in range(0, len(dirs), size)]


def _merge_all(root: str, chunks: list) -> int:
    from ncclscope.engine.rank_chunks import merge_chunk
    from ncclscope.load.trace import RunDirLoader
    loader = RunDirLoader(Path(root), [])
    for c in chunks:
        merge_chunk(loader, c)
    return loader.events.rows


def _measure(out: dict, root: str, stage, gather) -> None:
    """out["stage_s"]: stage() (the chunks read where the engine keeps them); out["gather_merge_s"]: that plus
    gather() (the chunks, now on the driver) and the merge; out["rows"]: the chunks' event rows."""
    t1 = time.perf_counter()
    stage()
    out["stage_s"] = time.perf_counter() - t1
    t2 = time.perf_counter()
    res = gather()
    out["rows"] = sum(r.rows for r in res)
    _merge_all(root, res)
    out["gather_merge_s"] = out["stage_s"] + time.perf_counter() - t2


def child(engine: str, root: str, workers: int, size: int) -> dict:
    from ncclscope.engine.rank_chunks import read_chunk
    chunks = _chunks(root, size)
    out: dict = {"engine": engine}
    t0 = time.perf_counter()
    held: list = []
    if engine == "inprocess":
        _measure(out, root, lambda: held.extend(read_chunk(root, c) for c in chunks), lambda: held)
    elif engine in ("dask", "dask-files"):
        import tempfile
        from dask.distributed import Client, LocalCluster, wait
        from ncclscope.engine.tasks import load_result, run_to_file
        from ncclscope.engine.rank_chunks import RankChunk
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None)
        client = Client(cluster)
        out["startup_s"] = time.perf_counter() - t0
        with tempfile.TemporaryDirectory(dir=os.environ.get("NCCLSCOPE_SCRATCH")) as scratch:
            if engine == "dask":          # results kept by the workers, then through Dask's comm
                futs = client.map(read_chunk, [root] * len(chunks), chunks, pure=False)
                _measure(out, root, lambda: wait(futs), lambda: client.gather(futs))
            else:                         # results as files in a scratch directory, only their paths through Dask
                futs = [client.submit(run_to_file, read_chunk, f"{scratch}/chunk-{i}.pkl", root, c, pure=False)
                        for i, c in enumerate(chunks)]
                _measure(out, root, lambda: held.extend(client.gather(futs)),
                         lambda: [load_result(p, RankChunk) for p in held])
        client.close()
        cluster.close()
    elif engine == "ray":
        import ray
        ray.init(num_cpus=workers, include_dashboard=False, log_to_driver=False)
        remote = ray.remote(read_chunk)
        ray.get(remote.remote(root, chunks[0][:1]))           # workers up before the clock
        out["startup_s"] = time.perf_counter() - t0
        refs = [remote.remote(root, c) for c in chunks]
        _measure(out, root, lambda: ray.wait(refs, num_returns=len(refs), fetch_local=False), lambda: ray.get(refs))
        ray.shutdown()
    import resource
    out["driver_peak_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=64, help="rank directories per task")
    ap.add_argument("--ray-python", default="", help="a Python interpreter with ray installed (optional)")
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--child", default="", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(a.child, a.run_dir, a.workers, a.chunk)))
        return 0
    env = dict(os.environ, OMP_NUM_THREADS="1")
    runs = [("inprocess", sys.executable), ("dask", sys.executable), ("dask-files", sys.executable)]
    if a.ray_python:
        runs.append(("ray", a.ray_python))
    results = {}
    for name, py in runs:
        cmd = [py, __file__, a.run_dir, "--workers", str(a.workers), "--chunk", str(a.chunk), "--child", name]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout_s, env=env)
        except subprocess.TimeoutExpired:
            print(f"{name}: past {a.timeout_s:.0f} s, stopped")
            continue
        line = (p.stdout.strip().splitlines() or [""])[-1]
        if p.returncode != 0 or not line.startswith("{"):
            print(f"{name}: failed (exit {p.returncode}): {(p.stderr.strip().splitlines() or [''])[-1][:200]}")
            continue
        results[name] = json.loads(line)
    base = results.get("inprocess")
    print(f"read + per-rank columns, {a.run_dir}, {a.workers} workers, {a.chunk} ranks per task")
    print("| engine | start-up s | stage s (results stay on workers) | x one process | + gather and merge s "
          "| x one process | driver peak MB |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in results.items():
        rs = r["stage_s"] / base["stage_s"] if base else float("nan")
        rg = r["gather_merge_s"] / base["gather_merge_s"] if base else float("nan")
        print(f"| {name} | {r.get('startup_s', 0):.1f} | {r['stage_s']:.1f} | {rs:.2f} | {r['gather_merge_s']:.1f} "
              f"| {rg:.2f} | {r['driver_peak_mb']:,.0f} |")
    return 0 if base and len(results) == len(runs) else 1


if __name__ == "__main__":
    sys.exit(main())
