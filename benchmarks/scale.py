"""Benchmark: how `ncclscope analyze` scales from 8 to 16,384 ranks.

    OMP_NUM_THREADS=1 python benchmarks/scale.py                       # 8 ... 16,384 ranks
    python benchmarks/scale.py --sizes 8,64 --events-per-rank 2000     # a quick look
    python benchmarks/scale.py --sizes 1024,4096,16384                 # the sizes the targets name
    python benchmarks/scale.py --sizes 1024 --profile                  # plus wall/CPU/peak RSS per stage

For each size, benchmarks/synth.py writes a synthetic hung run directory
(pp x dp x tp mesh, 1F1B, one rank skips a data-parallel all_reduce in the
last step; groups.json in the runtime's per-rank format, so a 16,384-rank
directory is a few GB, not 36) into a temporary directory; then a fresh
process loads it (`ncclscope.load.foreign.load_any`, as `ncclscope analyze`) and
runs the one analysis every face shows (`ncclscope.verdict.run`), and we
measure its load time, analysis time, wall time and peak resident memory
(`os.wait4` rusage of that one child; the child also reports its peak after
loading). The wall time includes the interpreter start and imports (about
1-2 s: the 8-rank row is mostly that). Events per size = ranks x
--events-per-rank, capped at --max-events but never below
--min-events-per-rank per rank (so 1,024 and 4,096 ranks get 10 M events,
16,384 ranks 32 M). A child past --max-rss-mb is killed and the size is
reported as over the limit. The run directory is deleted after each size.

Printed: per size the generation time, then ranks | events | load s |
analyze s | wall s | peak MB (after load, overall) | s per M events, the
growth exponents k between consecutive sizes (t ~ x^k, mem ~ x^k; 1.0 is
linear), and whether the verdict's first rank is the one synth.py made skip
its all_reduce (a check, not a timing; exit status 1 only when a size could
not be run).
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


def child(run: str, out: str, profile: bool = False) -> int:
    """In the measured process: load, analyze, write the JSON report plus the timings.

    With `profile`, the index views and the hang questions are first built one by one (each
    timed, with the peak resident memory while it ran: the kernel's high-water mark, reset per
    stage, else sampled every 20 ms), then the one analysis runs on the warm index: the per-stage
    rows say where the time and memory go."""
    import resource
    t0 = time.perf_counter()
    from ncclscope.cli.commands import run_analyses
    from ncclscope.cli.output import json_report
    from ncclscope.load.foreign import load_any
    stages: list[tuple[str, float, float, float, float]] = []
    sampler = _Sampler() if profile else None
    t1, c1 = time.perf_counter(), time.process_time()
    trace = load_any(run)
    t2, c2 = time.perf_counter(), time.process_time()
    load_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    load_s, load_cpu = t2 - t1, c2 - c1
    if sampler is not None:
        stages.append(("load", load_s, load_cpu, load_peak, _rss_mb(os.getpid())))
        _stage_line(stages[-1])
        _profile_stages(trace, sampler, stages)
        sampler.start()
        t2, c2 = time.perf_counter(), time.process_time()     # analyze_s: analysis.run on the warm index
    analysis = run_analyses(trace)
    t3, c3 = time.perf_counter(), time.process_time()
    report = json_report(trace, analysis)
    # the stages reset the kernel's high-water mark, which the parent's rusage reads too: say the peak here
    peak = max([load_peak] + [row[3] for row in stages] + ([sampler.peak] if sampler is not None else []))
    report["timing"] = {"import_s": t1 - t0, "load_s": load_s, "analyze_s": t3 - t2,
                        "load_cpu_s": load_cpu, "analyze_cpu_s": c3 - c2, "load_peak_mb": load_peak,
                        "peak_mb": peak if sampler is not None else None,
                        "stages": stages, "analyses_s": getattr(analysis, "timings_s", {})}
    Path(out).write_text(json.dumps(report, default=str))
    return 0


class _Sampler:
    """Peak resident memory since the last `start()`: the kernel's high-water mark (VmHWM, reset by writing 5
    to /proc/self/clear_refs) where Linux allows it, so that a spike shorter than a sample counts; else the
    resident set sampled every 20 ms by a daemon thread."""

    def __init__(self) -> None:
        import threading
        self._peak = 0.0
        self.exact = _reset_hwm()
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        while True:
            self._peak = max(self._peak, _rss_mb(os.getpid()))
            time.sleep(0.02)

    @property
    def peak(self) -> float:
        return max(self._peak, _rss_mb(os.getpid(), "VmHWM:") if self.exact else 0.0)

    def start(self) -> None:
        self.exact = _reset_hwm()
        self._peak = _rss_mb(os.getpid())


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _profile_stages(trace: object, sampler: _Sampler, stages: list) -> None:
    from ncclscope.hang.collectives import analyze_collectives
    from ncclscope.hang.group_checks import analyze_groups
    from ncclscope.index.views import index_of
    from ncclscope.hang.p2p import analyze_p2p
    from ncclscope.hang.schedule_check import analyze_schedule
    from ncclscope.hang.waitfor import analyze_waits
    ix = index_of(trace)
    steps = [(f"index.{v}", (lambda v=v: getattr(ix, v))) for v in
             ("coll", "instances", "max_seq", "groups", "missing", "p2p", "p2p_pairs", "end", "step_windows")]
    steps += [("analyze_collectives", lambda: analyze_collectives(ix)), ("analyze_p2p", lambda: analyze_p2p(ix)),
              ("analyze_groups", lambda: analyze_groups(ix)), ("analyze_waits", lambda: analyze_waits(ix)),
              ("analyze_schedule", lambda: analyze_schedule(ix))]
    from ncclscope.perf import performance as P
    steps += [(f"perf.{n}", (lambda f=f: f(trace))) for n, f in
              (("bubbles", P.analyze_bubbles), ("stragglers", P.analyze_stragglers), ("comm", P.analyze_comm),
               ("divergence", P.analyze_divergence), ("utilization", P.analyze_utilization), ("moe", P.analyze_moe),
               ("memory", P.analyze_memory))]
    for name, fn in steps:
        sampler.start()
        t, c = time.perf_counter(), time.process_time()
        fn()
        stages.append((name, time.perf_counter() - t, time.process_time() - c, sampler.peak, _rss_mb(os.getpid())))
        _stage_line(stages[-1])


def _stage_line(row: tuple) -> None:
    """One stage on stderr as it ends: a child killed at the memory limit still says how far it got."""
    name, w, c, peak, after = row
    print(f"      {name:24s} wall {w:6.2f} s  cpu {c:6.2f} s  peak {peak:7,.0f} MB  after {after:7,.0f} MB",
          file=sys.stderr, flush=True)


def _rss_mb(pid: int, field: str = "VmRSS:") -> float:
    try:
        with open(f"/proc/{pid}/status") as fh:
            for line in fh:
                if line.startswith(field):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def measure(run: Path, out_json: Path, timeout_s: float, max_rss_mb: float,
            profile: bool = False) -> tuple[float, float, int]:
    """(wall s, peak RSS MB, exit code) of the child (load + analyze) in a fresh process."""
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"),
               PYTHONWARNINGS="ignore::FutureWarning")
    t0 = time.perf_counter()
    extra = ["--profile"] if profile else []
    proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", str(run), str(out_json)] + extra,
                            stderr=subprocess.PIPE, cwd=ROOT, env=env, start_new_session=True)
    deadline = t0 + timeout_s
    while True:
        pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
        if pid:
            break
        over = _rss_mb(proc.pid) > max_rss_mb
        if over or time.perf_counter() > deadline:
            os.killpg(proc.pid, 9)
            pid, status, ru = os.wait4(proc.pid, 0)
            proc.returncode = -9
            if profile and proc.stderr:          # the stages it finished before it was stopped
                print(proc.stderr.read().decode(errors="replace")[-4000:], file=sys.stderr, flush=True)
            raise TimeoutError(f"over {max_rss_mb:.0f} MB of memory" if over
                               else f"did not finish in {timeout_s:.0f} s")
        time.sleep(0.05)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        err = proc.stderr.read().decode(errors="replace") if proc.stderr else ""
        print(err[-2000:], file=sys.stderr)
    return wall, ru.ru_maxrss / 1024, proc.returncode   # Linux: ru_maxrss in KiB


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="8,64,256,1024,4096,16384", help="comma-separated rank counts")
    ap.add_argument("--events-per-rank", type=int, default=10_000)
    ap.add_argument("--max-events", type=int, default=10_000_000, help="cap on the events of one size")
    ap.add_argument("--min-events-per-rank", type=int, default=2_000, help="floor under the cap, per rank")
    ap.add_argument("--tmp", default=tempfile.gettempdir(), help="where the synthetic traces are written")
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per-size limit for load + analyze")
    ap.add_argument("--max-rss-mb", type=float, default=8_000, help="kill the child past this resident memory")
    ap.add_argument("--run-dir", default="", help="measure this already generated run (one size, kept)")
    ap.add_argument("--profile", action="store_true",
                    help="also time each index view and hang question on its own (wall, CPU, peak RSS per stage)")
    ap.add_argument("--child", nargs=2, metavar=("RUN", "OUT"), help=argparse.SUPPRESS)
    ns = ap.parse_args(argv)
    if ns.child:
        return child(*ns.child, profile=ns.profile)
    import synth

    sizes = [int(s) for s in ns.sizes.split(",") if s.strip()]
    if ns.run_dir:       # one run, measured once, at its own size (not once per --sizes entry)
        sizes = [int(json.loads((Path(ns.run_dir) / "run.json").read_text()).get("world_size", 0))]
    print(f"ncclscope load + analysis.run on synthetic hung traces; {ns.events_per_rank:,} events per rank, "
          f"at most {ns.max_events:,} per size but at least {ns.min_events_per_rank:,} per rank; "
          f"{os.cpu_count()} CPUs, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', '(unset)')}", flush=True)
    rows = []
    for ranks in sizes:
        events = min(ranks * ns.events_per_rank, max(ns.max_events, ranks * ns.min_events_per_rank))
        tmp = Path(tempfile.mkdtemp(prefix=f"ncclscope-scale-{ranks}-", dir=ns.tmp))
        try:
            t = time.perf_counter()
            run = Path(ns.run_dir) if ns.run_dir else synth.generate(tmp / "run", ranks=ranks, events=events,
                                                                      hang=True, seed=0)
            gen_s = time.perf_counter() - t
            truth = json.loads((run / "run.json").read_text()).get("synthetic", {})
            rows_written = truth.get("events") or sum(_rows(p) for p in run.glob("rank-*/events.arrows"))
            meta = sum(p.stat().st_size for p in (run / "rank-00001").iterdir() if not p.name.endswith(".arrows"))
            size_gb = sum(p.stat().st_size for p in run.rglob("*") if p.is_file()) / 1e9
            wall, mb, rc = measure(run, tmp / "analyze.json", ns.timeout_s, ns.max_rss_mb, ns.profile)
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
        tm = report.get("timing", {})
        mb = max(mb, tm.get("peak_mb") or 0.0)       # --profile: the child's own account (see child())
        rows.append((ranks, rows_written, tm.get("load_s", float("nan")), tm.get("analyze_s", float("nan")), wall,
                     tm.get("load_peak_mb", float("nan")), mb, rc, named))
        print(f"  {ranks} ranks: generated {rows_written:,} event rows in {gen_s:.1f} s ({size_gb:.2f} GB; "
              f"rank 1's metadata {meta:,} bytes); load {tm.get('load_s', 0):.1f} s (cpu "
              f"{tm.get('load_cpu_s', 0):.1f}), analyze {tm.get('analyze_s', 0):.1f} s (cpu "
              f"{tm.get('analyze_cpu_s', 0):.1f}), wall {wall:.1f} s, {mb:.0f} MB peak, exit {rc}; "
              f"verdict: {report['verdict'][:100]}", flush=True)
        for name, w, c, peak, after in tm.get("stages", []):
            print(f"      {name:24s} wall {w:6.2f} s  cpu {c:6.2f} s  peak {peak:7,.0f} MB  after {after:7,.0f} MB")
        if tm.get("stages"):
            shown = sorted(tm.get("analyses_s", {}).items(), key=lambda kv: -kv[1])[:8]
            print("      analysis.run on the warm index: " + ", ".join(f"{k} {v:.1f} s" for k, v in shown))

    print()
    print("| ranks | events | load s | analyze s | wall s | peak MB after load | peak MB | s per M events "
          "| verdict's first rank is the skipper |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for ranks, ev, load_s, an_s, wall, lmb, mb, rc, named in rows:
        print(f"| {ranks:,} | {ev / 1e6:.2f} M | {load_s:.1f} | {an_s:.1f} | {wall:.1f} | {lmb:,.0f} | {mb:,.0f} | "
              f"{wall / (ev / 1e6):.2f} | {named} |")
    if len(rows) > 1:
        print()
        print("growth between consecutive sizes: k in t ~ x^k and mem ~ x^k, x = events or ranks "
              "(1.0 = linear; 'vs events' is left out where the cap kept events about equal):")
        for a, b in zip(rows, rows[1:]):
            lr, le = math.log(b[0] / a[0]), math.log(b[1] / a[1])
            lt, lm = math.log(b[4] / a[4]), math.log(b[6] / a[6])
            vs_ev = f"vs events: time k = {lt / le:.2f}, memory k = {lm / le:.2f}; " if le > math.log(1.5) else ""
            print(f"  {a[0]:>6,} -> {b[0]:>6,} ranks: {vs_ev}vs ranks: time k = {lt / lr:.2f}, "
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
