"""Verdicts on Flight Recorder dumps of real gloo jobs (tests/fr_jobs.py) with a known culprit.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_fr_verdicts.py

The jobs run once per module at 4 ranks (about 30 s on a loaded 2-core box);
the other cases are those dumps rewritten (times removed, entries cut, one
rank's groups renamed as a different creation order would have named them,
a dump deleted), so no further process is spawned."""
from __future__ import annotations

import os
import pickle
import re
import shutil
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

torch = pytest.importorskip("torch")
from fr_jobs import OP_TIMEOUT_S, make_dumps, reorder_groups  # noqa: E402

from ncclscope.verdict import run  # noqa: E402
from ncclscope.hang.group_order import creation_order_findings  # noqa: E402
from ncclscope.index.views import index_of  # noqa: E402
from ncclscope.findings import Role  # noqa: E402
from ncclscope.load.foreign import load_any  # noqa: E402

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


@pytest.fixture(scope="module")
def analyzed(dumps):
    """`_analyze(dumps[scenario])` of the module's unmodified dumps, computed once per scenario and shared
    by the tests that hold it (several tests read the same dumps' analysis); callers only read it."""
    cache: dict[str, tuple] = {}

    def get(scenario: str):
        if scenario not in cache:
            cache[scenario] = _analyze(dumps[scenario])
        return cache[scenario]
    return get


def test_wrong_group_by_call_site_names_the_culprit_and_the_call_site(analyzed):
    a, head = analyzed("wrong_group")
    assert a.verdict.startswith("WRONG GROUP: rank 1 called all_reduce"), a.verdict
    assert (head.kind, head.ranks) == ("wrong_group", [1])
    assert re.search(r"at tests/fr_jobs\.py:\d+", a.verdict), a.verdict


def test_group_creation_disagreement_from_pg_config_names_the_culprit(analyzed):
    a, head = analyzed("group_order")
    assert a.verdict.startswith("GROUP MISMATCH: rank 2 disagrees on the members of"), a.verdict
    assert (head.kind, head.ranks) == ("group_mismatch", [2])


def test_healthy_dumps_stay_ok(analyzed):
    a, _ = analyzed("healthy")
    assert a.ok, a.verdict
    assert a.verdict.startswith("OK")


def _last_time(entries: list[dict]) -> int:
    """The latest time of any kind in a dump's entries: a dump is written after its last op ended (an op
    completed more than a few ms after it was created would otherwise end after its own dump, whose time
    is then not trusted, and nothing is said: this made the idle-rank test fail on a loaded host)."""
    return max(max(e.get(k) or 0 for k in ("time_created_ns", "time_discovered_started_ns",
                                            "time_discovered_completed_ns")) for e in entries)


def _truncate(src: Path, dst: Path, keep: int, pg_config: dict | None, idle_s: float = 0.01) -> Path:
    """The first `keep` entries of each dump, as if the job had dumped `idle_s` after the last of them
    (the loader reads a dump's time from its file's mtime)."""
    dst.mkdir()
    for f in sorted(src.glob("nccl_trace_rank_*")):
        d = pickle.loads(f.read_bytes())
        d["entries"] = d["entries"][:keep]
        if pg_config is not None:
            d["pg_config"] = pg_config
        (dst / f.name).write_bytes(pickle.dumps(d))
        t = _last_time(d["entries"]) + int(idle_s * 1e9)
        os.utime(dst / f.name, ns=(t, t))
    return dst


def _texts(a) -> list[str]:
    """Every sentence a face shows: the verdict, each finding's title, wait summary and evidence notes."""
    out = [a.verdict]
    for f in a.findings:
        out.append(f.title)
        if f.wait is not None:
            out.append(f.wait.text)
        out += [e.note for e in f.evidence]
    return out


def _rewrite_times(src: Path, dst: Path, how: str) -> Path:
    dst.mkdir()
    for f in sorted(src.glob("nccl_trace_rank_*")):
        d = pickle.loads(f.read_bytes())
        for e in d["entries"]:
            for k in ("time_created_ns", "time_discovered_started_ns", "time_discovered_completed_ns"):
                if how == "drop":
                    e.pop(k, None)
                else:
                    e[k] = 0
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
    from ncclscope.load.foreign.fr_fixups import complete_groups
    # rank 3 left no dump: its tp group {2,3} and dp group {1,3} were rebuilt as {2} and {1}
    got = complete_groups({"1": {0, 1}, "2": {2}, "3": {0, 2}, "4": {1}}, present={0, 1, 2})
    assert got == {"2": (2, 3), "4": (1, 3)}
    # rank 2's dump is missing between others: {3} is {2,3}, not {3,4}
    got = complete_groups({"1": {0, 1}, "2": {3}, "3": {0}, "4": {1, 3}}, present={0, 1, 3}, world=4)
    assert got == {"2": (2, 3), "3": (0, 2)}
    # one lone group is no mesh: nothing is guessed about ranks past the dumps' names ...
    assert complete_groups({"1": {0, 1}, "2": {2}}, present={0, 1, 2}) == {}
    assert complete_groups({"1": {0, 1}, "2": {2}}, present={0, 1, 2}, world=3) == {}
    # ... but a rank whose dump is missing between others is put back where it alone fits (seed 20261214 #366)
    assert complete_groups({"1": {0}, "2": {1, 3}}, present={0, 1, 3}, world=4) == {"1": (0, 2)}
    # the rank to put back left a dump: it is not dead, nothing is guessed
    assert complete_groups({"1": {0, 1}, "2": {2}, "3": {0, 2}, "4": {1}}, present={0, 1, 2, 3}) == {}
    # two subgroups of different sizes ({0,1,2} and {3,4}, a healthy new_subgroups_by_enumeration) and the
    # leaders' {0,3}: no shape is shared by two groups, so {3,4} is not {3,4,5} with an invented rank 5
    assert complete_groups({"1": {0, 1, 2}, "2": {3, 4}, "3": {0, 3}}, present=set(range(5)), world=5) == {}


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



# ---- durations: said where the dump has them, never "0.0 s" ----------------------------------------
@pytest.mark.parametrize("scenario", ["wrong_group", "group_order", "healthy"])
def test_no_sentence_says_zero_seconds(analyzed, scenario):
    a, _ = analyzed(scenario)
    bad = [t for t in _texts(a) if "0.0 s" in t]
    assert not bad, bad[:3]


@pytest.mark.parametrize("how", ["drop", "zero"])
def test_dumps_without_usable_times_say_no_duration_anywhere(dumps, tmp_path, how):
    # time fields missing (read as -1) or all zero: no "since", "for N s" or wait_s, in any finding
    a, head = _analyze(_rewrite_times(dumps["wrong_group"], tmp_path / how, how))
    assert (head.kind, head.ranks) == ("wrong_group", [1]), a.verdict
    texts = _texts(a)
    assert not [t for t in texts if re.search(r"\bsince\b|\d\.\d s\b| \d+ ms\b", t)], texts
    assert all(f.wait is None or f.wait.wait_s is None for f in a.findings)


def test_real_timestamps_give_the_wait_of_the_waiters(analyzed):
    # the ranks behind the wrong call waited for the job's op timeout before the job dumped them
    a, head = analyzed("wrong_group")
    assert head.wait is not None and head.wait.wait_s is not None
    assert 0.5 * OP_TIMEOUT_S <= head.wait.wait_s <= 10 * OP_TIMEOUT_S, a.verdict
    assert re.search(r"waiting in all_reduce #\d+ on \S+ since \d+\.\d s", a.verdict), a.verdict


# ---- a rank without a dump --------------------------------------------------------------------------
def test_a_rank_without_a_dump_left_no_flight_recorder_dump(dumps, tmp_path):
    d = tmp_path / "no-dump"
    d.mkdir()
    for f in dumps["healthy"].glob("nccl_trace_rank_*"):
        if not f.name.endswith("_2"):
            shutil.copy2(f, d / f.name)
    a, head = _analyze(d)
    assert a.verdict.startswith("DEAD RANK: rank 2 left no Flight Recorder dump"), a.verdict
    assert not [t for t in _texts(a) if "trace directory" in t]


# ---- stopped with nothing in flight, pg_config empty ------------------------------------------------
def test_all_ranks_idle_past_their_timeout_before_the_dump_is_stopped(dumps, tmp_path):
    # gloo's empty pg_config lists no unused group; what says the job had more to do is time: every
    # rank sat outside any collective for longer than its collective timeout, then was dumped
    d = _truncate(dumps["healthy"], tmp_path / "idle", 1, None, idle_s=3 * (OP_TIMEOUT_S + 2))
    a, head = _analyze(d)
    assert not a.ok
    assert a.verdict.startswith("STOPPED: all ranks stopped after broadcast #1 on default_pg, no collective in "
                                "flight: the job hung or died outside collectives, for example in group creation"), \
        a.verdict
    assert "longer than its 5.0 s collective timeout" in a.verdict, a.verdict
    assert head.kind == "no_op_in_flight" and head.ranks == list(range(WORLD))


def test_some_ranks_idle_past_their_timeout_while_the_others_went_on_are_stopped(dumps, tmp_path):
    # ranks 1 and 3 never got past the first broadcast (hung in new_group, say) and were dumped long
    # after it; ranks 0 and 2 went on and were dumped right after their last op
    d = tmp_path / "half"
    d.mkdir()
    for f in sorted(dumps["healthy"].glob("nccl_trace_rank_*")):
        rank = int(f.name.rsplit("_", 1)[1])
        x = pickle.loads(f.read_bytes())
        if rank in (1, 3):
            x["entries"] = x["entries"][:1]
        (d / f.name).write_bytes(pickle.dumps(x))
        t = _last_time(x["entries"]) + int((3 * (OP_TIMEOUT_S + 2) if rank in (1, 3) else 0.01) * 1e9)
        os.utime(d / f.name, ns=(t, t))
    a, head = _analyze(d)
    assert a.verdict.startswith("STOPPED: ranks 1,3 stopped after broadcast #1 on default_pg, no collective in "
                                "flight, while ranks 0,2 went on to collectives on "), a.verdict
    assert head.kind == "no_op_in_flight" and head.ranks == [1, 3]


def test_a_dump_taken_within_the_timeout_after_the_last_op_is_not_stopped(dumps, tmp_path):
    d = _truncate(dumps["healthy"], tmp_path / "prompt", 1, None, idle_s=0.5 * (OP_TIMEOUT_S + 2))
    a, _ = _analyze(d)
    assert not a.verdict.startswith("STOPPED"), a.verdict


# ---- group creation order from the entries alone (pg_config empty) ----------------------------------
def _order_findings(path: Path):
    t = load_any(path)
    return creation_order_findings(index_of(t))


@pytest.mark.parametrize("culprit", [0, 2])
@pytest.mark.parametrize("descs,basis", [(False, "call_site"), (True, "desc")])
def test_creation_order_from_entries_names_the_culprit(dumps, tmp_path, descs, basis, culprit):
    # culprit 2's renamed groups are shared with two other ranks each (a 2-to-1 vote); culprit 0's with one
    # (1 to 1 on each name: it is the rank that disagrees on both of its groups, its partners on one each)
    d = reorder_groups(dumps["healthy"], tmp_path / f"reorder-{basis}", culprit=culprit, world=WORLD, descs=descs)
    fs = _order_findings(d)
    assert [(f.kind, f.ranks, f.cause.basis, f.data["attribute"]) for f in fs] == \
        [("group_mismatch", [culprit], basis, "creation_order")], [f.title for f in fs]
    assert fs[0].title.startswith(f"rank {culprit} created its process groups in a different order than the other "
                                  "ranks")
    assert {e.rank for e in fs[0].evidence} > {culprit}    # its calls and the other users' calls on those names


def test_creation_order_from_entries_is_silent_on_healthy_and_other_faults(dumps):
    for sc in ("healthy", "wrong_group", "group_order"):
        assert _order_findings(dumps[sc]) == [], sc


def test_creation_order_from_entries_is_the_verdict(dumps, tmp_path):
    # needs groups.analyze_groups to call group_order.creation_order_findings
    d = reorder_groups(dumps["healthy"], tmp_path / "reorder", culprit=2, world=WORLD)
    a, head = _analyze(d)
    assert a.verdict.startswith("GROUP MISMATCH: rank 2 created its process groups in a different order"), a.verdict
    assert (head.kind, head.ranks) == ("group_mismatch", [2])


def test_pg_config_and_entries_give_one_creation_order_finding(dumps, tmp_path):
    # with pg_config the member views already name rank 2; the entries' rule adds nothing on top
    d = reorder_groups(dumps["healthy"], tmp_path / "reorder-cfg", culprit=2, world=WORLD, keep_pg_config=True)
    a, head = _analyze(d)
    assert (head.kind, head.ranks) == ("group_mismatch", [2]), a.verdict
    assert sum(f.kind == "group_mismatch" and f.ranks == [2] for f in a.findings) == 1, \
        [f.title for f in a.findings]


# ---- group creation disagreement with gloo's empty pg_config ----------------------------------------
def _without_pg_config(src: Path, dst: Path, idle_s: float) -> Path:
    """The dumps as gloo writes them: pg_config empty (fr_jobs adds an NCCL-like one for group_order),
    each written `idle_s` after its rank's last op (a watchdog's dump after the timeout: the job's own
    last dump races its new_group timeout, so its file time is not used)."""
    dst.mkdir()
    for f in sorted(src.glob("nccl_trace_rank_*")):
        d = pickle.loads(f.read_bytes())
        d["pg_config"] = {"": {"name": "", "desc": "", "ranks": "[]"}}
        (dst / f.name).write_bytes(pickle.dumps(d))
        t = _last_time(d["entries"]) + int(idle_s * 1e9)
        os.utime(dst / f.name, ns=(t, t))
    return dst


def test_group_order_without_pg_config_is_never_ok_and_says_what_is_known(dumps, tmp_path):
    # rank 2 created dp before tp; every rank then hung inside new_group, so each dump holds the broadcast
    # alone: the entries name no group beyond default_pg and tell no rank from the others (the culprit
    # cannot be named from them). What they do say: every rank sat outside any collective past its
    # timeout before it was dumped. The verdict is not OK, and says where the ranks stopped and that group
    # creation is a candidate. (Dumped right after the broadcast instead, the same entries are those of a
    # job that did one broadcast: test_stopped_needs_evidence_of_more_to_do.)
    d = _without_pg_config(dumps["group_order"], tmp_path / "go-no-cfg", idle_s=3 * (OP_TIMEOUT_S + 2))
    groups = {e["process_group"][0] for f in d.iterdir() for e in pickle.loads(f.read_bytes())["entries"]}
    if groups != {"0"}:
        pytest.skip(f"this run's group_order job got past new_group on some rank (groups {sorted(groups)})")
    a, head = _analyze(d)
    assert not a.ok, a.verdict
    assert a.verdict.startswith("STOPPED: all ranks stopped after broadcast #1 on default_pg, no collective in "
                                "flight: the job hung or died outside collectives, for example in group creation"), \
        a.verdict
    assert head.kind == "no_op_in_flight" and head.ranks == list(range(WORLD))
