"""`ncclscope demo`: a short tour of real multi-rank jobs on this machine.

Each stop runs a real job with `ncclscope train` (gloo ranks on loopback),
prints the analyzer's verdict, and writes the HTML report next to the run:

  healthy            TP x PP x DP on 8 ranks, 1F1B: no problem to find
  pipeline-deadlock  pipeline rank 0 posts its recv before its send (p2p_order)
  wrong-group        rank 2 issues its gradient all-reduce on the world group
  straggler          rank 3 computes 4x slower than its peers
  diverging-replica  rank 1 ignores its reduced gradient once (desync_grad)

It ends by saying how to open the TUI on the hung run. `--quick` runs a
reduced tour (used by the test suite).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Stop:
    name: str
    story: str
    args: tuple[str, ...]
    expect: tuple[str, ...]   # verdict prefixes the stop may end with


TOUR = (
    Stop("healthy", "a TP x PP x DP job with no fault (8 ranks on this machine's cores, 1F1B, 4 microbatches): "
         "nothing hangs, and the scheduler noise of 8 ranks sharing the cores is not called a problem",
         ("--tp", "2", "--pp", "2", "--dp", "2", "--microbatches", "4", "--batch-size", "16", "--steps", "3"),
         ("OK",)),
    Stop("pipeline-deadlock", "pipeline rank 0 posts its recv before its send at step 1",
         ("--pp", "2", "--dp", "2", "--microbatches", "4", "--batch-size", "16", "--steps", "3",
          "--timeout-s", "3", "--inject", "p2p_order:rank=0,step=1"), ("SCHEDULE DEVIATION",)),
    Stop("wrong-group", "rank 2 issues its gradient all-reduce on the world group at step 1",
         ("--dp", "4", "--steps", "3", "--timeout-s", "3", "--inject", "wrong_group:rank=2,step=1,use=world"),
         ("WRONG GROUP",)),
    Stop("straggler", "rank 3 computes 4x slower than its three peers (a model big enough, and steps enough, "
         "that being last is significant against the scheduler noise of ranks sharing cores)",
         ("--dp", "4", "--steps", "10", "--n-embd", "64", "--block-size", "64", "--batch-size", "16",
          "--inject", "slow:rank=3,factor=4"), ("STRAGGLER",)),
    Stop("diverging-replica", "rank 1 keeps its own gradient instead of the averaged one at step 2",
         ("--dp", "2", "--steps", "5", "--inject", "desync_grad:rank=1,step=2"), ("DIVERGED",)),
)
QUICK = ("pipeline-deadlock", "diverging-replica")


def run_stop(stop: Stop, root: Path, out=None) -> tuple[str, Path]:
    """Run one stop: job, verdict, report. Returns (verdict, run directory)."""
    out = sys.stdout if out is None else out
    from ncclscope.verdict import run
    from ncclscope.report.html import write_report
    from ncclscope.load.trace import load
    from ncclscope.runtime import config as C
    from ncclscope.runtime.launch import launch

    parser = argparse.ArgumentParser()
    C.add_arguments(parser)
    cfg = C.from_args(parser.parse_args([*stop.args, "--out", str(root / stop.name)]))
    t0 = time.perf_counter()
    run_dir, job = launch(cfg, quiet=True)   # not `run`: that name is the composer imported above
    trace = load(run_dir)
    analysis = run(trace)
    verdict = analysis.verdict
    report = root / f"{stop.name}.html"
    write_report(trace, report, analysis=analysis)
    print(f"\n== {stop.name}: {stop.story}", file=out)
    print(f"   ncclscope train {' '.join(stop.args)}", file=out)
    print(f"   {trace.world_size} ranks, {job['end_reason']} in {time.perf_counter() - t0:.1f} s", file=out)
    print(f"   {verdict}", file=out)
    print(f"   report: {report}", file=out)
    return verdict, run_dir


def run_demo(out_dir: str = "", quick: bool = False, out=None) -> int:
    out = sys.stdout if out is None else out
    root = Path(out_dir or f"runs/demo-{_dt.datetime.now().strftime('%Y%m%d-%H%M%S')}")
    if root.exists() and any(root.iterdir()):
        print(f"ncclscope demo: {root} is not empty; choose another --out", file=sys.stderr)
        return 2
    root.mkdir(parents=True, exist_ok=True)
    stops = [s for s in TOUR if not quick or s.name in QUICK]
    print(f"ncclscope demo: {len(stops)} real multi-rank jobs on this machine, written under {root}/", file=out)
    hung = None
    misses = []
    for stop in stops:
        verdict, run_dir = run_stop(stop, root, out)
        if not verdict.startswith(stop.expect):
            misses.append(f"{stop.name}: expected {' or '.join(stop.expect)}, got {verdict[:80]}")
        if hung is None and stop.expect[0] in ("SCHEDULE DEVIATION", "DEADLOCK", "WRONG GROUP", "HANG"):
            hung = run_dir
    print("\nNext:", file=out)
    if hung is not None:
        print(f"   ncclscope tui {hung}        # walk from the verdict to the guilty rank's stack", file=out)
    print(f"   ncclscope analyze {root}/<run> --json   # the same diagnosis, machine-readable", file=out)
    if misses:
        print("\nncclscope demo: some stops did not end as expected:\n  " + "\n  ".join(misses), file=sys.stderr)
        return 1
    return 0
