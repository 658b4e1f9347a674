"""Group tables at scale: each rank writes its own groups plus its plan's fingerprint, the whole plan once.

Runs without spawning ranks: the directories are written through the real
writer (`Recorder.write_meta` with `mesh.group_file`, the object build_mesh
passes it), for a plan cut by the real `Grid`.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from ncclscope import schema as S
from ncclscope.verdict.diagnose import diagnose
from ncclscope.runtime.mesh import Grid, fingerprint, group_file, writes_whole_plan
from ncclscope.load.trace import load

pytestmark = pytest.mark.timeout(120)
SAMPLES = Path(__file__).resolve().parents[1] / "sample_traces"


def _view(plan: list[tuple[str, str, list[int]]], world: int) -> list[dict]:
    """The view build_mesh records: world first, then the plan in creation order."""
    return [{"name": "world", "kind": "world", "ranks": list(range(world)), "creation_order": 0, "backend": "gloo"}] + [
        {"name": n, "kind": k, "ranks": m, "creation_order": i + 1, "backend": "gloo"}
        for i, (n, k, m) in enumerate(plan)]


def _write_run(root: Path, grid: Grid, odd: dict[int, list] | None = None) -> Path:
    """One rank directory per rank through the runtime's writer; `odd` gives some ranks another plan."""
    from ncclscope.runtime.recorder import Recorder
    world = grid.world_size
    plans = {r: (odd or {}).get(r, grid.plan()) for r in range(world)}
    fps = [fingerprint(plans[r]) for r in range(world)]
    for r in range(world):
        rec = Recorder(root, r, world)
        rec.write_meta(coords=grid.coords(r),
                       groups=group_file(r, _view(plans[r], world), fps[r], full=writes_whole_plan(r, fps)))
        op = rec.begin("collective", "all_reduce", group="world", seq=1, nbytes=8)
        rec.end(op)
        rec.close()
    (root / S.RUN_JSON).write_text(json.dumps({"world_size": world,
                                               "ranks": {str(r): {"exitcode": 0} for r in range(world)}}))
    return root


def test_each_rank_writes_its_own_groups_and_the_loader_rebuilds_membership(tmp_path):
    grid = Grid(tp=2, dp=2, pp=2)
    root = _write_run(tmp_path, grid)
    files = {r: json.loads((root / S.rank_dir_name(r) / S.GROUPS_JSON).read_text()) for r in range(8)}
    fp = f"{fingerprint(grid.plan()):016x}"
    assert all(f["format"] == 2 and f["fingerprint"] == fp for f in files.values())
    assert "plan" in files[0] and not any("plan" in files[r] for r in range(1, 8))   # the whole plan once
    # rank 5 writes world + one group of each kind it is in: tp, cp, dp, pp
    assert [g["name"] for g in files[5]["groups"]] == ["world", "tp2", "cp5", "dp3", "pp1"]
    assert files[5]["groups"][0]["ranks"] == {"range": [0, 8, 1]}

    trace = load(root)
    assert trace.warnings == []
    want = {"world": list(range(8)), **{n: sorted(m) for n, _, m in grid.plan()}}
    assert trace.group_members() == want
    views = trace.group_views
    assert len(views.views) == 1 and views.holders == [list(range(8))]   # one distinct view, 8 holders
    # the table holds each rank's own groups, not ranks x groups
    assert len(trace.groups) == sum(len(f["groups"]) for f in files.values()) < 8 * len(want)
    assert not [f for f in diagnose(trace).findings if f.kind == "group_mismatch"]


def test_a_rank_with_another_plan_is_still_a_disagreeing_view(tmp_path):
    grid = Grid(tp=2, dp=2, pp=2)
    root = _write_run(tmp_path, grid, odd={5: list(reversed(grid.plan()))})   # the group_order drill
    assert "plan" in json.loads((root / "rank-00005" / S.GROUPS_JSON).read_text())   # its view is evidence
    trace = load(root)
    assert len(trace.group_views.views) == 2
    found = [f for f in diagnose(trace).findings if f.kind == "group_mismatch"]
    assert found and found[0].ranks == [5] and found[0].data["attribute"] == "creation_order"
    assert "different order" in found[0].title


def test_rank_zero_odd_the_majority_plan_is_written_by_rank_one():
    assert writes_whole_plan(0, [7, 3, 3, 3]) and writes_whole_plan(1, [7, 3, 3, 3])
    assert not writes_whole_plan(2, [7, 3, 3, 3])
    assert [writes_whole_plan(r, [3, 3, 9, 9]) for r in range(4)] == [True, False, True, False]


def test_missing_plan_leaves_each_ranks_own_groups(tmp_path):
    import shutil
    grid = Grid(tp=2, dp=2, pp=2)
    root = _write_run(tmp_path, grid)
    shutil.rmtree(root / "rank-00000")
    trace = load(root)
    assert any("is in no loaded groups.json" in w for w in trace.warnings)
    members = trace.group_members()
    assert members["tp1"] == [2, 3] and members["dp1"] == [1, 3] and members["world"] == list(range(8))


@pytest.mark.parametrize("name", ["healthy", "wrong-group", "hung-pipeline"])
def test_old_format_sample_traces_still_load(name):
    trace = load(SAMPLES / name)
    members = trace.group_members()
    assert members["world"] == list(range(trace.world_size))
    assert not any("group" in w for w in trace.warnings)


def test_per_rank_metadata_of_a_16384_rank_plan_fits_64_kb(tmp_path):
    from ncclscope.runtime.config import RunConfig
    from ncclscope.runtime.recorder import Recorder
    grid = Grid(tp=8, dp=256, pp=8)
    plan = grid.plan()
    assert len(plan) + 1 == 20_545
    view, fp = _view(plan, grid.world_size), fingerprint(plan)
    rank = 12_345
    rec = Recorder(tmp_path, rank, grid.world_size)   # writes rank.json the way a rank does
    cfg = RunConfig(tp=8, dp=256, pp=8, microbatches=8)
    rec.write_meta(clock_offset_ns=123_456, clock_uncertainty_ns=7_000, local_rank=rank % 8, config=cfg.to_json())
    rec.write_meta(coords=grid.coords(rank), groups=group_file(rank, view, fp, full=False))
    rec.close()
    d = tmp_path / S.rank_dir_name(rank)
    meta = sum(p.stat().st_size for p in d.iterdir() if not p.name.endswith(".arrows"))
    assert meta <= 64 * 1024, meta
    whole = len(json.dumps(group_file(0, view, fp, full=True), separators=(",", ":")))
    assert whole > 30 * meta          # what every rank wrote before (and rank 0 still does, once)


def test_synthetic_generator_writes_the_runtimes_format(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import synth
    assert synth._fingerprint(synth._group_plan(2, 2, 2)) == fingerprint(Grid(tp=2, dp=2, pp=2).plan())
    run = synth.generate(tmp_path / "run", ranks=16, events=20_000, hang=True, seed=1)
    trace = load(run)
    assert trace.warnings == []
    assert len(trace.group_views.views) == 1 and len(trace.group_views.holders[0]) == 16
    tp, pp, dp = synth.mesh_for(16)
    assert trace.group_members() == {"world": list(range(16)), **{n: sorted(m) for n, _, m in
                                                                  Grid(tp=tp, dp=dp, pp=pp).plan()}}
