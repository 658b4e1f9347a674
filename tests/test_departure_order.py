"""A rank that left its loop skipped several ops: the first one it failed to post is the first deviation.

Seed 20261217 #67 (tests/data/randprog, its run directory as written): 4 ranks on a (fsdp 2, dp 2) mesh;
rank 3's data shard is a batch short, so it leaves the loop (line 42) after five iterations and goes to the
barrier after it. Its peers' sixth iteration issues the loop's barrier (line 43, which rank 3's barrier after
the loop matches), the fsdp all_reduce (line 45, through a helper) and later a ring send/recv (line 55).
Rank 1 waits in the all_reduce, rank 0 in its recv from rank 3. Both the hang ("finished without posting
all_reduce #31 ... it left that loop early") and the unmatched p2p ("departed from its loop in iteration 6 ... never
the send to rank 0") name rank 3; the p2p took the headline though the all_reduce came first in the loop.
"""
from __future__ import annotations

from pathlib import Path

from ncclscope.findings import CauseBasis, Departure
from ncclscope.load.trace import load
from ncclscope.verdict.diagnose import diagnose

RUN = Path(__file__).parent / "data" / "randprog" / "rp20261217_067_uneven_loop"


def test_the_collective_skipped_before_the_send_is_the_headline_not_the_send(monkeypatch) -> None:
    # the trace names the script where it ran (an absolute path under the benchmark's scratch folder); its copy
    # is kept beside the run directory: read the loops there, wherever this checkout is
    from ncclscope.index import source_loops
    resolve = source_loops._resolve
    script = str(RUN / "program.py")
    monkeypatch.setattr(source_loops, "_resolve", lambda path, cwds: script if path.endswith(
        "rp20261217_067_uneven_loop.py") else resolve(path, cwds))
    d = diagnose(load(RUN))
    h = d.headline
    assert h is not None and (h.kind, h.ranks) == ("hang", [3]), d.verdict
    assert "all_reduce #31" in d.verdict and "left that loop early" in d.verdict, d.verdict
    assert ".py:42" in d.verdict, d.verdict                       # the loop it left
    p2p = [f for f in d.findings if f.kind == "unmatched_p2p" and f.cause.departure is not None]
    assert p2p and all(f.role.value == "supporting" for f in p2p), [(f.kind, f.role) for f in d.findings]
    dep = p2p[0].cause.departure
    assert dep.skipped_first.startswith("all_reduce at ") and ":45" in dep.skipped_first, dep


def test_skipped_first_is_written_only_when_there_is_one() -> None:
    plain = Departure(5, "a.py:55", "a.py:72", "barrier", 0, CauseBasis.LOOP)
    assert "skipped_first" not in plain.to_json()
    with_skip = Departure(5, "a.py:55", "a.py:72", "barrier", 0, CauseBasis.LOOP, skipped_first="all_reduce at a.py:45")
    assert with_skip.to_json()["skipped_first"] == "all_reduce at a.py:45"
