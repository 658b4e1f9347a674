"""The sample traces in sample_traces/: still small, still real, and the analyzer
still says about each what sample_traces/verdicts.json recorded.

The analyzer never imports torch, so the checks run in-process through
`ncclscope.cli.main.main` (the same code as `ncclscope analyze`); one sample is also
run through the real CLI. Re-make the samples with `python sample_traces/make.py`.
"""
from __future__ import annotations

import json
import shlex

import pytest

from conftest import ROOT, run_cli

SAMPLES = ROOT / "sample_traces"
RECORDED = json.loads((SAMPLES / "verdicts.json").read_text())
CLASSICS = {"healthy", "hung-pipeline", "wrong-group", "dead-rank", "straggler", "divergence", "moe-imbalance"}


def headline(report: dict) -> dict | None:
    serious = [f for f in report["findings"] if f["severity"] in ("error", "warning")]
    for f in serious:
        if f["title"] in report["verdict"]:
            return f
    return serious[0] if serious else None


def test_every_classic_is_there_and_small():
    assert CLASSICS <= set(RECORDED), f"missing samples: {CLASSICS - set(RECORDED)}"
    dirs = {p.name for p in SAMPLES.iterdir() if p.is_dir() and not p.name.startswith((".", "__"))}
    assert dirs == set(RECORDED), "every sample directory is recorded in verdicts.json and vice versa"
    total = sum(f.stat().st_size for f in SAMPLES.rglob("*") if f.is_file())
    assert total < 10 * 2**20, f"sample_traces/ is {total / 2**20:.1f} MiB, over 10 MiB"
    assert not list(SAMPLES.rglob("*.html")), "reports do not belong inside sample run directories"
    readme = (SAMPLES / "README.md").read_text()
    for name, rec in RECORDED.items():
        assert rec["command"] in readme and rec["verdict"] in readme.replace("\\|", "|"), name


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_sample_was_made_by_its_recorded_command(name):
    """run.json keeps the argv of the job that wrote the directory: it is the recorded command."""
    rec = RECORDED[name]
    if rec.get("source") == "nccl":       # NCCL's own files, written by the sample script (no GPU here)
        assert rec["command"].startswith("python tests/data/nccl/make_samples.py")
        return
    run = json.loads((SAMPLES / name / "run.json").read_text())
    argv = shlex.split(rec["command"])
    assert argv[:2] == ["ncclscope", "train"]
    assert run["argv"][1:] == argv[1:], f"{name}: run.json argv {run['argv'][1:]} != {argv[1:]}"
    assert run["launcher"] == "ncclscope" and run["world_size"] == len(run["ranks"])


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_recorded_verdict_still_holds(name, analyze_json):
    rec = RECORDED[name]
    res = analyze_json(SAMPLES / name)        # main(["analyze", SAMPLE, "--json"]), once per session (conftest)
    rc, out = res.returncode, res.stdout
    report = json.loads(out)
    assert report["verdict"].split(":", 1)[0] == rec["verdict_prefix"], report["verdict"]
    top = headline(report)
    assert (top["kind"] if top else "ok") == rec["kind"], report["verdict"]
    assert sorted(top["ranks"] if top else []) == rec["root_ranks"], report["verdict"]
    assert rc == (0 if rec["kind"] == "ok" else 1)
    assert not report["warnings"], f"{name}: the loader complained: {report['warnings'][:3]}"


def test_cli_on_a_sample():
    """The real entry point, in a child process, from another working directory: the
    text form's first line is the verdict."""
    rec = RECORDED["hung-pipeline"]
    res = run_cli("analyze", str(SAMPLES / "hung-pipeline"), timeout=60, cwd="/")
    assert res.returncode == 1, res.stderr
    assert res.stdout.splitlines()[0].startswith(rec["verdict_prefix"] + ": ")
