"""A fixed subset of PyTorch's own Flight Recorder analyzer cases (benchmarks/fr_torch_cases.py), judged
in-process as the benchmark judges them: one or two per kind of expectation.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_fr_torch_cases.py
    OMP_NUM_THREADS=1 python benchmarks/fr_torch_cases.py        # every case, and torch's analyzer beside

The subset: a match, each mismatch kind (type, size of an input and of an output, dtype of an output, state),
a shape rule (an all_gather's numel), coalesced blocks (a healthy one, an uneven one, one rank's extra),
groups sliced under one name, a receive from any source short of its send, the backend spellings."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import fr_torch_cases as cases  # noqa: E402

SUBSET = (
    "match_one_event e1/e1",
    "match_one_event e1/e2 all_gather",
    "match_one_event e1/e6 output",
    "match_one_event e1/e9 state",
    "match_one_event e10/e9 out dtype",
    "all_gather_base numel bad",
    "buildDB 1 all_reduce + sub_pg slices",
    "buildDB 3 coalesced broadcasts",
    "buildDB 4 uneven all_gather",
    "buildDB 6 coalesced block on rank 1 only",
    "recv_any_source short send",
    "backend nccl2 p2p",
    "hook list reduce_scatter x3",
)
BY_NAME = {c.name: c for c in cases.all_cases()}


def test_the_subset_names_existing_cases():
    assert set(SUBSET) <= set(BY_NAME)
    assert {BY_NAME[n].expect for n in SUBSET} >= {"match", "type", "size", "dtype", "state", "mismatch"}


@pytest.mark.parametrize("name", SUBSET)
def test_ncclscope_says_what_the_torch_test_expects(name, tmp_path):
    case = BY_NAME[name]
    report = cases.ours(cases.write(case, tmp_path))
    assert cases.agrees(case, report), (case.expect, report.get("verdict"))
