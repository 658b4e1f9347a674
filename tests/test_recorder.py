"""The recorder's crash-safety contract: what was flushed before a SIGKILL is read back."""
from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import time
from pathlib import Path

import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ncclscope import schema as S
from ncclscope.trace import load, read_stream

pytestmark = pytest.mark.timeout(120)


def _writer(run_dir: str, conn) -> None:
    """Child: record ops as fast as it can, flush often, report each flushed count."""
    from ncclscope.runtime.recorder import Recorder
    rec = Recorder(run_dir, 0, 1, flush_interval_s=0.05)
    i = 0
    while True:
        op = rec.begin("collective", "all_reduce", group="dp0", seq=i + 1, nbytes=64, dtype="float32",
                       sizes="[[16]]")
        rec.end(op)
        i += 1
        if i % 50 == 0:
            rec.flush()
            conn.send(rec.events.written)


@pytest.mark.parametrize("seed", range(6))
def test_sigkill_keeps_every_flushed_batch(tmp_path: Path, seed: int) -> None:
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_writer, args=(str(tmp_path), child))
    p.start()
    time.sleep(0.3 + random.Random(seed).random() * 0.7)    # a random moment
    os.kill(p.pid, signal.SIGKILL)
    p.join(10)
    assert p.exitcode == -signal.SIGKILL
    flushed = 0
    while parent.poll():
        flushed = parent.recv()
    assert flushed > 0
    warnings: list[str] = []
    table = read_stream(tmp_path / "rank-00000" / S.EVENTS_FILE, S.EVENTS_SCHEMA, warnings)
    assert table.num_rows >= flushed
    begins = table.filter(pa.compute.equal(table["phase"], "begin"))
    ids = begins["op_id"].to_pylist()
    assert ids == list(range(len(ids)))          # nothing lost in the middle
    # and the whole run directory still loads
    trace = load(tmp_path)
    assert len(trace.ops) >= flushed // 2


def _write_events(path: Path, n_batches: int, rows_per_batch: int = 10) -> int:
    with open(path, "wb") as f, pa.ipc.new_stream(f, S.EVENTS_SCHEMA) as w:
        op = 0
        for _ in range(n_batches):
            cols = {name: [] for name in S.EVENT_COLUMNS}
            for _ in range(rows_per_batch):
                for name, typ in S.EVENT_FIELDS:
                    cols[name].append("" if pa.types.is_string(typ) else -1)
                cols["rank"][-1], cols["op_id"][-1], cols["phase"][-1] = 0, op, "begin"
                cols["time_ns"][-1], cols["kind"][-1], cols["op_name"][-1] = 1000 + op, "compute", "forward"
                op += 1
            w.write_batch(pa.RecordBatch.from_pydict(cols, schema=S.EVENTS_SCHEMA))
    return op


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frac=st.floats(min_value=0.0, max_value=1.0))
def test_truncated_stream_keeps_complete_batches(tmp_path: Path, frac: float) -> None:
    path = tmp_path / "events.arrows"
    total = _write_events(path, 8)
    data = path.read_bytes()
    cut = int(len(data) * frac)
    torn = tmp_path / "torn.arrows"
    torn.write_bytes(data[:cut])
    warnings: list[str] = []
    table = read_stream(torn, S.EVENTS_SCHEMA, warnings)
    assert table.num_rows % 10 == 0 and table.num_rows <= total
    assert table["op_id"].to_pylist() == list(range(table.num_rows))
    if cut < len(data) - 8:   # the last 8 bytes are the end-of-stream marker
        assert warnings, "a torn file must be reported"
    assert torn.read_bytes() == data[:cut]    # never modified


def test_garbage_file_is_reported_not_raised(tmp_path: Path) -> None:
    path = tmp_path / "events.arrows"
    path.write_bytes(os.urandom(3000))
    warnings: list[str] = []
    table = read_stream(path, S.EVENTS_SCHEMA, warnings)
    assert table.num_rows == 0
    assert len(warnings) == 1 and str(path) in warnings[0]


def test_recorder_rows_and_meta(tmp_path: Path) -> None:
    from ncclscope.runtime.recorder import Recorder
    rec = Recorder(tmp_path, 3, 4)
    rec.context.step = 2
    with rec.span("forward"):
        pass
    op = rec.begin("p2p", "isend", group="pp0", p2p_seq=1, peer=2, tag=0, nbytes=8)
    rec.end(op, "timeout", "too slow")
    rec.metric(step=2, loss=1.5)
    rec.close()
    trace = load(tmp_path)
    ops = trace.ops
    assert list(ops["op_name"]) == ["forward", "isend"]
    assert list(ops["status"]) == ["ok", "timeout"]
    assert (ops["step"] == 2).all()
    assert ops.iloc[1]["peer"] == 2 and ops.iloc[1]["message"] == "too slow"
    assert trace.ranks[3].end_status == "ok"
    assert trace.metrics.iloc[0]["loss"] == 1.5
    # ranks 0..2 have no directory: reported, not fatal
    assert sum("has no directory" in w for w in trace.warnings) == 3
