"""A rank stuck inside process-group creation is held by the groups' creation, not computing.

Seed 20261214 #82 (its run directory, samples and Flight Recorder snapshots left out, event streams
re-encoded as one Arrow batch each): 6 ranks, a (row 3, rep 2) mesh built with `new_group`, rank 5 builds
the rep groups before the row groups. Rank 1's last stack dump has it on the `new_group` line, rank 0 waits
on it in the rep group's first reduce_scatter_tensor; the rank that created its groups in another order is
not among the ranks that wait-for edge involves. The verdict read STUCK IN COMPUTE on rank 1 (twice in
seed 20261214, once in each of seeds 20261210 and 20261213); the group-creation disagreement is the root.
"""
from __future__ import annotations

from types import SimpleNamespace

from ncclscope.findings import Evidence, Finding
from ncclscope.hang.group_order import in_group_creation
from ncclscope.load.trace import load
from ncclscope.verdict.diagnose import diagnose
from randprog_data import DATA

RUN = DATA / "rp20261214_082_group_order"


def test_the_creation_order_heads_a_rank_stuck_in_new_group() -> None:
    d = diagnose(load(RUN))
    assert (d.headline.kind, d.headline.ranks) == ("group_mismatch", [5]), d.verdict
    assert d.verdict.startswith("GROUP MISMATCH: rank 5 disagrees on the members of 5 groups"), d.verdict
    stuck = [f for f in d.findings if f.kind == "stuck_in_compute"]
    assert stuck and all(f.role != "headline" for f in stuck)


def _trace(stacks: dict[int, str], sites: dict[int, dict[str, str]]) -> SimpleNamespace:
    ranks = {r: SimpleNamespace(group_sites=s, clock_offset_ns=0) for r, s in sites.items()}
    return SimpleNamespace(stacks=stacks, ranks=ranks)


def _dump(line: int) -> str:
    return ("=== ncclscope rank 1: SIGTERM at 5000000000 ns ===\n"
            "Thread 0x00007f (most recent call first):\n"
            '  File "/usr/lib/python3/site-packages/torch/distributed/distributed_c10d.py", line 10 in new_group\n'
            f'  File "/home/u/train.py", line {line} in main\n')


def test_only_a_stack_on_a_group_creation_line_counts() -> None:
    sites = {0: {"g1": "/home/u/train.py:31 < /home/u/train.py:80"}, 1: {}}
    ev = [Evidence(rank=1, note="last op: none")]
    stuck = Finding(kind="stuck_in_compute", severity="error", title="t", ranks=[1], evidence=ev)
    assert in_group_creation(_trace({1: _dump(31)}, sites), [stuck]) == {1}
    assert in_group_creation(_trace({1: _dump(44)}, sites), [stuck]) == set()     # computing elsewhere
    assert in_group_creation(_trace({}, sites), [stuck]) == set()                 # no stack: nothing said
    hang = Finding(kind="hang", severity="error", title="t", ranks=[1], evidence=ev)
    assert in_group_creation(_trace({1: _dump(31)}, sites), [hang]) == set()
