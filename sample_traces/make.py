"""Re-make the sample traces: real `ncclscope train` runs, then record what the analyzer says.

    OMP_NUM_THREADS=1 python sample_traces/make.py              # all samples (about 2 minutes on 2 cores)
    OMP_NUM_THREADS=1 python sample_traces/make.py --only straggler
    python sample_traces/make.py --record-only                  # just re-record verdicts.json and README.md

Run from the repository root. Each sample is one `ncclscope train ... --out
sample_traces/NAME` (the exact command is kept in verdicts.json and the
README). Performance verdicts depend on timing, and on a loaded machine a
job can pick up an unrelated finding from noise (a 20 ms gloo hiccup reads
as a slow collective). So a run whose verdict does not start with the
expected prefix is deleted and run again, up to --tries times; the run that
is kept is recorded as it is. Hang verdicts (DEADLOCK, WRONG GROUP, DEAD
RANK) do not depend on timing.

Then `ncclscope analyze NAME --json` is run on every sample and its verdict,
headline finding kind and root-cause ranks are written to verdicts.json,
which tests/test_samples.py checks against the analyzer of the day.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

# name, what it is, `ncclscope train` arguments (without --out), expected verdict prefix
SAMPLES: list[tuple[str, str, str, str]] = [
    ("healthy", "2-rank data-parallel job, no fault",
     "--dp 2 --steps 4", "OK"),
    ("hung-pipeline", "2-stage 1F1B pipeline; pipeline rank 0 posts its recv before its send at step 1",
     "--pp 2 --microbatches 4 --batch-size 8 --steps 3 --timeout-s 2 --inject p2p_order:rank=0,step=1",
     "SCHEDULE DEVIATION"),
    ("wrong-group", "4-way data parallel; rank 1 issues its gradient all-reduce on the world group at step 1",
     "--dp 4 --steps 3 --timeout-s 2 --inject wrong_group:rank=1,step=1,use=world", "WRONG GROUP"),
    ("dead-rank", "4-way data parallel; rank 2 SIGKILLs itself at the start of step 2",
     "--dp 4 --steps 4 --timeout-s 2 --inject kill:rank=2,step=2", "DEAD RANK"),
    ("straggler", "4-way data parallel; rank 1 computes 4x slower than its peers",
     "--dp 4 --steps 6 --inject slow:rank=1,factor=4", "STRAGGLER"),
    ("divergence", "2-way data parallel; rank 1 applies its own gradient instead of the averaged one at step 2",
     "--dp 2 --steps 5 --inject desync_grad:rank=1,step=2", "DIVERGED"),
    ("moe-imbalance", "2-rank MoE, 4 experts over ep 2, capacity factor 1.0: an unbalanced router drops tokens",
     "--dp 2 --ep 2 --n-experts 4 --capacity-factor 1.0 --steps 4", "MOE IMBALANCE"),
    ("stuck-in-compute", "2-way data parallel; rank 1 blocks forever in its forward pass at step 2",
     "--dp 2 --steps 4 --timeout-s 3 --inject hang:rank=1,step=2", "STUCK IN COMPUTE"),
    ("nan", "2-way data parallel; rank 1's gradients turn NaN at step 2",
     "--dp 2 --steps 4 --inject nan:rank=1,step=2", "NAN"),
    ("slow-pipeline", "2-stage 1F1B pipeline with 1 layer on stage 0 and 3 on stage 1",
     "--pp 2 --microbatches 4 --n-layer 4 --pp-layers 1,3 --steps 4", "SLOW PIPELINE"),
]


def command(name: str, args: str) -> str:
    return f"ncclscope train {args} --out sample_traces/{name}"


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONWARNINGS"] = "ignore::FutureWarning"
    return env


def analyze_json(run: Path) -> dict:
    p = subprocess.run([sys.executable, "-m", "ncclscope", "analyze", str(run), "--json"], cwd=ROOT, env=_env(),
                       capture_output=True, text=True, timeout=120)
    if p.returncode not in (0, 1):
        raise SystemExit(f"analyze {run} failed ({p.returncode}): {p.stderr}")
    return json.loads(p.stdout)


def headline(report: dict) -> dict | None:
    """The finding the verdict line speaks for: the first error/warning finding
    whose title the verdict repeats (else the first error/warning one)."""
    serious = [f for f in report["findings"] if f["severity"] in ("error", "warning")]
    for f in serious:
        if f["title"] in report["verdict"]:
            return f
    return serious[0] if serious else None


def record(name: str, story: str, args: str, report: dict) -> dict:
    top = headline(report)
    return {
        "command": command(name, args),
        "story": story,
        "verdict_prefix": report["verdict"].split(":", 1)[0],
        "kind": top["kind"] if top else "ok",
        "root_ranks": sorted(top["ranks"]) if top else [],
        "verdict": report["verdict"],
    }


def make(name: str, args: str, expect: str, tries: int) -> dict:
    out = HERE / name
    for attempt in range(1, tries + 1):
        if out.exists():
            if not (out / "run.json").exists():
                raise SystemExit(f"{out} exists and is not a run directory; not deleting it")
            shutil.rmtree(out)
        argv = [sys.executable, "-m", "ncclscope", *shlex.split(command(name, args))[1:]]
        p = subprocess.run(argv, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300,
                           start_new_session=True)
        if not (out / "run.json").exists():
            raise SystemExit(f"{name}: train wrote no run directory ({p.returncode}):\n{p.stderr[-2000:]}")
        report = analyze_json(out)
        print(f"{name} (try {attempt}): {report['verdict'][:110]}", flush=True)
        if report["verdict"].startswith(expect):
            return report
    raise SystemExit(f"{name}: no run ended with {expect!r} in {tries} tries")


README_HEAD = """# Sample traces

Small real run directories written by `ncclscope train` (gloo ranks on one
machine, CPU only), one per classic failure. Open any of them with the
analyzer, the report or the TUI; no torch is needed to read them:

```bash
ncclscope analyze sample_traces/hung-pipeline
ncclscope report sample_traces/straggler -o /tmp/straggler.html
```

Each was made from the repository root by the command in the table, and
`tests/test_samples.py` checks that today's analyzer still gives each the
recorded verdict (prefix, headline finding kind and root-cause ranks, kept in
[verdicts.json](verdicts.json)). The full first line that `ncclscope analyze`
printed when the sample was recorded is below; the times in it are the run's
own.

To re-make them all (about 2 minutes on 2 cores): `OMP_NUM_THREADS=1 python
sample_traces/make.py`. Timing-dependent verdicts (straggler, MoE, healthy)
can pick up noise findings on a loaded machine; make.py reruns such a sample
until its verdict has the expected prefix (at most 5 tries) and records the
run it keeps.

| name | what it is | command | kind, root ranks | recorded verdict (first line of `ncclscope analyze`) |
|---|---|---|---|---|
"""


def write_readme(recs: dict[str, dict]) -> None:
    rows = []
    for name, r in recs.items():
        ranks = ",".join(map(str, r["root_ranks"])) or "-"
        verdict = r["verdict"].replace("|", "\\|")
        rows.append(f"| [{name}]({name}/) | {r['story']} | `{r['command']}` | {r['kind']}, {ranks} | {verdict} |")
    (HERE / "README.md").write_text(README_HEAD + "\n".join(rows) + "\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", action="append", default=[], help="re-make only this sample (repeatable)")
    ap.add_argument("--tries", type=int, default=5)
    ap.add_argument("--record-only", action="store_true", help="do not run jobs; re-record the verdicts")
    ns = ap.parse_args(argv)
    path = HERE / "verdicts.json"
    recs: dict[str, dict] = json.loads(path.read_text()) if path.exists() else {}
    for name, story, args, expect in SAMPLES:
        if ns.record_only or (ns.only and name not in ns.only):
            if (HERE / name / "run.json").exists():
                recs[name] = record(name, story, args, analyze_json(HERE / name))
            continue
        recs[name] = record(name, story, args, make(name, args, expect, ns.tries))
    order = [s[0] for s in SAMPLES]
    # samples this script does not make (NCCL's own files, written by tests/data/nccl/make_samples.py) are kept
    recs = {**{k: recs[k] for k in order if k in recs}, **{k: v for k, v in recs.items() if k not in order}}
    path.write_text(json.dumps(recs, indent=1) + "\n")
    write_readme(recs)
    total = sum(f.stat().st_size for f in HERE.rglob("*") if f.is_file())
    print(f"wrote {path} and README.md; sample_traces/ is {total / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
