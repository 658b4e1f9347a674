"""`ncclscope run`'s clock offsets through the job's c10d store (runtime/usertrace/clock.py):
the exchange on an in-process store with a skewed clock, its deadline when rank 0 never
answers, and two spawned gloo ranks whose tracer writes the offset into rank.json."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import sys
import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from ncclscope.runtime.usertrace.clock import ClockSync  # noqa: E402

SKEW_NS = 5_000_000_000   # rank 1's clock runs 5 s ahead of rank 0's


def _exchange(store, world: int, clocks: dict, **kw) -> dict:
    results: dict[int, dict] = {}
    syncs = [ClockSync(store, r, world, lambda res, r=r: results.__setitem__(r, res), host=f"h{r}",
                       clock=clocks.get(r, time.time_ns), **kw).start() for r in range(world)]
    for s in syncs:
        s.thread.join(timeout=10)
        assert not s.thread.is_alive()
    return results


def test_offset_to_rank0_is_measured_within_its_uncertainty():
    res = _exchange(dist.HashStore(), 3, {1: lambda: time.time_ns() + SKEW_NS, 2: lambda: time.time_ns() - 7})
    assert res[0]["clock_sync"]["role"] == "reference" and res[0]["clock_offset_ns"] == 0
    r1 = res[1]
    assert r1["clock_sync"]["method"] == "store" and r1["clock_sync"]["rounds"] == 5
    assert abs(r1["clock_offset_ns"] + SKEW_NS) <= r1["clock_uncertainty_ns"] + 1_000_000
    assert 0 < r1["clock_uncertainty_ns"] < 100_000_000
    assert abs(res[2]["clock_offset_ns"] - 7) <= res[2]["clock_uncertainty_ns"] + 1_000_000


def test_a_rank_on_rank0s_host_needs_no_exchange():
    store = dist.HashStore()
    results: dict[int, dict] = {}
    syncs = [ClockSync(store, r, 2, lambda res, r=r: results.__setitem__(r, res), host="same").start()
             for r in range(2)]
    for s in syncs:
        s.thread.join(timeout=10)
    assert results[1]["clock_sync"]["method"] == "same-host" and results[1]["clock_offset_ns"] == 0
    assert results[0]["clock_sync"]["seconds"] < 2   # rank 0 stopped when every rank said done


def test_no_answer_gives_up_at_the_deadline_without_raising(capsys):
    store = dist.HashStore()
    store.set("ncclscope/clock/host", "elsewhere")   # rank 0 published, then never answers
    got: list[dict] = []
    t0 = time.monotonic()
    s = ClockSync(store, 1, 2, got.append, host="here", deadline_s=0.3).start()
    s.thread.join(timeout=5)
    assert time.monotonic() - t0 < 2 and got[0]["clock_sync"]["method"] == "none"
    assert got[0]["clock_offset_ns"] == 0 and "no answer" in capsys.readouterr().err


def test_a_broken_store_costs_only_the_offset(capsys):
    class Broken:
        def __getattr__(self, name):
            raise RuntimeError("store gone")
    got: list[dict] = []
    s = ClockSync(Broken(), 1, 2, got.append, host="x").start()
    s.thread.join(timeout=5)
    assert got[0]["clock_sync"]["method"] == "none" and "store gone" in capsys.readouterr().err


# ---- two spawned gloo ranks, the tracer's own path (init_process_group wrapper -> rank.json) ----
def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    import datetime

    import torch
    import torch.distributed as dist

    from ncclscope.runtime.recorder import Recorder
    from ncclscope.runtime.usertrace import clock
    from ncclscope.runtime.usertrace.tracer import Tracer
    torch.set_num_threads(1)
    if rank == 1:   # as if on another host, 5 s ahead: the exchange runs and must find the skew
        orig = clock.ClockSync.__init__

        def skewed(self, *a, **kw):
            orig(self, *a, **{**kw, "host": "other-host", "clock": lambda: time.time_ns() + SKEW_NS})
        clock.ClockSync.__init__ = skewed
    rec = Recorder(out, rank, 2)
    rec.context.step = 0
    tracer = Tracer(rec, rank, 2, timeout_s=30).install()
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=30))
    assert tracer.wait_clock(10)
    t = torch.ones(2)
    dist.all_reduce(t)   # the script's next op writes the pending rank.json fields
    seq = dist.distributed_c10d._get_default_group()._get_sequence_number_for_group()
    rec.write_meta(seq_after=int(seq))
    dist.destroy_process_group()
    tracer.close()
    rec.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_ranks(port: int, out: str) -> int:
    """Rank 0 and rank 1 as fresh processes forked from the caller (the suite's warm zygote: torch is
    imported already, no process group, no tracer); each joined within 90 s, killed past it. Prints
    their exit codes; 0 when both exited 0."""
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_rank, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(timeout=90)
        codes = [p.exitcode for p in procs]
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    print(json.dumps(codes))
    return 0 if codes == [0, 0] else 1


@pytest.mark.spawn
def test_two_gloo_ranks_record_the_offset_through_the_store_without_any_op_on_the_job(tmp_path, zygote):
    # the two ranks are forked by a fork of the suite's warm zygote (conftest), in its own session, killed
    # whole past the timeout and reaped: two fresh interpreters importing torch cost ~10 s here
    res = zygote.call("run-clock", "test_run_clock:_two_ranks", [_free_port(), str(tmp_path)], timeout=200)
    assert res.returncode == 0 and res.stdout.strip() == "[0, 0]", (res.returncode, res.stdout, res.stderr[-3000:])
    metas = [json.loads((tmp_path / f"rank-{r:05d}" / "rank.json").read_text()) for r in range(2)]
    assert metas[0]["clock_offset_ns"] == 0 and metas[0]["clock_sync"]["role"] == "reference"
    m1 = metas[1]
    assert m1["clock_sync"]["method"] == "store", m1.get("clock_sync")
    assert abs(m1["clock_offset_ns"] + SKEW_NS) <= m1["clock_uncertainty_ns"] + 5_000_000
    # no op of ours on the job's group: its counter saw the script's one all_reduce only
    assert [m["seq_after"] for m in metas] == [1, 1]
    from ncclscope.load.trace import load
    t = load(tmp_path)
    assert t.ranks[1].clock_offset_ns == m1["clock_offset_ns"]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
