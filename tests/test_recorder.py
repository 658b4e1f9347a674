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
from ncclscope.load.ipc_read import read_stream
from ncclscope.load.trace import load

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


def _write_events(path: Path, n_batches: int, rows_per_batch: int = 10, ends: list[int] | None = None) -> int:
    """Write `n_batches` batches; `ends` collects the byte offset after the schema and after each batch."""
    with open(path, "wb") as f, pa.ipc.new_stream(f, S.EVENTS_SCHEMA) as w:
        op = 0
        if ends is not None:
            ends.append(S.EVENTS_SCHEMA.serialize().size)     # the schema message comes first
        for _ in range(n_batches):
            cols = {name: [] for name in S.EVENT_COLUMNS}
            for _ in range(rows_per_batch):
                for name, typ in S.EVENT_FIELDS:
                    cols[name].append("" if pa.types.is_string(typ) else -1)
                cols["rank"][-1], cols["op_id"][-1], cols["phase"][-1] = 0, op, "begin"
                cols["time_ns"][-1], cols["kind"][-1], cols["op_name"][-1] = 1000 + op, "compute", "forward"
                op += 1
            w.write_batch(pa.RecordBatch.from_pydict(cols, schema=S.EVENTS_SCHEMA))
            if ends is not None:
                ends.append(f.tell())
    return op


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(frac=st.floats(min_value=0.0, max_value=1.0))
def test_truncated_stream_keeps_complete_batches(tmp_path: Path, frac: float) -> None:
    path = tmp_path / "events.arrows"
    ends: list[int] = []
    total = _write_events(path, 8, ends=ends)
    data = path.read_bytes()
    cut = int(len(data) * frac)
    torn = tmp_path / "torn.arrows"
    torn.write_bytes(data[:cut])
    warnings: list[str] = []
    table = read_stream(torn, S.EVENTS_SCHEMA, warnings)
    assert table.num_rows % 10 == 0 and table.num_rows <= total
    assert table["op_id"].to_pylist() == list(range(table.num_rows))
    # A cut inside a message is a torn tail and must be reported. A cut exactly between two messages loses
    # nothing but the end-of-stream marker: that is what a rank killed between two flushes leaves, and
    # the batches it holds are whole (the rank's own state says it died).
    if cut < len(data) - 8 and cut not in ends:
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


def _raise_in_helper() -> None:
    raise RuntimeError("boom")


def test_an_exception_leaves_its_stack_and_the_call_sites_their_functions(tmp_path: Path) -> None:
    """What the analyzer's went-past-a-collective rule reads: the frames the exception unwound, with
    each function's def line, in a dump main_thread_dumps parses; rank.json's call_sites."""
    from ncclscope.index.stack_excerpts import main_thread_dumps
    from ncclscope.runtime.recorder import Recorder
    rec = Recorder(tmp_path, 0, 1)
    try:
        _raise_in_helper()
    except RuntimeError as exc:
        rec.dump_exception(exc)
    rec.write_meta(call_sites={"runtime/parallel/expert.py:190": ["_experts", 180], "bad": "shape"})
    rec.close("error", "boom")
    trace = load(tmp_path)
    (_, frames), = main_thread_dumps(trace.stacks[0])
    first = _raise_in_helper.__code__.co_firstlineno
    assert f"line {first + 1} in _raise_in_helper (def line {first})" in frames[0], frames
    assert "in test_an_exception_leaves_its_stack_and_the_call_sites_their_functions (def line" in frames[1]
    assert trace.ranks[0].call_sites == {"runtime/parallel/expert.py:190": ("_experts", 180)}


# ---- the hot path writes exactly the rows its calls describe ------------------
def _blank(**fields):
    row = {name: ("" if pa.types.is_string(t) else -1) for name, t in S.EVENT_FIELDS}
    row.update(fields)
    return row


def test_every_row_is_what_its_call_says(tmp_path: Path, monkeypatch) -> None:
    """Each call's row, field by field, against rows written out by hand (a
    fake clock makes time_ns known): keyword and positional begin, end of an
    unknown op, instants, spans that raise, the watchdog's suspect row."""
    from ncclscope.runtime import recorder as R
    clock = iter(range(10_000, 10**9, 10))
    monkeypatch.setattr(R, "_time_ns", lambda: next(clock))
    rec = R.Recorder(tmp_path, 5, 8, flush_interval_s=3600)
    rec.context.step, rec.context.microbatch, rec.context.stage, rec.context.chunk = 4, 1, 2, 0
    a = rec.begin("collective", "all_reduce", group="dp0", seq=7, nbytes=64, dtype="float32", sizes="[[16]]",
                  reduce_op="sum", timeout_ms=5000, call_site="train.py:9", message="m")
    b = rec.begin("p2p", "isend", "pp0", -1, 3, 6, 11, 8, "int64", "[[1]]", "", 100, "x.py:1", "")
    rec.end(b, "timeout", "too slow")
    rec.end(a)
    rec.end(99, "error", "never begun")
    rec.instant("marker", "step", message="step 4 begins", status="")
    rec.context.step = 5
    with pytest.raises(KeyError):
        with rec.span("forward"):
            raise KeyError("k")
    slow = rec.begin("collective", "all_reduce", group="dp0", seq=8, nbytes=64)
    rec._inflight[slow] = (rec._inflight[slow][0] - int(60e9), *rec._inflight[slow][1:])
    rec._watchdog()
    rec.close()
    ctx = dict(step=4, microbatch=1, stage=2, chunk=0)
    expected = [
        _blank(rank=5, op_id=0, phase="begin", time_ns=10_000, kind="collective", op_name="all_reduce",
               process_group="dp0", collective_seq_id=7, bytes=64, input_dtypes="float32", input_sizes="[[16]]",
               reduce_op="sum", timeout_ms=5000, call_site="train.py:9", message="m", **ctx),
        _blank(rank=5, op_id=1, phase="begin", time_ns=10_010, kind="p2p", op_name="isend", process_group="pp0",
               p2p_seq_id=3, peer=6, tag=11, bytes=8, input_dtypes="int64", input_sizes="[[1]]", timeout_ms=100,
               call_site="x.py:1", **ctx),
        _blank(rank=5, op_id=1, phase="end", time_ns=10_020, op_name="isend", process_group="pp0", step=4,
               status="timeout", message="too slow"),
        _blank(rank=5, op_id=0, phase="end", time_ns=10_030, op_name="all_reduce", process_group="dp0",
               collective_seq_id=7, step=4, status="ok"),
        _blank(rank=5, op_id=99, phase="end", time_ns=10_040, step=4, status="error", message="never begun"),
        _blank(rank=5, phase="instant", time_ns=10_050, kind="marker", op_name="step", step=4,
               message="step 4 begins"),
        _blank(rank=5, op_id=2, phase="begin", time_ns=10_060, kind="compute", op_name="forward", step=5,
               microbatch=1, stage=2, chunk=0),
        _blank(rank=5, op_id=2, phase="end", time_ns=10_070, op_name="forward", step=5, status="error",
               message="KeyError: 'k'"),
        _blank(rank=5, op_id=3, phase="begin", time_ns=10_080, kind="collective", op_name="all_reduce",
               process_group="dp0", collective_seq_id=8, bytes=64, step=5, microbatch=1, stage=2, chunk=0),
    ]
    table = read_stream(tmp_path / "rank-00005" / S.EVENTS_FILE, S.EVENTS_SCHEMA, [])
    rows = [r for r in table.to_pylist() if r["op_name"] != S.HEARTBEAT]
    suspect = [r for r in rows if r["status"] == S.STATUS_SUSPECT]
    assert rows[:len(expected)] == expected
    assert len(suspect) == 1 and suspect[0]["op_id"] == slow and suspect[0]["collective_seq_id"] == 8
    assert suspect[0]["message"].startswith("in flight 60.0 s; slowest earlier")


_INT_VALUES = st.one_of(st.integers(-1, 3), st.integers(-2**31, 2**31 - 1), st.integers(-2**63, 2**63 - 1),
                        st.none(), st.integers(2**63, 2**64))
_STR_VALUES = st.one_of(st.sampled_from(["", "ok", "all_reduce", "dp0", "a\x00b", "\x00", "\ud800", "é", "日本"]),
                        st.text(st.characters(codec=None, exclude_categories=()), max_size=12), st.none(),
                        st.just(5))


@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_batch_columns_convert_exactly_like_pa_array(data) -> None:
    """The flusher's fast conversions (numpy for numbers, one repeated value for
    a constant column) give the array pa.array gives, or fail where it fails."""
    from ncclscope.runtime.ipc_write import column_converter
    typ = data.draw(st.sampled_from([pa.int32(), pa.int64(), pa.string(), pa.float64()]))
    values = {pa.string(): _STR_VALUES,
              pa.float64(): st.one_of(st.floats(allow_nan=True), st.integers(-2**53, 2**53), st.none())}.get(
                  typ, _INT_VALUES)
    col = data.draw(st.one_of(st.lists(values, min_size=1, max_size=40),
                              values.flatmap(lambda v: st.integers(1, 40).map(lambda n: [v] * n))))
    try:
        want = pa.array(col, type=typ)
    except (pa.ArrowException, TypeError, ValueError, OverflowError):
        with pytest.raises((pa.ArrowException, TypeError, ValueError, OverflowError)):
            column_converter(typ)(col, len(col))
        return
    got = column_converter(typ)(col, len(col))
    assert got.type == typ
    assert got.to_pylist() == want.to_pylist() or (
        typ == pa.float64() and [str(v) for v in got.to_pylist()] == [str(v) for v in want.to_pylist()])


def test_rows_appended_while_the_flusher_drains_all_arrive_in_order(tmp_path: Path) -> None:
    """The training thread appends while the flusher takes batches every ms: no
    row lost, doubled or skewed (each begin/end pair keeps its own fields)."""
    from ncclscope.runtime.recorder import Recorder
    rec = Recorder(tmp_path, 0, 1, flush_interval_s=0.001)
    n = 30_000
    for i in range(n):
        op = rec.begin("collective", "all_reduce", group="dp0", seq=i + 1, nbytes=i, call_site=f"f.py:{i % 7}")
        rec.end(op)
    rec.close()
    with pa.ipc.open_stream(str(tmp_path / "rank-00000" / S.EVENTS_FILE)) as reader:
        batches = list(reader)
    assert len(batches) > 1
    table = pa.Table.from_batches(batches)
    ops = table.filter(pa.compute.not_equal(table["op_name"], S.HEARTBEAT))
    assert ops.num_rows == 2 * n
    d = ops.to_pydict()
    assert d["op_id"] == [i // 2 for i in range(2 * n)]
    assert d["phase"] == ["begin", "end"] * n
    assert d["collective_seq_id"] == [i // 2 + 1 for i in range(2 * n)]
    assert d["bytes"][0::2] == list(range(n)) and set(d["bytes"][1::2]) == {-1}
    assert d["call_site"][0::2] == [f"f.py:{i % 7}" for i in range(n)]
    assert d["status"][1::2] == ["ok"] * n


def test_a_row_of_the_wrong_width_is_refused(tmp_path: Path) -> None:
    from ncclscope.runtime.recorder import Recorder
    rec = Recorder(tmp_path, 0, 1, flush_interval_s=3600)
    try:
        with pytest.raises(ValueError, match="values"):
            rec.metrics.rows.append((0, 1))       # would skew every later row of the stream
        rec.metric(step=1, loss=2.0)
        assert len(rec.metrics.rows) == 1 and list(rec.metrics.rows)[0][1] == 1
    finally:
        rec.close()
    assert load(tmp_path).metrics.iloc[0]["loss"] == 2.0


def test_a_batch_that_cannot_be_converted_is_dropped_not_kept(tmp_path: Path) -> None:
    """A bad value fails its own flush (as it always did) and takes only its
    batch with it: kept, it would make every later flush raise too."""
    from ncclscope.runtime.recorder import Recorder
    rec = Recorder(tmp_path, 0, 1, flush_interval_s=3600)
    rec.metric(step=1, loss="not a number")
    with pytest.raises((pa.ArrowException, TypeError, ValueError)):
        rec.flush()
    rec.metric(step=2, loss=1.0)
    rec.flush()
    rec.close()
    assert list(load(tmp_path).metrics["step"]) == [2]


_ABORT_CHILD = """
import ctypes, sys, threading, time
from ncclscope.runtime.recorder import Recorder
rec = Recorder(sys.argv[1], 0, 1, flush_interval_s=60)   # the flusher never writes on its own here
time.sleep(0.3)
rec.begin("collective", "all_reduce", group="tp0", seq=7, nbytes=2052, call_site="model.py:73")
rec.metric(step=3, loss=0.5)
abort = ctypes.CDLL(None).abort
if sys.argv[2] == "native-thread":   # like gloo: its own thread aborts while the op waits
    threading.Thread(target=abort).start()
    time.sleep(30)
else:
    abort()
"""


@pytest.mark.parametrize("where", ["native-thread", "main-thread"])
def test_an_aborted_rank_keeps_its_queued_rows(tmp_path, where):
    """SIGABRT (gloo's answer to a size mismatch) kills the process before the flusher's next batch: the
    abort handler writes the queued begin row and metrics row, and an end record that says it aborted (a
    launcher stopped before it saw the rank die still knows), faulthandler still dumps the stacks, and the
    process still dies of SIGABRT."""
    import subprocess
    import sys
    res = subprocess.run([sys.executable, "-c", _ABORT_CHILD, str(tmp_path), where], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == -signal.SIGABRT, res.stderr
    ev = load(tmp_path).events
    assert list(ev["op_name"]) == ["all_reduce"] and int(ev["bytes"].iloc[0]) == 2052
    assert str(ev["call_site"].iloc[0]) == "model.py:73"
    trace = load(tmp_path)
    assert list(trace.metrics["step"]) == [3]
    assert (trace.ranks[0].end_status, trace.ranks[0].end_message) == ("error", "aborted (SIGABRT)")
    assert trace.ranks[0].died
    assert "Fatal Python error: Aborted" in (tmp_path / S.rank_dir_name(0) / S.STACKS_FILE).read_text()


def test_a_trace_reads_back_as_written(tmp_path):
    """Every row the recorder was given is in the events stream, in order, value for value: long runs of
    begin/end rows cut by step markers, drained through the flusher's path."""
    from ncclscope.runtime.recorder import Recorder
    rec = Recorder(tmp_path, 0, 1, flush_interval_s=3600)
    seen: list[tuple] = []
    append = rec._append

    def keep(row: tuple) -> None:
        seen.append(row)
        append(row)
    rec._append = keep
    for step in range(5):
        rec.context.step = step
        for i in range(1200):
            rec.end(rec.begin(S.KIND_COLLECTIVE, "all_reduce", "world", i + 1, -1, -1, -1, 16, "float32", "[4]",
                              "sum", 60000, "train.py:7"))
            if i % 397 == 0:
                rec.instant(S.KIND_MARKER, "step", f"step {step}")
        rec.flush()
    rec.close()
    with pa.OSFile(str(rec.dir / S.EVENTS_FILE)) as f:
        table = pa.ipc.open_stream(f).read_all()
    rows = [tuple(r[c] for c in S.EVENT_COLUMNS) for r in table.to_pylist()]
    assert rows == seen
