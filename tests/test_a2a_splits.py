"""all_to_all_single split lists, and all_to_all tensor lists, that do not pair up (hang/a2a.py), on hand-built
traces, and the tracer's encoding of them (runtime/usertrace/opspec.a2a_splits, a2a_list_splits)."""
from __future__ import annotations

from trace_builder import TraceBuilder

from ncclscope.hang.a2a import parse_splits
from ncclscope.verdict.diagnose import diagnose


def _job(splits: dict[int, tuple[list[int], list[int]]], hang: bool = True, op: str = "all_to_all_single"):
    """4 ranks: two consistent exchanges, then #3 with the given lists (every member posts it)."""
    b = TraceBuilder(4, groups={"ep": [0, 1, 2, 3]})
    for r in range(4):
        b.heartbeats(r, 0.0, 10.0)
        for k in (1, 2):   # uneven but consistent: rank i sends i+j+1 rows to j, j expects that from i
            send = [r + j + 1 for j in range(4)]
            sz = f"[[{sum(send)},8]] splits [{','.join(map(str, send))}]->[{','.join(map(str, send))}]"
            b.collective(r, "ep", k, op=op, start=float(k), end=k + 0.1, sizes=sz,
                         call_site="moe.py:40", step=k)
        a, e = splits[r]
        b.collective(r, "ep", 3, op=op, start=3.0, end=None if hang else 3.1,
                     sizes=f"[[{sum(a)},8]] splits [{','.join(map(str, a))}]->[{','.join(map(str, e))}]",
                     call_site="moe.py:40", step=3)
    return b.build()


def test_parse_splits():
    assert parse_splits("[[8,4]] splits [3,1,2,2]->[2,2,2,2]") == ([3, 1, 2, 2], [2, 2, 2, 2])
    assert parse_splits("[[8,4]]") is None
    assert parse_splits("[[0]] splits []->[]") is None


def test_uneven_but_consistent_exchanges_are_no_finding():
    even = {r: ([2, 2, 2, 2], [2, 2, 2, 2]) for r in range(4)}
    d = diagnose(_job(even, hang=False))
    assert d.ok, d.verdict


def test_the_rank_whose_sends_no_peer_expects_is_named():
    lists = {r: ([2, 2, 2, 2], [2, 2, 2, 2]) for r in range(4)}
    lists[2] = ([2, 2, 1, 3], [2, 2, 2, 2])            # rank 2 sends 1 to itself and 3 to rank 3
    d = diagnose(_job(lists))
    h = d.findings[0]
    assert (h.kind, h.ranks) == ("collective_mismatch", [2]), d.verdict
    assert "sends [2,2,1,3] rows to ranks 0-3 where they expect [2,2,2,2] from it" in h.title
    assert "moe.py:40" in h.title and not h.cause.ambiguous


def test_a_receiver_that_expects_the_wrong_rows_is_named():
    lists = {r: ([2, 2, 2, 2], [2, 2, 2, 2]) for r in range(4)}
    lists[0] = ([2, 2, 2, 2], [2, 3, 1, 2])            # rank 0 expects 3 from rank 1 and 1 from rank 2
    d = diagnose(_job(lists))
    h = d.findings[0]
    assert (h.kind, h.ranks) == ("collective_mismatch", [0]), d.verdict
    assert "expects [2,3,1,2] rows from ranks 0-3 where they send [2,2,2,2] to it" in h.title


def test_two_ranks_that_disagree_only_with_each_other_are_ambiguous():
    """1 sends 1 row to 3, which expects 2 from it: either list may be the wrong one."""
    lists = {r: ([2, 2, 2, 2], [2, 2, 2, 2]) for r in range(4)}
    lists[1] = ([2, 2, 3, 1], [2, 2, 2, 2])            # 1->2 is 3 rows, 1->3 is 1 row
    lists[2] = ([2, 2, 2, 2], [2, 3, 2, 2])            # 2 expects 3 from 1: that pair matches
    d = diagnose(_job(lists))
    h = d.findings[0]
    assert h.kind == "collective_mismatch" and h.ranks == [1], d.verdict   # the lowest, said to be a guess
    assert h.cause.ambiguous and "ambiguous" in h.title


def test_tracer_encoding_round_trips():
    import pytest
    torch = pytest.importorskip("torch")
    from ncclscope.runtime.usertrace.opspec import a2a_splits
    inp, out = torch.ones(8, 3), torch.ones(8, 3)
    assert parse_splits(a2a_splits(inp, out, [3, 1, 2, 2], None, 4)) == ([3, 1, 2, 2], [2, 2, 2, 2])
    assert parse_splits(a2a_splits(inp, out, None, None, 4)) == ([2, 2, 2, 2], [2, 2, 2, 2])
    assert a2a_splits(torch.ones(7), out, None, None, 4) == ""        # no even split: unknown, not guessed


def test_the_list_form_is_checked_the_same_way():
    """all_to_all(output_tensor_list, input_tensor_list): a rank whose buffers are sized by a capacity of its own
    (2 rows where its peers use 3) breaks every pair it is in; its own sizes alone look like MoE's legit ones."""
    lists = {r: ([3, 3, 3, 3], [3, 3, 3, 3]) for r in range(4)}
    lists[3] = ([2, 2, 2, 2], [2, 2, 2, 2])
    d = diagnose(_job(lists, op="all_to_all"))
    h = d.findings[0]
    assert (h.kind, h.ranks) == ("collective_mismatch", [3]), d.verdict
    assert "all_to_all" in h.title and not h.cause.ambiguous
    even = {r: ([3, 3, 3, 3], [3, 3, 3, 3]) for r in range(4)}
    assert diagnose(_job(even, hang=False, op="all_to_all")).ok


def test_tracer_encoding_of_the_list_form():
    import pytest
    torch = pytest.importorskip("torch")
    from ncclscope.runtime.usertrace.opspec import a2a_list_splits
    inp = [torch.ones(2, 8), torch.ones(3, 8), torch.ones(1, 8), torch.ones(())]
    out = [torch.ones(2, 8)] * 4
    assert parse_splits(a2a_list_splits(inp, out, 4)) == ([2, 3, 1, 1], [2, 2, 2, 2])
    assert a2a_list_splits(inp[:3], out, 4) == ""                     # not one tensor per member: unknown
    assert a2a_list_splits(inp, None, 4) == ""
