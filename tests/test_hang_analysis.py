"""Hang diagnosis on hand-built traces: each case states the scenario and the exact verdict.

Run: python -m pytest tests/test_hang_analysis.py -q

Every scenario is written op by op with `TraceBuilder` (seconds from the trace
start), so the expected root cause can be checked by reading the case. The
bar is PyTorch's Flight Recorder analyzer, which checks one group at a time,
stops at the first mismatch, ignores p2p and blames whichever rank it
compared first; the cases below are the ones it gets wrong. Mismatches and the
sequence-history cases are in tests/test_mismatch_analysis.py.
"""
from __future__ import annotations

import time

import numpy as np
import pandas as pd
import pytest
from hang_checks import alive, headline, kinds
from trace_builder import NS, TraceBuilder

from ncclscope.verdict.diagnose import diagnose
from ncclscope.verdict.headline import OK_VERDICT
from ncclscope.hang.group_checks import analyze_groups
from ncclscope.index.views import index_of
from ncclscope.index.labels import fmt_ranks, group_label, majority_vote
from ncclscope.hang.p2p import analyze_p2p
from ncclscope.index.stack_excerpts import stack_excerpt
from ncclscope.hang.waitfor import analyze_waits
from ncclscope.index.waitgraph import strongly_connected

pytestmark = pytest.mark.timeout(120)

FAULTHANDLER_DUMP = """\
Thread 0x00007f0000000002 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 320 in wait
  File "/app/ncclscope/runtime/recorder.py", line 88 in _flush_loop
  File "/usr/lib/python3.11/threading.py", line 975 in run
  File "/usr/lib/python3.11/threading.py", line 1038 in _bootstrap_inner
  File "/usr/lib/python3.11/threading.py", line 995 in _bootstrap

Current thread 0x00007f0000000001 (most recent call first):
  File "/app/model.py", line 212 in backward_hook
  File "/app/train.py", line 77 in train_step
  File "/app/train.py", line 120 in main
  File "/app/train.py", line 130 in <module>
"""


# ---------------------------------------------------------------------------
# Deadlocks
# ---------------------------------------------------------------------------
def test_two_pipeline_ranks_in_recv_from_each_other_is_a_deadlock():
    b = TraceBuilder(2, groups={"pp0": [0, 1]}, coords={0: {"pp": 0}, 1: {"pp": 1}})
    alive(b, [0, 1])
    for r in (0, 1):
        b.p2p(r, "send", peer=1 - r, seq=1, start=1.0, end=1.1)
        b.p2p(r, "recv", peer=1 - r, seq=1, start=1.0, end=1.1)
    b.p2p(0, "recv", peer=1, seq=2, start=2.0, end=8.0, status="timeout", call_site="pipe.py:31")   # gave up
    b.p2p(1, "recv", peer=0, seq=2, start=2.5, call_site="pipe.py:31")                             # still inside
    b.rank_state(0, exitcode=1)
    d = diagnose(b.build())
    h = headline(d)
    assert (h.kind, h.ranks) == ("deadlock", [0, 1])
    assert d.verdict.startswith("DEADLOCK: ranks 0,1 (pp 0,1) both blocked in recv from each other (p2p seq 2) "
                                "at pipe.py:31"), d.verdict
    assert h.data["cycle"] == [0, 1]
    # the unmatched recvs are supporting evidence, not separate root causes
    assert sorted(f.ranks[0] for f in d.findings if f.kind == "unmatched_p2p") == [0, 1]
    assert all(f.role == "supporting" for f in d.findings[1:])
    assert {e.rank for e in h.evidence} == {0, 1}


def test_three_rank_cycle_mixing_a_collective_and_p2p_is_a_deadlock():
    # rank 0 in all_reduce on g01 waits for rank 1; rank 1 in recv from 2; rank 2 in recv from 0
    b = TraceBuilder(3, groups={"world": [0, 1, 2], "g01": [0, 1]})
    alive(b, range(3))
    b.collective(0, "g01", 1, start=2.0)
    b.p2p(1, "recv", peer=2, seq=1, start=2.0)
    b.p2p(2, "recv", peer=0, seq=1, start=2.0)
    t = b.build()
    edges = analyze_waits(t).edges
    assert sorted(zip(edges["waiter"], edges["target"], edges["via"])) == [
        (0, 1, "collective"), (1, 2, "p2p"), (2, 0, "p2p")]
    d = diagnose(t)
    h = headline(d)
    assert (h.kind, h.ranks) == ("deadlock", [0, 1, 2])
    assert d.verdict.startswith("DEADLOCK: ranks 0-2 wait on each other in a cycle: "
                                "rank 0 in all_reduce #1 on g01[0,1] waits on rank 1; "
                                "rank 1 in recv #1 from rank 2 waits on rank 2; "
                                "rank 2 in recv #1 from rank 0 waits on rank 0")
    assert [k for k, _ in kinds(d)].count("deadlock") == 1


# ---------------------------------------------------------------------------
# Chains to a root
# ---------------------------------------------------------------------------
def _two_by_two(b: TraceBuilder) -> None:
    for r in range(4):
        b.coords(r, tp=r % 2, dp=r // 2)


def test_chain_across_two_groups_ends_at_the_killed_rank():
    # tp pairs [0,1],[2,3]; dp pairs [0,2],[1,3]. Rank 3 is SIGKILLed in backward at step 4.
    # 1 waits on 3 in dp1, 2 waits on 3 in tp1, and 0 waits on 1 in tp0: root = 3 for all.
    b = TraceBuilder(4, groups={"tp0": [0, 1], "tp1": [2, 3], "dp0": [0, 2], "dp1": [1, 3]})
    _two_by_two(b)
    for r in range(4):
        b.collective(r, f"tp{r // 2}", 1, start=1.0, end=1.1, step=4)
        b.heartbeats(r, 0.0, 3.0 if r == 3 else 10.0)
    b.compute(3, "backward", start=2.0, step=4)
    b.rank_state(3, signal="SIGKILL")
    b.collective(1, "dp1", 1, start=2.5, step=4)
    b.collective(2, "tp1", 2, start=2.5, step=4)
    b.collective(0, "dp0", 1, start=2.0, end=2.2, step=4)
    b.collective(2, "dp0", 1, start=2.0, end=2.2, step=4)
    b.collective(0, "tp0", 2, start=3.0, step=5)
    d = diagnose(b.build())
    h = headline(d)
    assert (h.kind, h.ranks) == ("dead_rank", [3])
    assert h.to_json()["data"]["waiting_ranks"] == [0, 1, 2]
    assert h.to_json()["data"]["direct_waiters"] == [1, 2]
    assert d.verdict.startswith("DEAD RANK: rank 3 (dp 1, tp 1) was killed (SIGKILL) at step 4;")
    assert "ranks 0-2 (dp 0,0,1, tp 0,1,0) waiting since 7.5 s in all_reduce #1 on dp1[1,3]" in d.verdict
    assert kinds(d) == [("dead_rank", [3])]
    assert any("indirectly" in e.note and e.rank == 0 for e in h.evidence)


def _rank_2_never_posts(step: int, start: float) -> TraceBuilder:
    """dp0 of 4 ranks: all complete #1 at `step`; ranks 0,1,3 then wait in #2 from `start`, rank 2 never posts it."""
    b = TraceBuilder(4, groups={"dp0": [0, 1, 2, 3]})
    alive(b, range(4))
    for r in range(4):
        b.collective(r, "dp0", 1, start=1.0, end=1.2, step=step)
    for r in (0, 1, 3):
        b.collective(r, "dp0", 2, start=start, step=step + 1)
    return b


def test_chain_ends_at_a_rank_stuck_in_compute():
    b = _rank_2_never_posts(6, 3.0)
    b.compute(2, "forward", start=1.5, end=2.0, step=7)
    b.compute(2, "backward", start=2.0, step=7)
    b.stacks(2, FAULTHANDLER_DUMP)
    d = diagnose(b.build())
    h = headline(d)
    assert (h.kind, h.ranks) == ("stuck_in_compute", [2])
    assert d.verdict == ("STUCK IN COMPUTE: rank 2 has been in backward for 8.0 s (step 7) and never posted "
                         "all_reduce #2 on dp0[0-3]; ranks 0,1,3 waiting since 7.0 s in all_reduce #2 on dp0[0-3] "
                         "at train.py:10")
    stack = h.stack
    assert "backward_hook" in stack and "threading.py" not in stack
    assert kinds(d) == [("stuck_in_compute", [2])]


def test_ranks_killed_by_the_launcher_at_the_deadline_are_not_dead_roots():
    # Everybody is SIGTERMed at the end (heartbeats run to the end): rank 2 was computing.
    b = TraceBuilder(3, groups={"dp0": [0, 1, 2]})
    alive(b, range(3))
    for r in range(3):
        b.rank_state(r, signal="SIGTERM", stopped_by_launcher=True)
    b.collective(0, "dp0", 1, start=2.0)
    b.collective(1, "dp0", 1, start=2.0)
    b.compute(2, "optimizer", start=1.0, step=3)
    d = diagnose(b.build())
    assert (headline(d).kind, headline(d).ranks) == ("stuck_in_compute", [2])


@pytest.mark.parametrize("launcher", ["ncclscope run", "torchrun or srun"])
def test_a_sigterm_to_the_whole_job_is_not_a_death(launcher):
    """A scheduler's time limit SIGTERMs every process of a hung job: each rank's tracer dumps its
    evidence and ends with 'terminated by SIGTERM'. Under `ncclscope run` run.json also says the
    launcher stopped them; under a plain torchrun or srun only rank.json does. Neither is a death
    that explains the hang: rank 2, stuck outside any op, is."""
    b = TraceBuilder(4, groups={"dp0": [0, 1, 2, 3]})
    alive(b, range(4))
    for r in range(4):
        b.collective(r, "dp0", 1, start=1.0, end=1.2, step=2)
        launched = launcher == "ncclscope run"
        b.rank_state(r, signal="SIGTERM" if launched else None, stopped_by_launcher=launched,
                     end_status="error", end_message="terminated by SIGTERM")
    for r in (0, 1, 3):
        b.collective(r, "dp0", 2, start=2.0, step=3)
    trace = b.build()
    assert [trace.ranks[r].state for r in range(4)] == ["stopped"] * 4
    assert not any(trace.ranks[r].died for r in range(4))
    d = diagnose(trace)
    assert (headline(d).kind, headline(d).ranks) == ("stuck_in_compute", [2]), d.verdict
    assert "dead_rank" not in [k for k, _ in kinds(d)]


def test_a_rank_stuck_outside_any_op_is_placed_by_its_latest_stack_dump():
    """No traced op says where rank 2 is; the stacks it dumped do (a timeout's, then SIGTERM's): the
    verdict names the user's frame of the latest dump taken after its last op, not an earlier one."""
    b = _rank_2_never_posts(2, 2.0)
    def dump(t: float, where: str) -> str:
        return (f"=== ncclscope rank 2: SIGTERM received at {b.ns(t)} ns ===\n"
                + FAULTHANDLER_DUMP.replace('"/app/model.py", line 212 in backward_hook', where))
    b.stacks(2, dump(0.5, '"/app/data.py", line 9 in load') + dump(6.0, '"/app/model.py", line 40 in forward')
             + dump(9.0, '"/app/model.py", line 57 in forward'))
    d = diagnose(b.build())
    h = headline(d)
    assert (h.kind, h.ranks) == ("stuck_in_compute", [2])
    assert "its last stack dump (at 9.0 s) has it at /app/model.py:57 in forward" in h.title, h.title


def test_rank_that_skipped_a_collective_is_the_root_not_the_ranks_that_timed_out():
    # dp0 #5: ranks 0,1,2 enter and time out; rank 3 skipped it and went on to tp1 #1 where
    # rank 2 (blocked in dp0) never comes: a wait cycle 2<->3, but 3 deviated first.
    b = TraceBuilder(4, groups={"dp0": [0, 1, 2, 3], "tp0": [0, 1], "tp1": [2, 3]})
    alive(b, range(4))
    for r in range(4):
        for k in range(1, 5):
            b.collective(r, "dp0", k, start=float(k), end=k + 0.1, step=k)
    for r in (0, 1, 2):
        b.collective(r, "dp0", 5, start=5.0, end=8.0, status="timeout", step=5, call_site="train.py:50")
        b.rank_state(r, exitcode=1)
    b.collective(3, "tp1", 1, start=5.1, end=8.1, status="error", step=5, call_site="train.py:60",
                 message="Connection closed by peer")
    b.rank_state(3, exitcode=1)
    d = diagnose(b.build())
    h = headline(d)
    assert (h.kind, h.ranks) == ("hang", [3])
    assert d.verdict == ("HANG: rank 3 never posted all_reduce #5 on dp0[0-3] (3 of 4 members did) and went on "
                         "to all_reduce #1 on tp1[2,3] at train.py:60 (the others post it at train.py:50); ranks 0-2 waiting "
                         "since 5.0 s in all_reduce #5 on dp0[0-3] at train.py:50")
    assert h.data["skipped"] == ["dp0", 5]
    assert kinds(d) == [("hang", [3])]
    missing = [f for f in d.findings if f.data.get("missing_participant") and f.ranks == [3]]
    assert missing and missing[0].role == "supporting"
    # the payloads are typed fields, written by the analyses themselves
    assert (h.instance.group, h.instance.seq) == ("dp0", 5) and h.wait.waiting_ranks == (0, 1, 2)
    assert (missing[0].instance.group, missing[0].instance.seq) == ("dp0", 5) and missing[0].supports == h.title


def test_rank_that_exited_normally_while_others_wait_is_the_root():
    b = TraceBuilder(2, groups={"dp0": [0, 1]})
    b.heartbeats(0, 0.0, 10.0)
    b.heartbeats(1, 0.0, 3.0)
    for r in (0, 1):
        b.collective(r, "dp0", 1, start=1.0, end=1.1, step=1)
        b.collective(r, "dp0", 2, start=2.0, end=2.1, step=2)
    b.p2p(1, "isend", peer=0, seq=1, start=2.5)          # left open: it exited anyway
    b.rank_state(1, exitcode=0, end_status="ok")
    b.collective(0, "dp0", 3, start=3.0, step=3)
    d = diagnose(b.build())
    h = headline(d)
    assert (h.kind, h.ranks) == ("hang", [1])
    assert d.verdict == ("HANG: rank 1 finished (exit 0) without posting all_reduce #3 on dp0[0,1] (the others "
                         "post it at train.py:10); rank 0 waiting since 7.0 s in all_reduce #3 on dp0[0,1] at train.py:10")


def test_missing_rank_directory_is_the_dead_rank_peers_wait_on():
    b = TraceBuilder(4, groups={"dp0": [0, 1, 2, 3]})
    alive(b, range(4))
    for r in range(4):
        b.collective(r, "dp0", 1, start=1.0, end=1.1)
    for r in range(3):
        b.collective(r, "dp0", 2, start=2.0)
    b.rank_state(3, present=False)
    t = b.build()
    assert t.ranks[3].state == "missing"
    d = diagnose(t)
    h = headline(d)
    assert (h.kind, h.ranks) == ("dead_rank", [3])
    assert d.verdict.startswith("DEAD RANK: rank 3 left no trace directory")
    assert d.verdict.endswith("ranks 0-2 waiting since 8.0 s in all_reduce #2 on dp0[0-3] at train.py:10")


def test_a_lost_node_is_one_dead_rank_finding_not_eight():
    b = TraceBuilder(16, groups={"world": list(range(16))})
    for r in range(16):
        b.heartbeats(r, 0.0, 4.0 if r >= 8 else 10.0)
        b.collective(r, "world", 1, start=1.0, end=1.1)
        if r < 8:
            b.collective(r, "world", 2, start=5.0)
        else:
            b.rank_state(r, signal="SIGKILL")
    d = diagnose(b.build())
    assert kinds(d) == [("dead_rank", list(range(8, 16)))]
    assert d.verdict == ("DEAD RANK: ranks 8-15 are dead (first: rank 8 was killed (SIGKILL) at step 0); "
                         "ranks 0-7 waiting since 5.0 s in all_reduce #2 on world[0-15] at train.py:10")


def test_heartbeats_that_stop_early_mark_a_rank_dead_even_without_an_exit_code():
    b = TraceBuilder(3, groups={"dp0": [0, 1, 2]})
    b.heartbeats(0, 0.0, 20.0)
    b.heartbeats(1, 0.0, 20.0)
    b.heartbeats(2, 0.0, 4.0)            # host vanished; the launcher never saw an exit code
    b.collective(0, "dp0", 1, start=5.0)
    b.collective(1, "dp0", 1, start=5.0)
    b.compute(2, "forward", start=3.5)
    d = diagnose(b.build())
    h = headline(d)
    assert (h.kind, h.ranks) == ("dead_rank", [2])
    assert "stopped heartbeating at 4.0 s (16.0 s before the end)" in h.title


def test_stalled_collective_with_every_member_inside_is_an_ambiguous_hang():
    b = TraceBuilder(2, groups={"dp0": [0, 1]})
    alive(b, [0, 1])
    b.collective(0, "dp0", 1, start=2.0)
    b.collective(1, "dp0", 1, start=2.0)
    d = diagnose(b.build())
    h = headline(d)
    assert (h.kind, h.ranks) == ("hang", [0, 1])
    assert h.data["ambiguous"] is True and h.data["stalled"] == ["dp0", 1]
    assert "although every member posted it" in d.verdict


# ---------------------------------------------------------------------------
# Groups
# ---------------------------------------------------------------------------
def test_group_views_disagree_on_members_and_on_creation_order():
    b = TraceBuilder(4, groups={"world": [0, 1, 2, 3], "dp0": [0, 1], "dp1": [2, 3]})
    b.group_view(3, "dp0", [0, 1, 3])
    b.group_view(2, "dp1", [2, 3], creation_order=7)
    for r in range(4):
        b.collective(r, "world", 1, start=1.0, end=2.0)
    d = diagnose(b.build())
    got = [(f.kind, f.ranks, f.data["attribute"]) for f in d.findings if f.kind == "group_mismatch"]
    assert got == [("group_mismatch", [3], "members"), ("group_mismatch", [2], "creation_order")]
    assert d.verdict == ("GROUP MISMATCH: rank 3 disagrees on the members of group dp0: rank 3 sees [0,1,3] "
                         "where 3 ranks see [0,1]")


def test_groups_of_one_kind_must_be_disjoint_and_cover_the_world():
    b = TraceBuilder(4, groups={"world": [0, 1, 2, 3], "dp0": [0, 1, 2], "dp1": [2, 3], "tp0": [0, 1]})
    rep = analyze_groups(b.build())
    got = sorted((f.severity, f.data["group_kind"], f.data["check"], f.ranks) for f in rep.findings)
    assert got == [("error", "dp", "overlap", [2]), ("warning", "tp", "coverage", [2, 3])]


def test_two_mesh_dimensions_of_one_kind_overlap_by_design():
    """seed 20261208 #36 (healthy, FR dumps alone): a 2 x 4 mesh ("dp", "fsdp") makes groups mesh_dp:N and
    mesh_fsdp:N; both read as data parallel, and every rank is in one of each: that is HSDP, not two dp
    groups sharing a rank. Groups of one dimension still may not overlap."""
    groups = {"world": list(range(8)), "mesh_dp:1": [0, 4], "mesh_dp:2": [1, 5], "mesh_dp:3": [2, 6],
              "mesh_dp:4": [3, 7], "mesh_fsdp:5": [0, 1, 2, 3], "mesh_fsdp:6": [4, 5, 6, 7]}
    kinds = {"world": "world", **{g: "dp" for g in groups if g != "world"}}
    rep = analyze_groups(TraceBuilder(8, groups=groups, group_kinds=kinds).build())
    assert not [f for f in rep.findings if f.data.get("check") in ("overlap", "coverage")], \
        [f.title for f in rep.findings]
    bad = dict(groups, **{"mesh_fsdp:6": [3, 4, 5, 6, 7]})           # rank 3 in two fsdp slices
    rep = analyze_groups(TraceBuilder(8, groups=bad, group_kinds=kinds).build())
    assert [(f.data["check"], f.ranks) for f in rep.findings if f.data.get("check") == "overlap"] == [("overlap", [3])]


# ---------------------------------------------------------------------------
# P2P
# ---------------------------------------------------------------------------
def test_unmatched_p2p_names_the_rank_that_never_posted():
    b = TraceBuilder(3, groups={"pp": [0, 1, 2]})
    alive(b, range(3))
    b.p2p(0, "send", peer=1, seq=1, start=1.0, end=1.1)
    b.p2p(1, "recv", peer=0, seq=1, start=1.0, end=1.1)
    b.p2p(0, "isend", peer=1, seq=2, start=1.5, end=1.6)       # ok without a recv: lost rows, no finding
    b.p2p(1, "send", peer=2, seq=1, start=2.0, end=6.0, status="timeout")
    b.p2p(2, "recv", peer=1, seq=1, tag=7, start=2.0, end=6.0, status="error")   # tag mismatch
    t = b.build()
    rep = analyze_p2p(t)
    assert len(rep.pairs) == 4
    assert sorted(rep.unmatched["state"]) == ["recv_only", "send_only", "send_only"]
    got = sorted((f.ranks, f.data["side"], f.data["tag_mismatch"]) for f in rep.findings)
    assert got == [([1], "recv", True), ([2], "send", True)]
    f = next(f for f in rep.findings if f.ranks == [2])
    assert f.title.startswith("rank 2 never posted the recv matching rank 1's send #1 (tag 0) to it "
                              "(rank 2 posted recv #1 from rank 1 with tag 7 instead)")
    d = diagnose(t)
    assert headline(d).kind == "deadlock" and headline(d).ranks == [1, 2]


def test_a_send_into_a_rank_that_is_computing():
    b = TraceBuilder(3, groups={"pp": [0, 1, 2]})
    alive(b, range(3))
    b.p2p(1, "send", peer=2, seq=1, start=2.0, end=6.0, status="timeout")
    b.compute(2, "forward", start=1.0, end=1.5)        # then uninstrumented work; heartbeats go on
    d = diagnose(b.build())
    h = headline(d)
    assert (h.kind, h.ranks) == ("stuck_in_compute", [2])
    assert "never posted the recv matching rank 1's send #1" in d.verdict
    assert [(f.kind, f.ranks, f.role) for f in d.findings[1:]] == [("unmatched_p2p", [2], "supporting")]


# ---------------------------------------------------------------------------
# Healthy, helpers
# ---------------------------------------------------------------------------
def test_healthy_trace_is_ok():
    b = TraceBuilder(2, groups={"dp0": [0, 1]})
    alive(b, [0, 1], until=5.0)
    for r in (0, 1):
        b.collective(r, "dp0", 1, start=1.0, end=2.0)
        b.p2p(r, "send" if r == 0 else "recv", peer=1 - r, seq=1, start=2.0, end=3.0)
        b.compute(r, "forward", start=3.0, end=4.0)
        b.rank_state(r, exitcode=0, end_status="ok")
    d = diagnose(b.build())
    assert d.verdict == OK_VERDICT and d.ok
    assert not [f for f in d.findings if f.severity == "error"]
    assert d.to_json()["verdict"] == OK_VERDICT


def test_empty_trace_is_ok():
    assert diagnose(TraceBuilder(2).build()).verdict == OK_VERDICT


def test_helpers():
    assert fmt_ranks([0, 1, 2, 3, 5, 7, 8]) == "0-3,5,7,8"
    assert group_label("dp5", range(5, 256, 8)) == "dp5[5,13,...,253]"
    comps = strongly_connected([0, 1, 2, 3], {0: [1], 1: [0, 2], 2: [3]})
    assert comps == [[3], [2], [0, 1]]
    df = pd.DataFrame({"g": ["a"] * 4 + ["b"] * 2, "rank": [0, 1, 2, 3, 0, 1], "v": [1, 1, 2, 1, 5, 6]})
    dev = majority_vote(df, ["g"], "v")
    assert sorted(zip(dev["g"], dev["rank"], dev["tie"])) == [("a", 2, False), ("b", 0, True)]
    assert stack_excerpt(FAULTHANDLER_DUMP).splitlines()[1].strip().startswith('File "/app/model.py"')


def test_typed_payloads_are_fields_and_data_keys_for_them_are_refused():
    from ncclscope.findings import Evidence, Finding, InstanceRef, WaitSummary
    ev = [Evidence(rank=0, note="blocked")]
    for key in ("instance", "waiting_ranks", "role", "stack"):
        with pytest.raises(ValueError, match=f"passes {key} in data: these are typed fields"):
            Finding(kind="hang", severity="error", title="t", ranks=[0], evidence=ev, data={key: ["dp0", 1]})
    f = Finding(kind="hang", severity="error", title="t", ranks=[0], evidence=ev, instance=InstanceRef("dp0", 1),
                wait=WaitSummary(text="rank 1 waiting", waiting_ranks=(1,)), data={"cycle": [0, 1]})
    data = f.to_json()["data"]
    assert data["instance"] == ["dp0", 1] and data["waiting_ranks"] == [1] and data["cycle"] == [0, 1]


# ---------------------------------------------------------------------------
# Performance: 256 ranks x ~2,000 ops, built straight into Arrow
# ---------------------------------------------------------------------------
PHASES, KINDS, STATUSES = ["begin", "end", "instant"], ["compute", "collective", "marker"], ["", "ok"]
OP_NAMES = ["forward", "all_reduce", "backward", "barrier", "heartbeat"]


def _cat(codes: np.ndarray, names: list[str]) -> pd.Categorical:
    return pd.Categorical.from_codes(codes, categories=names)


def synthetic_skip(world: int = 256, steps: int = 250, tp: int = 8, skipper: int = 77) -> TraceBuilder:
    """tp groups of 8 consecutive ranks, dp groups strided by 8; 8 ops per step per rank.

    In the last step `skipper` does not post its dp all_reduce and enters a
    world barrier instead: its dp peers block in dp #k, every other rank
    blocks in the next tp all_reduce on its dp-blocked tp partner. Columns
    are built with numpy and categoricals (no per-op Python).
    """
    FWD, TP, BWD, DP = 0, 1, 2, 3
    pattern = np.array([FWD, TP, TP, BWD, TP, TP, DP, DP])
    step = np.repeat(np.arange(steps), len(pattern))
    slot = np.tile(np.arange(len(pattern)), steps)
    keep = ~((step == steps - 1) & (slot == len(pattern) - 1))       # last step stops after its first dp op
    step, slot = step[keep], slot[keep]
    what = pattern[slot]
    tp_seq, dp_seq = np.cumsum(what == TP), np.cumsum(what == DP)
    n = len(what)
    rank = np.repeat(np.arange(world), n)
    what_r, step_r = np.tile(what, world), np.tile(step, world)
    start = step_r * 1.0 + np.tile(slot, world) * 0.1
    n_tp = world // tp
    names = [f"tp{t}" for t in range(n_tp)] + [f"dp{d}" for d in range(tp)] + ["", "world"]
    group = np.where(what_r == TP, rank // tp, np.where(what_r == DP, n_tp + rank % tp, n_tp + tp))
    seq = np.where(what_r == TP, np.tile(tp_seq, world), np.where(what_r == DP, np.tile(dp_seq, world), -1))
    last_dp = (step_r == steps - 1) & (what_r == DP)
    ops = pd.DataFrame({"rank": rank, "what": what_r, "group": group, "collective_seq_id": seq, "start": start,
                        "step": step_r, "ended": ~(last_dp & (rank % tp == skipper % tp))})
    ops = ops[~(last_dp & (rank == skipper))]
    nxt = np.array([r for r in range(world) if r % tp != skipper % tp])
    tail = pd.DataFrame({"rank": np.append(nxt, skipper), "what": np.append(np.full(len(nxt), TP), 4),
                         "group": np.append(nxt // tp, n_tp + tp + 1),
                         "collective_seq_id": np.append(np.full(len(nxt), int(tp_seq[-1]) + 1), 1),
                         "start": np.append(np.full(len(nxt), steps - 0.1), steps - 0.35),
                         "step": steps, "ended": False})
    ops = pd.concat([ops, tail], ignore_index=True)
    ops["op_id"] = ops.groupby("rank").cumcount() + 1
    w = ops["what"].to_numpy()
    is_comm = (w == TP) | (w == DP) | (w == 4)
    cols = {
        "rank": ops["rank"].to_numpy(), "op_id": ops["op_id"].to_numpy(),
        "kind": _cat(is_comm.astype(int), KINDS),
        "op_name": _cat(np.array([0, 1, 2, 1, 3])[w], OP_NAMES),
        "process_group": _cat(ops["group"].to_numpy(), names),
        "collective_seq_id": ops["collective_seq_id"].to_numpy(), "step": ops["step"].to_numpy(),
        "call_site": _cat(np.where(w == DP, 0, np.where(w == 4, 2, 1)), ["train.py:80", "model.py:30", "train.py:99"]),
        "input_sizes": _cat(is_comm.astype(int), ["", "[[1024]]"]),
        "input_dtypes": _cat(is_comm.astype(int), ["", "float32"]),
    }
    b = TraceBuilder(world, groups={"world": list(range(world)),
                                    **{f"tp{t}": list(range(t * tp, t * tp + tp)) for t in range(n_tp)},
                                    **{f"dp{d}": list(range(d, world, tp)) for d in range(tp)}})
    t_ns = b.t0_ns + (ops["start"].to_numpy() * NS).astype(np.int64)
    begin = pd.DataFrame(cols).assign(phase=_cat(np.zeros(len(ops), int), PHASES),
                                      status=_cat(np.zeros(len(ops), int), STATUSES), time_ns=t_ns)
    done = ops["ended"].to_numpy()
    end = begin[done].assign(phase=_cat(np.ones(int(done.sum()), int), PHASES),
                             status=_cat(np.ones(int(done.sum()), int), STATUSES),
                             time_ns=t_ns[done] + NS // 20)
    beats = np.arange(0, steps + 5)
    m = world * len(beats)
    hb = pd.DataFrame({"rank": np.repeat(np.arange(world), len(beats)),
                       "phase": _cat(np.full(m, 2), PHASES), "kind": _cat(np.full(m, 2), KINDS),
                       "op_name": _cat(np.full(m, 4), OP_NAMES), "status": _cat(np.zeros(m, int), STATUSES),
                       "time_ns": b.t0_ns + np.tile(beats, world) * NS})
    b.add_events(pd.concat([begin, end, hb], ignore_index=True))
    return b


def test_performance_256_ranks_2000_ops_each_names_the_skipper():
    trace = synthetic_skip().build()
    assert len(trace.ops) > 256 * 1900
    t = time.perf_counter()
    d = diagnose(trace)
    elapsed = time.perf_counter() - t
    assert elapsed < 10.0, f"diagnose took {elapsed:.1f} s"
    h = headline(d)
    assert (h.kind, h.ranks) == ("hang", [77])
    assert d.verdict.startswith("HANG: rank 77 skipped all_reduce on dp5[5,13,...,253] at step 249 (train.py:80, "
                                "#499 for ranks 5,13,"), d.verdict
    assert "(31 ranks)) and went on to barrier #1 on world[0-255]" in d.verdict
    assert len(h.to_json()["data"]["waiting_ranks"]) == 255
    assert len(h.evidence) <= 60


def test_a_pair_member_that_left_out_the_call_its_partner_is_stuck_in_is_named():
    """dp group of two: rank 1 leaves out step 2's all_reduce and goes on to the closing barrier, rank 0 is
    stuck in that all_reduce. 1 of 2 is no majority, and the barrier's 3 of 4 points at rank 0; the step
    census counts rank 0, still inside step 2, from below (it began the call), and rank 1's own steps 0-1
    say it always made that call."""
    groups = {"world": [0, 1, 2, 3], "dp0": [0, 1], "dp1": [2, 3], "tp0": [0, 2], "tp1": [1, 3]}
    b = TraceBuilder(4, groups=groups)
    for r in range(4):
        g = "dp0" if r < 2 else "dp1"
        for step in range(3):
            t = 1.0 + step
            b.collective(r, f"tp{r % 2}", step + 1, start=t - 0.2, end=t - 0.1, call_site="train.py:70", step=step)
            if r == 1 and step == 2:
                continue
            b.collective(r, g, step + 1, start=t, end=None if (r == 0 and step == 2) else t + 0.1,
                         call_site="train.py:80", step=step)
        if r != 0:
            b.collective(r, "world", 1, start=4.0, call_site="train.py:99", step=-1)
        b.heartbeats(r, 0.0, 12.0)
    d = diagnose(b.build())
    assert d.verdict.startswith("HANG: rank 1 skipped all_reduce on dp0[0,1] at step 2 (train.py:80, #3 for rank 0) "
                                "and went on to all_reduce #1 on world[0-3]"), d.verdict


@pytest.mark.parametrize("own", [True, False])
def test_a_rank_that_failed_of_its_own_error_inside_an_op_is_dead_its_peers_failures_are_not(own):
    """DDP's parameter check raises on rank 3 only, inside an op only Flight Recorder saw (left open);
    ranks 0-2 then fail with 'connection closed by peer' in the next one. Rank 3 is the dead root, and
    where it raised is named; when rank 3's own message is a peer error too, nobody is made dead by it."""
    b = TraceBuilder(4, groups={"world": [0, 1, 2, 3]})
    for r in range(4):
        b.heartbeats(r, 0.0, 1.0 if r == 3 else 3.0)
        b.collective(r, "world", 1, op="all_gather", start=0.5, end=0.6, call_site="job.py:6")
    b.collective(3, "world", 2, op="broadcast", start=0.7, call_site="job.py:6")
    for r in range(3):
        b.collective(r, "world", 2, op="broadcast", start=0.7, end=0.8, call_site="job.py:6")
        b.collective(r, "world", 3, op="all_reduce", start=0.9, call_site="job.py:9")
        b.rank_state(r, exitcode=1, end_status="error",
                     end_message="RuntimeError: Connection closed by peer [127.0.0.1]:35251")
    msg = "RuntimeError: [3]: params[0] in this process with sizes [24, 16] appears not to match" if own \
        else "RuntimeError: Connection reset by peer"
    b.rank_state(3, exitcode=1, end_status="error", end_message=msg)
    b.stacks(3, f"=== ncclscope rank 3: exception RuntimeError at {b.ns(0.75)} ns ===\n"
                "Current thread 0x00007f0000000001 (most recent call first):\n"
                '  File "/app/job.py", line 6 in <module> (def line 1)\n')
    trace = b.build()
    d = diagnose(trace)
    states = index_of(trace).rank_states
    if own:
        assert bool(states.at[3, "dead"]) and not states.loc[[0, 1, 2], "dead"].any()
        assert (headline(d).kind, headline(d).ranks) == ("dead_rank", [3]), d.verdict
        assert d.verdict.startswith("DEAD RANK: rank 3 failed (exit code 1: RuntimeError: [3]: params[0] in this "
                                    "process with sizes [24, 16] appears not to match) at step 0, raised at "
                                    "/app/job.py:6 in <module>"), d.verdict
    else:
        assert not states["dead"].any()
