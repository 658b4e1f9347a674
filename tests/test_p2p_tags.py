"""A send/recv pair kept apart only by their tags (analysis/p2p_tags.py): the side whose tag left its
own history is the root, not a deadlock between the two."""
from __future__ import annotations

import pytest
from trace_builder import TraceBuilder

from ncclscope.verdict.diagnose import diagnose


def _pair(recv_tags: list[int], send_tags: list[int]):
    b = TraceBuilder(2, groups={"world": [0, 1]})
    for r in (0, 1):
        b.heartbeats(r, 0.0, 10.0)
    n = len(send_tags)
    for k in range(1, n + 1):
        last = k == n
        b.p2p(0, "send", peer=1, seq=k, start=float(k), end=None if last else k + 0.1, tag=send_tags[k - 1],
              status="timeout" if last else "ok", call_site="job.py:8", step=k)
        b.p2p(1, "recv", peer=0, seq=k, start=float(k), end=None if last else k + 0.1, tag=recv_tags[k - 1],
              status="timeout" if last else "ok", call_site="job.py:10", step=k)
    return diagnose(b.build())


def test_the_receiver_that_changed_its_tag_is_the_root():
    d = _pair(recv_tags=[1, 1, 2], send_tags=[1, 1, 1])
    h = d.findings[0]
    assert (h.kind, h.ranks) == ("unmatched_p2p", [1]), d.verdict
    assert d.verdict.startswith("UNMATCHED P2P: rank 1 posted recv #3 from rank 0 with tag 2 where rank 0's send "
                                "#3 to it has tag 1; its own 2 earlier recvs from rank 0 from that line used tag 1 "
                                "(its call at job.py:10)"), d.verdict


def test_the_sender_that_changed_its_tag_is_the_root():
    d = _pair(recv_tags=[5, 5, 5], send_tags=[5, 5, 7])
    assert (d.findings[0].kind, d.findings[0].ranks) == ("unmatched_p2p", [0]), d.verdict


@pytest.mark.parametrize("recv,send", [([1, 2], [1, 1]),            # one earlier call: too little history
                                       ([1, 2, 3], [1, 1, 4])])     # both sides changed
def test_no_history_verdict_leaves_the_deadlock(recv, send):
    d = _pair(recv_tags=recv, send_tags=send)
    assert not any(f.cause.tag_deviant for f in d.findings), d.verdict
    assert d.findings[0].kind == "deadlock" and d.findings[0].ranks == [0, 1], d.verdict
