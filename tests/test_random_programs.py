"""The random-program yardstick (benchmarks/randprog/): deterministic generation, valid scripts,
consistent ground truth; and two cheap end-to-end runs (a healthy 2-rank program stays silent, a
skipped collective names its rank).

    pytest tests/test_random_programs.py             # generation checks: < 2 s
    pytest tests/test_random_programs.py -m e2e      # the two runs: ~60 s on 2 cores
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from randprog.catalogue import BUG_NAMES, CATALOGUE, HEALTHY  # noqa: E402
from randprog.generator import generate  # noqa: E402
from randprog.runner import analyze, run_job  # noqa: E402
from randprog.scorer import judge  # noqa: E402

CLASSES = list(BUG_NAMES) + [HEALTHY]


@pytest.mark.parametrize("bug", CLASSES)
def test_generation_is_deterministic_and_compiles(bug: str) -> None:
    for seed in (1, 7):
        a, b = generate(seed, 3, bug), generate(seed, 3, bug)
        assert a.source == b.source and a.truth == b.truth
        compile(a.source, a.filename, "exec")
        tree = ast.parse(a.source)
        imported = {n.name for node in ast.walk(tree) if isinstance(node, ast.Import) for n in node.names}
        imported |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
        assert not any("ncclscope" in m for m in imported), "a generated program must be plain torch"
    assert generate(1, 3, bug).source != generate(2, 3, bug).source


@pytest.mark.parametrize("bug", CLASSES)
def test_ground_truth_is_consistent(bug: str) -> None:
    for seed in range(1, 9):
        prog = generate(seed, seed, bug, max_world=8)
        t = prog.truth
        lines = prog.source.split("\n")
        assert 2 <= t.world <= 8
        assert t.bug == bug
        assert len(t.lines) == len(t.line_texts)
        for n, text in zip(t.lines, t.line_texts):
            assert 1 <= n <= len(lines) and lines[n - 1].strip() == text
        if bug == HEALTHY:
            assert not t.culprits and not t.lines and not t.accept_kinds
            continue
        cls = CATALOGUE[bug]
        assert t.world >= cls.needs_world
        assert t.accept_kinds == list(cls.kinds)
        assert t.culprits and all(0 <= c < t.world for c in t.culprits)
        assert all(set(t.culprits) <= set(r) for r in t.accept_roots)
        assert bool(t.lines) == cls.line_judged
        assert t.dies == (t.culprits if cls.kills_culprit else [])
        if t.mesh_shape:
            prod = 1
            for s in t.mesh_shape:
                prod *= s
            assert prod == t.world and len(t.mesh_dims) == len(t.mesh_shape) <= 3
        # the expected line is the one that tells the call apart
        first = t.line_texts[0] if t.lines else ""
        if bug in ("skip", "size", "dtype", "wrong_group", "short_objlist"):
            assert "dist." in first or "(" in first           # the op's call line, or its helper's caller
        if bug == "uneven_loop":
            assert first.startswith("for ")
        if bug in ("exception", "exit", "hang_compute"):
            assert any(w in first for w in ("raise", "os._exit", "time.sleep"))


def test_helpers_repeat_call_sites() -> None:
    """Helper functions are called from several loop lines (so a helper's own line cannot tell calls apart)."""
    seen = 0
    for seed in range(1, 20):
        src = generate(seed, 0, HEALTHY).source
        tree = ast.parse(src)
        helpers = [f.name for f in tree.body if isinstance(f, ast.FunctionDef) and f.name != "main"]
        for h in helpers:
            assert src.count(f"{h}(") >= 3          # the definition and >= 2 calls
            seen += 1
    assert seen >= 5


def _ran(tmp_path: Path, bug: str, world: int, seed: int) -> dict:
    prog = generate(seed, 0, bug, world=world)
    job = run_job(prog, tmp_path / prog.truth.name, timeout_s=50)
    rc, rep = analyze(tmp_path / prog.truth.name / "run", tmp_path / "a.json", timeout_s=40)
    return {"job": job, "verdict": judge(prog.truth, prog.filename, rc, rep, "run"), "truth": prog.truth}


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_healthy_two_rank_program_is_silent(tmp_path: Path) -> None:
    r = _ran(tmp_path, HEALTHY, 2, seed=3)
    assert r["job"].all_clean, r["job"].exits
    assert r["verdict"]["right"], r["verdict"]


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_skip_names_its_rank(tmp_path: Path) -> None:
    r = _ran(tmp_path, "skip", 2, seed=5)
    assert r["verdict"]["root"], (r["truth"].culprits, r["verdict"])


def test_faults_in_ops_gloo_dumps_do_not_record_are_told_apart() -> None:
    """The table prints the dumps' root score apart for send/recv faults and all_to_all split sizes."""
    from randprog.catalogue import fault_in_unrecorded_op
    for bug in ("wrong_peer", "swap_order"):
        assert fault_in_unrecorded_op(bug, generate(20261214, 1, bug).truth.detail)
    splits = [generate(20261214, i, "size").truth.detail for i in range(40)]
    assert any(fault_in_unrecorded_op("size", d) for d in splits), splits       # all_to_all_single's splits
    assert not all(fault_in_unrecorded_op("size", d) for d in splits)
    for bug in ("skip", "dtype", "exit", "group_order"):
        assert not fault_in_unrecorded_op(bug, generate(20261214, 2, bug).truth.detail)


def test_resume_runs_only_the_programs_a_stopped_run_lacks(tmp_path: Path, monkeypatch, capsys) -> None:
    """--resume keeps the scored rows of results.jsonl and runs only the programs it lacks."""
    import json
    import random_programs as rp

    def row(index: int, bug: str) -> dict:
        t = generate(5, index, bug).truth
        scored = {"root": True, "cause": True, "right": True, "line": None, "na": True, "kind": "", "ranks": [],
                  "verdict": ""}
        return {"name": t.name, "bug": bug, "silent": False, "healthy_job_failed": False, "miss": False,
                "detail": t.detail, "world": t.world, "took_s": 1.0, "culprits": t.culprits,
                **{s: dict(scored) for s in rp.SOURCES}}

    ran: list[int] = []
    monkeypatch.setattr(rp, "run_one", lambda ns, out, work, index, bug: ran.append(index) or row(index, bug))
    bugs = rp.plan(5, 2, 1, [])
    (tmp_path / "results.jsonl").write_text("".join(json.dumps(row(i, b)) + "\n" for i, b in enumerate(bugs[:2])))
    assert rp.main(["--seed", "5", "--count", "2", "--healthy", "1", "--out", str(tmp_path), "--resume"]) == 0
    assert ran == [2], ran
    assert len((tmp_path / "results.jsonl").read_text().splitlines()) == 3
    assert "seed 5: 3 programs" in capsys.readouterr().out
