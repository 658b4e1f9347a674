"""Benchmark: how `ncclscope analyze` scales from 8 to 4,096 ranks.

    OMP_NUM_THREADS=1 python benchmarks/scale.py                       # 8, 64, 256, 1024, 4096 ranks
    python benchmarks/scale.py --sizes 8,64 --events-per-rank 2000     # a quick look
    python benchmarks/scale.py --max-events 40000000                   # no cap at 4,096 (more memory)

For each size, benchmarks/synth.py writes a synthetic hung run directory
(pp x dp x tp mesh, 1F1B, one rank skips a data-parallel all_reduce in the
last step) into a temporary directory; then `python -m ncclscope analyze DIR
--json` runs in a fresh process and we measure its wall time and its peak
resident memory (`os.wait4` rusage of that one child). The time includes the
interpreter start and imports (about 1-2 s: the 8-rank row is mostly that).
Events per size = ranks x --events-per-rank, capped at --max-events (so the
largest sizes fit in memory and finish in minutes on a 2-core machine); the
table says what each size got. The run directory is deleted after each size.
The default run takes about 7 minutes on 2 cores and needs about 12 GB of
free memory at 4,096 ranks (analyze's peak); use --sizes 8,64,256,1024 on a
smaller machine.

Printed: ranks | events | analyze s | peak MB | s per M events, then the
growth exponents k between consecutive sizes (t ~ events^k, mem ~ events^k;
1.0 is linear), and whether the verdict's first rank is the one synth.py
made skip its all_reduce (a check, not a timing; exit status 1 only when a
size could not be run).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))


def measure(run: Path, out_json: Path, timeout_s: float) -> tuple[float, float, int]:
    """(wall s, peak RSS MB, exit code) of `ncclscope analyze RUN --json` in a fresh process."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONWARNINGS="ignore::FutureWarning")
    with open(out_json, "w") as fh:
        t0 = time.perf_counter()
        proc = subprocess.Popen([sys.executable, "-m", "ncclscope", "analyze", str(run), "--json"], stdout=fh,
                                stderr=subprocess.PIPE, cwd=ROOT, env=env, start_new_session=True)
        deadline = t0 + timeout_s
        while True:
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                os.killpg(proc.pid, 9)
                pid, status, ru = os.wait4(proc.pid, 0)
                proc.returncode = -9
                raise TimeoutError(f"analyze did not finish in {timeout_s:.0f} s")
            time.sleep(0.05)
        wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return wall, ru.ru_maxrss / 1024, proc.returncode   # Linux: ru_maxrss in KiB


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="8,64,256,1024,4096", help="comma-separated rank counts")
    ap.add_argument("--events-per-rank", type=int, default=10_000)
    ap.add_argument("--max-events", type=int, default=10_000_000, help="cap on the events of one size")
    ap.add_argument("--tmp", default=tempfile.gettempdir(), help="where the synthetic traces are written")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per-size limit for analyze")
    ns = ap.parse_args(argv)
    import synth

    sizes = [int(s) for s in ns.sizes.split(",") if s.strip()]
    print(f"ncclscope analyze --json on synthetic hung traces; {ns.events_per_rank:,} events per rank, "
          f"at most {ns.max_events:,} per size; {os.cpu_count()} CPUs, OMP_NUM_THREADS="
          f"{os.environ.get('OMP_NUM_THREADS', '(unset)')}", flush=True)
    rows = []
    for ranks in sizes:
        events = min(ranks * ns.events_per_rank, ns.max_events)
        tmp = Path(tempfile.mkdtemp(prefix=f"ncclscope-scale-{ranks}-", dir=ns.tmp))
        try:
            t = time.perf_counter()
            run = synth.generate(tmp / "run", ranks=ranks, events=events, hang=True, seed=0)
            gen_s = time.perf_counter() - t
            truth = json.loads((run / "run.json").read_text()).get("synthetic", {})
            rows_written = sum(_rows(p) for p in run.glob("rank-*/events.arrows"))
            wall, mb, rc = measure(run, tmp / "analyze.json", ns.timeout_s)
            report = json.loads((tmp / "analyze.json").read_text())
        except TimeoutError as exc:
            print(f"  {ranks} ranks: {exc}; stopping here", flush=True)
            break
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        hang_rank = truth.get("hang_rank")
        m = re.search(r"rank (\d+)", report["verdict"])
        first = int(m.group(1)) if m else None
        named = "yes" if first == hang_rank else f"no: names {first}, skipper is {hang_rank}"
        rows.append((ranks, rows_written, wall, mb, rc, named))
        print(f"  {ranks} ranks: generated {rows_written:,} event rows in {gen_s:.1f} s; analyze {wall:.1f} s, "
              f"{mb:.0f} MB peak, exit {rc}; verdict: {report['verdict'][:100]}", flush=True)

    print()
    print("| ranks | events | analyze s | peak MB | s per M events | verdict's first rank is the skipper |")
    print("|---:|---:|---:|---:|---:|---|")
    for ranks, ev, wall, mb, rc, named in rows:
        print(f"| {ranks:,} | {ev / 1e6:.2f} M | {wall:.1f} | {mb:,.0f} | {wall / (ev / 1e6):.2f} | "
              f"{named} |")
    if len(rows) > 1:
        print()
        print("growth between consecutive sizes: k in t ~ x^k and mem ~ x^k, x = events or ranks "
              "(1.0 = linear; 'vs events' is left out where the cap kept events about equal):")
        for a, b in zip(rows, rows[1:]):
            lr, le = math.log(b[0] / a[0]), math.log(b[1] / a[1])
            lt, lm = math.log(b[2] / a[2]), math.log(b[3] / a[3])
            vs_ev = f"vs events: time k = {lt / le:.2f}, memory k = {lm / le:.2f}; " if le > math.log(1.5) else ""
            print(f"  {a[0]:>5,} -> {b[0]:>5,} ranks: {vs_ev}vs ranks: time k = {lt / lr:.2f}, "
                  f"memory k = {lm / lr:.2f}")
    asked = set(sizes)
    done = {r[0] for r in rows}
    if asked - done:
        print(f"\nnot run: {', '.join(map(str, sorted(asked - done)))} ranks (see above)")
    return 0 if rows and not asked - done else 1


def _rows(path: Path) -> int:
    import pyarrow.ipc
    with pyarrow.ipc.open_stream(str(path)) as reader:
        return sum(b.num_rows for b in reader)


if __name__ == "__main__":
    sys.exit(main())
