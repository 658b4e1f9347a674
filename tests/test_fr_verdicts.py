"""Verdicts on Flight Recorder dumps of real gloo jobs (tests/fr_jobs.py) with a known culprit.

The jobs run once per module at 4 ranks (about 30 s on a loaded 2-core box)."""
from __future__ import annotations

import pickle
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

torch = pytest.importorskip("torch")
from fr_jobs import make_dumps  # noqa: E402

from ncclscope.analysis import run  # noqa: E402
from ncclscope.findings import Role  # noqa: E402
from ncclscope.ingest import load_any  # noqa: E402

WORLD = 4


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    base = tmp_path_factory.mktemp("fr-verdicts")
    return {sc: make_dumps(sc, WORLD, culprit, base) for sc, culprit in
            (("wrong_group", 1), ("group_order", 2), ("healthy", 0))}


def _analyze(path: Path):
    a = run(load_any(path))
    head = next((f for f in a.findings if f.role == Role.HEADLINE), None)
    return a, head


def test_wrong_group_by_call_site_names_the_culprit_and_the_call_site(dumps):
    a, head = _analyze(dumps["wrong_group"])
    assert a.verdict.startswith("WRONG GROUP: rank 1 called all_reduce"), a.verdict
    assert (head.kind, head.ranks) == ("wrong_group", [1])
    assert re.search(r"at tests/fr_jobs\.py:\d+", a.verdict), a.verdict


def test_group_creation_disagreement_from_pg_config_names_the_culprit(dumps):
    a, head = _analyze(dumps["group_order"])
    assert a.verdict.startswith("GROUP MISMATCH: rank 2 disagrees on the members of"), a.verdict
    assert (head.kind, head.ranks) == ("group_mismatch", [2])


def test_healthy_dumps_stay_ok(dumps):
    a, _ = _analyze(dumps["healthy"])
    assert a.ok, a.verdict
    assert a.verdict.startswith("OK")


def _truncate(src: Path, dst: Path, keep: int, pg_config: dict | None) -> Path:
    dst.mkdir()
    for f in sorted(src.glob("nccl_trace_rank_*")):
        d = pickle.loads(f.read_bytes())
        d["entries"] = d["entries"][:keep]
        if pg_config is not None:
            d["pg_config"] = pg_config
        (dst / f.name).write_bytes(pickle.dumps(d))
    return dst


def test_all_ranks_stopped_with_nothing_in_flight_is_never_ok(dumps, tmp_path):
    # every rank created the tp x dp groups (an NCCL job's pg_config lists them), then stopped right
    # after the first broadcast: nothing in flight, nothing waits on anyone, and yet not OK
    cfg = {"0": {"name": "0", "desc": "default_pg", "ranks": str(list(range(WORLD)))}}
    for i, m in enumerate(([0, 1], [2, 3], [0, 2], [1, 3])):
        cfg[str(i + 1)] = {"name": str(i + 1), "desc": "undefined", "ranks": str(m)}
    d = _truncate(dumps["healthy"], tmp_path / "stopped", 1, cfg)
    a, head = _analyze(d)
    assert not a.ok
    assert a.verdict.startswith("STOPPED: all ranks stopped after broadcast #1 on default_pg, no collective in "
                                "flight: the job hung or died outside collectives, for example in group creation"), \
        a.verdict
    assert head.kind == "no_op_in_flight" and head.wait is None


def test_stopped_needs_evidence_of_more_to_do(dumps, tmp_path):
    # the same truncation without any group beyond default_pg reads as a job that did one broadcast
    d = _truncate(dumps["healthy"], tmp_path / "one-op", 1, None)
    a, _ = _analyze(d)
    assert not a.verdict.startswith("STOPPED"), a.verdict


def test_a_rank_with_no_dump_is_put_back_into_its_mesh_groups():
    from ncclscope.ingest.fr_fixups import _complete_groups
    # rank 3 left no dump: its tp group {2,3} and dp group {1,3} were rebuilt as {2} and {1}
    got = _complete_groups({"1": {0, 1}, "2": {2}, "3": {0, 2}, "4": {1}}, present={0, 1, 2})
    assert got == {"2": (2, 3), "4": (1, 3)}
    # rank 2's dump is missing between others: {3} is {2,3}, not {3,4}
    got = _complete_groups({"1": {0, 1}, "2": {3}, "3": {0}, "4": {1, 3}}, present={0, 1, 3}, world=4)
    assert got == {"2": (2, 3), "3": (0, 2)}
    # one lone group is no mesh: nothing is guessed
    assert _complete_groups({"1": {0, 1}, "2": {2}}, present={0, 1, 2}) == {}
    # the rank to put back left a dump: it is not dead, nothing is guessed
    assert _complete_groups({"1": {0, 1}, "2": {2}, "3": {0, 2}, "4": {1}}, present={0, 1, 2, 3}) == {}


def test_dumps_without_timestamps_say_no_duration(dumps, tmp_path):
    # the same wrong-group dumps with every time field gone: the call sites still name the culprit,
    # and nothing claims a wait of "0.0 s"
    dst = tmp_path / "no-times"
    dst.mkdir()
    for f in sorted(dumps["wrong_group"].glob("nccl_trace_rank_*")):
        d = pickle.loads(f.read_bytes())
        for e in d["entries"]:
            for k in ("time_created_ns", "time_discovered_started_ns", "time_discovered_completed_ns"):
                e.pop(k, None)
        (dst / f.name).write_bytes(pickle.dumps(d))
    a, head = _analyze(dst)
    assert (head.kind, head.ranks) == ("wrong_group", [1]), a.verdict
    assert re.search(r"at tests/fr_jobs\.py:\d+", a.verdict), a.verdict
    assert " since " not in a.verdict and head.wait is not None and head.wait.wait_s is None, a.verdict
