"""How fast does a hang become a verdict? Prints two figures measured on this machine.

    OMP_NUM_THREADS=1 python benchmarks/diagnosis.py                  # both parts
    python benchmarks/diagnosis.py --part a                           # only the live drill
    python benchmarks/diagnosis.py --part b --synth-dir /tmp/synth    # reuse a generated trace

(a) Fault to verdict. Runs `ncclscope train --dp 4 --steps 6 --timeout-s 10
    --inject skip:rank=2,step=3` as a subprocess and timestamps every stdout
    line as it arrives; the verdict is the first stdout line (the progress bar
    goes to stderr). The fault onset comes from the trace: the moment the
    skipper went past the skipped op, i.e. when its peers began the instance
    it never began (the headline's `skipped` instance, earliest begin among
    the peers). Trace times are wall-clock ns aligned to rank 0, the same
    clock as this process's time.time() on one host. Target: <= timeout + 5 s.

(b) Analysis at scale. Generates (or reuses) a synthetic hung run directory
    of 1,024 ranks and ~10 million event rows with benchmarks/synth.py
    (`generate(out_dir, ranks, events, hang=True, seed)`, ground truth in
    run.json["synthetic"]), then in a fresh subprocess times
    `ncclscope.load.trace.load` and `analysis.diagnose.diagnose` separately and
    reports the child's peak RSS (ru_maxrss) and whether the verdict names the
    planted root. Targets: <= 30 s and <= 4 GB on 2 cores.

Wall times on a shared 2-core machine depend on what else runs; the load
average at the start is printed next to them, with CPU times for (b).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP_RANK, SKIP_STEP, TIMEOUT_S = 2, 3, 10.0
TARGET_B_S, TARGET_B_GB = 30.0, 4.0


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONWARNINGS="ignore::FutureWarning")


def _load() -> str:
    return " ".join(f"{x:.1f}" for x in os.getloadavg())


# --------------------------------------------------------------------------
# (a) fault onset -> printed verdict
# --------------------------------------------------------------------------
def part_a(work: Path) -> dict:
    run_dir = work / "skip-run"
    cmd = [sys.executable, "-m", "ncclscope", "train", "--dp", "4", "--steps", "6", "--timeout-s", str(TIMEOUT_S),
           "--inject", f"skip:rank={SKIP_RANK},step={SKIP_STEP}", "--out", str(run_dir)]
    print(f"(a) {' '.join(cmd[2:])}   [load {_load()}]", flush=True)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT,
                            start_new_session=True)
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)   # type: ignore[arg-type]
    reader.start()
    lines: list[tuple[float, str]] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append((time.time(), line.rstrip("\n")))
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise SystemExit("(a) ncclscope train did not end in 120 s")
    reader.join(timeout=5)
    shown = [(t, s) for t, s in lines if s.strip()]
    if not shown:
        raise SystemExit("(a) no verdict printed:\n" + "".join(err[-20:]))
    t_verdict, verdict = shown[0]

    sys.path.insert(0, str(ROOT))
    from ncclscope.verdict.diagnose import diagnose
    from ncclscope.load.trace import load
    trace = load(run_dir)
    d = diagnose(trace)
    head = d.headline
    onset_ns, how = _onset(trace, head)
    out = {"verdict": verdict, "exit": proc.returncode, "root_ok": bool(head and head.ranks == [SKIP_RANK]),
           "onset_how": how, "fault_to_verdict_s": t_verdict - onset_ns / 1e9 if onset_ns else None,
           "target_s": TIMEOUT_S + 5.0}
    print(f"    verdict: {verdict}")
    print(f"    onset: {how}")
    if out["fault_to_verdict_s"] is not None:
        ok = "meets" if out["fault_to_verdict_s"] <= out["target_s"] else "MISSES"
        print(f"    fault onset -> printed verdict: {out['fault_to_verdict_s']:.1f} s "
              f"(target <= timeout {TIMEOUT_S:g} s + 5 s = {out['target_s']:g} s: {ok}); "
              f"names rank {SKIP_RANK}: {out['root_ok']}")
    return out


def _onset(trace, head) -> tuple[int | None, str]:
    """When the skipper went past the skipped op: the peers' earliest begin of the instance it never began."""
    ops = trace.ops
    g = k = None
    if head is not None and head.data.get("skipped"):
        g, k = str(head.data["skipped"][0]), int(head.data["skipped"][1])
    if g is None:
        return None, "no skipped instance in the headline"
    inst = ops[(ops["process_group"].astype(str) == g) & (ops["collective_seq_id"] == k)
               & (ops["rank"] != SKIP_RANK)]
    if not len(inst):
        return None, f"no peer began {g} #{k}"
    t = int(inst["start_ns"].min())
    clock = time.strftime("%H:%M:%S", time.localtime(t / 1e9)) + f".{int(t % 1_000_000_000 / 1e6):03d}"
    return t, f"peers began {g} #{k} (step {int(inst['step'].min())}) at {clock}; the op rank {SKIP_RANK} skipped"


# --------------------------------------------------------------------------
# (b) 1,024 ranks, ~10 M events: load + diagnose in a fresh process
# --------------------------------------------------------------------------
CHILD = r"""
import json, resource, sys, time
t0 = time.perf_counter(); c0 = time.process_time()
from ncclscope.load.trace import load
from ncclscope.verdict.diagnose import diagnose
rss_imports = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
t1 = time.perf_counter(); c1 = time.process_time()
trace = load(sys.argv[1])
t2 = time.perf_counter(); c2 = time.process_time()
rss_load = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
d = diagnose(trace)
t3 = time.perf_counter(); c3 = time.process_time()
h = d.headline
print(json.dumps({"import_s": t1 - t0, "load_s": t2 - t1, "diagnose_s": t3 - t2, "load_cpu_s": c2 - c1,
                  "diagnose_cpu_s": c3 - c2, "rows": int(len(trace.events)), "ranks": trace.world_size,
                  "rss_imports_kb": rss_imports, "rss_after_load_kb": rss_load,
                  "rss_kb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss,
                  "verdict": d.verdict, "kind": h.kind if h else None, "roots": list(h.ranks) if h else []}))
"""


def part_b(work: Path, synth_dir: str, ranks: int, events: int, seed: int) -> dict:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    sys.path.insert(0, str(ROOT))
    path = Path(synth_dir) if synth_dir else work / "synth"
    if not (path / "run.json").exists():
        try:
            from synth import generate
        except ImportError:
            raise SystemExit("(b) benchmarks/synth.py (generate) is missing")
        t0 = time.perf_counter()
        generate(path, ranks=ranks, events=events, hang=True, seed=seed)
        print(f"(b) generated {path} in {time.perf_counter() - t0:.0f} s")
    truth = json.loads((path / "run.json").read_text()).get("synthetic", {})
    print(f"(b) load + diagnose {path}: {truth.get('events', '?'):,} event rows, {ranks} ranks, planted root "
          f"rank {truth.get('hang_rank')} skipped {truth.get('skipped')}   [load {_load()}]", flush=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    proc = subprocess.run([sys.executable, "-c", CHILD, str(path)], capture_output=True, text=True, env=_env(),
                          cwd=ROOT, timeout=900)
    if proc.returncode != 0:
        raise SystemExit(f"(b) analysis child failed:\n{proc.stderr[-3000:]}")
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    child_rss = max(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, before, r["rss_kb"])
    total = r["load_s"] + r["diagnose_s"]
    r.update(total_s=total, peak_rss_gb=child_rss / 1024 ** 2, planted=truth.get("hang_rank"),
             root_ok=r["roots"] == [truth.get("hang_rank")])
    print(f"    verdict: {r['verdict'][:300]}")
    print(f"    load {r['load_s']:.1f} s (cpu {r['load_cpu_s']:.1f}) + diagnose {r['diagnose_s']:.1f} s "
          f"(cpu {r['diagnose_cpu_s']:.1f}) = {total:.1f} s (target <= {TARGET_B_S:g} s: "
          f"{'meets' if total <= TARGET_B_S else 'MISSES'}); load is {100 * r['load_s'] / total:.0f}% of it")
    print(f"    peak RSS {r['peak_rss_gb']:.2f} GB (after imports {r['rss_imports_kb'] / 1024 ** 2:.2f} GB, after load "
          f"{r['rss_after_load_kb'] / 1024 ** 2:.2f} GB; target <= {TARGET_B_GB:g} GB: "
          f"{'meets' if r['peak_rss_gb'] <= TARGET_B_GB else 'MISSES'})")
    print(f"    names the planted root rank {truth.get('hang_rank')}: {r['root_ok']} "
          f"(headline {r['kind']} {r['roots']})")
    return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--part", choices=("a", "b", "both"), default="both")
    ap.add_argument("--synth-dir", default="", help="existing synthetic run directory (else generated in a temp dir)")
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--events", type=int, default=10_000_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (run directories)")
    ns = ap.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"
    work = Path(tempfile.mkdtemp(prefix="ncclscope-bench-diag-"))
    try:
        if ns.part in ("a", "both"):
            part_a(work)
        if ns.part in ("b", "both"):
            part_b(work, ns.synth_dir, ns.ranks, ns.events, ns.seed)
    finally:
        if ns.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
