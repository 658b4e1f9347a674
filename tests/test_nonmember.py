"""`wrong_group` from a collective called on a group the rank is not a member of (torch makes it a no-op;
`ncclscope run` writes a `not_member` marker row with the call site). Hand-built traces."""
from __future__ import annotations

from ncclscope import schema as S
from ncclscope.verdict import run
from trace_builder import TraceBuilder

GROUPS = {"world": [0, 1, 2, 3], "g1": [0, 2], "g2": [1, 3]}


def _not_member(b: TraceBuilder, rank: int, t: float, site: str = "train.py:13", op: str = "all_reduce") -> None:
    b._rows.append({"rank": rank, "op_id": -1, "phase": S.PHASE_INSTANT, "time_ns": b.ns(t),
                    "kind": S.KIND_MARKER, "op_name": op, "status": S.STATUS_NOT_MEMBER, "call_site": site,
                    "message": "called on a process group this rank is not a member of", "step": 0})


def _alternating(b: TraceBuilder, upto: int, skip_rank: int | None = None) -> None:
    """Each rank: its pair group from train.py:13, then world from train.py:16, `upto` times; `skip_rank`
    makes its last pair-group call on the other pair group (a no-op) and goes on to world."""
    for r in range(4):
        pair = "g1" if r % 2 == 0 else "g2"
        for i in range(1, upto + 1):
            t = float(i)
            last = i == upto
            if r == skip_rank and last:
                _not_member(b, r, t)
            elif last and r == 3 and skip_rank == 1:
                b.collective(r, pair, i, start=t, call_site="train.py:13")        # waits for rank 1
                continue
            else:
                b.collective(r, pair, i, start=t, end=t + 0.1, call_site="train.py:13")
            if last and skip_rank is not None:
                if r != 3:
                    b.collective(r, "world", i, start=t + 0.2, call_site="train.py:16")   # waits for rank 3
                continue
            b.collective(r, "world", i, start=t + 0.2, end=t + 0.3, call_site="train.py:16")
        b.heartbeats(r, 0.0, upto + 8.0)


def test_a_call_on_a_foreign_group_heads_the_hang_it_caused():
    b = TraceBuilder(4, groups=GROUPS)
    _alternating(b, 3, skip_rank=1)
    a = run(b.build())
    assert a.verdict.startswith("WRONG GROUP: rank 1 called all_reduce at train.py:13 on a process group it is "
                                "not a member of"), a.verdict
    assert "its other all_reduce calls there went to g2[1,3], whose all_reduce #3 rank 3 is waiting in" in a.verdict
    assert a.root_ranks == [1]


def test_without_a_hang_it_is_information_only():
    """Code that calls collectives on every rank with every group on purpose: a healthy run stays quiet."""
    b = TraceBuilder(4, groups=GROUPS)
    _alternating(b, 3)
    _not_member(b, 1, 3.5)
    a = run(b.build())
    assert a.verdict.startswith("OK"), a.verdict
    assert a.exit_code == 0
    f = [f for f in a.findings if f.kind == "wrong_group"]
    assert len(f) == 1 and f[0].severity == "info" and f[0].ranks == [1]


def test_a_no_op_call_that_shifted_the_rank_onto_its_peers_next_call_heads_the_tie_it_caused():
    """Seed 20261213 #235 in small: each step, an all_reduce on the pair group (train.py:13) then an all_gather
    on it (train.py:20). In step 2 rank 1's all_reduce goes to the other pair group (a no-op), so its
    all_gather is its #3 on g2, which meets rank 3's all_reduce #3: a 1 vs 1 tie both hang in, rank 1 missing
    from nothing. The call that never reached g2 comes first."""
    b = TraceBuilder(4, groups=GROUPS)
    for r in range(4):
        pair = "g1" if r % 2 == 0 else "g2"
        b.collective(r, pair, 1, start=1.0, end=1.1, call_site="train.py:13")
        b.collective(r, pair, 2, op="all_gather", start=1.2, end=1.3, call_site="train.py:20")
        if r == 1:
            _not_member(b, r, 2.0)
            b.collective(r, pair, 3, op="all_gather", start=2.2, call_site="train.py:20")
        elif r == 3:
            b.collective(r, pair, 3, start=2.0, call_site="train.py:13")
        else:
            b.collective(r, pair, 3, start=2.0, end=2.1, call_site="train.py:13")
            b.collective(r, pair, 4, op="all_gather", start=2.2, end=2.3, call_site="train.py:20")
        b.heartbeats(r, 0.0, 10.0)
    a = run(b.build())
    assert a.verdict.startswith("WRONG GROUP: rank 1 called all_reduce at train.py:13 on a process group it is "
                                "not a member of"), a.verdict
    assert "went to g2[1,3], whose all_reduce #3 rank 3 is waiting in" in a.verdict, a.verdict
    assert a.root_ranks == [1]


def test_a_no_op_call_followed_by_a_healthy_next_call_stays_information():
    """The same no-op call, with the rank's next call on its group finishing: nothing shifted, nothing hung."""
    b = TraceBuilder(4, groups=GROUPS)
    for r in range(4):
        pair = "g1" if r % 2 == 0 else "g2"
        b.collective(r, pair, 1, start=1.0, end=1.1, call_site="train.py:13")
        if r == 1:
            _not_member(b, r, 1.5)
        b.collective(r, pair, 2, op="all_gather", start=2.0, end=2.1, call_site="train.py:20")
        b.heartbeats(r, 0.0, 3.0)
    a = run(b.build())
    assert a.verdict.startswith("OK"), a.verdict
