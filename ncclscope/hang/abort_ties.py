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
those silently), where a survivor's byte count is not known, or where a member left no record for another reason.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

_CATEGORIES = {"size", "dtype"}


def _bytes(trace: object, inst: pd.DataFrame) -> list[int] | None:
    """Bytes each row of `inst` posted, as the loader counted them (the ops' `bytes`); None where unknown."""
    ops = getattr(trace, "ops", None)
    if ops is None or "bytes" not in ops.columns or "op_id" not in inst.columns:
        return None
    mine = ops[np.isin(ops["op_id"].to_numpy(), inst["op_id"].to_numpy())][["rank", "op_id", "bytes"]]
    got = inst[["rank", "op_id"]].merge(mine, on=["rank", "op_id"], how="left")["bytes"].fillna(0)
    return [int(b) for b in got] if (got > 0).all() else None


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
    sizes = _bytes(trace, inst)
    if sizes is None or sizes[0] == sizes[1]:
        return None
    return int(inst["rank"].iloc[0 if sizes[0] > sizes[1] else 1])
