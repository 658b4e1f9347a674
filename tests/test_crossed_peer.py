"""Two unmatched p2p ops that would pair if one named the other's rank (hang/p2p.with_crossed_peer): the rank
whose named peer never exchanges with it made the mistake, even in the first iteration.

Found by an unseen hand-written program (benchmarks/hand_programs/ring_spare_irecv.py): a ring over ranks 0-3
with rank 4 a spare; rank 0 posts its irecv from rank 4, rank 3's isend to rank 0 waits, and the verdict was a
deadlock of all five ranks through rank 4's next collective.
"""
from __future__ import annotations

import pytest
from hang_checks import alive, headline
from trace_builder import TraceBuilder

from ncclscope.verdict.diagnose import diagnose

pytestmark = pytest.mark.timeout(120)


def _ring_with_spare(spare_sent_before: bool = False) -> TraceBuilder:
    """Ranks 0-2 a ring (each isends right, then irecvs from its left), rank 3 a spare that only joins the
    world all_reduce after it; rank 0's irecv names rank 3 instead of rank 2."""
    b = TraceBuilder(4, groups={"world": [0, 1, 2, 3]})
    alive(b, range(4))
    if spare_sent_before:       # the spare exchanged with rank 0 before: then it may only be late
        b.p2p(3, "send", peer=0, seq=1, start=0.5, end=0.6, call_site="ring.py:9")
        b.p2p(0, "recv", peer=3, seq=1, start=0.5, end=0.6, call_site="ring.py:9")
    for r in range(3):
        b.p2p(r, "isend", peer=(r + 1) % 3, seq=1, start=1.0, end=None if r == 2 else 1.1, call_site="ring.py:20")
    b.p2p(0, "irecv", peer=3, seq=2 if spare_sent_before else 1, start=1.0, call_site="ring.py:21")
    b.p2p(1, "irecv", peer=0, seq=1, start=1.0, end=1.1, call_site="ring.py:21")
    b.p2p(2, "irecv", peer=1, seq=1, start=1.0, end=1.1, call_site="ring.py:21")
    b.collective(1, "world", 1, start=1.2)
    b.collective(2, "world", 1, start=1.2)
    b.collective(3, "world", 1, start=1.0)
    return b


def test_a_recv_from_a_rank_that_never_exchanges_with_it_is_the_departure() -> None:
    d = diagnose(_ring_with_spare().build())
    h = headline(d)
    assert (h.kind, h.ranks) == ("unmatched_p2p", [0]), d.verdict
    assert h.cause.departure is not None and h.cause.departure.went_op == "irecv from rank 3"
    assert h.data["call_site"] == "ring.py:21"
    assert "rank 0 posted irecv from rank 3 at ring.py:21, a rank that never sends to or receives from it" \
        in d.verdict


def test_silent_when_the_named_peer_exchanges_with_the_rank_elsewhere() -> None:
    """The peer sent to the rank before: its send may only be late (a skip), nothing says the recv is wrong."""
    d = diagnose(_ring_with_spare(spare_sent_before=True).build())
    assert not any(f.kind == "unmatched_p2p" and f.cause.departure is not None
                   and "never sends to or receives from it" in f.title for f in d.findings), d.verdict


def test_a_send_to_a_rank_that_never_exchanges_with_it_is_the_departure() -> None:
    """The mirror: rank 1 sends to the spare (rank 2) while rank 0 waits in its recv from rank 1."""
    b = TraceBuilder(3, groups={"world": [0, 1, 2]})
    alive(b, range(3))
    b.p2p(0, "recv", peer=1, seq=1, start=1.0, call_site="pipe.py:30")
    b.p2p(1, "send", peer=2, seq=1, start=1.0, call_site="pipe.py:31")
    b.collective(2, "world", 1, start=1.0)
    d = diagnose(b.build())
    h = headline(d)
    assert (h.kind, h.ranks) == ("unmatched_p2p", [1]), d.verdict
    assert h.cause.departure is not None and h.cause.departure.went_op == "send to rank 2"


def _grid_edge(exchanged_before: bool = False, other_absent: bool = False) -> TraceBuilder:
    """Ranks 0 and 1 exchange (matched), rank 2 sends "east" to rank 3, which exchanges with no one and waits
    in the world all_reduce with ranks 0 and 1 (hand_programs/grid_halo_east_bound.py, in small)."""
    b = TraceBuilder(4, groups={"world": [0, 1, 2, 3]})
    alive(b, range(4))
    if exchanged_before:        # rank 3 sent to rank 2 before: it may have skipped its side now
        b.p2p(3, "send", peer=2, seq=1, start=0.5, end=0.6, call_site="halo.py:9")
        b.p2p(2, "recv", peer=3, seq=1, start=0.5, end=0.6, call_site="halo.py:9")
    b.p2p(0, "isend", peer=1, seq=1, start=1.0, end=1.1, call_site="halo.py:20")
    b.p2p(1, "irecv", peer=0, seq=1, start=1.0, end=1.1, call_site="halo.py:21")
    b.p2p(2, "isend", peer=3, seq=1, start=1.0, call_site="halo.py:20")
    for r in (0, 1, 3) if not other_absent else (0, 3):
        b.collective(r, "world", 1, start=1.2)
    return b


def test_a_send_to_a_rank_that_never_exchanges_with_it_and_went_on_is_the_posters_departure() -> None:
    d = diagnose(_grid_edge().build())
    h = headline(d)
    assert (h.kind, h.ranks) == ("unmatched_p2p", [2]), d.verdict
    assert h.cause.departure is not None and h.cause.departure.went_op == "isend to rank 3"
    assert h.data["call_site"] == "halo.py:20"
    assert "rank 3 finished its own exchanges and waits in all_reduce #1" in d.verdict


@pytest.mark.parametrize("variant", ["exchanged_before", "other_absent"])
def test_the_poster_is_not_blamed_where_the_peer_knew_it_or_others_hold_the_collective_up(variant) -> None:
    d = diagnose(_grid_edge(**{variant: True}).build())
    assert not any("finished its own exchanges" in f.title for f in d.findings), d.verdict
