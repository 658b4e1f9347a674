"""A 1 vs 1 size or dtype tie decided by the member gloo aborted (`larger_side`).

gloo checks every message it receives against the buffer the receiver posted, and aborts the process
(SIGABRT, `Received data size doesn't match expected size`, "12 vs 8") only when the message is larger:
measured on this torch (`benchmarks/gloo_abort_side.py`: all_reduce, all_gather_into_tensor and
reduce_scatter_tensor, 3 ranks, the deviant posting twice or half the others' elements, each of the 12 runs),
the rank that died was always one that received more than it posted, an innocent neighbour when the deviant's
tensor was the larger, the deviant itself when it was the smaller. So where two survivors split 1 vs 1 on the
byte count of an instance whose other member(s) died of that abort (killed by SIGABRT in a run trace; no dump
at all among Flight Recorder dumps, whose writers lose an aborted process), the dead member was an innocent
one that received the larger message: the survivor that posted more bytes is the deviant, and the smaller one
agrees with the dead. Nothing is decided where the byte counts are equal (a dtype of one item size: gloo pairs
those silently), where a survivor's sizes cannot be read, or where a member left no record for another reason.
"""
from __future__ import annotations

import json
import math

import pandas as pd

from ncclscope.load.foreign.vocab import dtype_itemsize

_CATEGORIES = {"size", "dtype"}


def _nbytes(sizes: str, dtypes: str) -> int | None:
    """Bytes of a row's input tensors ("[[2, 12]] -> [[3, 2, 12]]", "float32"); None where unreadable."""
    try:
        shapes = json.loads(str(sizes).split("->")[0].strip())
    except ValueError:
        return None
    names = [d.strip() for d in str(dtypes).split(",") if d.strip()]
    if not isinstance(shapes, list) or not shapes or not names:
        return None
    if len(names) == 1:
        names = names * len(shapes)
    if len(names) != len(shapes):
        return None
    total = 0
    for shape, name in zip(shapes, names):
        size = dtype_itemsize(name)
        if not size or not isinstance(shape, list) or not all(isinstance(x, int) for x in shape):
            return None
        total += math.prod(shape) * size
    return total


def _aborted(trace: object, ranks: list[int]) -> bool:
    """Did each of these members die the way gloo's abort leaves it: SIGABRT, or no dump at all?"""
    infos = getattr(trace, "ranks", {})
    for r in ranks:
        info = infos.get(r)
        if info is None:
            return False
        if not (info.state == "missing" or (info.state == "killed" and info.signal == "SIGABRT")):
            return False
    return bool(ranks)


def _on_gloo(trace: object, group: str) -> bool:
    """Did the ranks record the group as a gloo one (NCCL aborts nothing on a size mismatch)?"""
    groups = getattr(trace, "groups", None)
    if groups is None or not len(groups) or "backend" not in groups.columns:
        return False
    mine = groups[groups["process_group"].astype(str) == group]["backend"].astype(str)
    return bool(len(mine)) and bool((mine == "gloo").all())


def larger_side(trace: object, inst: pd.DataFrame, absent: list[int], categories: list[str],
                group: str) -> int | None:
    """The survivor that posted more bytes, where two survivors of the instance (`inst`, one row each) of a
    gloo `group` split 1 vs 1 on size or dtype and every other member (`absent`) died of gloo's abort;
    else None."""
    if not set(categories) <= _CATEGORIES or len(inst) != 2 or not _aborted(trace, absent):
        return None
    if not _on_gloo(trace, group):
        return None
    if "input_sizes" not in inst.columns or "input_dtypes" not in inst.columns:
        return None
    sizes = [_nbytes(s, d) for s, d in zip(inst["input_sizes"], inst["input_dtypes"])]
    if None in sizes or sizes[0] == sizes[1]:
        return None
    return int(inst["rank"].iloc[0 if sizes[0] > sizes[1] else 1])
