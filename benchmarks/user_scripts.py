"""Accuracy on bugs users write: plain-PyTorch scripts (benchmarks/user_bugs/, no ncclscope code in
them, each broken by an `if` on one rank) under `ncclscope run`, judged from `ncclscope analyze --json`.

    OMP_NUM_THREADS=1 python benchmarks/user_scripts.py
    OMP_NUM_THREADS=1 python benchmarks/user_scripts.py --only subgroup,skip_nostep

A script is right when the headline's kind is the expected one and its root ranks are the expected ones
(for a deadlock, either pair of the symmetric bug). Every job has a hard timeout (its process group
is killed), so the sweep cannot hang. Prints one row per script and the total.

A case in STOP_AFTER_S is stopped from outside the way a scheduler's time limit stops a job: its whole
process group gets SIGTERM once every rank has begun its hung op (then at most that many seconds later).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUGS = ROOT / "benchmarks" / "user_bugs"
# script -> (ranks, expected headline kind, acceptable root-rank sets)
CASES: dict[str, tuple[int, str, list[list[int]]]] = {
    "stuck_sigterm": (4, "stuck_in_compute", [[2]]),
    "a2a_split": (4, "collective_mismatch", [[1]]),
    "tag_mismatch": (4, "unmatched_p2p", [[1]]),
    "ddp_model": (4, "dead_rank", [[3]]),
    "bcast_src": (4, "collective_mismatch", [[2]]),
    "recv_first": (4, "deadlock", [[0, 1], [2, 3]]),
    "ag_size": (4, "collective_mismatch", [[3]]),
    "subgroup": (4, "wrong_group", [[1]]),
    "extra_barrier": (4, "collective_mismatch", [[0]]),
    "skip_step": (4, "hang", [[2]]),
    "skip_nostep": (4, "hang", [[2]]),
    "log_extra": (4, "hang", [[1]]),
    "wrong_peer": (4, "unmatched_p2p", [[0]]),
    "ddp_skip": (4, "hang", [[2]]),
    "p2p_size": (4, "collective_mismatch", [[1]]),
    "ag_list": (4, "dead_rank", [[3]]),
    "late_swap": (4, "unmatched_p2p", [[2]]),
}

# script -> seconds after the hang begins when the job gets SIGTERM (as a scheduler's time limit would)
STOP_AFTER_S: dict[str, float] = {"stuck_sigterm": 3.0}


def _hung(out: Path, nproc: int) -> bool:
    """Every rank has written its first batch of rows and one more second passed: the hang is on."""
    files = [out / f"rank-{r:05d}" / "events.arrows" for r in range(nproc)]
    return all(f.exists() and f.stat().st_size > 4096 for f in files)


def run_case(name: str, out: Path, timeout_s: float) -> tuple[str, list[int], str, float]:
    nproc = CASES[name][0]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "ncclscope", "run", "--nproc", str(nproc), "--timeout-s", "10",
                             "--no-analyze", "--out", str(out), "--", str(BUGS / f"{name}.py")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        if name in STOP_AFTER_S:
            deadline = t0 + timeout_s / 2
            while proc.poll() is None and time.perf_counter() < deadline and not _hung(out, nproc):
                time.sleep(0.2)
            time.sleep(STOP_AFTER_S[name])
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=max(1.0, timeout_s - (time.perf_counter() - t0)))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    took = time.perf_counter() - t0
    res = subprocess.run([sys.executable, "-m", "ncclscope", "analyze", "--json", str(out)], capture_output=True,
                         text=True, timeout=300)
    try:
        rep = json.loads(res.stdout)
    except json.JSONDecodeError:
        return "", [], f"(no JSON: rc {res.returncode}: {res.stderr.strip()[:120]})", took
    heads = [f for f in rep.get("findings", []) if f.get("data", {}).get("role") == "headline"]
    kind, ranks = (heads[0]["kind"], sorted(heads[0]["ranks"])) if heads else ("", [])
    return kind, ranks, rep.get("verdict", ""), took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="comma-separated script names")
    ap.add_argument("--timeout-s", type=float, default=120.0, help="hard limit per job")
    ns = ap.parse_args()
    names = [n for n in CASES if not ns.only or n in ns.only.split(",")]
    right = 0
    with tempfile.TemporaryDirectory(prefix="ncclscope-user-bugs-") as tmp:
        for name in names:
            kind, ranks, verdict, took = run_case(name, Path(tmp) / name, ns.timeout_s)
            want_kind, want_ranks = CASES[name][1], CASES[name][2]
            ok = kind == want_kind and ranks in want_ranks
            right += ok
            print(f"{'ok  ' if ok else 'MISS'} {name:14s} {took:5.1f} s  {verdict[:150]}", flush=True)
    print(f"\nright {right}/{len(names)} (root ranks and headline kind)")
    return 0 if right == len(names) else 1


if __name__ == "__main__":
    sys.exit(main())
