"""The loader's fast paths against the plain code they stand in for (same frames, warnings and errors).

Each fast path exists to cut the CPU of loading a 16,384-rank run directory (docs/scale.md): a missing
column filled once per batch of ranks instead of once per file (`streams.read_stream_lazy`,
`columns.Columns._runs`), one listing per rank directory instead of a stat per question
(`trace.RunDirLoader.add_rank`), string codes registered in one pass (`Columns._codes_chunked`), the begin rows of
`ops` gathered with numpy (`opsjoin._take`), JSON without the walk where it cannot change anything
(`safe_io.loads`), small files read on a bare descriptor (`safe_io.read_bytes`). What must not change
is the result, torn and hostile input included: each case is compared with the plain path here.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from ncclscope.load import columns as C
from ncclscope.load import opsjoin as J
from ncclscope.load import safe_io
from ncclscope import schema as S
from ncclscope.load import trace as T
from ncclscope.load.ipc_read import read_stream, read_stream_lazy


def _events(rank: int, n: int, seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed + rank)
    ops = np.repeat(np.arange(n // 2 + 1), 2)[:n]
    cols = {f.name: pa.nulls(n, f.type).fill_null(-1 if pa.types.is_integer(f.type) else "")
            for f in S.EVENTS_SCHEMA}
    cols["rank"] = pa.array(np.full(n, rank), pa.int32())
    cols["op_id"] = pa.array(ops, pa.int64())
    cols["phase"] = pa.array(np.where(np.arange(n) % 2 == 0, "begin", "end"))
    cols["time_ns"] = pa.array(np.arange(n, dtype=np.int64) * 1000 + rank)
    cols["kind"] = pa.array(rng.choice(["collective", "p2p", "compute"], n))
    cols["op_name"] = pa.array(rng.choice(["all_reduce", "isend", "forward", "x" * 30], n))
    cols["process_group"] = pa.array(rng.choice(["dp0", "", "tp1"], n))
    cols["status"] = pa.array(np.where(np.arange(n) % 2 == 1, "ok", ""))
    return pa.table(cols, schema=S.EVENTS_SCHEMA)


def _metrics(rank: int, n: int, drop: tuple[str, ...] = ()) -> pa.Table:
    cols = {}
    for f in S.METRICS_SCHEMA:
        if f.name in drop:
            continue
        if f.name == "rank":
            cols[f.name] = pa.array(np.full(n, rank), pa.int32())
        elif pa.types.is_integer(f.type):
            cols[f.name] = pa.array(np.arange(n), f.type)
        elif pa.types.is_floating(f.type):
            cols[f.name] = pa.array(np.linspace(0, 1, n), f.type)
        elif pa.types.is_list(f.type):
            cols[f.name] = pa.array([[i, 1] for i in range(n)], f.type)
        else:
            cols[f.name] = pa.array([f"{{\"i\": {i}}}" for i in range(n)], f.type)
    return pa.table(cols)


def _write(path: Path, table: pa.Table, batch: int = 7) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {b"ncclscope_schema": S.SCHEMA_VERSION.encode()}
    with pa.ipc.new_stream(str(path), table.schema.with_metadata(meta)) as w:
        for b in table.to_batches(max_chunksize=batch):
            w.write_batch(b)


def _run(tmp: Path, ranks: int = 4, drop: tuple[str, ...] = ("grad_norm_reduced",)) -> Path:
    root = tmp / "run"
    for r in range(ranks):
        d = root / S.rank_dir_name(r)
        _write(d / S.EVENTS_FILE, _events(r, 20 + r))
        _write(d / S.METRICS_FILE, _metrics(r, 3 + r, drop))
        (d / S.RANK_JSON).write_text(json.dumps({"rank": r, "world_size": ranks, "host": "h", "pid": 10 + r,
                                                 "clock_offset_ns": r * 7, "coords": {"dp": r}}))
    (root / S.RUN_JSON).write_text(json.dumps({"world_size": ranks}))
    return root


def _plain_tables(root: Path, schema: pa.Schema, name: str) -> tuple[pd.DataFrame, list[str]]:
    """The plain path: every file conformed on its own (`read_stream`), rank forced table by table."""
    warnings: list[str] = []
    cols = C.Columns(schema)
    for d in sorted(root.glob("rank-*")):
        cols.add(C.force_rank(read_stream(d / name, schema, warnings), int(d.name[5:])))
    return cols.frame(), warnings


@pytest.mark.parametrize("drop", [(), ("grad_norm_reduced",), ("grad_norm_reduced", "extra", "tokens")])
def test_lazy_fill_is_the_per_file_conform(tmp_path: Path, drop: tuple[str, ...]) -> None:
    root = _run(tmp_path, 5, drop)
    trace = T.load(root)
    want, warns = _plain_tables(root, S.METRICS_SCHEMA, S.METRICS_FILE)
    want["time_ns"] = want["time_ns"] + want["rank"].to_numpy().astype(np.int64) * 7
    pd.testing.assert_frame_equal(trace.metrics, want, check_exact=True)
    events, _ = _plain_tables(root, S.EVENTS_SCHEMA, S.EVENTS_FILE)
    events = _begin_first(events)                # the loader keeps the begin rows first (trace.assemble)
    pd.testing.assert_frame_equal(trace.events.drop(columns=["t_ns"]), events, check_exact=True)
    assert not warns and not [w for w in trace.warnings if "metrics" in w]


def test_mixed_schemas_in_one_batch_keep_row_order(tmp_path: Path) -> None:
    """Ranks alternating between full and short metrics files: runs are filled apart, rows stay in order."""
    cols, plain = C.Columns(S.METRICS_SCHEMA), C.Columns(S.METRICS_SCHEMA)
    for r in range(9):
        t = _metrics(r, 2 + r % 3, ("grad_norm_reduced",) if r % 3 else ())
        cols.add(t, rank=r)
        plain.add(C.force_rank(C.conform_table(t, S.METRICS_SCHEMA, Path("."), []), r))
    pd.testing.assert_frame_equal(cols.frame(), plain.frame(), check_exact=True)


def _hostile(tmp: Path) -> dict[str, Path]:
    good = tmp / "good.arrows"
    _write(good, _events(0, 30))
    data = good.read_bytes()
    out = {"good": good}
    (tmp / "torn.arrows").write_bytes(data[: len(data) - 200])
    out["torn"] = tmp / "torn.arrows"
    (tmp / "empty.arrows").write_bytes(b"")
    out["empty"] = tmp / "empty.arrows"
    (tmp / "junk.arrows").write_bytes(b"\xff" * 100)
    out["junk"] = tmp / "junk.arrows"
    (tmp / "dir.arrows").mkdir()
    out["dir"] = tmp / "dir.arrows"
    flip = bytearray(data)
    flip[len(flip) // 2] ^= 0xFF
    (tmp / "flip.arrows").write_bytes(bytes(flip))
    out["flip"] = tmp / "flip.arrows"
    extra = _events(0, 10).append_column("surprise", pa.array(np.arange(10)))
    _write(tmp / "extra.arrows", extra)
    out["extra"] = tmp / "extra.arrows"
    badtype = _events(0, 10).drop_columns(["op_id"]).append_column("op_id", pa.array(["x"] * 10))
    _write(tmp / "badtype.arrows", badtype)
    out["badtype"] = tmp / "badtype.arrows"
    short = _events(0, 10).drop_columns(["message", "tag"])
    _write(tmp / "short.arrows", short)
    out["short"] = tmp / "short.arrows"
    out["missing"] = tmp / "nope.arrows"
    os.symlink(tmp / "gone", tmp / "dangling.arrows")
    out["dangling"] = tmp / "dangling.arrows"
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp / "fifo.arrows")
        out["fifo"] = tmp / "fifo.arrows"
    return out


def test_lazy_reader_says_what_the_plain_one_says(tmp_path: Path) -> None:
    for name, path in _hostile(tmp_path).items():
        w_plain: list[str] = []
        w_lazy: list[str] = []
        plain = read_stream(path, S.EVENTS_SCHEMA, w_plain)
        lazy, absent = read_stream_lazy(str(path), S.EVENTS_SCHEMA, w_lazy)
        assert w_lazy == w_plain, name
        assert all("\n" not in w and str(path) in w for w in w_lazy), name
        assert absent == (not path.exists()), name
        filled = C.Columns(S.EVENTS_SCHEMA)
        filled.add(lazy, rank=0)
        want = C.Columns(S.EVENTS_SCHEMA)
        want.add(C.force_rank(plain, 0))
        pd.testing.assert_frame_equal(filled.frame(), want.frame(), check_exact=True)
        if name == "short":
            assert lazy.num_columns < plain.num_columns     # left for the column engine to fill


def test_hostile_rank_files_warn_once_and_the_rest_loads(tmp_path: Path) -> None:
    root = _run(tmp_path, 4)
    d1, d2, d3 = (root / S.rank_dir_name(r) for r in (1, 2, 3))
    (d1 / S.EVENTS_FILE).write_bytes((d1 / S.EVENTS_FILE).read_bytes()[:-150])          # torn tail
    (d2 / S.EVENTS_FILE).unlink()                                                        # never wrote
    (d2 / S.RANK_JSON).write_text('{"rank": 2, "world_size": 99999999999999999999999999999999999999999999}')
    (d3 / S.RANK_JSON).write_text("[" * 100 + "]" * 100)                                # too deep
    (d3 / S.GROUPS_JSON).write_text('{"format": 2, "fingerprint": "f", "groups": ')     # torn JSON
    (d3 / S.STACKS_FILE).mkdir()                                                         # not a file
    trace = T.load(root)
    assert sorted(trace.events["rank"].unique().tolist()) == [0, 1, 3]
    text = "\n".join(trace.warnings)
    assert f"{d1 / S.EVENTS_FILE}: torn batch" in text
    assert f"{d2 / S.EVENTS_FILE}: missing" in text
    assert f"{d3 / S.RANK_JSON}: nested more than" in text
    assert f"{d3 / S.GROUPS_JSON}: unreadable JSON" in text
    assert f"{d3 / S.STACKS_FILE}: unreadable" in text
    assert all("\n" not in w for w in trace.warnings)
    assert trace.world_size == 4 and trace.ranks[2].pid == -1 and trace.ranks[1].pid == 11


@pytest.mark.parametrize("seed", range(30))
def test_chunked_codes_with_nulls_anywhere_are_the_per_chunk_ones(seed: int) -> None:
    rng = np.random.default_rng(seed)
    values = ["a", "", "bb", None, "c", "dd"]
    chunks = [pa.array([values[i] for i in rng.integers(0, 6 if rng.random() < 0.3 else 3, int(rng.integers(0, 6)))],
                       pa.string()) for _ in range(int(rng.integers(2, 9)))]
    fast = C.Columns(pa.schema([("op_name", pa.string())]))
    slow = C.Columns(pa.schema([("op_name", pa.string())]))
    fast.cats["op_name"] = {"c": 0} if seed % 2 else {}
    slow.cats["op_name"] = dict(fast.cats["op_name"])
    got = fast._codes_chunked("op_name", chunks)
    want = np.concatenate([slow._codes("op_name", [c]) for c in chunks])
    assert list(fast.cats["op_name"]) == list(slow.cats["op_name"])
    assert got.dtype == want.dtype and np.array_equal(got, want)


@pytest.mark.parametrize("seed", range(10))
def test_ops_gather_is_the_iloc(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 60))
    events = pd.DataFrame({
        "rank": rng.integers(0, 4, n).astype(np.int32), "op_id": rng.integers(0, 9, n),
        "phase": pd.Categorical(rng.choice(["begin", "end", "instant"], n)), "time_ns": rng.integers(0, 99, n),
        "kind": pd.Categorical(rng.choice(["p2p", "compute"], n), categories=["p2p", "compute", "never"]),
        "status": pd.Categorical(rng.choice(["", "ok"], n)), "message": pd.Categorical(rng.choice(["", "m"], n)),
        "bytes": rng.random(n), "text": pd.array(rng.choice(["x", "y"], n), dtype=object),
        "t_ns": rng.integers(0, 99, n)})
    rows = np.flatnonzero(rng.random(n) < 0.6)
    match = np.where(rng.random(len(rows)) < 0.5, rng.integers(0, n, len(rows)), -1)
    got = J.ops_from_join(events, rows, match, match >= 0)
    keep = [c for c in events.columns if c not in ("phase", "status", "message", "time_ns")]
    want = events[keep].iloc[rows].rename(columns={"t_ns": "start_ns"}).reset_index(drop=True)
    pd.testing.assert_frame_equal(got[want.columns], want, check_exact=True)


def _plain_loads(text: str) -> object:
    obj, _ = safe_io._DECODER.raw_decode(text, safe_io._skip_ws(text, 0))
    return safe_io.sanitize(obj, "x", has_surrogates="\\ud" in text or "\\uD" in text)


@pytest.mark.parametrize("text", ['{"a": 1}', '[' * 64 + ']' * 64, '{"k": "\\ud800"}', '{"\\uDFFF": [1, 2.5]}',
                                  '{"n": ' + "9" * 41 + '}', '{"n": -' + "1" * 40 + ', "m": 3}', '[1e400, NaN]',
                                  '{"s": "[[[[{{{{"}', '{"big": ' + "1" * 39 + "}"])
def test_loads_fast_path_is_the_walk(text: str) -> None:
    assert safe_io.loads(text, "x") == _plain_loads(text)
    assert safe_io.loads(text.encode(), "x") == _plain_loads(text)


def test_loads_still_refuses_deep_nesting() -> None:
    with pytest.raises(safe_io.InputError, match="nested more than"):
        safe_io.loads("[" * 65 + "]" * 65, "x")


def test_read_bytes_limits_and_kinds(tmp_path: Path) -> None:
    f = tmp_path / "f.json"
    f.write_bytes(b"x" * 100_000)
    assert safe_io.read_bytes(f, 100_000) == b"x" * 100_000
    (tmp_path / "empty").write_bytes(b"")
    assert safe_io.read_bytes(tmp_path / "empty", 10) == b""
    for path, limit, why in ((f, 99_999, "over the 99999-byte limit"), (tmp_path, 10, "a directory"),
                             (tmp_path / "no", 10, "unreadable")):
        with pytest.raises(safe_io.InputError, match=why) as exc:
            safe_io.read_bytes(path, limit)
        assert str(path) in str(exc.value) and "\n" not in str(exc.value)


@pytest.mark.parametrize("value", [0, -1, 2**53, 2**53 + 1, -(2**53) - 1, True, 3.0, 3.5, "12", " 7 ", None, [1]])
def test_int_fast_path_is_to_int(value: object) -> None:
    assert T._int(value, -9) == safe_io.to_int(value, -9, -(2**53), 2**53)


def test_world_bound_uses_the_cached_highest_rank(tmp_path: Path) -> None:
    root = _run(tmp_path, 3)
    (root / S.rank_dir_name(1) / S.RANK_JSON).write_text(json.dumps({"rank": 1, "world_size": 10**9}))
    trace = T.load(root)
    assert trace.world_size == 3
    assert any("says world_size 1000000000, but 3 rank directories" in w and "using 3" in w
               for w in trace.warnings)


def test_missing_only() -> None:
    want = S.METRICS_SCHEMA
    assert C.missing_only(pa.schema([want.field("rank"), want.field("loss")]), want)
    assert not C.missing_only(pa.schema([want.field("rank"), ("loss", pa.string())]), want)
    assert not C.missing_only(pa.schema([want.field("rank"), ("zzz", pa.int32())]), want)
    assert not C.missing_only(pa.schema([want.field("rank"), want.field("rank")]), want)


@pytest.mark.parametrize("seed", range(40))
def test_direct_join_is_the_sorted_join(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Dense op ids (the direct slot table) and every case it must hand back (duplicate or unsorted
    end rows, sparse or huge ids): the same ops as the sorted-key join."""
    from ncclscope.load import opsjoin
    rng = np.random.default_rng(seed)
    rows = []
    for r in range(int(rng.integers(1, 5))):
        n = int(rng.integers(0, 12))
        ids = np.arange(n) * (1 if seed % 4 else int(rng.integers(1, 2**33)))
        for i in ids:
            rows.append((r, int(i), "begin", int(rng.integers(0, 99))))
            if rng.random() < 0.7:
                rows.append((r, int(i), "end", int(rng.integers(0, 99))))
            if seed % 5 == 0 and rng.random() < 0.2:
                rows.append((r, int(i), "end", int(rng.integers(0, 99))))       # a second end row
            if rng.random() < 0.1:
                rows.append((r, -1, "instant", int(rng.integers(0, 99))))
    if seed % 3 == 0 and len(rows) > 2:
        rows = [rows[i] for i in rng.permutation(len(rows))]
    n = len(rows)
    events = pd.DataFrame({
        "rank": np.array([x[0] for x in rows], dtype=np.int32), "op_id": np.array([x[1] for x in rows], dtype=np.int64),
        "phase": pd.Categorical([x[2] for x in rows], categories=["begin", "end", "instant"]),
        "time_ns": np.array([x[3] for x in rows], dtype=np.int64),
        "status": pd.Categorical(rng.choice(["", "ok", "timeout"], n)), "message": pd.Categorical(rng.choice(["", "m"], n)),
        "t_ns": np.array([x[3] for x in rows], dtype=np.int64)})
    got = J.build_ops(events)
    monkeypatch.setattr(opsjoin, "_direct_join", lambda *a: None)
    want = J.build_ops(events)
    pd.testing.assert_frame_equal(got, want, check_exact=True)


def _begin_first(df: pd.DataFrame) -> pd.DataFrame:
    """The frame's begin rows, then the others, each in its order (what `Columns.frame(lead=...)` makes)."""
    begin = (df["phase"].astype(str) == "begin").to_numpy()
    return pd.concat([df[begin], df[~begin]]).reset_index(drop=True)


@pytest.mark.parametrize("seed", range(16))
def test_leading_rows_come_first_and_ops_are_views(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """`frame(lead=("phase", "begin"))`: the frame `frame()` makes with its begin rows first, each part in its
    order, over any batching (pieces that start, end or hold no begin row, rows that lead already); the ops
    `build_ops` makes from it equal the file order's, their columns views of the events' (and a write to
    either frame leaves the other as it was: copy-on-write)."""
    monkeypatch.setattr(C.Columns, "BATCH_ROWS", int(np.random.default_rng(seed).integers(1, 40)))
    rng = np.random.default_rng(seed)
    schema = pa.schema([("rank", pa.int32()), ("op_id", pa.int64()), ("phase", pa.string()), ("peer", pa.int32()),
                        ("kind", pa.string()), ("status", pa.string()), ("message", pa.string()),
                        ("time_ns", pa.int64()), ("note", pa.string())])
    tables = []
    for r in range(int(rng.integers(1, 6))):
        n = int(rng.integers(0, 40))
        p = [0.45, 0.45, 0.1] if seed % 4 else [1.0, 0.0, 0.0]
        phase = rng.choice(["begin", "end", "instant"], n, p=p)
        if seed % 4 == 1:
            phase = np.sort(phase)           # begin rows lead within the rank (not across ranks)
        tables.append(pa.table({"rank": pa.array(np.full(n, r, np.int32)), "op_id": pa.array(np.arange(n) // 2),
                                "phase": pa.array(phase.tolist(), pa.string()),
                                "peer": pa.array(rng.integers(-1, 3, n).astype(np.int32)),
                                "kind": pa.array(rng.choice(["p2p", "collective"], n).tolist()),
                                "status": pa.array(rng.choice(["", "ok"], n).tolist()),
                                "message": pa.array(rng.choice(["", "m"], n).tolist()),
                                "time_ns": pa.array(np.arange(n) * 10), "note": pa.array([f"n{i}" for i in range(n)])},
                               schema=schema))
    plain, lead = C.Columns(schema), C.Columns(schema)
    plain.cats.pop("note", None), lead.cats.pop("note", None)
    for t in tables:
        plain.add(t)
        lead.add(t)
    want = plain.frame()
    got = lead.frame(lead=("phase", "begin"))
    pd.testing.assert_frame_equal(got, _begin_first(want), check_exact=True)
    want["t_ns"], got["t_ns"] = want["time_ns"], got["time_ns"]
    want_ops, ops = J.build_ops(want), J.build_ops(got)
    pd.testing.assert_frame_equal(ops, want_ops, check_exact=True)
    nb = int((want["phase"] == "begin").sum())
    if nb and nb < len(got):
        for c in ("rank", "op_id", "peer", "start_ns"):
            assert np.shares_memory(ops[c].to_numpy(), got["t_ns" if c == "start_ns" else c].to_numpy())
        assert np.shares_memory(ops["kind"].array._codes, got["kind"].array._codes)
        before = got.copy()
        ops.loc[0, "peer"] = 99
        ops.loc[0, "kind"] = "p2p" if ops["kind"].iat[0] == "collective" else "collective"
        pd.testing.assert_frame_equal(got, before)
        got.loc[0, "rank"] = 7
        assert int(ops["rank"].iat[0]) == int(before["rank"].iat[0])
