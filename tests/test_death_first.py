"""A rank that died without a dump before anything could time out comes before the idle ranks that may wait on
it in a send/recv gloo does not record (hang/death_first.py).

Seed 20261218 #262 (tests/data/randprog, the dumps as written): 4 ranks on a (pp 2, outer 2) mesh; rank 1
raises in step 3's compute and leaves no dump. Ranks 0 and 2 wait in the ring's recv from it (unrecorded),
rank 3 in a reduce_scatter with rank 2; the launcher stops them all 1.4 s later and they dump then. The
wait-for graph saw rank 3 wait on rank 2, idle: HANG on rank 2, and rank 1's death a warning nobody waited on.
"""
from __future__ import annotations

from ncclscope.load.foreign.flight_recorder import load_flight_recorder
from ncclscope.verdict import run

from randprog_data import timed_dumps

CASE = "rp20261218_262_exception_fr"


def test_the_death_before_any_timeout_is_the_root_and_the_idle_rank_its_consequence(tmp_path) -> None:
    a = run(load_flight_recorder(timed_dumps(CASE, tmp_path)))
    h = a.headline
    assert h is not None and (h.kind, h.ranks) == ("dead_rank", [1]), a.verdict
    assert "ended before any collective could time out" in a.verdict and "rank 2 sat outside" in a.verdict, a.verdict
    assert h.data["died_first"] and h.data["idle_ranks"] == [2]


def test_when_the_dumps_came_after_a_timeout_the_death_may_be_its_consequence(tmp_path) -> None:
    """The same dumps written 20 s after each rank's last op, past the ranks' 12 s collective timeout: the
    death may then be a timeout's (a rank that waited on the idle one), and nothing says it came first."""
    a = run(load_flight_recorder(timed_dumps(CASE, tmp_path, {0: 20.0, 2: 20.0, 3: 20.0})))
    h = a.headline
    assert h is not None and h.kind != "dead_rank", a.verdict
    assert any(f.kind == "dead_rank" and f.severity.value == "warning" for f in a.findings), a.verdict
