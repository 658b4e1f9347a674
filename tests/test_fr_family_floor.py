"""`fr_world.family_floor` on hand-built entries: a run of consecutively created groups of one width whose
users share no rank is a mesh dimension, and holds run x width distinct ranks; anything else says nothing."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ncclscope.load.foreign.fr_world import family_floor


def _ents(uses: dict[str, list[int]]) -> SimpleNamespace:
    """Entries stand-in: one entry per (group, rank) use."""
    names = sorted(uses)
    pg, rank = [], []
    for i, n in enumerate(names):
        for r in uses[n]:
            pg.append(i)
            rank.append(r)
    ents = SimpleNamespace(n=len(pg), pg_code=np.array(pg, dtype=np.int64), rank=np.array(rank, dtype=np.int64),
                           pg_names=names)
    ents.rank_pg_pairs = lambda: np.unique(ents.rank * len(names) + ents.pg_code, return_index=True,
                                           return_inverse=True)
    return ents


def test_two_disjoint_groups_of_two_created_in_a_row_hold_four_ranks() -> None:
    ents = _ents({"1": [0, 2], "2": [1], "3": [0], "4": [2]})
    assert family_floor(ents, {"1": 2, "2": 2, "3": 2, "4": 2}) == 4


def test_groups_that_share_a_rank_or_differ_in_width_or_were_not_created_in_a_row_say_nothing() -> None:
    assert family_floor(_ents({"1": [0, 1], "2": [1, 2]}), {"1": 2, "2": 2}) == 0      # sliding pairs
    assert family_floor(_ents({"1": [0, 1], "2": [2]}), {"1": 2, "2": 3}) == 0          # two widths
    assert family_floor(_ents({"1": [0, 1], "3": [2]}), {"1": 2, "3": 2}) == 0          # not consecutive
    assert family_floor(_ents({"0": [0, 1], "1": [2]}), {"0": 2, "1": 2}) == 0          # the default group
    assert family_floor(_ents({"1": [0, 1]}), {"1": 2}) == 0                             # one group alone
