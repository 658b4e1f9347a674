"""The hand-written programs' yardstick (benchmarks/hand_programs.py): every program compiles once its marks
are stripped, imports nothing of ncclscope, and its truth is consistent with its source."""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import hand_programs as hp  # noqa: E402
from randprog.catalogue import CATALOGUE, HEALTHY  # noqa: E402


@pytest.mark.parametrize("name", sorted(hp.CASES))
def test_a_hand_program_compiles_and_its_truth_matches_its_source(name: str) -> None:
    prog = hp.program(name)
    assert "# <BUG>" not in prog.source and "# <ALT>" not in prog.source
    tree = ast.parse(prog.source)
    mods = {n.name for node in ast.walk(tree) if isinstance(node, ast.Import) for n in node.names}
    mods |= {node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not any("ncclscope" in m for m in mods)
    t = prog.truth
    src = prog.source.split("\n")
    assert all(src[n - 1].strip() == text for n, text in zip(t.lines, t.line_texts))
    if t.bug == HEALTHY:
        assert not t.culprits and not t.lines
    else:
        assert t.culprits and all(0 <= r < t.world for r in t.culprits)
        assert bool(t.lines) == CATALOGUE[t.bug].line_judged
