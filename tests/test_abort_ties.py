"""A 1 vs 1 size or dtype tie decided by the member gloo aborted (hang/abort_ties.py): gloo aborts a process
only when it receives more bytes than it posted, so where the third member of a 3-rank instance died of that
abort and left no record, the survivor that posted more is the deviant.

Found by two unseen hand-written programs (benchmarks/hand_programs/seqpar_tail_chunk.py, an all_gather of a
tail chunk twice the others' on rank 2; fsdp2_host_bf16_reduce.py, rank 2 reducing in float32 where its peers
use bfloat16): each's Flight Recorder dumps read "ambiguous (1 vs 1 tie), naming the lowest rank".
"""
from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pandas as pd
import pytest

from ncclscope.hang.abort_ties import larger_side
from ncclscope.load.trace_model import RankInfo

pytestmark = pytest.mark.timeout(60)


_ITEM = {"float32": 4, "bfloat16": 2, "int32": 4}


def _trace(dead: RankInfo, inst: pd.DataFrame, backend: str = "gloo") -> SimpleNamespace:
    """Rank 0 ended as `dead`; the ops table holds the instance rows' ops with the bytes the loader counted."""
    ranks = {0: dead, 1: RankInfo(rank=1, present=True), 2: RankInfo(rank=2, present=True)}
    groups = pd.DataFrame({"rank": [1, 2], "process_group": ["default_pg"] * 2, "backend": [backend] * 2})
    return SimpleNamespace(ranks=ranks, groups=groups, ops=inst[["rank", "op_id", "bytes"]])


def _inst(sizes: tuple[str, str], dtypes: tuple[str, str] = ("float32", "float32")) -> pd.DataFrame:
    """Two instance rows, with their ops' bytes (0, unknown, where a size text does not read)."""
    rows = []
    for op_id, (rank, size, dtype) in enumerate(zip((1, 2), sizes, dtypes)):
        try:
            numel = sum(math.prod(s) for s in json.loads(size.split("->")[0]))
        except ValueError:
            numel = 0
        rows.append({"rank": rank, "op_id": op_id, "bytes": numel * _ITEM[dtype], "input_sizes": size,
                     "input_dtypes": dtype})
    return pd.DataFrame(rows)


NO_DUMP = RankInfo(rank=0, present=False)
ABORTED = RankInfo(rank=0, present=True, signal="SIGABRT")


@pytest.mark.parametrize("dead", [NO_DUMP, ABORTED], ids=["no-dump", "sigabrt"])
def test_the_survivor_that_posted_more_bytes_is_named(dead: RankInfo) -> None:
    inst = _inst(("[[2, 12]] -> [[3, 2, 12]]", "[[4, 12]] -> [[3, 4, 12]]"))
    assert larger_side(_trace(dead, inst), inst, [0], ["size"], "default_pg") == 2
    inst = _inst(("[[147]]", "[[147]]"), ("float32", "bfloat16"))
    assert larger_side(_trace(dead, inst), inst, [0], ["dtype"], "default_pg") == 1


def test_nothing_is_decided_without_the_abort_or_its_evidence() -> None:
    inst = _inst(("[[2, 12]]", "[[4, 12]]"))
    # the third member exited by itself (not gloo's abort): nothing says which survivor it agreed with
    exited = RankInfo(rank=0, present=True, exitcode=1, end_status="error", end_message="ValueError")
    assert larger_side(_trace(exited, inst), inst, [0], ["size"], "default_pg") is None
    # no third member: a 2-rank group's tie is not this rule's
    assert larger_side(_trace(NO_DUMP, inst), inst, [], ["size"], "default_pg") is None
    # NCCL aborts nothing on a size mismatch
    assert larger_side(_trace(NO_DUMP, inst, backend="nccl"), inst, [0], ["size"], "default_pg") is None
    # equal byte counts (a dtype of one item size), another category, unreadable sizes
    same = _inst(("[[4]]", "[[4]]"), ("float32", "int32"))
    assert larger_side(_trace(NO_DUMP, same), same, [0], ["dtype"], "default_pg") is None
    assert larger_side(_trace(NO_DUMP, inst), inst, [0], ["type"], "default_pg") is None
    torn = _inst(("?", "[[4]]"))
    assert larger_side(_trace(NO_DUMP, torn), torn, [0], ["size"], "default_pg") is None
