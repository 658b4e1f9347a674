"""`wrong_group` from call sites (hang/wrong_site.py) where nothing crossed, and mesh dimensions the schema
files under one kind.

Seed 20261214 #327 (unseen; its gloo dumps as written): a (dp 3, fsdp 2) DeviceMesh; at step 3 rank 2
all-reduces on its fsdp group {2,3} from line 55, the line every rank (rank 2 too, at steps 0-2) uses for its
dp group. Rank 3 had gone on past line 55 on its own dp group, so no one paired the call: rank 2 waits alone
in fsdp #25, ranks 0 and 4 wait for it in dp #12. The rule needed a peer's crossing call, and "mesh_fsdp"
and "mesh_dp" were one kind ("dp") to it: the verdict read HANG on rank 3.
"""
from __future__ import annotations

from ncclscope.hang.wrong_site import site_kind_of
from ncclscope.load.foreign.flight_recorder import load_flight_recorder
from ncclscope.verdict import run

from randprog_data import timed_dumps


def test_a_lone_wrong_call_awaited_on_the_rank_s_own_group_is_the_root(tmp_path) -> None:
    a = run(load_flight_recorder(timed_dumps("rp20261214_327_wrong_group_fr", tmp_path)))
    h = a.headline
    assert h is not None and (h.kind, h.ranks) == ("wrong_group", [2]), a.verdict
    assert "instead of mesh_dp:1[0,2,4]" in h.title and ".py:55" in h.title, h.title
    assert "which no other member entered" in h.title and "ranks 0,4 waiting in all_reduce #12" in h.title, h.title


def test_mesh_dimensions_are_kinds_to_a_call_site() -> None:
    kinds = {"mesh_dp:1": "dp", "mesh_fsdp:4": "dp", "default_pg": "world", "dp0": "dp", "g3": "custom:2x1"}
    assert site_kind_of("mesh_dp:1", kinds) == "mesh_dp" and site_kind_of("mesh_fsdp:4", kinds) == "mesh_fsdp"
    assert site_kind_of("default_pg", kinds) == "world"
    assert site_kind_of("dp0", kinds) == "dp" and site_kind_of("g3", kinds) == "custom:2x1"   # run traces' names
