"""A rank that died of its own timeout is a consequence of what it waited on, not a root to headline.

Seed 20261218 #2 (tests/data/randprog, its run directory as written, less the NVML samples): 8 ranks on a
(inner 2, sp 4) mesh; rank 5 skips its broadcast_object_list on sp1 at step 2 (line 50). Ranks 4, 6 and 7
entered it; the source (6) and rank 7 wait in it, rank 4 finished it and went on to step 3, where it timed
out after 12 s in DDP's all_reduce ("Timed out waiting 12000ms for recv") and died; the launcher then killed
the rest. Four ranks waited on the dead rank 4, three on rank 5, and the roots were ranked by their waiters:
DEAD RANK on rank 4, the skip second.
"""
from __future__ import annotations

from pathlib import Path

import pandas as pd

from ncclscope.findings import Evidence, Finding
from ncclscope.hang.waitfor import timeouts_last
from ncclscope.hang.wording import timed_out_ranks
from ncclscope.load.trace import load
from ncclscope.verdict.diagnose import diagnose

RUN = Path(__file__).parent / "data" / "randprog" / "rp20261218_002_skip"


def test_the_skip_comes_before_the_death_by_timeout_it_led_to() -> None:
    d = diagnose(load(RUN))
    h = d.headline
    assert h is not None and (h.kind, h.ranks) == ("hang", [5]), d.verdict
    assert "never posted broadcast_object_list #5" in d.verdict and ".py:50" in d.verdict, d.verdict
    dead4 = [f for f in d.findings if f.kind == "dead_rank" and f.ranks == [4]]
    assert dead4 and "Timed out" in dead4[0].title, [f.title for f in d.findings]


def _states(msgs: dict[int, str]) -> pd.DataFrame:
    return pd.DataFrame({"end_message": list(msgs.values())}, index=pd.Index(list(msgs), name="rank"))


def test_only_deaths_whose_every_rank_timed_out_move_and_only_behind_roots_that_are_not_deaths() -> None:
    st = _states({0: "RuntimeError: Timed out waiting 12000ms for recv operation to complete",
                  1: "killed (SIGTERM)", 2: "", 3: "Watchdog caught collective operation timeout"})
    assert timed_out_ranks(st) == {0, 3}
    tdead = Finding(kind="dead_rank", severity="error", title="0", ranks=[0], evidence=[Evidence(rank=0, note="died")])
    both = Finding(kind="dead_rank", severity="error", title="0,1", ranks=[0, 1], evidence=[Evidence(rank=0, note="died")])
    killed = Finding(kind="dead_rank", severity="error", title="1", ranks=[1], evidence=[Evidence(rank=1, note="killed")])
    hang = Finding(kind="hang", severity="error", title="2", ranks=[2], evidence=[Evidence(rank=2, note="idle")])
    ctx = type("Ctx", (), {"st": st})()
    assert [f.title for f in timeouts_last(ctx, [tdead, both, hang, killed])] == ["0,1", "2", "1", "0"]
    # every root a death: the order is kept, whoever timed out
    assert [f.title for f in timeouts_last(ctx, [tdead, killed])] == ["0", "1"]
    assert timed_out_ranks(pd.DataFrame(index=pd.Index([0], name="rank"))) == set()
