"""The accuracy sweep's drawn layouts (benchmarks/accuracy.py --random-layouts): deterministic per seed,
accepted by the runtime's own checks, varied, and each drill's culprit a rank of its layout."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import accuracy  # noqa: E402


def test_random_matrix_is_deterministic_and_valid() -> None:
    a = accuracy.random_matrix(11, 40, 5)
    assert [(c.name, c.argv) for c in a] == [(c.name, c.argv) for c in accuracy.random_matrix(11, 40, 5)]
    assert [(c.name, c.argv) for c in a] != [(c.name, c.argv) for c in accuracy.random_matrix(12, 40, 5)]
    assert len({c.name for c in a}) == len(a) == 45                    # one run directory each
    assert sum(c.kind == "healthy" for c in a) == 5
    for c in a:
        assert accuracy._valid(c.argv), c.argv                          # the runtime accepts every draw
        if c.kind != "healthy":
            assert 0 <= c.rank < c.layout.world and c.kind in accuracy.CAUSE
            assert accuracy.applies(c.kind, c.layout)


def test_random_layouts_vary() -> None:
    cases = accuracy.random_matrix(3, 120, 0)
    names = {c.layout.name for c in cases}
    argv = " ".join(" ".join(c.argv) for c in cases)
    assert len(names) >= 20
    for flag in ("--tp", "--pp", "--cp", "--dp", "--ep", "--zero", "interleaved", "1f1b", "gpipe"):
        assert flag in argv, flag
    assert {c.layout.world for c in cases} == {2, 4, 8}
    assert len({c.kind for c in cases}) == len(accuracy.CAUSE)


def test_an_invalid_draw_is_refused() -> None:
    assert not accuracy._valid(("--tp", "4", "--steps", "4"))          # --n-head 2 is not divisible by --tp 4
    assert not accuracy._valid(("--dp", "2", "--inject", "p2p_order:rank=0,step=1"))   # no pipeline
