"""Perfetto (Chrome trace-event JSON) and Parquet exports.

    OMP_NUM_THREADS=1 python -m pytest tests/test_export.py -q

The Perfetto file is checked structurally against the trace-event format
(what the Perfetto UI's JSON importer needs): every event has the fields its
phase requires, slices on one track nest, each flow's start sits inside its
send slice and its end inside the matching recv, every pid/tid used is named.
The Parquet dataset is read back three ways: `load_parquet` (the Trace
round-trips), pandas directly on a table directory, and pyarrow.dataset with
hive partitioning (what DuckDB and Polars use).
"""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from ncclscope import schema as S
from ncclscope.export import DATASET_MARKER, INFLIGHT_NOTE, export_parquet, export_perfetto, load_parquet
from ncclscope.load.foreign.detect import load_any
from ncclscope.load.trace import Tables, TraceError, assemble
from trace_builder import NS, TraceBuilder

pytestmark = pytest.mark.timeout(60)


def _samples_table(world: int, t0_ns: int, n: int = 5) -> pa.Table:
    rows = {f.name: [] for f in S.SAMPLES_SCHEMA}
    for r in range(world):
        for i in range(n):
            rows["rank"].append(r)
            rows["time_ns"].append(t0_ns + i * NS // 2)
            rows["source"].append("nvml")
            rows["device"].append(r)
            rows["gpu_util"].append(50.0 + i)
            rows["mem_util"].append(10.0)
            rows["mem_used_bytes"].append(2**30 * (i + 1))
            rows["power_w"].append(300.0)
            rows["temperature_c"].append(60.0)
            rows["cpu_percent"].append(float("nan"))
            rows["rss_bytes"].append(-1)
    return pa.Table.from_pydict(rows, schema=S.SAMPLES_SCHEMA)


def _metrics_table(world: int, t0_ns: int) -> pa.Table:
    rows = {f.name: [] for f in S.METRICS_SCHEMA}
    for r in range(world):
        for step in range(2):
            vals = dict(rank=r, step=step, time_ns=t0_ns + (step + 1) * NS, step_time_s=1.0, loss=2.0 - step,
                        grad_norm_local=1.0, grad_norm_global=1.5, grad_norm_reduced=1.0, param_checksum=3.0, memory_bytes=2**30,
                        tokens=1024, expert_load=[1, 2], dropped_tokens=0, extra="{}")
            for k, v in vals.items():
                rows[k].append(v)
    return pa.Table.from_pydict(rows, schema=S.METRICS_SCHEMA)


@pytest.fixture
def trace():
    """4 ranks, 2 pipeline stages: compute, dp collectives, p2p (matched, async overlapping,
    and one recv that never completed), markers, heartbeats, NVML samples and metrics."""
    b = TraceBuilder(4, groups={"dp0": [0, 2], "dp1": [1, 3], "pp0": [0, 1], "pp1": [2, 3]})
    for r in range(4):
        b.compute(r, "forward", start=0.1, end=0.4, step=0, microbatch=0)
        b.collective(r, "dp0" if r % 2 == 0 else "dp1", 1, start=0.5, end=0.6)
        b.heartbeats(r, 0.0, 3.0)
    b.p2p(0, "isend", peer=1, seq=1, start=1.0, end=1.5, group="pp0", call_site='pipe "x".py:1')
    b.p2p(0, "isend", peer=1, seq=2, start=1.2, end=1.7, group="pp0")          # overlaps the first
    b.p2p(1, "irecv", peer=0, seq=1, start=1.1, end=1.5, group="pp0")
    b.p2p(1, "irecv", peer=0, seq=2, start=1.3, end=1.8, group="pp0")
    b.p2p(2, "send", peer=3, seq=1, start=2.0, end=2.2, group="pp1")
    b.p2p(3, "recv", peer=2, seq=1, start=2.1, end=2.2, group="pp1")
    b.p2p(3, "recv", peer=2, seq=2, start=2.5, group="pp1")                   # never completed
    b.marker(0, "fault_injected", 2.4, message="stall rank 2\nfor 5 s")
    built = b.build()
    t0 = b.t0_ns
    return assemble(Path("<built>"), built.run, built.world_size, built.ranks, Tables(
        events=[pa.Table.from_pandas(built.events[S.EVENT_COLUMNS], schema=S.EVENTS_SCHEMA, preserve_index=False)],
        metrics=[_metrics_table(4, t0)], samples=[_samples_table(4, t0)], group_rows=built.groups.to_dict("records"),
        stacks={1: "Thread 0x1 (most recent call first):\n  File \"x.py\", line 3"}, warnings=["a warning"]))


# --------------------------------------------------------------------------
# Perfetto
# --------------------------------------------------------------------------
REQUIRED = {"X": {"name", "ph", "ts", "dur", "pid", "tid"}, "M": {"name", "ph", "pid", "args"},
            "s": {"ph", "id", "ts", "pid", "tid", "cat", "name"}, "f": {"ph", "id", "ts", "pid", "tid", "cat", "name"},
            "C": {"name", "ph", "ts", "pid", "args"}, "i": {"name", "ph", "ts", "pid", "tid", "s"}}


def check_trace_events(doc: dict) -> dict[str, list[dict]]:
    """Structural validation of Chrome trace-event JSON; returns events by phase."""
    assert isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list)
    assert doc.get("displayTimeUnit") in ("ns", "ms")
    by_ph: dict[str, list[dict]] = defaultdict(list)
    for ev in doc["traceEvents"]:
        ph = ev.get("ph")
        assert ph in REQUIRED, ev
        missing = REQUIRED[ph] - set(ev)
        assert not missing, (missing, ev)
        assert isinstance(ev["pid"], int)
        if "tid" in ev:
            assert isinstance(ev["tid"], int)
        if "ts" in ev:
            assert isinstance(ev["ts"], (int, float)) and ev["ts"] >= 0 and np.isfinite(ev["ts"])
        if ph == "X":
            assert isinstance(ev["dur"], (int, float)) and ev["dur"] >= 0
            assert isinstance(ev["name"], str) and isinstance(ev.get("args", {}), dict)
        if ph == "C":
            assert ev["args"] and all(isinstance(v, (int, float)) for v in ev["args"].values())
        by_ph[ph].append(ev)
    # names for every process and thread used
    procs = {e["pid"] for e in by_ph["M"] if e["name"] == "process_name"}
    threads = {(e["pid"], e["tid"]) for e in by_ph["M"] if e["name"] == "thread_name"}
    for ph in ("X", "s", "f", "i"):
        for ev in by_ph[ph]:
            assert ev["pid"] in procs and (ev["pid"], ev["tid"]) in threads, ev
    for ev in by_ph["C"]:
        assert ev["pid"] in procs
    # slices on one track never partially overlap (viewers need proper nesting)
    tracks: dict[tuple[int, int], list[tuple[float, float]]] = defaultdict(list)
    for ev in by_ph["X"]:
        tracks[(ev["pid"], ev["tid"])].append((ev["ts"], ev["ts"] + ev["dur"]))
    for spans in tracks.values():
        spans.sort()
        stack: list[float] = []
        for a, b in spans:
            while stack and stack[-1] <= a + 1e-9:
                stack.pop()
            assert not stack or b <= stack[-1] + 1e-9, "partially overlapping slices on one track"
            stack.append(b)
    # flows: each id once as "s" and once as "f" (bp "e"), same cat and name
    starts = {e["id"]: e for e in by_ph["s"]}
    ends = {e["id"]: e for e in by_ph["f"]}
    assert len(starts) == len(by_ph["s"]) and set(starts) == set(ends)
    for i, f in ends.items():
        assert f.get("bp") == "e" and f["cat"] == starts[i]["cat"] and f["name"] == starts[i]["name"]
    return by_ph


def _inside(ev: dict, slices: list[dict]) -> dict:
    hits = [x for x in slices if x["pid"] == ev["pid"] and x["tid"] == ev["tid"]
            and x["ts"] - 1e-6 <= ev["ts"] <= x["ts"] + x["dur"] + 1e-6]
    assert hits, ev
    return hits[0]


def test_perfetto_export_is_valid_trace_event_json(trace, tmp_path):
    out = tmp_path / "trace.json"
    stats = export_perfetto(trace, out)
    doc = json.loads(out.read_text())
    by_ph = check_trace_events(doc)
    slices = by_ph["X"]
    assert stats["slices"] == len(slices) == len(trace.ops)
    assert stats["events"] == len(doc["traceEvents"])
    # one process per rank, named
    names = {e["pid"]: e["args"]["name"] for e in by_ph["M"] if e["name"] == "process_name"}
    assert names == {0: "rank 0", 1: "rank 1", 2: "rank 2", 3: "rank 3"}
    threads = {(e["pid"], e["args"]["name"]) for e in by_ph["M"] if e["name"] == "thread_name"}
    assert {(0, "compute"), (0, "collective dp0"), (0, "p2p pp0"), (0, "p2p pp0 (2)"), (0, "markers")} <= threads
    # the two overlapping isends went to two lanes of rank 0's pp0 track
    isends = [e for e in slices if e["pid"] == 0 and e["name"].startswith("isend")]
    assert len({e["tid"] for e in isends}) == 2
    # flows: send -> matching recv, anchored in the right slices
    assert stats["flows"] == 3 and len(by_ph["s"]) == 3
    for s in by_ph["s"]:
        f = next(x for x in by_ph["f"] if x["id"] == s["id"])
        send, recv = _inside(s, slices), _inside(f, slices)
        assert send["name"].split(" #")[0] in ("isend", "send") and recv["name"].split(" #")[0] in ("irecv", "recv")
        assert send["args"]["peer"] == f["pid"] and recv["args"]["peer"] == s["pid"]
        assert send["args"]["p2p_seq_id"] == recv["args"]["p2p_seq_id"]
    # the recv that never completed runs to the end of the trace and says so
    stuck = [e for e in slices if e["args"]["status"] == "inflight"]
    assert len(stuck) == 1 and stuck[0]["args"]["note"] == INFLIGHT_NOTE and stuck[0]["pid"] == 3
    end_us = max(e["ts"] + e.get("dur", 0) for e in slices)
    assert stuck[0]["ts"] + stuck[0]["dur"] == pytest.approx(end_us, abs=1e-3)
    # args carry what the analyses know; strings survive escaping
    first = next(e for e in slices if e["name"] == "isend #1")
    assert first["args"]["call_site"] == 'pipe "x".py:1' and first["args"]["process_group"] == "pp0"
    assert first["cat"] == "p2p" and first["dur"] == pytest.approx(500_000.0)   # 0.5 s in µs
    # counters from samples and metrics; markers (not heartbeats) as instants
    counter_names = {e["name"] for e in by_ph["C"]}
    assert {"GPU util %", "GPU memory used GiB", "power W", "loss", "step time s"} <= counter_names
    assert "CPU %" not in counter_names and "RSS GiB" not in counter_names           # NaN / -1: absent
    assert [e["name"] for e in by_ph["i"]] == ["fault_injected"]
    assert by_ph["i"][0]["args"]["message"] == "stall rank 2\nfor 5 s"
    assert doc["otherData"]["t0_ns"] == int(trace.ops["start_ns"].min()) or doc["otherData"]["t0_ns"] <= int(
        trace.ops["start_ns"].min())


def test_perfetto_export_of_empty_trace(tmp_path):
    b = TraceBuilder(2)
    b.rank_state(1, present=False)
    stats = export_perfetto(b.build(), tmp_path / "empty.json")
    doc = json.loads((tmp_path / "empty.json").read_text())
    by_ph = check_trace_events(doc)
    names = {e["args"]["name"] for e in by_ph["M"] if e["name"] == "process_name"}
    assert stats["slices"] == 0 and names == {"rank 0", "rank 1 (no trace)"}


# --------------------------------------------------------------------------
# Parquet
# --------------------------------------------------------------------------
def _same(a: pd.DataFrame, b: pd.DataFrame) -> None:
    def norm(df: pd.DataFrame) -> pd.DataFrame:
        df = df.reset_index(drop=True).copy()
        for c in df.columns:
            if isinstance(df[c].dtype, pd.CategoricalDtype) or df[c].dtype == object:
                df[c] = df[c].map(lambda v: list(v) if isinstance(v, (list, np.ndarray)) else v).astype(str)
        return df
    pd.testing.assert_frame_equal(norm(a), norm(b), check_dtype=False)


def test_parquet_export_round_trips(trace, tmp_path):
    out = tmp_path / "pq"
    stats = export_parquet(trace, out)
    assert stats["events"] == len(trace.events) and stats["ops"] == len(trace.ops)
    assert (out / DATASET_MARKER).exists()
    assert sorted(p.name for p in (out / "ops").iterdir()) == ["rank=0", "rank=1", "rank=2", "rank=3"]
    back = load_parquet(out)
    assert back.world_size == trace.world_size and back.ranks == trace.ranks
    assert back.stacks == trace.stacks and back.warnings == trace.warnings
    for name in ("events", "ops", "metrics", "samples", "groups"):
        a = getattr(trace, name).sort_values(["rank"], kind="stable")
        b = getattr(back, name).sort_values(["rank"], kind="stable")
        _same(a[sorted(a.columns)], b[sorted(a.columns)])
    # load_any recognises the dataset
    assert len(load_any(out).ops) == len(trace.ops)


def test_parquet_dataset_reads_directly(trace, tmp_path):
    out = tmp_path / "pq"
    export_parquet(trace, out)
    ops = pd.read_parquet(out / "ops")                      # pandas: hive partitions come back as a column
    assert len(ops) == len(trace.ops)
    assert sorted(ops["rank"].astype(int).unique()) == [0, 1, 2, 3]
    assert set(ops["status"].astype(str)) == {"ok", "inflight"}
    dataset = ds.dataset(out / "events", format="parquet", partitioning="hive")   # what DuckDB / Polars see
    t = dataset.to_table(filter=ds.field("rank") == 3)
    assert t.num_rows == int((trace.events["rank"] == 3).sum())
    assert pa.types.is_string(dataset.schema.field("op_name").type)            # plain strings, no dictionaries
    groups = pd.read_parquet(out / "groups")
    views = groups[groups["process_group"] == "dp0"]["ranks"].map(lambda r: [int(x) for x in r]).tolist()
    assert views == [[0, 2]] * 2      # the members' views of dp0 (the groups table holds no ranks x groups rows)
    try:
        import duckdb  # noqa: F401
    except ImportError:
        return
    n = duckdb.sql(f"select count(*) from read_parquet('{out}/ops/*/*.parquet', hive_partitioning=true)").fetchone()[0]
    assert n == len(trace.ops)


def test_parquet_export_refuses_foreign_directory_and_overwrites_its_own(trace, tmp_path):
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")
    with pytest.raises(TraceError, match="refusing"):
        export_parquet(trace, foreign)
    assert (foreign / "thesis.tex").read_text() == "precious"
    out = tmp_path / "pq"
    export_parquet(trace, out)
    export_parquet(trace, out)                               # re-export replaces, never duplicates
    assert len(pd.read_parquet(out / "ops")) == len(trace.ops)


def test_export_of_ingested_trace(tmp_path):
    """A hand-made NCCL-style Flight Recorder trace exports both ways (p2p flows included)."""
    from test_ingest import _nccl_dumps
    trace = load_any(_nccl_dumps(tmp_path / "fr"))
    stats = export_perfetto(trace, tmp_path / "fr.json")
    by_ph = check_trace_events(json.loads((tmp_path / "fr.json").read_text()))
    assert stats["flows"] > 0 and len(by_ph["s"]) == stats["flows"]
    assert stats["inflight"] == int((trace.ops["status"].astype(str) == "inflight").sum())
    export_parquet(trace, tmp_path / "fr_pq")
    back = load_parquet(tmp_path / "fr_pq")
    _same(trace.ops[sorted(trace.ops.columns)], back.ops.sort_values(["rank", "start_ns", "op_id"], kind="stable")
          [sorted(trace.ops.columns)])


@pytest.mark.e2e
def test_cli_export(tmp_path, cli):
    """`ncclscope export DIR --perfetto OUT --parquet DIR` on Flight Recorder dumps."""
    from test_ingest import _nccl_dumps
    dumps = _nccl_dumps(tmp_path / "fr")
    res = cli("export", str(dumps), "--perfetto", str(tmp_path / "t.json"), "--parquet", str(tmp_path / "pq"))
    assert res.returncode == 0, res.stderr
    check_trace_events(json.loads((tmp_path / "t.json").read_text()))
    assert len(load_parquet(tmp_path / "pq").ops) == len(load_any(dumps).ops)
    # the refusal through the same `main` in this process (the export above is the real entry point)
    from conftest import cli_in_process
    res = cli_in_process(["export", str(tmp_path / "nothing_here"), "--perfetto", str(tmp_path / "x.json")])
    assert res.returncode == 2 and "no such file" in res.stderr
