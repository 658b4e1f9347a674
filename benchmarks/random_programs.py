"""Accuracy on programs nobody here wrote: random SPMD torch.distributed programs with known bugs.

    OMP_NUM_THREADS=1 python benchmarks/random_programs.py --seed 1 --count 30 --healthy 8 --out /tmp/rp1
    OMP_NUM_THREADS=1 python benchmarks/random_programs.py --seed 2 --count 6 --only skip,wrong_peer
    python benchmarks/random_programs.py --seed 1 --count 4 --dry-run --out /tmp/rp   # write programs only

Each program (benchmarks/randprog/generator.py: plain torch.distributed on gloo, no ncclscope code in
it) carries one bug from the catalogue (benchmarks/randprog/catalogue.py) or none, and a ground truth
JSON beside it. It runs under `ncclscope run` (one job at a time, hard deadline, whole process group
reaped), and is judged twice: from the run directory, and from the Flight Recorder dumps alone (the
`nccl_trace_rank_N` files a plain torchrun user would have; none for a rank that died). Prints the
accuracy per bug class and evidence source (root rank, cause, file:line); every miss is kept as a
reproducer directory (script, truth.json, analyze JSON, run and FR directories) under OUT/misses/.
A faulty program whose job nevertheless ended cleanly on every rank is "silent" (the bug did not
change what gloo did) and is left out of the scores, listed instead. A job in which a rank failed in
`init_process_group` (a loaded machine: a rank's store wait ran past the program's short timeout; no bug
of the catalogue acts there) is run once more, and the table lists it.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from randprog.catalogue import BUG_NAMES, CATALOGUE, HEALTHY, fault_in_unrecorded_op  # noqa: E402
from randprog.generator import Truth, generate  # noqa: E402
from randprog.runner import analyze, run_job  # noqa: E402
from randprog.scorer import judge  # noqa: E402

SOURCES = ("run", "fr")


def plan(seed: int, count: int, healthy: int, only: list[str]) -> list[str]:
    """The bug class of each program: every class in turn (a seeded order), then the healthy ones."""
    classes = [c for c in BUG_NAMES if not only or c in only]
    rng = random.Random(f"plan:{seed}")
    order = classes[:]
    rng.shuffle(order)
    faulty = [order[i % len(order)] for i in range(count)]
    # healthy programs spread evenly among the faulty ones: a run stopped early has measured both
    out: list[str] = []
    for i, name in enumerate(faulty):
        out.append(name)
        while healthy and len(out) * healthy > (len(faulty) + healthy) * (out.count(HEALTHY) + 1) - healthy:
            out.append(HEALTHY)
            if out.count(HEALTHY) >= healthy:
                break
    return out + [HEALTHY] * (healthy - out.count(HEALTHY))


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def mark(r: dict | None) -> str:
    if r is None:
        return "-"
    if r.get("false_alarm") is not None:
        return "ok" if r["right"] else "FALSE-ALARM"
    s = ("R" if r["root"] else "r") + ("C" if r["cause"] else "c") + ("" if r["line"] is None else "L" if r["line"] else "l")
    return s


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--count", type=int, default=16, help="faulty programs (the classes in turn)")
    ap.add_argument("--healthy", type=int, default=4, help="healthy programs (no bug)")
    ap.add_argument("--out", default="", help="folder for results and misses (default: a new temp folder)")
    ap.add_argument("--max-world", type=int, default=8, help="largest world size drawn (2-16; favours 2-6)")
    ap.add_argument("--only", default="", help="comma-separated bug classes: " + ",".join(BUG_NAMES))
    ap.add_argument("--timeout-s", type=float, default=150.0, help="hard limit per job")
    ap.add_argument("--keep-all", action="store_true", help="keep every program's directory, not only misses")
    ap.add_argument("--jobs", type=int, default=1,
                    help="programs run at once (a hung job mostly waits on its timeout; 2 on 2 cores)")
    ap.add_argument("--dry-run", action="store_true", help="write the programs and their truth; run nothing")
    ap.add_argument("--resume", action="store_true",
                    help="with --out of a run that was stopped: run only the programs its results.jsonl lacks")
    ap.add_argument("--rejudge", default="", metavar="OUT",
                    help="analyze the kept programs of an earlier run (OUT/misses, and OUT/work after --keep-all) "
                         "again with this code and print its table with them rescored; the other programs keep "
                         "their recorded scores")
    ap.add_argument("--rejudge-sources", default=",".join(SOURCES), metavar="LIST",
                    help="with --rejudge: the evidence sources to analyze again (run, fr); the others keep "
                         "their recorded scores")
    ap.add_argument("--fr-world-size", action="store_true",
                    help="give the Flight Recorder analysis the job's number of ranks (--world-size), as a torchrun "
                         "user who knows how many ranks they started can; default: the dumps alone")
    ns = ap.parse_args(argv)
    if ns.rejudge:
        sources = tuple(x for x in ns.rejudge_sources.split(",") if x)
        if not sources or set(sources) - set(SOURCES):
            ap.error(f"--rejudge-sources: a comma-separated list of {', '.join(SOURCES)}")
        return rejudge(Path(ns.rejudge), sources, ns.fr_world_size)
    only = [c for c in ns.only.split(",") if c]
    bad = [c for c in only if c not in CATALOGUE and c != HEALTHY]
    if bad:
        ap.error(f"unknown classes {bad}; known: {', '.join(BUG_NAMES)}")
    out = Path(ns.out) if ns.out else Path(tempfile.mkdtemp(prefix=f"randprog-s{ns.seed}-"))
    out.mkdir(parents=True, exist_ok=True)
    work_root = out / "work"
    bugs = plan(ns.seed, ns.count, ns.healthy, only)
    log(f"randprog: seed {ns.seed}, {len(bugs)} programs, out {out}")
    results: list[dict] = []
    t_all = time.monotonic()
    if ns.dry_run:
        for index, bug in enumerate(bugs):
            prog = generate(ns.seed, index, bug, max_world=min(16, max(2, ns.max_world)))
            work = work_root / prog.truth.name
            work.mkdir(parents=True, exist_ok=True)
            (work / prog.filename).write_text(prog.source)
            (work / "truth.json").write_text(json.dumps(prog.truth.to_json(), indent=1))
            log(f"[{index + 1}/{len(bugs)}] {prog.truth.name} world {prog.truth.world}: {prog.truth.detail}")
        return 0
    lock = threading.Lock()
    done = [0]
    todo = list(enumerate(bugs))
    if ns.resume and (out / "results.jsonl").exists():
        # the same seed and counts give the same programs: the ones already scored are kept as they are
        results = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines() if x.strip()]
        have = {r["name"] for r in results}
        todo = [(i, b) for i, b in todo if generate(ns.seed, i, b, max_world=min(16, max(2, ns.max_world))
                                                     ).truth.name not in have]
        done[0] = len(results)
        log(f"randprog: resuming, {len(results)} programs already scored, {len(todo)} to run")

    def one(index: int, bug: str) -> dict:
        row = run_one(ns, out, work_root, index, bug)
        with lock:
            done[0] += 1
            results.append(row)
            log(f"[{done[0]}/{len(bugs)}] {row_line(row)}")
            with open(out / "results.jsonl", "a") as fh:
                fh.write(json.dumps(row) + "\n")
        return row

    with ThreadPoolExecutor(max_workers=max(1, ns.jobs)) as pool:
        list(pool.map(lambda ib: one(*ib), todo))
    results.sort(key=lambda r: r["name"])
    report = table(results, ns.seed)
    print(report)
    (out / "summary.txt").write_text(report + "\n")
    log(f"randprog: {len(results)} programs in {time.monotonic() - t_all:.0f} s; misses under {out / 'misses'}")
    return 0


def rejudge(out: Path, sources: tuple[str, ...] = SOURCES, fr_world: bool = False) -> int:
    """Rescore an earlier run's kept programs with the code here (their jobs are not run again): each
    OUT/misses/NAME (or, after --keep-all, OUT/work/NAME) holds the program, truth.json and the run and
    dump directories it wrote; programs kept nowhere keep their recorded scores."""
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines() if line.strip()]
    seed = rows[0]["name"].split("_")[0][2:] if rows else "?"
    changed = 0
    for row in rows:
        d = out / "misses" / row["name"]
        if not (d / "truth.json").exists():
            d = out / "work" / row["name"]
        if not (d / "truth.json").exists():
            continue
        t = Truth(**json.loads((d / "truth.json").read_text()))
        for src in sources:
            path = d / src
            if not path.exists() or row[src].get("na") or row[src].get("no_dumps"):
                continue
            rc, rep = analyze(path, d / f"rejudged_{src}.json", extra=world_args(src, t.world, fr_world))
            row[src] = score(t, f"{row['name']}.py", rc, rep, src, row.get("fr_left_out"))
        was = row.get("miss")
        row["miss"] = is_miss(row)
        changed += was != row["miss"]
        log(f"rejudged {row_line(row)}")
    rows.sort(key=lambda r: r["name"])
    print(table(rows, int(seed) if seed.isdigit() else 0))
    log(f"randprog: {changed} of the kept programs changed miss/right on this code")
    return 0


def run_one(ns: argparse.Namespace, out: Path, work_root: Path, index: int, bug: str) -> dict:
    """Generate, run and judge one program from both evidence sources; keep it under misses/ if wrong."""
    prog = generate(ns.seed, index, bug, max_world=min(16, max(2, ns.max_world)))
    t = prog.truth
    work = work_root / t.name
    shutil.rmtree(work, ignore_errors=True)    # a run that was stopped (--resume) may have left one
    job = run_job(prog, work, ns.timeout_s)
    retried = not job.all_clean and setup_failed(work)
    if retried:     # the machine, not the program: run it once more (said in the row and the table)
        shutil.rmtree(work, ignore_errors=True)
        job = run_job(prog, work, ns.timeout_s)
    row: dict = {"name": t.name, "bug": bug, "world": t.world, "culprits": t.culprits, "detail": t.detail,
                 "setup_retry": retried, "lines": t.lines, "took_s": round(job.took_s, 1), "stopped": job.stopped,
                 "exits": job.exits, "fr_ranks": job.fr_ranks, "fr_left_out": job.fr_left_out}
    silent = bug != HEALTHY and CATALOGUE[bug].hangs and job.all_clean
    failed_healthy = bug == HEALTHY and not job.all_clean
    row["silent"], row["healthy_job_failed"] = silent, failed_healthy
    for src in SOURCES:
        path = work / "run" if src == "run" else work / "fr"
        unjudged = unjudged_dumps(bug, job.all_clean, job.fr_ranks) if src == "fr" else None
        if unjudged is not None:
            row[src] = unjudged
            continue
        rc, rep = analyze(path, work / f"analyze_{src}.json", extra=world_args(src, t.world, ns.fr_world_size))
        row[src] = score(t, prog.filename, rc, rep, src, job.fr_left_out)
    miss = row["miss"] = is_miss(row)
    dst = out / "misses" / t.name
    if dst.exists():                # an earlier run's copy (--resume), right or wrong now
        shutil.rmtree(dst)
    if miss:
        shutil.copytree(work, dst)
    if not ns.keep_all:
        shutil.rmtree(work, ignore_errors=True)
    return row


def setup_failed(work: Path) -> bool:
    """Whether the job failed in `init_process_group` (a rank's traceback passes through it): every bug of the
    catalogue acts after it, so that is the machine (seed 20261228 #53: with two jobs and a test suite on 2
    cores, a rank's TCPStore wait ran past the program's 5 s timeout), not the program."""
    try:
        log = (work / "job.log").read_bytes()
    except OSError:
        return False
    return b", in init_process_group" in log


def unjudged_dumps(bug: str, all_clean: bool, fr_ranks: list[int]) -> dict | None:
    """The dumps' score where there is nothing to analyze, else None. torch writes Flight Recorder dumps on a
    timeout or an error (or when asked): a plain torchrun user whose job ended cleanly on every rank has none
    to give (a slow rank, a NaN): n/a. A job that hung with no dump at all is scored, and wrong."""
    if bug != HEALTHY and not CATALOGUE[bug].hangs and all_clean:
        return not_applicable("fr", "the job ended cleanly, so torch wrote no dump")
    if fr_ranks:
        return None
    row = {"source": "fr", "right": False, "root": False, "cause": False, "line": None,
           "kind": "", "ranks": [], "verdict": "(no Flight Recorder dump)", "no_dumps": True}
    if bug == HEALTHY:
        row["false_alarm"] = False
    return row


def world_args(src: str, world: int, given: bool) -> tuple[str, ...]:
    """`--world-size N` for the dumps' analysis when the run says a user knows it (--fr-world-size)."""
    return ("--world-size", str(world)) if given and src == "fr" else ()


EMPTY_DUMPS = "the dumps hold no entries"     # flight_recorder._load's line for dumps with no entry at all


def not_applicable(src: str, why: str) -> dict:
    """A source's score where it has no evidence to judge (left out of the table's rates)."""
    return {"source": src, "right": True, "root": True, "cause": True, "line": None, "na": True,
            "kind": "", "ranks": [], "verdict": f"(n/a: {why})"}


def score(t: Truth, filename: str, rc: int, rep: dict, src: str, left_out: list[int] | None) -> dict:
    """One source's analysis judged against the truth (scorer.judge). Dumps in which every rank wrote nothing
    the program did (gloo's recorder keeps no p2p) are n/a: exit 2 ("nothing readable") is the right
    answer there, and there is no verdict to judge."""
    if src == "fr" and rc == 2 and EMPTY_DUMPS in str(rep.get("no_json", "")):
        return not_applicable(src, "the dumps hold no entries; exit 2")
    return judge(t, filename, rc, rep, src, left_out)


def is_miss(row: dict) -> bool:
    """A scored program that some source got wrong (silent bugs and failed healthy jobs are not scored)."""
    return not row["silent"] and not row["healthy_job_failed"] and not all(row[s]["right"] for s in SOURCES)


def row_line(row: dict) -> str:
    tag = "SILENT " if row["silent"] else "JOBFAIL" if row["healthy_job_failed"] else "miss   " if row["miss"] else "ok     "
    return (f"{tag} {row['name']:28s} w{row['world']} {row['took_s']:5.1f}s "
            f"run {mark(row['run']):4s} {row['run']['kind'] or '-':20s} {row['run']['ranks']} | "
            f"fr {mark(row['fr']):4s} {row['fr']['kind'] or '-':20s} {row['fr']['ranks']} | "
            f"truth {row['culprits']} {row['detail']}")


def _unrecorded_split(results: list[dict]) -> str:
    """The dumps' root score apart for faults in ops gloo's recorder keeps and in ops it does not
    (catalogue.fault_in_unrecorded_op): where the departure left no record, what the dumps say is the
    consequence, and which rank departed is beyond them."""
    parts = []
    for label, want in (("in ops the dumps record", False), ("in ops they do not (send/recv, split sizes)", True)):
        mine = [r for r in results if r["bug"] != HEALTHY and not r["silent"] and not r["healthy_job_failed"]
                and not r["fr"].get("na") and fault_in_unrecorded_op(r["bug"], r.get("detail", "")) == want]
        root = sum(r["fr"]["root"] for r in mine)
        parts.append(f"{label} {root}/{len(mine)}" + (f" ({100.0 * root / len(mine):.1f} %)" if mine else ""))
    return "fr root, faults " + "; faults ".join(parts)


def table(results: list[dict], seed: int) -> str:
    lines = [f"seed {seed}: {len(results)} programs (silent bugs and failed healthy jobs left out of the scores)",
             "", f"{'class':14s} {'n':>3s} {'excl':>4s} | " + " | ".join(
                 f"{s + ' root':>8s} {'cause':>6s} {'right':>6s} {'line':>6s}" for s in SOURCES)]
    by: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        by[r["bug"]].append(r)
    tot = {s: [0, 0, 0, 0, 0, 0] for s in SOURCES}       # root, cause, right, line hits, line judged, n
    for bug in list(BUG_NAMES) + [HEALTHY]:
        rows = by.get(bug, [])
        if not rows:
            continue
        scored = [r for r in rows if not r["silent"] and not r["healthy_job_failed"]]
        cells = []
        for s in SOURCES:
            mine = [r for r in scored if not r[s].get("na")]     # n/a: no such evidence for this job
            n = len(mine)
            if not n and bug != HEALTHY:
                cells.append(f"{'n/a':>8s} {'':>6s} {'':>6s} {'':>6s}")
                continue
            root = sum(r[s]["root"] for r in mine)
            cause = sum(r[s]["cause"] for r in mine)
            right = sum(r[s]["right"] for r in mine)
            judged = [r for r in mine if r[s].get("line") is not None]
            line = sum(bool(r[s]["line"]) for r in judged)
            if bug == HEALTHY:
                cells.append(f"{'':>8s} {'':>6s} {right:>3d}/{n:<2d} {'-':>6s}")
            else:
                lcell = f"{line}/{len(judged)}" if judged else "-"
                cells.append(f"{root:>5d}/{n:<2d} {cause:>3d}/{n:<2d} {right:>3d}/{n:<2d} {lcell:>6s}")
            if bug == HEALTHY:
                continue              # the totals are of faulty programs; healthy ones have their own line
            t = tot[s]
            t[0] += root; t[1] += cause; t[2] += right; t[3] += line; t[4] += len(judged); t[5] += n
        lines.append(f"{bug:14s} {len(rows):3d} {len(rows) - len(scored):4d} | " + " | ".join(cells))
    cells = []
    for s in SOURCES:
        root, cause, right, line, judged, n = tot[s]
        cells.append(f"{root:>5d}/{n:<2d} {cause:>3d}/{n:<2d} {right:>3d}/{n:<2d} {line:>3d}/{judged:<2d}")
    lines.append(f"{'total faulty':14s} {sum(r['bug'] != HEALTHY for r in results):3d} {'':4s} | " + " | ".join(cells))
    for s in SOURCES:
        root, cause, right, line, judged, n = tot[s]
        pct = lambda a, b: f"{100.0 * a / b:.1f} %" if b else "-"   # noqa: E731
        lines.append(f"{s}: root {pct(root, n)}, cause {pct(cause, n)}, line {pct(line, judged)} "
                     f"(faulty programs; n/a rows left out)")
    lines.append(_unrecorded_split(results))
    fa = [r for r in results if r["bug"] == HEALTHY]
    if fa:
        lines.append("healthy: right = no error finding and exit code 0; warned (a warning only): "
                     + ", ".join(f"{r['name']}[{s}]" for r in fa for s in SOURCES if r[s].get("warned")) or "none")
    retried = [r["name"] for r in results if r.get("setup_retry")]
    if retried:
        lines.append("run again once (a rank failed in init_process_group: the machine, not the program): "
                     + ", ".join(retried))
    silent = [r["name"] for r in results if r["silent"]]
    failed = [r["name"] for r in results if r["healthy_job_failed"]]
    if silent:
        lines.append("silent (bug changed nothing gloo did; not scored): " + ", ".join(silent))
    if failed:
        lines.append("healthy jobs that failed by themselves (not scored): " + ", ".join(failed))
    lines.append("")
    lines.append("misses:")
    for r in results:
        if not r.get("miss"):
            continue
        for s in SOURCES:
            x = r[s]
            if x["right"]:
                continue
            lines.append(f"  {r['name']} [{s}] truth {r['bug']} ranks {r['culprits']} lines {r['lines']}: "
                         f"got {x.get('kind') or '-'} {x.get('ranks')} (root {'ok' if x['root'] else 'WRONG'}, "
                         f"cause {'ok' if x['cause'] else 'WRONG'}, line {x.get('line')}) :: {x.get('verdict', '')[:160]}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
