"""Flight Recorder accuracy sweep: plain-PyTorch gloo jobs with known culprits, judged from their dumps.

    OMP_NUM_THREADS=1 python benchmarks/fr_sweep.py                  # every scenario, 4 and 8 ranks
    OMP_NUM_THREADS=1 python benchmarks/fr_sweep.py --worlds 4 --scenarios skip,wrong_group
    OMP_NUM_THREADS=1 python benchmarks/fr_sweep.py --variants asis,no_pg_config,no_times --reorder

Each job (tests/fr_jobs.py: a tp x dp mesh of new_groups, no ncclscope code in
it) is broken by one rank drawn at random (seeded), leaves one dump per rank,
and is analyzed with `ncclscope analyze DIR --json` in-process. A drill is
right when the headline's kind is the scenario's expected kind and its root
ranks are exactly the culprit; a healthy job is right when nothing at warning
level or above is found. Prints one row per job and the totals.

`--variants` judges the same dumps rewritten as well: `no_pg_config` with
gloo's own empty pg_config (fr_jobs writes an NCCL-like one only for
group_order), `no_times` with every time field removed (a verdict must then
say no duration: a row whose findings say "0.0 s" or "since" is marked). A
group_order job without pg_config can keep no evidence of its culprit
(`evidence_removed`): where every rank hung inside new_group no dump holds an
op on a created group (row marked "stopped": right is the all-stopped verdict,
blaming no rank alone), and where gloo paired the swapped names with the same
members the dumps equal a healthy job's (marked "silent": right is no warning).
`--reorder` adds, per healthy 4-rank job, its dumps rewritten as if the culprit had
created the dp groups before the tp groups (`fr_jobs.reorder_groups`: no
process runs, gloo's empty pg_config; "reorder" with bare group names,
"reorder+desc" with DeviceMesh-like descriptions): the entries-only creation
order rule must name the culprit (kind group_mismatch). At 8 ranks dp groups
are larger than tp groups, and gloo hangs in new_group instead (group_order).
"""
from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import random
import re
import sys
import tempfile
import time
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))


def analyze(path: Path) -> tuple[int, dict]:
    from ncclscope.cli.main import main
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(["analyze", str(path), "--json"])
    text = out.getvalue()
    start = text.find("{") if text.startswith("{") else text.find("\n{") + 1   # skip stray lines before it
    try:
        return rc, json.loads(text[start:]) if start >= 0 else {}
    except json.JSONDecodeError:
        pass
    return rc, {"verdict": f"(no JSON; rc {rc}: {err.getvalue().strip()[:160]})", "findings": [], "no_json": True}


TIME_KEYS = ("time_created_ns", "time_discovered_started_ns", "time_discovered_completed_ns")
EMPTY_PG_CONFIG = {"": {"name": "", "desc": "", "ranks": "[]"}}     # what gloo writes


def rewrite(src: Path, variant: str) -> Path:
    """The dumps of `src` as variant `variant` would have them, in a sibling directory (file times kept)."""
    if variant == "asis":
        return src
    dst = src.with_name(f"{src.name}.{variant}")
    dst.mkdir(exist_ok=True)
    for f in sorted(src.glob("nccl_trace_rank_*")):
        d = pickle.loads(f.read_bytes())
        if variant == "no_pg_config":
            d["pg_config"] = dict(EMPTY_PG_CONFIG)
        elif variant == "no_times":
            for e in d["entries"]:
                for k in TIME_KEYS:
                    e.pop(k, None)
        else:
            raise SystemExit(f"unknown variant {variant!r} (asis, no_pg_config, no_times)")
        (dst / f.name).write_bytes(pickle.dumps(d))
        st = f.stat()
        os.utime(dst / f.name, ns=(st.st_atime_ns, st.st_mtime_ns))
    return dst


def says_duration(report: dict) -> bool:
    """Does any sentence of the report claim a wait ("since", "0.0 s")?"""
    texts = [report.get("verdict", "")] + [f.get("title", "") for f in report.get("findings", [])]
    texts += [e.get("note", "") for f in report.get("findings", []) for e in f.get("evidence", [])]
    return any(re.search(r"\bsince\b|\b0\.0 s\b", t) for t in texts)


def judge(scenario: str, culprit: int, report: dict, expected: dict) -> tuple[bool, bool]:
    """(culprit right, cause right); for healthy: (no false positive, same)."""
    findings = report.get("findings", [])
    if report.get("no_json"):                   # an analysis that wrote no report is right about nothing
        return False, False
    if scenario == "healthy":
        ok = not any(f["severity"] in ("error", "warning") for f in findings)
        return ok, ok
    heads = [f for f in findings if f["data"].get("role") == "headline"]
    if not heads:
        return False, False
    return list(heads[0]["ranks"]) == [culprit], heads[0]["kind"] == expected[scenario]


def evidence_removed(scenario: str, variant: str, dumps: Path, world: int) -> str | None:
    """What is right for a group_order job once pg_config is emptied, when its entries no longer tell the
    culprit; None where they still do (judged as usual).

    - "stopped": every rank hung inside new_group (dp and tp groups of other sizes, or a culprit whose
      swapped names collide), so no dump holds an op on a created group. Right is what is known, the
      all-stopped verdict, blaming no rank alone.
    - "silent": the job ran on, and every rank's sequence of group names is the one the plan gives it
      unswapped (at 4 ranks, culprit 0 or 3: gloo pairs groups by name, and its swapped names fall on the
      same members): the dumps equal a healthy job's. Right is no warning."""
    if scenario != "group_order" or variant != "no_pg_config":
        return None
    from fr_jobs import _plan
    plan = _plan(world, swap=False)
    seqs = {}
    for f in dumps.glob("nccl_trace_rank_*"):
        rank = int(f.name.rsplit("_", 1)[1])
        seqs[rank] = [str(e["process_group"][0]) for e in pickle.loads(f.read_bytes())["entries"]
                      if str(e["process_group"][0]) != "0"]
    if not any(seqs.values()):
        return "stopped"
    normal = {r: [str(i + 1) for i, m in enumerate(plan) if r in m] for r in range(world)}
    return "silent" if all(seqs.get(r) == normal[r] for r in range(world)) else None


def judge_no_evidence(world: int, report: dict, expect: str) -> tuple[bool, bool]:
    """`judge` for a row `evidence_removed` marked: "silent" as a healthy job, "stopped" as the all-stopped
    verdict naming every rank or none."""
    if expect == "silent":
        return judge("healthy", -1, report, {})
    _, ok_kind = judge("stopped", -1, report, {"stopped": "no_op_in_flight"})
    heads = [f for f in report.get("findings", []) if f["data"].get("role") == "headline"]
    return bool(heads) and sorted(heads[0]["ranks"]) in ([], list(range(world))), ok_kind


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=2026)
    ap.add_argument("--worlds", default="4,8")
    ap.add_argument("--scenarios", default="")
    ap.add_argument("--out", default="")
    ap.add_argument("--variants", default="asis", help="comma list of asis, no_pg_config, no_times")
    ap.add_argument("--reorder", action="store_true", help="also judge healthy dumps rewritten with a creation order")
    ns = ap.parse_args()
    import torch  # noqa: F401  (imported once, before the jobs fork)
    from fr_jobs import EXPECTED_KIND, SCENARIOS, make_dumps, reorder_groups

    rng = random.Random(ns.seed)
    variants = [v for v in ns.variants.split(",") if v]
    scenarios = ns.scenarios.split(",") if ns.scenarios else list(SCENARIOS)
    base = Path(ns.out) if ns.out else Path(tempfile.mkdtemp(prefix="ncclscope-fr-sweep-"))
    base.mkdir(parents=True, exist_ok=True)
    rows = []
    t0 = time.monotonic()
    for world in (int(w) for w in ns.worlds.split(",")):
        for sc in scenarios:
            culprit = rng.randrange(world)
            d = make_dumps(sc, world, culprit, base)
            for variant in variants:
                src = rewrite(d, variant)
                rc, report = analyze(src)
                blind = evidence_removed(sc, variant, src, world)
                ok_rank, ok_kind = (judge_no_evidence(world, report, blind) if blind
                                    else judge(sc, culprit, report, EXPECTED_KIND))
                timed = variant == "no_times" and says_duration(report)
                rows.append((sc, world, culprit, ok_rank, ok_kind, variant, timed, bool(blind)))
                mark = "ok" if ok_rank and ok_kind else ("FP" if sc == "healthy" else "MISS")
                mark += f" ({blind})" if blind else ""
                tag = "" if len(variants) == 1 else f"[{variant}] "
                print(f"{mark:4s} {sc:12s} world {world} culprit {culprit}: {tag}rc {rc}"
                      f"{' SAYS A DURATION' if timed else ''} {report.get('verdict', '')[:120]}", flush=True)
            if ns.reorder and sc == "healthy" and world == 4:   # tp and dp groups of one size: a job that runs on
                for descs in (False, True):
                    name = "reorder+desc" if descs else "reorder"
                    dst = d.with_name(f"{d.name}.{name}")
                    rc, report = analyze(reorder_groups(d, dst, culprit, world, descs=descs))
                    ok_rank, ok_kind = judge("group_order", culprit, report, EXPECTED_KIND)
                    rows.append((name, world, culprit, ok_rank, ok_kind, name, False, False))
                    mark = "ok" if ok_rank and ok_kind else "MISS"
                    print(f"{mark:4s} {name:12s} world {world} culprit {culprit}: rc {rc} "
                          f"{report.get('verdict', '')[:120]}", flush=True)
    print()
    for variant in variants + (["reorder", "reorder+desc"] if ns.reorder else []):
        mine = [r for r in rows if r[5] == variant]
        drills = [r for r in mine if r[0] != "healthy"]
        healthy = [r for r in mine if r[0] == "healthy"]
        tag = "" if len(variants) == 1 and not ns.reorder else f"[{variant}] "
        print(f"{tag}{len(drills)} dumps with a fault, {len(healthy)} healthy; "
              f"culprit {sum(r[3] for r in drills)}/{len(drills)}, cause {sum(r[4] for r in drills)}/{len(drills)}, "
              f"false positives {sum(not r[3] for r in healthy)}/{len(healthy)}"
              + (f", durations said without times {sum(r[6] for r in mine)}/{len(mine)}" if variant == "no_times"
                 else "")
              + (f"; {sum(r[7] for r in drills)} of the dumps with a fault keep no evidence of it (marked"
                 " 'stopped' or 'silent', judged on saying what is known)" if any(r[7] for r in drills) else ""))
    print(f"{time.monotonic() - t0:.0f} s; under {base}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
