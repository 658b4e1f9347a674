"""Flight Recorder accuracy sweep: plain-PyTorch gloo jobs with known culprits, judged from their dumps.

    OMP_NUM_THREADS=1 python benchmarks/fr_sweep.py                  # every scenario, 4 and 8 ranks
    OMP_NUM_THREADS=1 python benchmarks/fr_sweep.py --worlds 4 --scenarios skip,wrong_group

Each job (tests/fr_jobs.py: a tp x dp mesh of new_groups, no ncclscope code in
it) is broken by one rank drawn at random (seeded), leaves one dump per rank,
and is analyzed with `ncclscope analyze DIR --json` in-process. A drill is
right when the headline's kind is the scenario's expected kind and its root
ranks are exactly the culprit; a healthy job is right when nothing at warning
level or above is found. Prints one row per job and the totals.
"""
from __future__ import annotations

import argparse
import io
import json
import random
import sys
import tempfile
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))


def analyze(path: Path) -> tuple[int, dict]:
    from ncclscope.cli import main
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(["analyze", str(path), "--json"])
    try:
        return rc, json.loads(out.getvalue())
    except json.JSONDecodeError:
        return rc, {"verdict": f"(no JSON; rc {rc}: {err.getvalue().strip()[:160]})", "findings": []}


def judge(scenario: str, culprit: int, report: dict, expected: dict) -> tuple[bool, bool]:
    """(culprit right, cause right); for healthy: (no false positive, same)."""
    findings = report.get("findings", [])
    if scenario == "healthy":
        ok = not any(f["severity"] in ("error", "warning") for f in findings)
        return ok, ok
    heads = [f for f in findings if f["data"].get("role") == "headline"]
    if not heads:
        return False, False
    return list(heads[0]["ranks"]) == [culprit], heads[0]["kind"] == expected[scenario]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--worlds", default="4,8")
    ap.add_argument("--scenarios", default="")
    ap.add_argument("--out", default="")
    ns = ap.parse_args()
    import torch  # noqa: F401  (imported once, before the jobs fork)
    from fr_jobs import EXPECTED_KIND, SCENARIOS, make_dumps

    rng = random.Random(ns.seed)
    scenarios = ns.scenarios.split(",") if ns.scenarios else list(SCENARIOS)
    base = Path(ns.out) if ns.out else Path(tempfile.mkdtemp(prefix="ncclscope-fr-sweep-"))
    base.mkdir(parents=True, exist_ok=True)
    rows = []
    t0 = time.monotonic()
    for world in (int(w) for w in ns.worlds.split(",")):
        for sc in scenarios:
            culprit = rng.randrange(world)
            d = make_dumps(sc, world, culprit, base)
            rc, report = analyze(d)
            ok_rank, ok_kind = judge(sc, culprit, report, EXPECTED_KIND)
            rows.append((sc, world, culprit, ok_rank, ok_kind))
            mark = "ok" if ok_rank and ok_kind else ("FP" if sc == "healthy" else "MISS")
            print(f"{mark:4s} {sc:12s} world {world} culprit {culprit}: rc {rc} {report.get('verdict', '')[:120]}",
                  flush=True)
    drills = [r for r in rows if r[0] != "healthy"]
    healthy = [r for r in rows if r[0] == "healthy"]
    print(f"\n{len(drills)} dumps with a fault, {len(healthy)} healthy, {time.monotonic() - t0:.0f} s; under {base}")
    print(f"culprit {sum(r[3] for r in drills)}/{len(drills)}, cause {sum(r[4] for r in drills)}/{len(drills)}, "
          f"false positives {sum(not r[3] for r in healthy)}/{len(healthy)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
