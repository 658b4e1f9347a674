"""A send and its recv that disagree on size: the side that changed against its own history
(analysis/p2p_sizes.py), with the receiver's gloo abort as its consequence."""
from __future__ import annotations

from ncclscope.verdict import run
from trace_builder import TraceBuilder


def _pair(send_sizes: list[str], recv_sizes: list[str], abort: bool) -> TraceBuilder:
    """Rank 1 sends to rank 0 (pp.py:9 -> pp.py:5) once per step; with `abort`, rank 0 dies (SIGABRT)
    inside its last recv, as gloo aborts a receiver whose buffer is too small."""
    b = TraceBuilder(2, groups={"world": [0, 1]})
    n = len(send_sizes)
    for k in range(1, n + 1):
        last = k == n
        t = float(k)
        b.p2p(1, "send", 0, k, start=t, end=t + 0.01, sizes=send_sizes[k - 1], call_site="pp.py:9", step=k)
        b.p2p(0, "recv", 1, k, start=t, end=None if (abort and last) else t + 0.01, sizes=recv_sizes[k - 1],
              call_site="pp.py:5", step=k, status="inflight" if (abort and last) else "ok")
    b.collective(1, "world", 1, start=n + 0.5, end=None, call_site="pp.py:12", step=n)
    for r in (0, 1):
        b.heartbeats(r, 0.0, n + 0.2 if (abort and r == 0) else n + 3.0)
    if abort:
        b.rank_state(0, signal="SIGABRT")
    return b


def test_the_sender_that_changed_its_size_is_the_root_and_the_abort_its_consequence():
    a = run(_pair(["[[16]]"] * 3 + ["[[24]]"], ["[[16]]"] * 4, abort=True).build())
    assert a.root_ranks == [1], a.verdict
    assert a.verdict.startswith("MISMATCH: rank 1 deviates in send #4 to rank 0: passed sizes [[24]] where its own "
                                "earlier sends to rank 0 from that line passed [[16]], and rank 0's recv #4 from it "
                                "expects [[16]] (its call at pp.py:9); then rank 0 was killed (SIGABRT)"), a.verdict


def test_sizes_that_always_differ_are_the_program_not_a_change():
    a = run(_pair(["[[16]]"] * 4, ["[[24]]"] * 4, abort=False).build())
    assert not [f for f in a.findings if f.cause.p2p_pair], a.verdict
