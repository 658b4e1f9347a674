"""Benchmark: analyze and write the HTML report for a 1,024-rank, 10-million-event trace.

    python benchmarks/report.py                      # generate (cached) and measure
    python benchmarks/report.py --run DIR -o r.html  # measure an existing run directory

Prints the time to load, to analyze, to write the report, the process's peak
memory and the report's size, next to the targets: analyze + report <= 30 s,
peak memory <= 4 GB, report <= 15 MB. The synthetic trace comes from
benchmarks/synth.py and is cached under --cache (about 1.7 GB on disk).
Exit status 1 when a target is missed.
"""
from __future__ import annotations

import argparse
import resource
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

TARGET_S, TARGET_MEM, TARGET_SIZE = 30.0, 4 * 2**30, 15 * 2**20


def peak_rss() -> int:
    """Peak resident memory of this process so far, in bytes (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", help="existing run directory (default: the cached synthetic trace)")
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--events", type=int, default=10_000_000)
    ap.add_argument("--no-hang", action="store_true")
    ap.add_argument("--cache", default="/tmp/ncclscope-bench")
    ap.add_argument("-o", "--out", default="")
    ns = ap.parse_args(argv)

    from ncclscope.verdict import run as run_analysis
    from ncclscope.report import write_report
    from ncclscope.load.trace import load

    if ns.run:
        run = Path(ns.run)
    else:
        import synth
        run = Path(ns.cache) / f"synth-{ns.ranks}-{ns.events}-{'ok' if ns.no_hang else 'hang'}"
        if not (run / "run.json").exists():
            t = time.perf_counter()
            synth.generate(run, ns.ranks, ns.events, hang=not ns.no_hang)
            print(f"generated {run} in {time.perf_counter() - t:.1f} s")
    out = Path(ns.out or Path(ns.cache) / "report.html")

    t0 = time.perf_counter()
    trace = load(run)
    t_load = time.perf_counter() - t0
    mem_load = peak_rss()
    t1, c1 = time.perf_counter(), time.process_time()
    analysis = run_analysis(trace)
    t_an = analysis.timings_s.get("performance", 0.0)
    t_diag = analysis.timings_s.get("hang diagnosis", 0.0)
    t2 = time.perf_counter()
    stats = write_report(trace, out, analysis=analysis)
    t_rep = time.perf_counter() - t2
    mem = peak_rss()
    work = t_an + t_diag + t_rep
    cpu = time.process_time() - c1

    def mark(ok: bool) -> str:
        return "ok" if ok else "MISSED"

    print(f"trace: {run} ({trace.world_size} ranks, {len(trace.events):,} events, {len(trace.ops):,} ops)")
    print(f"load                {t_load:7.1f} s   peak RSS after load {mem_load / 2**30:.2f} GiB")
    print(f"analyze             {t_an:7.1f} s   " + ", ".join(f"{k} {v:.1f}" for k, v in perf.timings.items()))
    print(f"hang diagnosis      {t_diag:7.1f} s   (analysis/diagnose.py, shown in the report's verdict)")
    print(f"write report        {t_rep:7.1f} s   (figures + HTML)")
    print(f"analyze + report    {work:7.1f} s   target <= {TARGET_S:.0f} s: {mark(work <= TARGET_S)}  "
          f"(CPU {cpu:.1f} s: wall time on a shared machine is inflated by other processes)")
    print(f"peak memory         {mem / 2**30:7.2f} GiB target <= {TARGET_MEM / 2**30:.0f} GiB: {mark(mem <= TARGET_MEM)}"
          " (whole process, loaded trace included)")
    print(f"report size         {stats['bytes'] / 2**20:7.1f} MiB target <= {TARGET_SIZE / 2**20:.0f} MiB: "
          f"{mark(stats['bytes'] <= TARGET_SIZE)}  -> {out}")
    print(f"sections drawn: {', '.join(stats['sections'])}; skipped: {', '.join(stats['skipped']) or '-'}; "
          f"failed: {stats['failed'] or '-'}; findings: {stats['findings']}")
    if perf.errors:
        print("analysis errors:", *perf.errors, sep="\n  ")
    return 0 if work <= TARGET_S and mem <= TARGET_MEM and stats["bytes"] <= TARGET_SIZE else 1


if __name__ == "__main__":
    sys.exit(main())
