"""PyTorch's own Flight Recorder analyzer tests, re-created as dump directories and judged by ncclscope.

    OMP_NUM_THREADS=1 python benchmarks/fr_torch_cases.py             # every case: ours, and torch's analyzer
    OMP_NUM_THREADS=1 python benchmarks/fr_torch_cases.py -v --only hook   # cases whose name holds "hook", verdicts

Each case of pytorch's test/distributed/flight_recorder/test_fr_analysis.py (the event pairs of
`test_match_one_event`, every name of `test_all_events`, the variant, numel, uneven all_to_all and
recv-any-source tests, the backend spellings, the six `testBuildDB` jobs, the hook-shaped traces)
becomes a directory of per-rank dumps as ProcessGroupNCCL writes them (format 2.10, or the version the
test names; pickles named `nccl_trace_rank_<r>`): a pair of events `match_one_event(a, b)` compares is
rank 0 recording `a` and rank 1 recording `b` on a two-rank group. `ncclscope analyze DIR --json` runs
in-process on each; a case agrees when ncclscope reports a mismatch exactly where the test expects one
(a collective_mismatch / group_mismatch / wrong_group at error level), of the kind the test names
(type, size, dtype, state). Where torch's analyzer is importable it runs on the same directory
(`build_db`, as `python -m torch.distributed.flight_recorder.fr_trace DIR` does) and its agreement is
printed beside ours.

How the cases are encoded, where the test leaves it open:
- sequence ids are what a job writes: one `collective_seq_id` per launch and per group from 1, the ops of
  a coalesced block and its `coalesced` marker sharing one (testBuildDB leaves every id at 0, which no
  job writes; torch's analyzer pairs by order, ncclscope by sequence id, as gloo and NCCL do);
- dtypes are lists of c10 names (["Float"], as torch writes them), a non-root gather's output is
  empty, a coalesced marker's sizes are [] (the tests write "float32", [[]]);
- times are real (a minute ago, 1 ms apart), frames name a user file, pg_config lists each rank's groups;
- test_all_events gives every op name an output equal to its input but the six it special-cases; for
  all_gather_single and reduce_scatter_single (the same ops as _all_gather_base and _reduce_scatter_base)
  that shape is refused by the backend before anything is recorded (the output must be world x the
  input), so the case writes the shape a job records, as the test does for the other six.
Expectations "match" (FULLY_MATCHED, UNDECIDED, pass_check True), a kind, "mismatch" (pass_check False,
no kind stated) or "refused" (the test expects the parser to raise: ncclscope reads on and must warn).
A kind agrees when an error-level mismatch finding names it; "state" (torch's COLLECTIVE_STATE_MISMATCH:
one member completed what another still waits in) also agrees with ncclscope's hang of the members still
in that instance (`stalled_with_survivors`): NCCL completes a collective on every member or none, so
that is no rank passing something different but ranks stuck in an op their peers finished.
"""
from __future__ import annotations

import argparse
import copy
import io
import json
import logging
import pickle
import sys
import tempfile
import time
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TWO = {"0": ("default", [0, 1])}                                      # test_match_one_event's membership
TEMPLATE = {0: {"0": ("default_pg", [0, 1]), "1": ("sub_pg", [0])},   # LOADED_FR_DETAIL_TEMPLATE: sub_pg is
            1: {"0": ("default_pg", [0, 1]), "1": ("sub_pg", [1])}}   # each rank's own one-rank slice
MISMATCH_KINDS = ("collective_mismatch", "group_mismatch", "wrong_group")
# torch 2.13's COLLECTIVES (components/types.py), which test_all_events walks in sorted order
COLLECTIVES = ("ALLGATHER_coalesced", "REDUCE_SCATTER_coalesced", "_all_gather_base", "_broadcast_oop",
               "_reduce_oop", "_reduce_scatter_base", "all_gather", "all_gather_into_tensor_coalesced",
               "all_gather_single", "all_gather_v", "all_reduce", "all_reduce_barrier", "all_to_all",
               "all_to_all_single", "all_to_all_v_single", "allreduce_coalesced", "barrier", "broadcast",
               "gather", "new_window", "reduce", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_tensor_coalesced",
               "reduce_scatter_v", "scatter", "split")


@dataclass
class Op:
    """One recorded op: its name as the backend spells it ("all_reduce", "send 0->1"), shapes, dtypes (c10)."""
    name: str
    ins: list[list[int]]
    outs: list[list[int]]
    state: str = "scheduled"
    pg: str = "0"
    in_dt: str = "Float"
    out_dt: str | None = None      # None: like the input; "": no output dtype written
    block: int = 0                 # ops of one coalesced block share a block number (> 0), the marker last
    backend: str = "nccl"
    p2p: bool = False


@dataclass
class Case:
    name: str
    ops: dict[int, list[Op]]                      # rank -> what it recorded, in order
    expect: str                                   # match | type | size | dtype | state | mismatch | refused
    groups: dict[int, dict[str, tuple[str, list[int]]]] = field(default_factory=dict)   # rank -> pg_config
    version: str = "2.10"
    op: str = ""                                  # the op name(s) ncclscope must read, "|"-separated


def _pair(name: str, a: Op, b: Op, expect: str, **kw: Any) -> Case:
    """match_one_event(a, b): rank 0 recorded `a`, rank 1 recorded `b`."""
    return Case(name, {0: [a], 1: [b]}, expect, **kw)


def _same(name: str, ops: list[Op], expect: str, **kw: Any) -> Case:
    return Case(name, {0: ops, 1: copy.deepcopy(ops)}, expect, **kw)


def _ar(ins: list[list[int]], outs: list[list[int]], state: str = "scheduled", **kw: Any) -> Op:
    return Op("all_reduce", ins, outs, state, **kw)


def event_cases() -> list[Case]:
    """test_match_one_event, test_all_events and the other single-event tests."""
    e1 = _ar([[4, 4]], [[4, 4]])
    e9 = _ar([[4, 4]], [[4, 4]], "completed")
    g11 = Op("gather", [[4, 4]], [[4, 4], [4, 4]], "completed")
    cases = [
        _pair("match_one_event e1/e1", e1, e1, "match"),
        _pair("match_one_event e1/e2 all_gather", e1, Op("all_gather", [[4, 4]], [[4, 4]]), "type"),
        _pair("match_one_event e3/e4 all_to_all", Op("all_to_all", [[4, 4]], [[4, 4]]),
              Op("all_to_all", [[4, 4]], [[4, 4]]), "match"),
        _pair("match_one_event e1/e5 input", e1, _ar([[5, 4]], [[4, 4]]), "size"),
        _pair("match_one_event e1/e6 output", e1, _ar([[4, 4]], [[5, 4]]), "size"),
        _pair("match_one_event e7/e7 in!=out", _ar([[4, 4]], [[5, 4]]), _ar([[4, 4]], [[5, 4]]), "size"),
        _pair("match_one_event e1/e9 state", e1, e9, "state"),
        _pair("match_one_event e10/e9 out dtype", _ar([[4, 4]], [[4, 4]], "completed", out_dt="Half"), e9, "dtype"),
        _pair("match_one_event e11/e12 gather non-root", g11, Op("gather", [[4, 4]], [], "completed", out_dt=""),
              "match"),
        _pair("match_one_event e11/e13 gather", g11, Op("gather", [[4, 4]], [[4, 4]], "completed"), "match"),
    ]
    for name in COLLECTIVES:
        ins, outs = [[4, 4]], [[4, 4]]
        if name in ("reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced",
                    "reduce_scatter_single"):
            outs = [[8]]
        if name in ("all_gather", "_all_gather_base", "all_gather_into_tensor_coalesced", "all_gather_single"):
            outs = [[32]]
        cases.append(_same(f"all_events {name}", [Op(name, ins, outs)], "match"))
    for a, b in (("all_gather", "_all_gather_base"), ("all_reduce", "allreduce_coalesced"),
                 ("reduce_scatter", "_reduce_scatter_base"), ("all_to_all", "all_to_all_single")):
        cases.append(_pair(f"variants distinct {a}/{b}", Op(a, [[8]], [[8]]), Op(b, [[8]], [[8]]), "type"))
    cases += [
        _same("all_gather_base numel good", [Op("_all_gather_base", [[8]], [[16]])], "match"),
        _same("all_gather_base numel bad", [Op("_all_gather_base", [[8]], [[24]])], "size"),
        _pair("all_to_all_single uneven splits", Op("all_to_all_single", [[8]], [[12]]),
              Op("all_to_all_single", [[12]], [[8]]), "match"),
    ]
    return cases + recv_any_source_cases()


def recv_any_source_cases() -> list[Case]:
    """test_recv_any_source_has_no_peer: group "0" is global ranks {2, 5}; the recv names no source."""
    g = {r: {"0": ("default", [2, 5])} for r in (2, 5)}
    send = Op("send 0->1", [[8]], [[8]], p2p=True)
    return [
        Case("recv_any_source send->recv", {2: [send], 5: [Op("recv 1<-?", [[8]], [[8]], p2p=True)]}, "match", g),
        Case("recv_any_source recv->send", {2: [Op("recv 0<-?", [[8]], [[8]], p2p=True)],
                                            5: [Op("send 1->0", [[8]], [[8]], p2p=True)]}, "match", g),
        Case("recv_any_source short send", {2: [Op("send 0->1", [[4]], [[4]], p2p=True)],
                                            5: [Op("recv 1<-?", [[8]], [[8]], p2p=True)]}, "size", g),
    ]


def backend_cases() -> list[Case]:
    """FlightRecorderOpBackendTest: backend prefixes the hook and the comm libraries write."""
    out = [_same(f"backend {b}", [_ar([[4, 4]], [[4, 4]], "completed", backend=b)], "match", op="all_reduce")
           for b in ("nccl", "ncclx", "gloo", "xccl", "nccl2", "c10d", "unknown_backend", "weird:backend")]
    out.append(Case("backend nccl2 p2p", {0: [Op("send 0->1", [[4, 4]], [[4, 4]], "completed", backend="nccl2",
                                                 p2p=True)],
                                          1: [Op("recv 1<-0", [[4, 4]], [[4, 4]], "completed", backend="nccl2",
                                                 p2p=True)]}, "match", op="send|recv"))
    out.append(_same("backend missing colon", [_ar([[4, 4]], [[4, 4]], "completed", backend="")], "refused"))
    return out


def build_db_cases() -> list[Case]:
    """FlightRecorderE2ETest.testBuildDB (version 2.8, state completed, the template's sub_pg slices)."""
    def c(name: str, ins: list[list[int]], outs: list[list[int]], **kw: Any) -> Op:
        return Op(name, ins, outs, "completed", **kw)
    four = [[4, 4]]
    bc = [c("broadcast", four, four, block=1), c("broadcast", four, four, block=1), c("coalesced", [], [], block=1)]
    red = [c("_reduce_oop", four, four, block=1), c("_reduce_oop", four, four, block=1),
           c("REDUCE_SCATTER_coalesced", [], [], block=1)]
    kw = {"groups": TEMPLATE, "version": "2.8"}
    return [
        _same("buildDB 1 all_reduce + sub_pg slices", [c("all_reduce", four, four),
                                                       c("all_reduce", [[5, 5]], [[5, 5]], pg="1")], "match", **kw),
        _same("buildDB 2 allreduce_coalesced", [c("allreduce_coalesced", four, four)], "match", **kw),
        _same("buildDB 3 coalesced broadcasts", bc, "match", **kw),
        Case("buildDB 4 uneven all_gather", {
            0: [c("_broadcast_oop", four, four, block=1), c("_broadcast_oop", [[5, 5]], [[5, 5]], block=1),
                c("ALLGATHER_coalesced", [], [], block=1)],
            1: [c("_broadcast_oop", four, four, block=1), c("_broadcast_oop", four, four, block=1),
                c("ALLGATHER_coalesced", [], [], block=1)]}, "mismatch", **kw),
        _same("buildDB 5 uneven reduce_scatter", red, "match", **kw),
        Case("buildDB 6 coalesced block on rank 1 only", {0: [c("all_reduce", four, four)],
                                                          1: [c("all_reduce", four, four)] + copy.deepcopy(red)},
             "match", **kw),
    ]


def hook_cases() -> list[Case]:
    """FlightRecorderHookShapeTest: the c10d hook's spellings (backend nccl2, version 2.8, scheduled)."""
    def h(name: str, ins: list[list[int]], outs: list[list[int]]) -> Op:
        return Op(name, ins, outs, backend="nccl2")
    shapes = [("all_reduce", [[8]], [[8]]), ("allreduce_coalesced", [[8], [4]], [[8], [4]]), ("reduce", [[8]], [[8]]),
              ("all_gather", [[8]], [[8], [8]]), ("reduce_scatter", [[8], [8]], [[8]])]
    kw = {"groups": TEMPLATE, "version": "2.8"}
    out = [_same(f"hook shape {n}", [h(n, i, o)], "match", **kw) for n, i, o in shapes]
    out.append(_same("hook shaped run", [h(n, i, o) for n, i, o in shapes], "match", **kw))
    out += [_same("hook list all_gather x3", [h("all_gather", [[8]], [[8], [8], [8]])], "mismatch", **kw),
            _same("hook list reduce_scatter x3", [h("reduce_scatter", [[8], [8], [8]], [[8]])], "mismatch", **kw),
            _same("hook flat all_gather 17", [h("all_gather", [[8]], [[17]])], "mismatch", **kw),
            _same("hook flat reduce_scatter 17", [h("reduce_scatter", [[17]], [[8]])], "mismatch", **kw)]
    return out


def all_cases() -> list[Case]:
    return event_cases() + backend_cases() + build_db_cases() + hook_cases()


# --------------------------------------------------------------------------
# Dumps
# --------------------------------------------------------------------------
def _frames(line: int) -> list[dict[str, Any]]:
    """Innermost first, as torch stores them: c10d, its logger wrapper, the user's training step."""
    lib = "/usr/lib/python3.11/site-packages/torch/distributed"
    return [{"name": "all_reduce", "filename": f"{lib}/distributed_c10d.py", "line": 2950},
            {"name": "wrapper", "filename": f"{lib}/c10d_logger.py", "line": 83},
            {"name": "train_step", "filename": "/workspace/train.py", "line": line}]


def entries(ops: list[Op], t0: int, desc: dict[str, str]) -> list[dict[str, Any]]:
    """One rank's entries as ProcessGroupNCCL records them: a collective_seq_id per launch and group (a
    coalesced block's ops and marker share one), a p2p_seq_id per p2p launch and group; `desc`: each
    group's description, as the entries carry it beside the group's name."""
    coll: dict[str, int] = {}
    p2p: dict[str, int] = {}
    out = []
    last_block = 0
    for i, op in enumerate(ops):
        new_launch = op.block == 0 or op.block != last_block
        if op.p2p:
            p2p[op.pg] = p2p.get(op.pg, 0) + (1 if new_launch else 0)
        else:
            coll[op.pg] = coll.get(op.pg, 0) + (1 if new_launch else 0)
        last_block = op.block
        t = t0 + i * 1_000_000
        done = op.state == "completed"
        out_dt = op.in_dt if op.out_dt is None else op.out_dt
        out.append({
            "record_id": i, "pg_id": int(op.pg) if op.pg.isdigit() else 0,
            "process_group": (op.pg, desc.get(op.pg, "undefined")),
            "thread_name": "pt_main_thread", "thread_id": "140213", "collective_seq_id": coll.get(op.pg, 0),
            "p2p_seq_id": p2p.get(op.pg, 0), "op_id": i + 1,
            "profiling_name": f"{op.backend}:{op.name}" if op.backend else op.name,
            "time_created_ns": t, "input_sizes": op.ins, "input_dtypes": [op.in_dt] * len(op.ins),
            "output_sizes": op.outs, "output_dtypes": [out_dt] * len(op.outs) if out_dt else [],
            "state": op.state, "time_discovered_started_ns": t + 50_000 if op.state != "scheduled" else None,
            "time_discovered_completed_ns": t + 200_000 if done else None, "retired": done,
            "timeout_ms": 600_000, "is_p2p": op.p2p, "frames": _frames(40 + i)})
    return out


def write(case: Case, root: Path) -> Path:
    """The case's dumps in a fresh directory under `root`."""
    d = Path(tempfile.mkdtemp(prefix="case-", dir=root))
    t0 = time.time_ns() - 60_000_000_000
    for rank, ops in case.ops.items():
        groups = case.groups.get(rank) or TWO
        es = entries(ops, t0, {n: desc for n, (desc, _) in groups.items()})
        cfg = {n: {"name": n, "desc": desc, "ranks": str(members)} for n, (desc, members) in groups.items()}
        dump = {"version": case.version, "pg_config": cfg, "pg_status": {}, "comm_lib_version": "2.21.5",
                "entries": es}
        (d / f"nccl_trace_rank_{rank}").write_bytes(pickle.dumps(dump))
    return d


# --------------------------------------------------------------------------
# Judging
# --------------------------------------------------------------------------
def ours(path: Path) -> dict[str, Any]:
    """ncclscope analyze PATH --json, in-process."""
    from ncclscope.cli.main import main
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        rc = main(["analyze", str(path), "--json"])
    text = out.getvalue()
    try:
        report = json.loads(text[text.find("{"):])
    except json.JSONDecodeError:
        report = {"verdict": f"(no JSON; rc {rc}: {err.getvalue().strip()[:160]})", "findings": []}
    report["rc"] = rc
    return report


def our_kinds(report: dict[str, Any]) -> set[str] | None:
    """The mismatch kinds ncclscope reported (type, size, dtype, state, group), None when none."""
    kinds: set[str] = set()
    found = False
    for f in report.get("findings", []):
        if f["kind"] not in MISMATCH_KINDS or f["severity"] != "error":
            continue
        found = True
        cats = set(f.get("data", {}).get("categories") or [])
        kinds |= {"size" if c == "split" else c for c in cats} or {"group"}
    return kinds if found else None


def agrees(case: Case, report: dict[str, Any]) -> bool:
    """Does ncclscope say what the test expects?"""
    kinds = our_kinds(report)
    if case.expect == "refused":
        return any("profiling name" in w for w in report.get("warnings", []))
    if case.expect == "match":
        ok = kinds is None
    elif case.expect == "mismatch":
        ok = kinds is not None
    else:
        ok = kinds is not None and case.expect in kinds
    if case.expect == "state" and not ok:
        ok = stalled_with_survivors(report)
    if ok and case.op:
        ok = all(str(r.get("last_op", "")).startswith(tuple(case.op.split("|"))) for r in report.get("ranks", []))
    return ok


def stalled_with_survivors(report: dict[str, Any]) -> bool:
    """Whether ncclscope's verdict is the hang of members still in an instance that others completed (a
    `hang` whose data names the stalled instance, "... (rank r completed it)"): what torch's analyzer calls a
    state mismatch. NCCL completes a collective on every member or on none, so the members still in it are
    stuck (a peer that died inside it, a transport fault); no rank passed anything different."""
    return any(f["kind"] == "hang" and f["severity"] == "error" and "stalled" in f.get("data", {})
               and "completed it)" in f["title"] for f in report.get("findings", []))


def torch_outcome(path: Path, version: str) -> tuple[str, set[str]]:
    """("match" | "mismatch" | "error: ...", mismatch kinds) from torch's own analyzer on the directory."""
    try:
        with redirect_stdout(io.StringIO()):            # its import prints whether tabulate is installed
            from torch.distributed.flight_recorder.components.builder import build_db
            from torch.distributed.flight_recorder.components.config_manager import JobConfig
    except ImportError:
        return "n/a", set()
    details = {}
    for f in sorted(path.iterdir()):
        d = pickle.loads(f.read_bytes())
        rank = int(f.name.rsplit("_", 1)[1])
        details[f.name] = {"rank": rank, "host_name": f"host{rank}", "entries": d["entries"],
                           "version": d["version"], "pg_config": d["pg_config"]}
    logging.disable(logging.CRITICAL)
    sink = io.StringIO()
    try:
        with redirect_stdout(sink), redirect_stderr(sink):
            db = build_db(details, JobConfig().parse_args([]), version)
    except BaseException as exc:      # noqa: BLE001 - its asserts are the outcome we report
        return f"error: {type(exc).__name__}", set()
    finally:
        logging.disable(logging.NOTSET)
    bad = [c for c in db.collectives if not c.pass_check]
    kinds = {_TORCH_KIND.get(m.type_of_mismatch.state.name, "?") for c in bad
             for m in (c.mismatch_collectives or {}).values() if m.type_of_mismatch is not None}
    return ("mismatch" if bad else "match"), kinds


_TORCH_KIND = {"COLLECTIVE_TYPE_MISMATCH": "type", "SIZE_OR_SYNTAX_MISMATCH": "size",
               "COLLECTIVE_DTYPE_MISMATCH": "dtype", "COLLECTIVE_STATE_MISMATCH": "state"}


def torch_agrees(case: Case, outcome: str, kinds: set[str]) -> bool | None:
    if outcome == "n/a":
        return None
    if case.expect == "refused":
        return outcome.startswith("error")
    if outcome.startswith("error"):
        return False
    if case.expect == "match":
        return outcome == "match"
    if case.expect == "mismatch":
        return outcome == "mismatch"
    return outcome == "mismatch" and (case.expect in kinds or not kinds)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default="", help="cases whose name contains this text")
    ap.add_argument("-v", "--verbose", action="store_true", help="print ncclscope's verdict per case")
    ap.add_argument("--no-torch", action="store_true", help="do not run torch's analyzer")
    args = ap.parse_args(argv)
    cases = [c for c in all_cases() if args.only in c.name]
    n_ours = n_torch = n_torch_run = 0
    with tempfile.TemporaryDirectory(prefix="fr-torch-cases-") as tmp:
        for case in cases:
            path = write(case, Path(tmp))
            report = ours(path)
            ok = agrees(case, report)
            n_ours += ok
            t_out, t_kinds = ("n/a", set()) if args.no_torch else torch_outcome(path, case.version)
            t_ok = torch_agrees(case, t_out, t_kinds)
            if t_ok is not None:
                n_torch_run += 1
                n_torch += t_ok
            kinds = our_kinds(report)
            said = "match" if kinds is None else "mismatch(" + ",".join(sorted(kinds)) + ")"
            t_said = t_out + (f"({','.join(sorted(t_kinds))})" if t_kinds else "")
            print(f"{'ok ' if ok else 'BAD'} {case.name:<48} expect {case.expect:<8} ncclscope {said:<22} "
                  f"torch {t_said:<22} {'' if t_ok is None else ('agrees' if t_ok else 'differs')}")
            if args.verbose or not ok:
                print(f"      {report.get('verdict', '')[:300]}")
    torch_part = f"; torch's analyzer agrees with {n_torch} of {n_torch_run}" if n_torch_run else ""
    print(f"ncclscope agrees with {n_ours} of {len(cases)} cases{torch_part}")
    return 0 if n_ours == len(cases) else 1


if __name__ == "__main__":
    sys.exit(main())
