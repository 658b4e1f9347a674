"""Flight Recorder dumps of NCCL jobs in the format torch writes (2.10), one test per defect.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_fr_real_format.py

Each test records what ProcessGroupNCCL records for a short job (`Job`: entries with torch's keys in
torch's order, one `collective_seq_id` per launch and group, coalesced blocks as members sharing the
block's sequence id with no events of their own and a `coalesced` marker that carries them) and writes
the dumps as torch does: a protocol-2 pickle (`_dump_fr_trace`) or JSON (`_dump_fr_trace_json`: no
frames, keys sorted, a missing time written 0). No torch, no process: the dumps are files."""
from __future__ import annotations

import json
import pickle
import time
from pathlib import Path
from typing import Any

import pytest

from ncclscope.findings import Role
from ncclscope.load.foreign import load_any
from ncclscope.verdict import run

LIB = "/usr/lib/python3.11/site-packages/torch/distributed"
_ORDER = ("frames", "record_id", "pg_id", "process_group", "thread_name", "thread_id", "collective_seq_id",
          "p2p_seq_id", "op_id", "profiling_name", "time_created_ns", "input_sizes", "input_dtypes",
          "output_sizes", "output_dtypes", "state", "time_discovered_started_ns",
          "time_discovered_completed_ns", "retired", "timeout_ms", "is_p2p")


class Job:
    """Per-rank Flight Recorder entries of a job on `world` ranks; `groups`: pg name -> (desc, {rank: its
    members}), each rank's own pg_config view (default_pg spans the world)."""

    def __init__(self, world: int, groups: dict[str, tuple[str, dict[int, list[int]]]] | None = None) -> None:
        self.world = world
        self.groups = {"0": ("default_pg", {r: list(range(world)) for r in range(world)})}
        self.groups.update(groups or {})
        self.entries: dict[int, list[dict[str, Any]]] = {r: [] for r in range(world)}
        self.seq: dict[tuple[int, str, bool], int] = {}
        self.t0 = time.time_ns() - 60_000_000_000

    def _entry(self, rank: int, name: str, ins: list, outs: list | None, pg: str, state: str, p2p: bool,
               bump: bool, dtype: str = "Float", out_dtype: str | None = None, line: int = 40) -> None:
        es = self.entries[rank]
        if bump:
            self.seq[(rank, pg, p2p)] = self.seq.get((rank, pg, p2p), 0) + 1
        t = self.t0 + 1_000_000 * len(es)
        outs = ins if outs is None else outs
        out_dtype = dtype if out_dtype is None else out_dtype
        done = state == "completed"
        e = {"frames": [{"name": "all_reduce", "filename": f"{LIB}/distributed_c10d.py", "line": 2950},
                        {"name": "step", "filename": "/job/train.py", "line": line}],
             "record_id": len(es), "pg_id": int(pg) if pg.isdigit() else 9, "process_group": (pg, self.groups[pg][0]),
             "thread_name": "pt_main_thread", "thread_id": "140213", "op_id": len(es) + 1,
             "collective_seq_id": self.seq.get((rank, pg, False), 0), "p2p_seq_id": self.seq.get((rank, pg, True), 0),
             "profiling_name": f"nccl:{name}", "time_created_ns": t, "input_sizes": ins,
             "input_dtypes": [dtype] * len(ins), "output_sizes": outs, "output_dtypes": [out_dtype] * len(outs),
             "state": state, "time_discovered_started_ns": t + 50_000 if state != "scheduled" else None,
             "time_discovered_completed_ns": t + 200_000 if done else None, "retired": done,
             "timeout_ms": 600_000, "is_p2p": p2p}
        es.append({k: e[k] for k in _ORDER})

    def coll(self, name: str, ins: list, outs: list | None = None, ranks: Any = None, pg: str = "0",
             state: str = "completed", **kw: Any) -> "Job":
        for r in self._ranks(ranks, pg):
            self._entry(r, name, ins, outs, pg, state, False, True, **kw)
        return self

    def block(self, ops: list[tuple[str, list, list | None]], ranks: Any = None, pg: str = "0",
              state: str = "completed", marker: str = "coalesced") -> "Job":
        """A coalesced block of collectives: members never leave `scheduled`, the marker carries the state."""
        for r in self._ranks(ranks, pg):
            for i, (name, ins, outs) in enumerate(ops):
                self._entry(r, name, ins, outs, pg, "scheduled", False, i == 0)
            self._entry(r, marker, [], [], pg, state, False, False)
        return self

    def p2p(self, rank: int, ops: list[tuple[str, int, list]], pg: str = "0", state: str = "completed",
            dtype: str = "Float") -> "Job":
        """One rank's sends and receives ("send"/"recv", group-local peer or -1 for any source, sizes); more
        than one is a batch_isend_irecv block (its marker carries the state)."""
        me = self.groups[pg][1][rank].index(rank)
        for i, (kind, peer, sizes) in enumerate(ops):
            other = "?" if peer < 0 else str(peer)
            name = f"send {me}->{other}" if kind == "send" else f"recv {me}<-{other}"
            if len(ops) > 1 and i == 0:
                self.seq[(rank, pg, False)] = self.seq.get((rank, pg, False), 0) + 1   # startCoalescing's bump
            self._entry(rank, name, sizes, None, pg, "scheduled" if len(ops) > 1 else state, True, i == 0, dtype)
        if len(ops) > 1:
            self._entry(rank, "coalesced", [], [], pg, state, True, False)
        return self

    def _ranks(self, ranks: Any, pg: str) -> list[int]:
        if ranks is None:
            return list(range(self.world)) if pg == "0" else sorted(self.groups[pg][1])
        return [ranks] if isinstance(ranks, int) else list(ranks)

    def write(self, d: Path, fmt: str = "pickle", version: str = "2.10") -> Path:
        d.mkdir(parents=True, exist_ok=True)
        for r, es in self.entries.items():
            cfg = {n: {"name": n, "desc": desc, "ranks": str(views[r])} for n, (desc, views) in self.groups.items()
                   if r in views}
            dump = {"version": version, "pg_config": cfg, "comm_lib_version": "2.21.5",
                    "pg_status": {"0": {"last_enqueued_collective": 1, "last_started_collective": 1,
                                        "last_completed_collective": 1}}, "entries": es}
            if fmt == "pickle":
                (d / f"nccl_trace_rank_{r}").write_bytes(pickle.dumps(dump, protocol=2))
            else:
                (d / f"nccl_trace_rank_{r}.json").write_text(json.dumps(_as_json(dump), sort_keys=True))
        return d


def _as_json(dump: dict[str, Any]) -> dict[str, Any]:
    """What `_dump_fr_trace_json` writes: no frames, a missing time 0, the group as a list."""
    es = [{**{k: v for k, v in e.items() if k != "frames"},
           "time_discovered_started_ns": e["time_discovered_started_ns"] or 0,
           "time_discovered_completed_ns": e["time_discovered_completed_ns"] or 0,
           "process_group": list(e["process_group"])} for e in dump["entries"]]
    return {**dump, "entries": es, "pg_status": {k: {a: str(b) for a, b in v.items()}
                                                  for k, v in dump["pg_status"].items()}}


def _analyze(path: Path):
    trace = load_any(path)
    a = run(trace)
    head = next((f for f in a.findings if f.role == Role.HEADLINE), None)
    return trace, a, head


def _errors(a, kind: str = "collective_mismatch") -> list:
    return [f for f in a.findings if f.kind == kind and f.severity == "error"]


FMTS = ["pickle", "json"]


# ---- coalesced blocks ------------------------------------------------------------------------------
def _ddp_startup(world: int = 4) -> Job:
    """DDP's start-up: the model broadcast as one coalesced block, then gradient all-reduces."""
    job = Job(world).block([("broadcast", [[64, 32]], None), ("broadcast", [[32]], None), ("broadcast", [[8]], None)])
    for _ in range(3):
        job.coll("all_reduce", [[2600]])
    return job


@pytest.mark.parametrize("fmt", FMTS)
def test_a_healthy_job_with_a_coalesced_block_is_silent(tmp_path, fmt):
    trace, a, _ = _analyze(_ddp_startup().write(tmp_path, fmt))
    assert a.ok and not [f for f in a.findings if f.severity != "info"], a.verdict
    ops = trace.ops
    assert "coalesced" not in set(ops["op_name"].astype(str))
    first = ops[ops["collective_seq_id"] == 1]
    assert set(first["op_name"].astype(str)) == {"broadcast_coalesced"} and len(first) == 4
    assert set(first["input_sizes"].astype(str)) == {"[[64, 32], [32], [8]]"}
    assert (ops["status"].astype(str) == "ok").all()


def test_a_block_in_flight_is_one_op_in_flight_not_a_mismatch(tmp_path):
    job = _ddp_startup().block([("_broadcast_oop", [[4, 4]], None), ("_broadcast_oop", [[4, 4]], None)],
                               state="started", marker="ALLGATHER_coalesced")
    trace, a, head = _analyze(job.write(tmp_path))
    assert not _errors(a), a.verdict
    assert head.kind == "hang" and "all_gather_coalesced #5" in a.verdict, a.verdict


@pytest.mark.parametrize("world", [2, 4])
def test_batch_isend_irecv_blocks_of_a_healthy_ring_are_silent(tmp_path, world):
    # on 2 ranks the marker could read as a receive from the one other member: it must not count
    job = Job(world)
    for step in range(2):
        for r in range(world):
            job.p2p(r, [("send", (r + 1) % world, [[128]]), ("recv", (r - 1) % world, [[128]])])
        job.coll("all_reduce", [[16]])
    trace, a, _ = _analyze(job.write(tmp_path))
    assert a.ok and not _errors(a) and not _errors(a, "unmatched_p2p"), a.verdict
    p2p = trace.ops[trace.ops["kind"].astype(str) == "p2p"]
    assert len(p2p) == 4 * world and (p2p["status"].astype(str) == "ok").all()
    assert sorted(p2p["p2p_seq_id"].tolist()) == sorted([1, 1, 2, 2] * world)


def test_a_ring_whose_last_batch_one_rank_never_posted_waits_on_it(tmp_path):
    job = Job(4)
    for step in range(2):
        for r in range(4):
            if step == 0 or r != 2:
                job.p2p(r, [("send", (r + 1) % 4, [[128]]), ("recv", (r - 1) % 4, [[128]])],
                        state="completed" if step == 0 else "started")
    trace, a, head = _analyze(job.write(tmp_path))
    assert not _errors(a), a.verdict
    assert 2 in head.ranks, a.verdict


def test_a_different_size_inside_a_block_names_the_rank(tmp_path):
    job = Job(4)
    for r in range(4):
        job.block([("broadcast", [[64, 32]], None), ("broadcast", [[5, 5]] if r == 2 else [[32]], None)], ranks=r,
                  state="started")
    trace, a, head = _analyze(job.write(tmp_path))
    assert head.kind == "collective_mismatch" and head.ranks == [2], a.verdict
    assert head.data["categories"] == ["size"] and "broadcast_coalesced #1" in a.verdict, a.verdict


# ---- groups that share a name but not members -----------------------------------------------------
def test_split_group_slices_under_one_name_are_not_a_group_mismatch(tmp_path):
    job = Job(4, {"1": ("split", {0: [0, 1], 1: [0, 1], 2: [2, 3], 3: [2, 3]})})
    job.coll("all_reduce", [[8]], pg="1").coll("all_reduce", [[8]], pg="1").coll("all_reduce", [[16]])
    trace, a, _ = _analyze(job.write(tmp_path))
    assert a.ok and not _errors(a, "group_mismatch"), a.verdict


def test_a_view_that_overlaps_another_slice_is_still_a_group_mismatch(tmp_path):
    job = Job(4, {"1": ("split", {0: [0, 1], 1: [0, 1, 2], 2: [2, 3], 3: [2, 3]})})
    job.coll("all_reduce", [[8]], pg="1").coll("all_reduce", [[16]])
    trace, a, head = _analyze(job.write(tmp_path))
    bad = _errors(a, "group_mismatch")
    assert bad and 1 in {r for f in bad for r in f.ranks}, a.verdict


# ---- outputs compared across ranks -----------------------------------------------------------------
def test_an_output_size_one_rank_differs_on_names_it(tmp_path):
    job = Job(4)
    for r in range(4):
        job.coll("reduce", [[4, 4]], [[16]] if r == 3 else None, ranks=r, state="started")
    trace, a, head = _analyze(job.write(tmp_path))
    assert head.kind == "collective_mismatch" and head.ranks == [3], a.verdict
    assert "size" in head.data["categories"] and "[[4,4]]->[[16]] where ranks 0-2 passed [[4,4]]" in a.verdict, a.verdict


def test_an_output_dtype_one_rank_differs_on_names_it(tmp_path):
    job = Job(4)
    for r in range(4):
        job.coll("_allgather_base", [[8]], [[32]], ranks=r, state="started", out_dtype="Half" if r == 1 else None)
    trace, a, head = _analyze(job.write(tmp_path))
    assert head.kind == "collective_mismatch" and head.ranks == [1], a.verdict
    assert head.data["categories"] == ["dtype"], a.verdict


# ---- shapes an op's own rule forbids --------------------------------------------------------------
@pytest.mark.parametrize("name, ins, outs", [
    ("all_reduce", [[4, 4]], [[5, 4]]),
    ("_allgather_base", [[8]], [[24]]),
    ("all_gather", [[8]], [[8], [8], [8]]),
    ("all_gather", [[8]], [[8], [8], [8], [4]]),
    ("_reduce_scatter_base", [[24]], [[8]]),
    ("reduce_scatter", [[8], [8]], [[8]]),
    ("all_gather_into_tensor_coalesced", [[8], [2]], [[32], [2]]),
])
def test_a_shape_its_op_forbids_is_a_size_mismatch_of_every_rank_that_passed_it(tmp_path, name, ins, outs):
    job = Job(4).coll("all_reduce", [[16]]).coll(name, ins, outs, state="started")
    trace, a, head = _analyze(job.write(tmp_path))
    assert head.kind == "collective_mismatch" and head.ranks == [0, 1, 2, 3], a.verdict
    assert head.data["categories"] == ["size"] and head.data["rule"], a.verdict


@pytest.mark.parametrize("name, ins, outs", [
    ("all_gather", [[8]], [[8], [8], [8], [8]]),
    ("all_gather", [[8]], [[4, 8]]),
    ("_allgather_base", [[8]], [[32]]),
    ("reduce_scatter", [[8], [8], [8], [8]], [[8]]),
    ("_reduce_scatter_base", [[32]], [[8]]),
    ("all_gather_into_tensor_coalesced", [[8], [2]], [[32], [8]]),
    ("allreduce_coalesced", [[8], [4]], [[8], [4]]),
    ("gather", [[4, 4]], []),
])
def test_shapes_their_op_allows_are_silent(tmp_path, name, ins, outs):
    job = Job(4).coll("all_reduce", [[16]]).coll(name, ins, outs)
    trace, a, _ = _analyze(job.write(tmp_path))
    assert a.ok and not _errors(a), a.verdict


def test_uneven_all_to_all_splits_are_silent(tmp_path):
    job = Job(2).coll("all_reduce", [[16]])
    job.coll("all_to_all", [[8]], [[12]], ranks=0).coll("all_to_all", [[12]], [[8]], ranks=1)
    trace, a, _ = _analyze(job.write(tmp_path))
    assert a.ok and not _errors(a), a.verdict


def test_gloo_groups_without_listed_members_apply_no_group_size_rule(tmp_path):
    job = Job(4, {"1": ("undefined", {0: [], 1: [], 2: []})})
    job.coll("all_reduce", [[16]]).coll("all_gather", [[4]], [[4, 4]], pg="1", state="started")
    d = job.write(tmp_path)
    for f in d.iterdir():                      # gloo writes an empty pg_config
        dump = pickle.loads(f.read_bytes())
        dump["pg_config"] = {"": {"name": "", "desc": "", "ranks": "[]"}}
        f.write_bytes(pickle.dumps(dump, protocol=2))
    trace, a, _ = _analyze(d)
    assert not [f for f in a.findings if f.data.get("rule")], a.verdict


# ---- a send and its receive -----------------------------------------------------------------------
def test_a_send_and_its_any_source_receive_that_disagree_on_size_are_a_size_mismatch(tmp_path):
    job = Job(3).coll("all_reduce", [[16]])
    job.p2p(0, [("send", 2, [[4]])], state="scheduled").p2p(2, [("recv", -1, [[8]])], state="scheduled")
    trace, a, head = _analyze(job.write(tmp_path))
    recv = trace.ops[(trace.ops["rank"] == 2) & (trace.ops["kind"].astype(str) == "p2p")]
    assert recv["peer"].tolist() == [0]
    assert head.kind == "collective_mismatch" and head.cause.p2p_pair == (0, 2), a.verdict
    assert head.data["categories"] == ["size"] and "[[4]]" in a.verdict and "[[8]]" in a.verdict, a.verdict


@pytest.mark.parametrize("sizes, dtype, cats", [([[8]], "Float", ["size"]), ([[4]], "Half", ["dtype"]),
                                                 ([[2, 2]], "Float", [])])
def test_a_send_and_its_receive_are_compared_by_what_they_move(tmp_path, sizes, dtype, cats):
    # both backends move bytes: a receive of the same bytes in another shape completes
    job = Job(2).coll("all_reduce", [[16]])
    job.p2p(0, [("send", 1, [[4]])], state="started").p2p(1, [("recv", 0, sizes)], state="started", dtype=dtype)
    trace, a, head = _analyze(job.write(tmp_path))
    pairs = [f for f in _errors(a) if f.cause.p2p_pair]
    assert [f.data["categories"] for f in pairs] == ([cats] if cats else []), a.verdict


def test_an_any_source_receive_takes_the_sender_with_a_send_to_spare(tmp_path):
    job = Job(3).coll("all_reduce", [[16]])
    job.p2p(1, [("send", 0, [[8]])]).p2p(2, [("send", 0, [[8]])])
    job.p2p(0, [("recv", 1, [[8]])]).p2p(0, [("recv", -1, [[8]])])
    trace, a, _ = _analyze(job.write(tmp_path))
    recvs = trace.ops[(trace.ops["rank"] == 0) & (trace.ops["kind"].astype(str) == "p2p")]
    assert recvs["peer"].tolist() == [1, 2]
    assert a.ok and not _errors(a), a.verdict


# ---- the formats ------------------------------------------------------------------------------------
def test_json_and_pickle_dumps_read_alike(tmp_path):
    job = _ddp_startup()
    job.coll("_allgather_base", [[8]], [[32]], state="started")
    cols = ["rank", "op_name", "process_group", "collective_seq_id", "input_sizes", "input_dtypes", "status"]
    a = load_any(job.write(tmp_path / "p", "pickle")).ops[cols].astype(str).reset_index(drop=True)
    b = load_any(job.write(tmp_path / "j", "json")).ops[cols].astype(str).reset_index(drop=True)
    assert a.equals(b)
    assert "[[8]] -> [[32]]" in set(a["input_sizes"])


def test_an_older_dump_without_outputs_or_thread_names_reads(tmp_path):
    job = _ddp_startup()
    d = job.write(tmp_path, version="2.1")
    for f in d.iterdir():
        dump = pickle.loads(f.read_bytes())
        for e in dump["entries"]:
            for k in ("output_sizes", "output_dtypes", "thread_name"):
                del e[k]
        f.write_bytes(pickle.dumps(dump, protocol=2))
    trace, a, _ = _analyze(d)
    assert a.ok, a.verdict
    assert not any(" -> " in s for s in trace.ops["input_sizes"].astype(str))
    assert not [w for w in trace.warnings if "unusable" in w]


def test_an_in_flight_stack_names_its_thread(tmp_path):
    job = Job(2).coll("all_reduce", [[16]]).coll("all_reduce", [[16]], ranks=0, state="started")
    trace = load_any(job.write(tmp_path))
    assert "thread 140213 (pt_main_thread)" in trace.stacks[0]
