"""`fr_world.family_floor` on hand-built entries: a run of consecutively created groups of one width whose
users share no rank is a mesh dimension, and holds run x width distinct ranks; anything else says nothing."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ncclscope.load.foreign.fr_world import family_floor


def _ents(uses: dict[str, list[int]], descs: dict[str, str] | None = None) -> SimpleNamespace:
    """Entries stand-in: one entry per (group, rank) use; `descs` the groups' descriptions (else "undefined")."""
    names = sorted(uses)
    texts = sorted({*(descs or {}).values(), "undefined"})
    pg, rank, desc = [], [], []
    for i, n in enumerate(names):
        for r in uses[n]:
            pg.append(i)
            rank.append(r)
            desc.append(texts.index((descs or {}).get(n, "undefined")))
    ents = SimpleNamespace(n=len(pg), pg_code=np.array(pg, dtype=np.int64), rank=np.array(rank, dtype=np.int64),
                           pg_names=names, descs=texts, desc_code=np.array(desc, dtype=np.int64))
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


def test_a_device_mesh_dimension_whose_group_lost_a_member_keeps_its_width() -> None:
    """Seed 20261221 #151: no all_gather to read widths from; mesh_inner groups "3" {0,1} and "4" {2} (rank 3,
    rank 2's partner, aborted without a dump). A DeviceMesh dimension's groups are of one size: 4 ranks."""
    mesh = {"3": "mesh_inner", "4": "mesh_inner"}
    assert family_floor(_ents({"0": [0, 1, 2], "3": [0, 1], "4": [2]}, mesh), {}) == 4
    # groups of new_group (no mesh description) say nothing without shapes; neither does a description
    # whose full groups differ in size (two meshes naming a dimension alike)
    assert family_floor(_ents({"0": [0, 1, 2], "3": [0, 1], "4": [2]}), {}) == 0
    two = {"3": "mesh_dp", "4": "mesh_dp", "5": "mesh_dp"}
    assert family_floor(_ents({"3": [0, 1, 2, 3], "4": [4, 5], "5": [6]}, two), {}) == 0
    # two dimensions of one size, one after the other, are not read as one run
    dims = {"1": "mesh_a", "2": "mesh_a", "3": "mesh_b", "4": "mesh_b"}
    assert family_floor(_ents({"1": [0, 1], "2": [2, 3], "3": [0, 2], "4": [1]}, dims), {}) == 4


def test_dumps_of_a_mesh_whose_aborted_rank_left_none_are_not_ok(tmp_path) -> None:
    """Seed 20261221 #151 as dumped (unseen): 4 ranks on a 2 x 2 DeviceMesh, rank 3 alone all-reduces a
    scalar on the world at step 6, gloo aborts it, and it leaves no dump. Three dumps, every op of them
    entered by all three: "OK: no hang, deadlock or mismatch found", exit 0. The mesh says the world has 4
    ranks: rank 3 left no dump, and the others wait in the all_reduce it never entered."""
    from ncclscope.load.foreign.flight_recorder import load_flight_recorder
    from ncclscope.verdict.compose import run
    from randprog_data import timed_dumps
    a = run(load_flight_recorder(timed_dumps("rp20261221_151_extra_fr", tmp_path)))
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("dead_rank", [3]), a.verdict
    assert a.exit_code != 0
