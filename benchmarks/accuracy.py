"""Accuracy sweep: does the verdict name the right rank and cause, on layouts the tests never saw?

    OMP_NUM_THREADS=1 python benchmarks/accuracy.py                 # the full seeded matrix
    OMP_NUM_THREADS=1 python benchmarks/accuracy.py --limit 12      # the first 12 drills only
    OMP_NUM_THREADS=1 python benchmarks/accuracy.py --seed 7 --out /tmp/acc
    OMP_NUM_THREADS=1 python benchmarks/accuracy.py --random-layouts 30 --healthy 6 --seed 11   # drawn layouts
    python benchmarks/accuracy.py --reanalyze /tmp/acc                  # judge kept run dirs again, no jobs

A seeded matrix of real jobs: every `--inject` kind that applies to a layout x
layouts (dp, tp, pp gpipe / 1f1b / interleaved, cp, ep, ZeRO 1/2, 3-D and 4-D
meshes), with the culprit rank and step drawn at random, plus healthy runs.
Each job runs `ncclscope train` exactly as a user would (through the warmed
zygote of tests/test_drills_e2e.py, so torch is imported once) and is judged by
`ncclscope analyze --json`:

- culprit: the headline's root ranks are exactly the injected rank;
- cause: the headline's kind is the one the fault kind must produce;
- false positive: a healthy run with any warning or error, or exit code != 0.

`--random-layouts N` replaces the fixed layouts with N drawn ones (`random_matrix`:
world 2, 4 or 8 spread at random over tp, pp, cp and dp, with expert parallelism,
ZeRO, the pipeline schedule, virtual stages, microbatches and the batch drawn
too; every draw is checked by the runtime's own `RunConfig.validate` and
`check_specs`), one drill of a random applicable kind on each, so the sweep
meets layouts no rule was shaped on.

It prints one row per drill and a table per kind and per layout. Every job has a
hard timeout (the zygote kills its whole session), so the sweep cannot hang.

`--reanalyze DIR` judges the run directories a sweep kept under DIR (`--out`)
again with today's analyzer, without rerunning any job: the cases are rebuilt
from the same seed, each `DIR/<case>/run` is analyzed by `ncclscope analyze
--json` as a user would, and the same tables are printed. Cases whose
directory is missing are skipped (and counted).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

# fault kind -> the headline kind it must produce
CAUSE = {
    "skip": "hang", "hang": "stuck_in_compute", "kill": "dead_rank", "crash": "dead_rank",
    "wrong_group": "wrong_group", "p2p_order": "schedule_deviation", "mismatch": "collective_mismatch",
    "slow": "straggler", "nan": "nan", "desync_grad": "grad_divergence", "group_order": "group_mismatch",
}


@dataclass(frozen=True)
class Layout:
    name: str
    argv: tuple[str, ...]
    world: int
    pp: int = 1
    dp: int = 1

    def has(self, dim: str) -> bool:
        return f"--{dim}" in self.argv


LAYOUTS = [
    Layout("dp4", ("--dp", "4"), 4, dp=4),
    Layout("tp2dp2", ("--tp", "2", "--dp", "2"), 4, dp=2),
    Layout("pp2-gpipe-dp2", ("--pp", "2", "--dp", "2", "--schedule", "gpipe", "--microbatches", "2"), 4, pp=2, dp=2),
    Layout("pp2-1f1b-dp2", ("--pp", "2", "--dp", "2", "--schedule", "1f1b", "--microbatches", "2"), 4, pp=2, dp=2),
    Layout("pp2-interleaved", ("--pp", "2", "--vpp", "2", "--schedule", "interleaved", "--microbatches", "2",
                               "--n-layer", "4"), 2, pp=2),
    Layout("cp2dp2", ("--cp", "2", "--dp", "2"), 4, dp=2),
    Layout("dp4ep2", ("--dp", "4", "--ep", "2"), 4, dp=4),
    Layout("dp4-zero1", ("--dp", "4", "--zero", "1"), 4, dp=4),
    Layout("dp4-zero2", ("--dp", "4", "--zero", "2"), 4, dp=4),
    Layout("tp2pp2dp2", ("--tp", "2", "--pp", "2", "--dp", "2", "--microbatches", "2"), 8, pp=2, dp=2),
    Layout("tp2pp2dp2ep2", ("--tp", "2", "--pp", "2", "--dp", "2", "--ep", "2", "--microbatches", "2"), 8,
           pp=2, dp=2),
]
STEPS = 4


def applies(kind: str, lay: Layout) -> bool:
    if kind == "p2p_order":
        return lay.pp > 1
    if kind in ("desync_grad",):
        return lay.dp > 1 and not lay.has("zero")     # refused there: ZeRO replicas cannot drift
    return True


def spec(kind: str, rank: int, step: int, lay: Layout) -> str:
    if kind == "slow":
        return f"slow:rank={rank},factor=4"
    if kind == "group_order":
        return f"group_order:rank={rank}"
    if kind == "mismatch":
        return f"mismatch:rank={rank},step={step},what=size"
    if kind == "wrong_group":
        return f"wrong_group:rank={rank},step={step},use=world"
    return f"{kind}:rank={rank},step={step}"


@dataclass
class Case:
    name: str
    layout: Layout
    kind: str            # fault kind, or "healthy"
    rank: int = -1
    argv: tuple[str, ...] = ()


def matrix(seed: int, healthy: int) -> list[Case]:
    rng = random.Random(seed)
    cases: list[Case] = []
    for lay in LAYOUTS:
        for kind in CAUSE:
            if not applies(kind, lay):
                continue
            # p2p_order needs a rank that sends activations onward: any stage but the last
            # (pp is the outermost mesh dimension, so the last stage is the top world/pp ranks)
            rank = rng.randrange(lay.world - lay.world // lay.pp if kind == "p2p_order" else lay.world)
            step = rng.randrange(1, STEPS - 1)
            inject = spec(kind, rank, step, lay)
            extra = ("--steps", "6") if kind == "slow" else ("--steps", str(STEPS))
            cases.append(Case(f"{kind}-{lay.name}-r{rank}", lay, kind, rank,
                              (*lay.argv, *extra, "--timeout-s", "3", "--inject", inject)))
    for i in range(healthy):
        lay = LAYOUTS[i % len(LAYOUTS)]
        cases.append(Case(f"healthy-{lay.name}-{i}", lay, "healthy", -1, (*lay.argv, "--steps", "3")))
    return cases


def random_layout(rng: random.Random) -> Layout:
    """A layout drawn at random: world 2, 4 or 8, its factors of 2 spread over tp, pp, cp and dp; expert
    parallelism (ep 2, where dp is even and there is no cp), ZeRO 1-2, the schedule, virtual stages and
    microbatches of a pipeline, and the global batch drawn as well."""
    world = rng.choice((2, 4, 4, 4, 8))
    deg = {"tp": 1, "pp": 1, "cp": 1, "dp": 1}
    for _ in range(world.bit_length() - 1):
        deg[rng.choice(tuple(deg))] *= 2
    argv: list[str] = []
    name: list[str] = []
    for dim in ("tp", "pp", "cp", "dp"):
        if deg[dim] > 1:
            argv += [f"--{dim}", str(deg[dim])]
            name.append(f"{dim}{deg[dim]}")
    if deg["tp"] > 2:
        argv += ["--n-head", str(deg["tp"])]
    mb = 1
    if deg["pp"] > 1:
        schedule = rng.choice(("gpipe", "1f1b", "interleaved"))
        mb = deg["pp"] * rng.choice((1, 2)) if schedule == "interleaved" else rng.choice((1, 2, 4))
        argv += ["--schedule", schedule, "--microbatches", str(mb)]
        name += [schedule, f"mb{mb}"]
        if schedule == "interleaved":
            argv += ["--vpp", "2"]
    if deg["dp"] % 2 == 0 and deg["cp"] == 1 and rng.random() < 0.3:
        argv += ["--ep", "2"]
        name.append("ep2")
    if deg["dp"] > 1 and rng.random() < 0.3:
        zero = rng.choice((1, 2))
        argv += ["--zero", str(zero)]
        name.append(f"zero{zero}")
    argv += ["--batch-size", str(deg["dp"] * mb * rng.choice((1, 2)))]
    return Layout("-".join(name), tuple(argv), world, pp=deg["pp"], dp=deg["dp"])


def _valid(argv: tuple[str, ...]) -> bool:
    """The runtime's own checks (`RunConfig.validate`, the drills' `check_specs`) accept `argv`."""
    from ncclscope.runtime.config import ConfigError, add_arguments, from_args
    from ncclscope.runtime.faults import FaultSpecError
    p = argparse.ArgumentParser()
    add_arguments(p)
    try:
        from_args(p.parse_args(list(argv)))
    except (ConfigError, FaultSpecError):
        return False
    return True


def random_matrix(seed: int, n: int, healthy: int) -> list[Case]:
    """`n` drills, each on its own drawn layout (`random_layout`) with a random applicable fault kind,
    culprit rank and step (redrawn until the runtime accepts it), then `healthy` healthy runs on drawn
    layouts."""
    rng = random.Random(seed)
    cases: list[Case] = []
    while len(cases) < n:
        lay = random_layout(rng)
        kind = rng.choice([k for k in CAUSE if applies(k, lay)])
        rank = rng.randrange(lay.world - lay.world // lay.pp if kind == "p2p_order" else lay.world)
        step = rng.randrange(1, STEPS - 1)
        extra = ("--steps", "6") if kind == "slow" else ("--steps", str(STEPS))
        argv = (*lay.argv, *extra, "--timeout-s", "3", "--inject", spec(kind, rank, step, lay))
        if _valid(argv):
            cases.append(Case(f"{kind}-{lay.name}-r{rank}-{len(cases)}", lay, kind, rank, argv))
    while healthy > 0:
        lay = random_layout(rng)
        argv = (*lay.argv, "--steps", "3")
        if _valid(argv):
            cases.append(Case(f"healthy-{lay.name}-{healthy}", lay, "healthy", -1, argv))
            healthy -= 1
    return cases


def judge(case: Case, report: dict) -> tuple[bool, bool, bool, str]:
    """(culprit ok, cause ok, false positive, headline text)."""
    findings = report.get("findings", [])
    verdict = str(report.get("verdict", ""))
    if case.kind == "healthy":
        serious = [f for f in findings if f["severity"] in ("error", "warning")]
        return True, True, bool(serious) or not verdict.startswith("OK"), verdict
    heads = [f for f in findings if f["data"].get("role") == "headline"] or \
        [f for f in findings if f["severity"] in ("error", "warning") and f["title"] in verdict]
    if not heads:
        return False, False, False, verdict
    h = heads[0]
    return list(h["ranks"]) == [case.rank], h["kind"] == CAUSE[case.kind], False, verdict


def analyze_dir(run_dir: Path, timeout: float = 300.0) -> dict:
    """`ncclscope analyze --json RUN_DIR`, exactly as a user runs it; the report, or a no-result stub."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    try:
        proc = subprocess.run([sys.executable, "-m", "ncclscope", "analyze", "--json", str(run_dir)], cwd=ROOT,
                              env=env, capture_output=True, text=True, timeout=timeout)
        return json.loads(proc.stdout) if proc.stdout.strip() else {
            "verdict": f"(no result: exit {proc.returncode}: {proc.stderr.strip()[-120:]})", "findings": []}
    except (subprocess.TimeoutExpired, json.JSONDecodeError) as exc:
        return {"verdict": f"(no result: {type(exc).__name__})", "findings": []}


def summarize(rows: list, seconds: float) -> None:
    """The per-kind and per-layout tables and the totals line."""
    faults = [r for r in rows if r[0].kind != "healthy"]
    healthy = [r for r in rows if r[0].kind == "healthy"]
    print(f"\n{len(faults)} drills, {len(healthy)} healthy runs in {seconds:.0f} s\n")
    print(f"{'kind':14s} {'drills':>6s} {'culprit':>8s} {'cause':>6s}")
    for kind in CAUSE:
        sel = [r for r in faults if r[0].kind == kind]
        if sel:
            print(f"{kind:14s} {len(sel):6d} {sum(r[1] for r in sel):8d} {sum(r[2] for r in sel):6d}")
    print(f"\n{'layout':18s} {'drills':>6s} {'culprit':>8s} {'cause':>6s} {'healthy FP':>10s}")
    for lay in dict.fromkeys(r[0].layout for r in rows):
        sel = [r for r in faults if r[0].layout is lay]
        hs = [r for r in healthy if r[0].layout is lay]
        if sel or hs:
            print(f"{lay.name:18s} {len(sel):6d} {sum(r[1] for r in sel):8d} {sum(r[2] for r in sel):6d} "
                  f"{sum(r[3] for r in hs):6d}/{len(hs)}")
    n = max(len(faults), 1)
    print(f"\nculprit {sum(r[1] for r in faults)}/{len(faults)} ({100 * sum(r[1] for r in faults) / n:.0f}%), "
          f"cause {sum(r[2] for r in faults)}/{len(faults)} ({100 * sum(r[2] for r in faults) / n:.0f}%), "
          f"false positives {sum(r[3] for r in healthy)}/{len(healthy)}")


def _row(i: int, n: int, c: Case, report: dict, rows: list) -> None:
    ok_rank, ok_kind, fp, text = judge(c, report)
    rows.append((c, ok_rank, ok_kind, fp))
    mark = "FP" if fp else ("ok" if ok_rank and ok_kind else "MISS")
    print(f"[{i:3d}/{n}] {mark:4s} {c.name:36s} {text[:110]}", flush=True)


def reanalyze(base: Path, cases: list[Case]) -> int:
    """Judge the run directories a sweep kept under `base` again; no job is run."""
    kept = [c for c in cases if (base / c.name / "run").is_dir()]
    print(f"reanalyzing {len(kept)} kept run directories under {base} ({len(cases) - len(kept)} of the "
          f"matrix not there)", flush=True)
    rows: list = []
    t0 = time.monotonic()
    for i, c in enumerate(kept, 1):
        _row(i, len(kept), c, analyze_dir(base / c.name / "run"), rows)
    summarize(rows, time.monotonic() - t0)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--healthy", type=int, default=11)
    ap.add_argument("--limit", type=int, default=0, help="run only the first N cases")
    ap.add_argument("--kinds", default="", help="comma-separated fault kinds to keep (and healthy)")
    ap.add_argument("--out", default="", help="keep the run directories here")
    ap.add_argument("--random-layouts", type=int, default=0, metavar="N",
                    help="N drills on drawn layouts (random_matrix) instead of the fixed matrix")
    ap.add_argument("--reanalyze", default="", metavar="DIR",
                    help="judge the run directories kept under DIR (a sweep's --out) again, without running jobs")
    ns = ap.parse_args()

    cases = random_matrix(ns.seed, ns.random_layouts, ns.healthy) if ns.random_layouts else \
        matrix(ns.seed, ns.healthy)
    if ns.kinds:
        keep = set(ns.kinds.split(",")) | {"healthy"}
        cases = [c for c in cases if c.kind in keep]
    if ns.limit:
        cases = cases[:ns.limit]
    if ns.reanalyze:
        return reanalyze(Path(ns.reanalyze), cases)
    from test_drills_e2e import Zygote   # the warmed job server the e2e tests use
    base = Path(ns.out) if ns.out else Path(tempfile.mkdtemp(prefix="ncclscope-accuracy-"))
    base.mkdir(parents=True, exist_ok=True)
    print(f"accuracy sweep: {len(cases)} jobs (seed {ns.seed}) under {base}", flush=True)
    z = Zygote(base)
    rows = []
    t0 = time.monotonic()
    try:
        for i, c in enumerate(cases, 1):
            try:
                job = z.run(c.name, list(c.argv), timeout=150.0)
                report = job.report
            except BaseException as exc:   # pytest.fail on a job timeout is a BaseException
                if isinstance(exc, KeyboardInterrupt):
                    raise
                report = {"verdict": f"(no result: {type(exc).__name__}: {str(exc)[:120]})", "findings": []}
            _row(i, len(cases), c, report, rows)
    finally:
        z.close()
    summarize(rows, time.monotonic() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
