"""The tracer's lean wrapper (runtime/usertrace/hotpath.py) writes the rows the general one writes.

all_reduce and its one-tensor kin are wrapped twice at install: the lean wrapper
torch.distributed gets, and the general one it hands unusual calls to. Here both
are called from one line, in every argument form a script uses, on a one-rank
gloo world, and their rows compared field by field (the op id, the time and the
sequence number, which move by one per call, apart)."""
from __future__ import annotations

import datetime
import sys

import pytest

from ncclscope import schema as S

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402


def _rows(rec) -> list[dict]:
    """Begin/end rows the recorder was given since the last `rec.seen.clear()` (heartbeats and markers left out)."""
    cols = S.EVENT_COLUMNS
    return [dict(zip(cols, r)) for r in rec.seen if r[cols.index("phase")] != S.PHASE_INSTANT]


@pytest.fixture()
def world(tmp_path):
    from ncclscope.runtime.recorder import Recorder
    from ncclscope.runtime.usertrace.tracer import Tracer
    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    rec = Recorder(tmp_path, 0, 1)
    rec.context.step = 0
    rec.seen = []
    append = rec._append

    def seen(row):   # every row begin/end/instant write, flushed or not
        rec.seen.append(row)
        append(row)
    rec._append = seen
    tracer = Tracer(rec, 0, 1, timeout_s=30, clock_sync=False).install()
    try:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1,
                                timeout=datetime.timedelta(seconds=30))
        yield rec, tracer
        dist.destroy_process_group()
    finally:
        tracer.close()
        rec.close()


def test_the_lean_and_the_general_wrapper_write_the_same_rows(world):
    rec, tracer = world
    fast = dist.all_reduce
    general = fast.__ncclscope_general__
    assert fast is not general and getattr(dist.broadcast, "__ncclscope_general__", None) is None
    sub = dist.new_group([0])
    t, t64 = torch.ones(4), torch.ones(2, 3, dtype=torch.float64)
    forms = [((t,), {}), ((t, dist.ReduceOp.MAX), {}), ((t,), {"op": dist.ReduceOp.MIN}),
             ((), {"tensor": t, "group": sub}), ((t, dist.ReduceOp.PRODUCT, None, False), {}), ((t64,), {"group": sub}),
             ((t,), {"async_op": True}), ((t,), {"group": sub, "async_op": True, "op": dist.ReduceOp.SUM})]
    for args, kwargs in forms:
        rec.seen.clear()
        for fn in (fast, general):
            out = fn(*args, **kwargs); line = sys._getframe().f_lineno   # noqa: E702  (one line: one call site)
            if out is not None:
                out.wait()
        rows = _rows(rec)
        assert [r["phase"] for r in rows] == ["begin", "end", "begin", "end"], (args, kwargs, rows)
        a, b = rows[:2], rows[2:]
        assert b[0]["collective_seq_id"] == a[0]["collective_seq_id"] + 1
        assert a[0]["call_site"] == f"tests/test_run_hotpath.py:{line}"
        for x, y in zip(a, b):
            for k in ("op_id", "time_ns", "collective_seq_id"):
                x.pop(k), y.pop(k)
            assert x == y, (args, kwargs)


def test_the_lean_wrapper_hands_on_what_it_does_not_cover(world):
    """A group made behind the tracer's back is registered (by the general wrapper), a non-tensor
    argument is the user's error, unchanged, and a call from inside a traced call passes through."""
    rec, tracer = world
    import torch.distributed.distributed_c10d as c10d
    orig_new_group = tracer._orig[(c10d, "new_group")]
    hidden = orig_new_group([0])                     # not through the tracer: unknown to it
    t = torch.ones(4)
    rec.seen.clear()
    dist.all_reduce(t, group=hidden)
    with pytest.raises((TypeError, AttributeError, RuntimeError, ValueError)):
        dist.all_reduce("not a tensor")
    dist.all_gather_object([None], {"a": 1})         # its inner all_gather writes no row of its own
    rows = _rows(rec)
    begins = [r for r in rows if r["phase"] == S.PHASE_BEGIN]
    assert [(r["op_name"], r["process_group"]) for r in begins] == [
        ("all_reduce", f"pg{hidden.group_name}"), ("all_reduce", "world"), ("all_gather_object", "world")]
    assert begins[1]["bytes"] == -1 and begins[1]["input_sizes"] == "[]"
    ends = [r["status"] for r in rows if r["phase"] == S.PHASE_END]
    assert ends == [S.STATUS_OK, S.STATUS_ERROR, S.STATUS_OK]
    assert all(r["call_site"].startswith("tests/test_run_hotpath.py:") for r in begins)
