"""Pipeline parallelism in the runtime: `executor.py` runs a rank's action list.

The schedules themselves (GPipe, 1F1B, interleaved 1F1B: per-rank action lists)
and the dry-run simulator are pure logic with no torch, so they live in the
analyzer package (`ncclscope/schedules.py`, `ncclscope/pipesim.py`), where the
schedule check and the bubble replay read them too; the executor imports them
from there.
"""
