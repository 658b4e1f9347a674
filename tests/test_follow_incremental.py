"""`--follow` builds each poll's trace and index from the last poll's plus the appended batches.

The contract: after every poll the incrementally built `ops` (and events, metrics,
samples) and every incrementally maintained index view equal, row for row and dtype
for dtype, a full rebuild from the same files (`Follower(incremental=False)`:
`trace.assemble` over everything read), and `analysis.run` says the same.

Event streams are hand-built per rank, serialised once, and the files grow by
prefixes cut at random byte offsets: a cut inside a message is a torn batch (held
back until complete), an op's begin and end rows often land in different polls, a
rank's directory may appear late, and a stream may be recreated shorter.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.ipc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ncclscope import verdict as analysis
from ncclscope import schema as S
from ncclscope.index.views import index_of
from ncclscope.tui.follow import Follower
from ncclscope.tui.follow_index import MERGED

NS = 1_000_000_000
T0 = 1_750_000_000 * NS
SAMPLES = Path(__file__).resolve().parent.parent / "sample_traces"


# ---- hand-built streams ------------------------------------------------------------------
def _rows(rank: int, world: int, n_ops: int, rng: np.random.Generator, shuffle: bool = False) -> list[dict[str, Any]]:
    """One rank's rows in write order: collectives on two groups, p2p with a neighbour, compute; some ops
    never end, an end row may carry an error, rows are written by time (begin and end far apart)."""
    rows: list[dict[str, Any]] = []
    seq = {"dp0": 0, "tp0": 0}
    pseq = 0
    t = 0.0
    for op_id in range(n_ops):
        t += float(rng.uniform(0.01, 0.2))
        what = rng.integers(0, 5)
        step = op_id // 4
        base = {"op_id": op_id, "step": step,
                "call_site": f"train.py:{10 + int(what)}" if rng.random() > 0.15 else None}   # None: a null
        if what <= 1:
            g = "dp0" if what == 0 else "tp0"
            seq[g] += 1
            base.update(kind="collective", op_name="all_reduce" if what == 0 else "all_gather",
                        process_group=g, collective_seq_id=seq[g], reduce_op="sum" if what == 0 else "",
                        input_dtypes="float32", input_sizes="[[4, 16]]")
        elif what == 2 and world > 1:
            pseq += 1
            send = rank % 2 == 0
            base.update(kind="p2p", op_name="isend" if send else "irecv", process_group="pp0",
                        peer=rank + 1 if send else rank - 1, p2p_seq_id=pseq, tag=0)
            if base["peer"] >= world:
                base.update(peer=rank - 1)
        else:
            base.update(kind="compute", op_name=["forward", "backward", "optimizer"][int(rng.integers(0, 3))])
        rows.append({**base, "phase": "begin", "time_ns": T0 + int(t * NS)})
        fate = rng.random()
        if fate < 0.85:                                   # ends (maybe late); else never ends
            te = t + float(rng.uniform(0.001, 0.6))
            status = "ok" if fate < 0.8 else str(rng.choice(["error", "timeout"]))
            rows.append({**base, "phase": "end", "time_ns": T0 + int(te * NS), "status": status,
                         "message": "" if status == "ok" else f"{status} after {te:.1f}s"})
        if rng.random() < 0.1:
            rows.append({"op_id": 10_000 + op_id, "phase": "instant", "kind": "marker", "op_name": S.HEARTBEAT,
                         "time_ns": T0 + int((t + 0.05) * NS)})
    rows.sort(key=lambda r: r["time_ns"])
    if shuffle:                                           # rows written out of time order: build_ops sorts
        for i in range(0, len(rows) - 1, 5):
            rows[i], rows[i + 1] = rows[i + 1], rows[i]
    return rows


def _stream(rows: list[dict[str, Any]], rank: int, batch_rows: list[int]) -> tuple[bytes, list[int]]:
    """The Arrow IPC stream bytes of `rows` in batches of the given sizes, and each message's end offset."""
    sink = pa.BufferOutputStream()
    w = pa.ipc.new_stream(sink, S.EVENTS_SCHEMA)
    ends = [sink.tell()]
    at = 0
    for n in batch_rows:
        part = rows[at:at + n]
        at += n
        if not part:
            continue
        cols = {name: [r.get(name, "" if pa.types.is_string(t) else -1) for r in part] for name, t in S.EVENT_FIELDS}
        cols["rank"] = [rank] * len(part)
        w.write_batch(pa.RecordBatch.from_pydict(cols, schema=S.EVENTS_SCHEMA))
        ends.append(sink.tell())
    return sink.getvalue().to_pybytes(), ends


def _setup(root: Path, world: int) -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / S.RUN_JSON).write_text(json.dumps({"world_size": world}))


def _rank_dir(root: Path, rank: int, world: int, offset_ns: int = 0) -> Path:
    d = root / S.rank_dir_name(rank)
    if not d.exists():
        d.mkdir()
        (d / S.RANK_JSON).write_text(json.dumps({
            "rank": rank, "world_size": world, "clock_offset_ns": offset_ns,
            "groups": [{"name": "dp0", "kind": "dp", "ranks": list(range(world)), "creation_order": 0},
                       {"name": "tp0", "kind": "tp", "ranks": list(range(world)), "creation_order": 1},
                       {"name": "pp0", "kind": "pp", "ranks": list(range(world)), "creation_order": 2}]}))
    return d


# ---- the contract ------------------------------------------------------------------------
def _begin_rows_first(events: pd.DataFrame) -> pd.DataFrame:
    begin = (events["phase"].astype(str) == S.PHASE_BEGIN).to_numpy()
    return pd.concat([events[begin], events[~begin]]).reset_index(drop=True)


def assert_same(live: Follower, root: Path, verdict: bool = True) -> None:
    """The incremental trace and views equal a full rebuild from the same files."""
    ref = Follower(root, incremental=False)
    ref.poll()
    a, b = live.trace(), ref.trace()
    # the same event rows; the full load keeps the begin rows first (ops columns are views of them), the
    # follower keeps them as they came: each part in the same order
    pd.testing.assert_frame_equal(_begin_rows_first(a.events), b.events, obj="events")
    for name in ("ops", "metrics", "samples"):
        pd.testing.assert_frame_equal(getattr(a, name), getattr(b, name), obj=name)
    ia, ib = index_of(a), index_of(b)
    for view in MERGED:
        assert view in ia.__dict__, f"{view} was not seeded"
        pd.testing.assert_frame_equal(getattr(ia, view), getattr(ib, view), obj=view)
    assert a.world_size == b.world_size and {r: i.state for r, i in a.ranks.items()} == \
        {r: i.state for r, i in b.ranks.items()}
    if verdict:
        ra, rb = analysis.run(a), analysis.run(b)
        assert (ra.verdict, ra.level) == (rb.verdict, rb.level)
        assert [(f.kind, f.title) for f in ra.findings] == [(f.kind, f.title) for f in rb.findings]


@st.composite
def scenarios(draw: Any) -> dict[str, Any]:
    world = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    n_polls = draw(st.integers(2, 6))
    late = draw(st.integers(0, world - 1)) if world > 1 and draw(st.booleans()) else -1
    recreate = draw(st.integers(0, world - 1)) if draw(st.integers(0, 3)) == 0 else -1
    shuffle = draw(st.integers(0, 5)) == 0
    return {"world": world, "seed": seed, "polls": n_polls, "late": late, "recreate": recreate, "shuffle": shuffle}


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(sc=scenarios())
def test_incremental_equals_full_rebuild(tmp_path_factory: pytest.TempPathFactory, sc: dict[str, Any]) -> None:
    rng = np.random.default_rng(sc["seed"])
    root = tmp_path_factory.mktemp("live")
    world, polls = sc["world"], sc["polls"]
    _setup(root, world)
    streams = {}
    for r in range(world):
        rows = _rows(r, world, int(rng.integers(3, 25)), rng, shuffle=sc["shuffle"] and r == 0)
        sizes = list(rng.integers(1, 6, size=len(rows)))
        streams[r] = _stream(rows, r, sizes)
    live = Follower(root)
    recreated = False
    for k in range(1, polls + 1):
        recreated_now = False
        for r, (data, ends) in streams.items():
            if r == sc["late"] and k < polls // 2 + 1:
                continue                                     # this rank's directory is not there yet
            d = _rank_dir(root, r, world, offset_ns=int(r * 1000))
            cut = len(data) if k == polls else int(rng.integers(0, len(data) + 1) * k / polls)
            path = d / S.EVENTS_FILE
            if r == sc["recreate"] and k == polls - 1 and not recreated and path.exists() \
                    and path.stat().st_size >= ends[0]:
                rows = _rows(r, world, int(rng.integers(2, 6)), rng)      # a restarted rank: a new, shorter file
                data, ends = _stream(rows, r, [2] * len(rows))
                streams[r] = (data, ends)
                cut = ends[0] // 2                                 # shorter than what was read: seen as new
                path.unlink()
                recreated = recreated_now = True
            old = path.stat().st_size if path.exists() else 0
            if cut > old or not path.exists():
                with open(path, "ab") as fh:
                    fh.write(data[old:max(cut, old)])
        changed = live.poll()
        assert_same(live, root, verdict=(k == polls))
        if k > 1 and changed and not recreated_now and live._live.ops.ordered:   # extended, not rebuilt
            assert live.index_timings["full_index"] is False, live.index_timings["why_full"]
    assert live.index_timings["ops"] == len(live.trace().ops)


def test_begin_in_one_poll_end_in_a_later_one(tmp_path: Path) -> None:
    root = tmp_path / "live"
    _setup(root, 2)
    rows = {r: [{"op_id": 1, "phase": "begin", "time_ns": T0, "kind": "collective", "op_name": "all_reduce",
                 "process_group": "dp0", "collective_seq_id": 1, "step": 0},
                {"op_id": 2, "phase": "begin", "time_ns": T0 + NS, "kind": "compute", "op_name": "forward",
                 "step": 1},
                {"op_id": 1, "phase": "end", "time_ns": T0 + 2 * NS, "status": "ok", "kind": "collective",
                 "op_name": "all_reduce", "process_group": "dp0", "collective_seq_id": 1, "step": 0}]
            for r in range(2)}
    streams = {r: _stream(rows[r], r, [2, 1]) for r in range(2)}
    live = Follower(root)
    for r, (data, ends) in streams.items():
        (_rank_dir(root, r, 2) / S.EVENTS_FILE).write_bytes(data[:ends[1] + 7])    # begins + a torn end batch
    live.poll()
    assert_same(live, root)
    assert list(live.trace().ops["status"].astype(str)) == ["inflight"] * 4
    for r, (data, _) in streams.items():
        (root / S.rank_dir_name(r) / S.EVENTS_FILE).write_bytes(data)
    live.poll()
    assert_same(live, root)
    ops = live.trace().ops
    assert list(ops["status"].astype(str)) == ["ok", "inflight"] * 2
    t = live.index_timings
    assert not t["full_index"] and t["changed_ops"] == 2             # only the two closed ops were re-joined


def _messages(src: Path) -> dict[str, dict[str, tuple[bytes, list[int]]]]:
    """rank dir -> file -> (its bytes, each message's end offset): for writing growing prefixes."""
    out = {}
    for d in sorted(src.glob("rank-*")):
        files = {}
        for name in (S.EVENTS_FILE, S.METRICS_FILE, S.SAMPLES_FILE):
            if not (d / name).exists():
                continue
            data = (d / name).read_bytes()
            reader = pa.BufferReader(pa.py_buffer(data))
            ends = []
            while True:
                try:
                    msg = pa.ipc.read_message(reader)
                except (EOFError, pa.ArrowInvalid):
                    break
                if msg is None:
                    break
                ends.append(reader.tell())
            files[name] = (data, ends)
        out[d.name] = files
    return out


@pytest.mark.parametrize("sample", ["hung-pipeline", "straggler"])
def test_recorded_run_replayed_batch_by_batch(tmp_path: Path, sample: str) -> None:
    src = SAMPLES / sample
    dst = tmp_path / sample
    dst.mkdir()
    run = json.loads((src / S.RUN_JSON).read_text())
    (dst / S.RUN_JSON).write_text(json.dumps({k: v for k, v in run.items() if k not in ("end_reason", "ranks")}))
    files = _messages(src)
    for name in files:
        (dst / name).mkdir()
        for f in (src / name).iterdir():
            if f.suffix != ".arrows":
                shutil.copy(f, dst / name / f.name)
    steps = 6
    live = Follower(dst)
    for k in range(1, steps + 1):
        for rname, fs in files.items():
            for fname, (data, ends) in fs.items():
                i = max(1, len(ends) * k // (steps + 1))          # the first i messages, then half of the next
                cut = ends[i - 1] + ((ends[i] - ends[i - 1]) // 2 if i < len(ends) else 0)
                (dst / rname / fname).write_bytes(data[:cut])
        live.poll()
        assert_same(live, dst, verdict=(k == steps // 2))
        assert k == 1 or live.index_timings["full_index"] is False
    shutil.copy(src / S.RUN_JSON, dst / S.RUN_JSON)
    for rname, fs in files.items():
        for fname, (data, _) in fs.items():
            (dst / rname / fname).write_bytes(data)
    live.poll()
    assert_same(live, dst)
    assert live.ended
