"""Mismatch diagnosis on hand-built traces: wrong groups, type/size/count deviants by majority vote, and
the sequence history (skips in earlier steps, ties broken by history). Split from
tests/test_hang_analysis.py; each case states the scenario and the exact verdict.
"""
from __future__ import annotations

import pytest
from hang_checks import alive, headline
from trace_builder import TraceBuilder

from ncclscope.hang.collectives import analyze_collectives
from ncclscope.verdict.diagnose import diagnose

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------------------
# Wrong group, mismatches
# ---------------------------------------------------------------------------
def test_rank_calling_the_collective_on_the_wrong_group():
    # dp0 = [0,1,2]: ranks 0,2 call all_reduce #3 on dp0 from train.py:42 at step 5;
    # rank 1 calls it on "world" from the same line instead and never reaches dp0 #3.
    b = TraceBuilder(4, groups={"world": [0, 1, 2, 3], "dp0": [0, 1, 2], "dp1": [3]})
    alive(b, range(4))
    for r in (0, 1, 2):
        for k in (1, 2):
            b.collective(r, "dp0", k, start=float(k), end=k + 0.1, step=k + 2, call_site="train.py:42")
    b.collective(0, "dp0", 3, start=5.0, step=5, call_site="train.py:42")
    b.collective(2, "dp0", 3, start=5.0, step=5, call_site="train.py:42")
    b.collective(1, "world", 1, start=5.0, step=5, call_site="train.py:42")
    b.collective(3, "world", 1, start=5.0, step=5, call_site="train.py:99")
    d = diagnose(b.build())
    h = headline(d)
    assert (h.kind, h.ranks) == ("wrong_group", [1])
    assert d.verdict == ("WRONG GROUP: rank 1 called all_reduce on world[0-3] instead of dp0[0-2] (#3) at "
                         "train.py:42 (step 5); ranks 0,2 waiting in all_reduce #3 on dp0 since 5.0 s")
    assert h.cause.wrong.group == "world" and h.to_json()["data"]["instance"] == ["dp0", 3]
    assert h.to_json()["data"]["explains"]["kind"] == "hang" and h.to_json()["data"]["explains"]["ranks"] == [1]
    assert [f.kind for f in d.findings if f.severity == "error"] == ["wrong_group"]


def _mismatch_trace(world: int, group: str, deviant: int, seq: int, **odd) -> TraceBuilder:
    b = TraceBuilder(world, groups={group: list(range(world))})
    for r in range(world):
        for k in range(1, 4):
            kw = odd if (r == deviant and k == seq) else {}
            b.collective(r, group, k, start=float(k), end=k + 0.1, **kw)
    return b


@pytest.mark.parametrize("odd, category, text", [
    ({"sizes": "[[8]]"}, "size", "rank 2 deviates in all_reduce #2 on dp0[0-3]: passed sizes [[8]] where ranks 0,1,3 passed [[4]] (its call at train.py:10)"),
    ({"dtype": "bfloat16"}, "dtype", "rank 2 deviates in all_reduce #2 on dp0[0-3]: used dtype bfloat16 where ranks 0,1,3 used float32 (its call at train.py:10)"),
    ({"op": "all_gather"}, "type", "rank 2 deviates in all_reduce #2 on dp0[0-3]: called all_gather where ranks 0,1,3 called all_reduce(sum) (its call at train.py:10)"),
])
def test_majority_vote_names_the_deviant(odd, category, text):
    d = diagnose(_mismatch_trace(4, "dp0", deviant=2, seq=2, **odd).build())
    h = headline(d)
    assert (h.kind, h.ranks, h.data["categories"]) == ("collective_mismatch", [2], [category])
    assert d.verdict == "MISMATCH: " + text
    assert h.evidence[0].rank == 2 and h.evidence[0].note.startswith("deviant")


def test_type_mismatch_that_hangs_names_the_deviant_not_the_stalled_ranks():
    # gloo: all_reduce against broadcast just hangs with every member inside instance #2.
    b = TraceBuilder(4, groups={"dp0": [0, 1, 2, 3]})
    alive(b, range(4))
    for r in range(4):
        b.collective(r, "dp0", 1, start=1.0, end=1.1)
        b.collective(r, "dp0", 2, op="broadcast" if r == 2 else "all_reduce", start=2.0)
    d = diagnose(b.build())
    h = headline(d)
    assert (h.kind, h.ranks) == ("collective_mismatch", [2])
    assert d.verdict == ("MISMATCH: rank 2 deviates in all_reduce #2 on dp0[0-3]: called broadcast where "
                         "ranks 0,1,3 called all_reduce(sum) (its call at train.py:10); ranks 0-3 blocked in it for 8.0 s")
    assert h.to_json()["data"]["explains"]["kind"] == "hang"     # the stalled-instance root was folded into it
    assert [f.kind for f in d.findings if f.severity == "error"] == ["collective_mismatch"]


def test_size_mismatch_that_aborts_an_innocent_neighbour_names_the_deviant():
    # gloo: rank 1 passes [[8]] to dp0 #2, rank 2 (innocent) dies with SIGABRT inside it,
    # ranks 0,1,3 sit in #2 until their timeout. The first rank to deviate is 1, not 2.
    b = TraceBuilder(4, groups={"dp0": [0, 1, 2, 3]})
    for r in range(4):
        b.heartbeats(r, 0.0, 2.0 if r == 2 else 10.0)
        b.collective(r, "dp0", 1, start=1.0, end=1.1)
    b.collective(2, "dp0", 2, start=2.0)
    b.rank_state(2, signal="SIGABRT")
    for r in (0, 1, 3):
        b.collective(r, "dp0", 2, start=2.0, end=9.0, status="timeout", sizes="[[8]]" if r == 1 else "[[4]]")
        b.rank_state(r, exitcode=1)
    d = diagnose(b.build())
    h = headline(d)
    assert (h.kind, h.ranks) == ("collective_mismatch", [1])
    assert d.verdict.startswith("MISMATCH: rank 1 deviates in all_reduce #2 on dp0[0-3]: passed sizes [[8]] "
                                "where ranks 0,2,3 passed [[4]]")
    assert "then rank 2 was killed (SIGABRT)" in d.verdict
    dead = [f for f in d.findings if f.kind == "dead_rank"]
    assert len(dead) == 1 and dead[0].ranks == [2] and dead[0].role == "supporting"


def test_an_old_mismatch_that_completed_does_not_replace_a_later_dead_rank():
    b = TraceBuilder(2, groups={"dp0": [0, 1]})
    b.heartbeats(0, 0.0, 20.0)
    b.heartbeats(1, 0.0, 5.0)
    b.collective(0, "dp0", 1, start=1.0, end=1.1, sizes="[[4]]")
    b.collective(1, "dp0", 1, start=1.0, end=1.1, sizes="[[4, 1]]")     # odd but it completed
    for r in (0, 1):
        b.collective(r, "dp0", 2, start=2.0, end=2.1)
    b.collective(0, "dp0", 3, start=6.0)
    b.rank_state(1, signal="SIGKILL")
    d = diagnose(b.build())
    # the 1 vs 1 tie at #1 is decided by each rank's own other calls from that line: rank 0 passed [[4]]
    # as always, rank 1 changed; the old, completed mismatch stays below the later death, beside it
    assert [(f.kind, f.ranks, f.role) for f in d.findings if f.severity == "error"] == [
        ("dead_rank", [1], "headline"), ("collective_mismatch", [1], "supporting")]


def test_a_tie_is_called_ambiguous_and_names_the_lowest_rank():
    b = TraceBuilder(2, groups={"dp0": [0, 1]})
    b.collective(0, "dp0", 1, start=1.0, end=1.1, sizes="[[4]]")
    b.collective(1, "dp0", 1, start=1.0, end=1.1, sizes="[[8]]")
    d = diagnose(b.build())
    h = headline(d)
    assert (h.kind, h.ranks, h.cause.ambiguous) == ("collective_mismatch", [0], True)
    assert d.verdict.startswith("MISMATCH: ambiguous (1 vs 1 tie), naming the lowest rank 0:")


def test_analysis_continues_past_the_first_mismatch_into_other_groups():
    # dp0: rank 1 passes [[8]] at #3 only; dp1: rank 5 switches to float64 from #2 on.
    b = TraceBuilder(6, groups={"dp0": [0, 1, 2], "dp1": [3, 4, 5]})
    for r in range(6):
        for k in range(1, 6):
            b.collective(r, f"dp{r // 3}", k, start=float(k), end=k + 0.1,
                         sizes="[[8]]" if (r == 1 and k == 3) else "[[4]]",
                         dtype="float64" if (r == 5 and k >= 2) else "float32")
    d = diagnose(b.build())
    errors = [(f.kind, f.ranks, f.to_json()["data"]["instance"], f.cause.later_instances) for f in d.findings
              if f.severity == "error"]
    assert errors == [("collective_mismatch", [1], ["dp0", 3], 0), ("collective_mismatch", [5], ["dp1", 2], 3)]
    assert d.verdict.startswith("MISMATCH: rank 1 deviates in all_reduce #3 on dp0[0-2]")
    assert "(and in 3 later instances)" in d.findings[1].title


def test_mismatch_findings_are_bounded_per_group_with_a_summary():
    b = TraceBuilder(12, groups={"dp0": list(range(12))})
    for r in range(12):
        for k in range(1, 11):      # rank k-1 deviates at instance k only: 10 separate deviations
            b.collective(r, "dp0", k, start=float(k), end=k + 0.1, sizes="[[8]]" if r == k - 1 else "[[4]]")
    rep = analyze_collectives(b.build(), max_per_group=5)
    mism = [f for f in rep.findings if f.kind == "collective_mismatch" and not f.data.get("missing_participant")]
    assert len(mism) == 6 and mism[-1].cause.summary is True and mism[-1].severity == "warning"
    assert "5 more mismatched instances" in mism[-1].title
    assert len(rep.deviations) == 10


# ---------------------------------------------------------------------------
# What real drills revealed (tests/test_drills_e2e.py): sequence shifts, lost rows
# ---------------------------------------------------------------------------
def _pp_dp_skip(steps: int = 4, skip_step: int = 1) -> TraceBuilder:
    """pp 2 x dp 2: dp0=[0,1], dp1=[2,3], pp0=[0,2], pp1=[1,3]. Each step: all_reduce on dp (data.py:76),
    then on pp (data.py:235). Rank 1 skips its dp all_reduce at `skip_step`: gloo pairs its next one with
    rank 0's skipped one, so nothing hangs there; at the end rank 0 waits in dp0 #steps while rank 1
    is already in the final world barrier, and rank 2 waits for rank 0 in pp0: a cycle 0 <-> 1."""
    groups = {"world": [0, 1, 2, 3], "dp0": [0, 1], "dp1": [2, 3], "pp0": [0, 2], "pp1": [1, 3]}
    b = TraceBuilder(4, groups=groups, coords={r: {"pp": r // 2, "dp": r % 2} for r in range(4)})
    alive(b, range(4), until=20.0)
    dp_of, pp_of = {0: "dp0", 1: "dp0", 2: "dp1", 3: "dp1"}, {0: "pp0", 2: "pp0", 1: "pp1", 3: "pp1"}
    seq = {(r, g): 0 for r in range(4) for g in groups}

    def op(r, g, t, site, step, end=True, status="ok"):
        seq[(r, g)] += 1
        b.collective(r, g, seq[(r, g)], op="barrier" if g == "world" else "all_reduce", start=t,
                     end=(t + 0.05) if end else None, status=status, step=step, call_site=site,
                     sizes="[[21921]]" if site.endswith(":76") else "[[1]]")

    last = steps - 1
    for r in range(4):
        for s in range(steps):
            t = 1.0 + s
            stuck_dp = r == 0 and s == last
            stuck_pp = r == 2 and s == last
            if not (r == 1 and s == skip_step):
                op(r, dp_of[r], t, "data.py:76", s, end=not stuck_dp, status="timeout" if stuck_dp else "ok")
            if stuck_dp:
                break
            op(r, pp_of[r], t + 0.2, "data.py:235", s, end=not stuck_pp, status="timeout" if stuck_pp else "ok")
            if stuck_pp:
                break
        else:
            op(r, "world", 1.0 + steps, "train.py:241", -1, end=False)
        b.rank_state(r, exitcode=3)
    return b


def test_a_skip_in_an_earlier_step_of_a_two_member_group_is_named_with_its_step():
    # "3 of 4 members entered" cannot point at anyone in a 2-member group; the step census can:
    # rank 1 issued no all_reduce from data.py:76 on dp0 in step 1, rank 0 (and rank 1 in every
    # other step) issued one.
    d = diagnose(_pp_dp_skip().build())
    h = headline(d)
    assert (h.kind, h.ranks) == ("hang", [1])
    assert d.verdict.startswith(
        "HANG: rank 1 (pp 0, dp 1) skipped all_reduce on dp0[0,1] at step 1 (data.py:76, #2 for rank 0): "
        "its later all_reduces on dp0 paired one instance off, and it went on to barrier #1 on world[0-3]")
    assert h.data["shift"]["basis"] == "regularity" and h.data["shift"]["step"] == 1
    assert h.data["skipped"] == ["dp0", 2] and h.to_json()["data"]["instance"] == ["dp0", 4]
    assert [f.kind for f in d.findings if f.severity == "error"] == ["hang"]


def test_a_skip_in_an_earlier_step_is_named_by_majority_in_a_larger_group():
    # dp0 = [0..3]: rank 2 skipped at step 2 of 4; its step-3 all_reduce paired with the others' step-2 one.
    b = TraceBuilder(4, groups={"world": [0, 1, 2, 3], "dp0": [0, 1, 2, 3]})
    alive(b, range(4), until=20.0)
    for r in range(4):
        k = 0
        for s in range(4):
            if r == 2 and s == 2:
                continue
            k += 1
            stuck = r != 2 and s == 3
            b.collective(r, "dp0", k, start=1.0 + s, end=None if stuck else 1.05 + s, step=s, call_site="d.py:7")
        if r == 2:
            b.collective(r, "world", 1, start=5.0, step=-1, call_site="train.py:241")
    d = diagnose(b.build())
    h = headline(d)
    assert (h.kind, h.ranks) == ("hang", [2])
    assert d.verdict.startswith("HANG: rank 2 skipped all_reduce on dp0[0-3] at step 2 (d.py:7, #3 for ranks "
                                "0,1,3): its later all_reduces on dp0 paired one instance off")
    assert h.data["shift"]["basis"] == "majority"


def test_ranks_still_inside_their_last_step_are_not_a_sequence_shift():
    # Rank 0 is blocked earlier in step 3 than rank 1: different counts in an unfinished step are
    # progress, not a skip. Nobody skipped: the census finds nothing.
    from ncclscope.hang.census import step_census_deviations
    from ncclscope.index.instances import collective_ops
    b = TraceBuilder(2, groups={"dp0": [0, 1]})
    for r in (0, 1):
        for s in range(3):
            b.collective(r, "dp0", s + 1, start=1.0 + s, end=1.05 + s, step=s, call_site="d.py:7")
    b.collective(1, "dp0", 4, start=4.0, step=3, call_site="d.py:7")
    t = b.build()
    assert not len(step_census_deviations(collective_ops(t.ops), {"dp0": [0, 1]}))


def test_a_dtype_deviant_whose_partner_died_without_a_record_is_named_from_history():
    # tp x dp 2 x 2: dp0=[0,2]. Rank 2 sends float64 into dp0 #3 at step 2; gloo SIGABRTs rank 0
    # (innocent) before its begin row is flushed. Nobody else began #3: no vote inside the instance.
    # Rank 2's own steps 0,1 and the other dp group at step 2 used float32.
    b = TraceBuilder(4, groups={"dp0": [0, 2], "dp1": [1, 3], "tp0": [0, 1], "tp1": [2, 3]},
                     coords={r: {"tp": r % 2, "dp": r // 2} for r in range(4)})
    for r in range(4):
        b.heartbeats(r, 0.0, 2.5 if r == 0 else 10.0)
        g = f"dp{r % 2}"
        for s in range(3):
            if r == 0 and s == 2:
                continue
            fail = s == 2 and r == 2
            b.collective(r, g, s + 1, start=1.0 + 0.5 * s, end=9.0 if fail else 1.1 + 0.5 * s,
                         status="error" if fail else "ok", step=s, call_site="data.py:76",
                         dtype="float64" if fail else "float32")
    b.rank_state(0, signal="SIGABRT")
    for r in (1, 2, 3):
        b.rank_state(r, exitcode=4)
    d = diagnose(b.build())
    h = headline(d)
    assert (h.kind, h.ranks) == ("collective_mismatch", [2])
    assert d.verdict.startswith("MISMATCH: rank 2 (dp 1, tp 0) deviates in all_reduce #3 on dp0[0,2]: used dtype "
                                "float64 where its own other iterations of that call (2) and dp1 at this step used float32 "
                                "(its call at data.py:76); "
                                "rank 0 (dp 0, tp 0) left no record of #3 (killed by SIGABRT)")
    assert h.cause.basis == "history" and h.cause.absent_ranks == (0,)
    assert "then rank 0 (dp 0, tp 0) was killed (SIGABRT)" in d.verdict


def test_history_breaks_a_one_vs_one_tie():
    b = TraceBuilder(2, groups={"dp0": [0, 1]})
    for k in range(1, 5):
        for r in (0, 1):
            b.collective(r, "dp0", k, start=float(k), end=k + 0.1, step=k, call_site="d.py:7",
                         sizes="[[8]]" if (r == 1 and k == 3) else "[[4]]")
    d = diagnose(b.build())
    h = headline(d)
    assert (h.kind, h.ranks, h.cause.ambiguous) == ("collective_mismatch", [1], False)
    assert d.verdict == ("MISMATCH: rank 1 deviates in all_reduce #3 on dp0[0,1]: passed sizes [[8]] where its "
                         "own other iterations of that call (3) passed [[4]] (its call at d.py:7)")


def test_history_does_not_blame_dynamic_shapes():
    # The partner died without a record, but this call's sizes change every step anyway: no verdict
    # from history, the dead rank stays the headline.
    b = TraceBuilder(2, groups={"dp0": [0, 1]})
    b.heartbeats(0, 0.0, 10.0)
    b.heartbeats(1, 0.0, 3.0)
    for k in range(1, 4):
        for r in (0, 1):
            b.collective(r, "dp0", k, start=float(k) * 0.5, end=k * 0.5 + 0.1, step=k, call_site="d.py:7",
                         sizes=f"[[{4 * k}]]")
    b.collective(0, "dp0", 4, start=3.0, step=4, call_site="d.py:7", sizes="[[99]]")
    b.rank_state(1, signal="SIGABRT")
    d = diagnose(b.build())
    assert [(f.kind, f.ranks) for f in d.findings if f.severity == "error"] == [("dead_rank", [1])]


def test_wrong_group_in_two_member_groups_is_decided_by_the_call_sites_usual_group():
    # tp x dp 2 x 2. At step 2 rank 1 issues its dp gradient all_reduce (data.py:76) on tp0 instead of
    # dp1; rank 3 waits in dp1 #3. 1 of 2 members entered each: the tie goes to the group kind
    # data.py:76 uses everywhere else (dp).
    groups = {"dp0": [0, 2], "dp1": [1, 3], "tp0": [0, 1], "tp1": [2, 3]}
    b = TraceBuilder(4, groups=groups, coords={r: {"tp": r % 2, "dp": r // 2} for r in range(4)})
    alive(b, range(4))
    for r in range(4):
        for s in range(3):
            last = s == 2
            if r == 1 and last:
                b.collective(1, "tp0", 3, start=3.0, step=2, call_site="data.py:76", sizes="[[100]]")
                continue
            b.collective(r, f"tp{r // 2}", s + 1, start=1.0 + s, end=1.1 + s, step=s, call_site="tensor.py:63")
            if r == 0 and last:
                continue
            b.collective(r, f"dp{r % 2}", s + 1, start=1.2 + s, end=None if last and r == 3 else 1.3 + s,
                         step=s, call_site="data.py:76", sizes="[[100]]")
    d = diagnose(b.build())
    h = headline(d)
    assert (h.kind, h.ranks) == ("wrong_group", [1])
    assert d.verdict.startswith("WRONG GROUP: rank 1 (dp 0, tp 1) called all_reduce on tp0[0,1] instead of "
                                "dp1[1,3] (#3) at data.py:76 (step 2)")
