"""The typed causal record on `Finding` (`Cause`) and the one table of what explains what.

    OMP_NUM_THREADS=1 python -m pytest -q tests/test_findings_cause.py
"""
from __future__ import annotations

import json

import pytest

from ncclscope.findings import (CAUSE_KEYS, Cause, CauseBasis, Departure, Evidence, Finding, FindingKind, InstanceRef,
                                WaitSummary, WrongCall)
from ncclscope.hang.collectives import MISMATCH_LAYOUT
from ncclscope.hang.p2p import UNMATCHED_LAYOUT
from ncclscope.verdict.diagnose import EXPLAINS, PROMOTABLE, ROOT_KINDS, explains, supports

EV = [Evidence(rank=0, note="blocked", op_name="all_reduce", process_group="dp0", seq=3)]


def _finding(kind: FindingKind, **kw) -> Finding:
    return Finding(kind=kind, severity="error", title="t", ranks=kw.pop("ranks", [0]), evidence=EV, **kw)


@pytest.mark.parametrize("key", CAUSE_KEYS)
def test_a_cause_key_in_data_is_refused(key):
    with pytest.raises(ValueError, match=f"passes {key} in data: a cause's claims are the typed record"):
        _finding(FindingKind.HANG, data={key: 1})


def test_a_data_key_that_the_cause_also_writes_is_refused():
    # `basis` and `ambiguous` stay free for other analyses' data, never both there and in the cause
    _finding(FindingKind.STRAGGLER, data={"basis": "off_schedule", "ambiguous": False})
    with pytest.raises(ValueError, match="passes basis in data"):
        _finding(FindingKind.HANG, data={"basis": "sequence"}, cause=Cause(basis=CauseBasis.SEQUENCE))


def test_the_cause_writes_its_claims_under_the_old_data_keys_in_the_writers_order():
    f = _finding(FindingKind.COLLECTIVE_MISMATCH, instance=InstanceRef("dp0", 3),
                 data={"process_group": "dp0", "seq": 3, "categories": ["size"], "call_site": "train.py:9"},
                 cause=Cause(basis=CauseBasis.HISTORY, ambiguous=False, deviant_ranks=(1,), absent_ranks=(),
                             unfinished=True, later_instances=0, died_inside=(2,)),
                 layout=MISMATCH_LAYOUT)
    data = f.to_json()["data"]
    assert list(data) == ["process_group", "seq", "categories", "ambiguous", "deviant_ranks", "later_instances",
                          "unfinished", "basis", "absent_ranks", "call_site", "died_inside", "role", "instance"]
    assert data["basis"] == "history" and data["deviant_ranks"] == [1] and data["absent_ranks"] == []
    assert data["died_inside"] == [2] and data["later_instances"] == 0
    assert "before_death" not in data and "summary" not in data      # unclaimed: not written
    json.dumps(f.to_json())


def test_an_unmatched_p2p_departure_and_wrong_call_serialize_as_before():
    dep = Departure(step=2, call_site="a.py:1", went_site="a.py:5", went_op="barrier", position=3,
                    basis=CauseBasis.STEP)
    f = _finding(FindingKind.UNMATCHED_P2P, ranks=[1],
                 data={"side": "send", "src": 0, "op_step": 2, "op_name": "send", "dst": 1, "tag": 0, "seq": 4,
                       "count": 1, "tag_mismatch": False, "call_site": "a.py:1"},
                 cause=Cause(poster=0, absent=1, departure=dep), layout=UNMATCHED_LAYOUT)
    data = f.json_data()
    assert list(data)[:2] == ["poster", "absent"] and list(data)[-2:] == ["departure", "call_site"]
    assert data["departure"] == {"step": 2, "call_site": "a.py:1", "went_site": "a.py:5", "went_op": "barrier",
                                 "position": 3, "basis": "step"}
    w = Cause(basis=CauseBasis.NOT_MEMBER, wrong=WrongCall("", None, 7)).to_json()
    assert w == {"basis": "not_member", "wrong_group": "", "wrong_ns": 7}       # no seq: no wrong_seq key


def test_the_rules_are_one_table_keyed_by_kind():
    assert set(EXPLAINS) == set(PROMOTABLE) and all(isinstance(k, FindingKind) for k in PROMOTABLE)
    assert PROMOTABLE[0] == FindingKind.WRONG_GROUP and all(isinstance(k, FindingKind) for k in ROOT_KINDS)


def _root(kind: FindingKind, ranks: list[int], involved: list[int], blocked=()) -> Finding:
    return _finding(kind, ranks=ranks, involved=involved, instances=[InstanceRef(g, k) for g, k in blocked],
                    wait=WaitSummary(text="ranks waiting"))


def test_explains_reads_the_typed_cause():
    hang = _root(FindingKind.DEADLOCK, [0, 1], [0, 1])
    p2p = _finding(FindingKind.UNMATCHED_P2P, ranks=[1], cause=Cause(poster=0, absent=1))
    assert not explains(p2p, hang)                                          # no departure, no tag change
    dep = Departure(2, "a.py:1", "a.py:5", "barrier", 3, CauseBasis.STEP)
    assert explains(_finding(FindingKind.UNMATCHED_P2P, ranks=[1], cause=Cause(poster=0, absent=1, departure=dep)),
                    hang)
    assert supports(p2p, hang, hang)
    dead = _root(FindingKind.DEAD_RANK, [2], [0, 1, 2])
    wrong = _finding(FindingKind.WRONG_GROUP, ranks=[3], instance=InstanceRef("dp0", 3),
                     cause=Cause(wrong=WrongCall("tp1", 1, 5), partner_deaths=(2,)))
    assert explains(wrong, dead)
    assert not explains(_finding(FindingKind.WRONG_GROUP, ranks=[3], instance=InstanceRef("dp0", 3),
                                 cause=Cause(wrong=WrongCall("tp1", 1, 5))), dead)
    waiting = _root(FindingKind.HANG, [5], [0, 5], blocked=[("tp1", 1)])
    assert explains(wrong, waiting)                                          # the instance its wrong call made
    summary = _finding(FindingKind.COLLECTIVE_MISMATCH, ranks=[0], instance=InstanceRef("tp1", 1),
                       cause=Cause(summary=True))
    assert not explains(summary, waiting)                                    # a count is never a cause
