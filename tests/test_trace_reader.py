"""The reader tolerates what a dying job leaves behind and names each problem."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ncclscope import schema as S
from ncclscope.load.trace import TraceError, load

pytestmark = pytest.mark.timeout(60)


def _make_run(root: Path, world: int = 3) -> Path:
    from ncclscope.runtime.recorder import Recorder
    for r in range(world):
        rec = Recorder(root, r, world)
        rec.write_meta(groups=[{"name": "world", "kind": "world", "ranks": list(range(world)), "creation_order": 0}])
        rec.context.step = 0
        op = rec.begin("collective", "all_reduce", group="world", seq=1, nbytes=8)
        rec.end(op)
        rec.metric(step=0, loss=2.0)
        rec.close()
    (root / S.RUN_JSON).write_text(json.dumps({"world_size": world, "ranks": {str(r): {"exitcode": 0} for r in range(world)}}))
    return root


def test_healthy_run_loads(tmp_path):
    trace = load(_make_run(tmp_path))
    assert trace.world_size == 3 and trace.warnings == []
    assert len(trace.ops) == 3 and set(trace.ops["status"]) == {"ok"}
    assert trace.group_members() == {"world": [0, 1, 2]}
    assert all(info.state == "finished" for info in trace.ranks.values())


def test_missing_rank_torn_and_garbage_files(tmp_path):
    root = _make_run(tmp_path)
    shutil.rmtree(root / "rank-00001")
    events = root / "rank-00002" / S.EVENTS_FILE
    events.write_bytes(events.read_bytes()[:-40])
    (root / "rank-00000" / S.METRICS_FILE).write_bytes(b"not arrow at all")
    (root / "rank-00000" / S.RANK_JSON).write_text("{torn")
    before = {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}
    trace = load(root)
    text = "\n".join(trace.warnings)
    assert "rank 1 has no directory rank-00001" in text
    assert f"{events}: torn batch" in text
    assert "metrics.arrows: not a readable Arrow stream" in text
    assert "rank.json: unreadable JSON" in text
    assert trace.ranks[1].state == "missing"
    assert set(trace.ops["rank"]) >= {0}
    assert {p: p.read_bytes() for p in root.rglob("*") if p.is_file()} == before   # nothing modified


def test_hostile_rows_cannot_claim_another_rank(tmp_path):
    from ncclscope.runtime.recorder import Recorder
    rec = Recorder(tmp_path, 1, 2)
    rec.rank = 0   # a forged writer
    rec.close()
    op = load(tmp_path).events
    assert set(op["rank"]) <= {1}


def test_not_a_run_directory(tmp_path):
    with pytest.raises(TraceError, match="no rank-NNNNN directories"):
        load(tmp_path)
    with pytest.raises(TraceError, match="no such directory"):
        load(tmp_path / "nope")
    f = tmp_path / "file.txt"
    f.write_text("x")
    with pytest.raises(TraceError, match="not a directory"):
        load(f)
