"""Hostile and broken inputs: one line and a documented exit code, never a traceback.

Each class of bad input from issue 14 gets a case here. Every case runs
`ncclscope.cli.main.main([...])` in-process and checks:
- the exit code: 2 when nothing could be read (or an output path cannot be
  written), 0/1 when the input is partly readable and was analyzed;
- stderr: for exit 2 exactly one line naming the problem; never "Traceback";
- partly readable input: its warnings are printed (on stderr) before the verdict;
- the input is unmodified (bytes of every regular file, and the file list).
"""
from __future__ import annotations

import gzip
import hashlib
import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from conftest import ROOT
from ncclscope.cli import main as cli
from ncclscope.load import safe_io

SAMPLES = ROOT / "sample_traces"
pytestmark = pytest.mark.timeout(120)


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------
def snapshot(root: Path) -> dict[str, str]:
    """Path -> sha256 of every regular file (links and specials by kind), never blocking on a FIFO."""
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = "link:" + os.readlink(p)
            elif safe_io.is_regular(p):
                out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = "special"
    return out


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def copy_sample(tmp_path: Path, name: str = "healthy") -> Path:
    dst = tmp_path / name
    shutil.copytree(SAMPLES / name, dst)
    return dst


def check_unreadable(capsys, path: Path, *words: str) -> str:
    before = snapshot(path) if path.is_dir() else None
    rc, out, err = run(capsys, "analyze", str(path))
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in err and "Traceback" not in out
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert not out.startswith("OK"), out
    for w in words:
        assert w in err, err
    if before is not None:
        assert snapshot(path) == before
    return err


def check_partial(capsys, path: Path, *words: str) -> tuple[int, str, str]:
    before = snapshot(path)
    rc, out, err = run(capsys, "analyze", str(path))
    assert rc in (0, 1), (rc, out, err)
    assert "Traceback" not in err and "internal error" not in err, err
    assert out.splitlines()[0].split(":")[0].isupper(), out      # the verdict is stdout's first line
    assert "warning:" in err, err                                # the warnings came first, on stderr
    for w in words:
        assert w in err, err
    assert snapshot(path) == before
    return rc, out, err


def all_events_junk(run_dir: Path, data: bytes = b"\x00junk\xff" * 100) -> None:
    for d in run_dir.glob("rank-*"):
        (d / "events.arrows").write_bytes(data)
        for f in ("metrics.arrows", "samples.arrows"):
            (d / f).unlink(missing_ok=True)


# --------------------------------------------------------------------------
# item 1: unreadable input is not "OK"
# --------------------------------------------------------------------------
def test_run_dir_with_only_junk_events_is_unreadable(tmp_path, capsys):
    d = copy_sample(tmp_path)
    all_events_junk(d)
    check_unreadable(capsys, d, "nothing readable", "events.arrows")
    rc, out, err = run(capsys, "report", str(d), "-o", str(tmp_path / "r.html"))
    assert rc == 2 and not (tmp_path / "r.html").exists() and len(err.strip().splitlines()) == 1


def test_cut_off_profiler_trace_is_unreadable(tmp_path, capsys):
    d = tmp_path / "prof"
    d.mkdir()
    doc = {"schemaVersion": 1, "distributedInfo": {"rank": 0, "world_size": 1}, "traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "ts": 1.0, "dur": 2.0}]}
    text = json.dumps(doc, indent=2)
    (d / "trace.json").write_text(text[: text.index("gloo:all_reduce") - 20])   # cut inside traceEvents
    check_unreadable(capsys, d, "nothing readable")


def test_partly_readable_run_dir_shows_warnings_first(tmp_path, capsys):
    d = copy_sample(tmp_path)
    (d / "rank-00001" / "events.arrows").write_bytes(b"not arrow at all")
    check_partial(capsys, d, "rank-00001")


# --------------------------------------------------------------------------
# item 2: wrong JSON types and unusable output paths
# --------------------------------------------------------------------------
def test_profiler_trace_events_not_a_list(tmp_path, capsys):
    d = tmp_path / "prof"
    d.mkdir()
    (d / "trace.json").write_text('{"traceEvents": 5}')
    check_unreadable(capsys, d)


@pytest.mark.parametrize("make_out", [
    lambda t: ["report", "-o", str(t / "afile" / "r.html")],
    lambda t: ["report", "-o", "/proc/r.html"],
    lambda t: ["report", "-o", str(t)],                                      # a directory
    lambda t: ["export", "--perfetto", str(t / "afile" / "x.json")],
    lambda t: ["export", "--parquet", str(t / "afile")],
    lambda t: ["export", "--parquet", str(t / "afile" / "sub")],
], ids=["report-file-parent", "report-proc", "report-dir", "perfetto-file-parent", "parquet-is-file",
        "parquet-file-parent"])
def test_unwritable_output_paths(tmp_path, capsys, make_out):
    (tmp_path / "afile").write_text("x")
    argv = make_out(tmp_path)
    sub, rest = argv[0], argv[1:]
    before = snapshot(SAMPLES / "healthy")
    rc, out, err = run(capsys, sub, str(SAMPLES / "healthy"), *rest)
    assert rc == 2, (rc, out, err)
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert (tmp_path / "afile").read_text() == "x"
    assert snapshot(SAMPLES / "healthy") == before


@pytest.mark.parametrize("out", ["/proc/nope", "{tmp}/afile/run"], ids=["proc", "file-parent"])
def test_train_out_unusable(tmp_path, capsys, out):
    pytest.importorskip("torch")
    (tmp_path / "afile").write_text("x")
    rc, _, err = run(capsys, "train", "--dp", "2", "--steps", "1", "--out", out.format(tmp=tmp_path))
    assert rc == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert "--out" in err


# --------------------------------------------------------------------------
# item 3: fuzzed and hostile run directories
# --------------------------------------------------------------------------
def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset % len(data)] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("offset", [8, 200, 400, 1000, 3000, 6000, 9000, 12000])
def test_flipped_byte_in_events_never_crashes(tmp_path, capsys, offset):
    d = copy_sample(tmp_path)
    _flip(d / "rank-00000" / "events.arrows", offset)
    before = snapshot(d)
    rc, out, err = run(capsys, "analyze", str(d))
    assert rc in (0, 1, 2) and "Traceback" not in err and "internal error" not in err, err
    assert snapshot(d) == before


def _rewrite_events(path: Path, transform) -> None:
    import pyarrow as pa
    import pyarrow.ipc
    table = pa.ipc.open_stream(pa.BufferReader(path.read_bytes())).read_all()
    table = transform(table)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    path.write_bytes(sink.getvalue().to_pybytes())


def _bad_utf8(table):
    import pyarrow as pa
    i = table.schema.get_field_index("op_name")
    col = table.column(i).combine_chunks()
    if pa.types.is_dictionary(col.type):
        col = col.dictionary_decode()
    bufs = col.buffers()
    data = bytearray(bufs[2].to_pybytes())
    data[0] = 0xFF
    bad = pa.Array.from_buffers(pa.string(), len(col), [bufs[0], bufs[1], pa.py_buffer(bytes(data))])
    return table.set_column(i, "op_name", bad)


def _dup_column(table):
    return table.append_column("rank", table.column("rank"))


def _rename_column(table):
    names = list(table.column_names)
    names[names.index("op_name")] = "op_name_v2"
    return table.rename_columns(names)


def _retype_column(table):
    import pyarrow as pa
    i = table.schema.get_field_index("time_ns")
    return table.set_column(i, "time_ns", pa.array([[1]] * len(table), pa.list_(pa.int64())))


@pytest.mark.parametrize("transform", [_bad_utf8, _dup_column, _rename_column, _retype_column],
                         ids=["invalid-utf8", "duplicated-column", "renamed-column", "retyped-column"])
def test_hostile_arrow_columns(tmp_path, capsys, transform):
    d = copy_sample(tmp_path)
    _rewrite_events(d / "rank-00000" / "events.arrows", transform)
    before = snapshot(d)
    rc, out, err = run(capsys, "analyze", str(d))
    assert rc in (0, 1, 2) and "Traceback" not in err and "internal error" not in err, err
    assert "warning:" in err or rc == 2
    assert snapshot(d) == before


def _deep(n: int = 1000) -> str:
    return "[" * n + "]" * n


@pytest.mark.parametrize("name, content", [
    ("rank.json", '{"rank": 0, "host": ' + _deep() + "}"),
    ("rank.json", '{"rank": 0, "clock_offset_ns": 9223372036854775808, "pid": 1e30, "world_size": Infinity}'),
    ("rank.json", '{"rank": 0, "host": "\\ud800", "coords": {"dp": -Infinity}}'),
    ("rank.json", '{"rank": 0, "world_size": 2147483648}'),
], ids=["deep", "huge-numbers", "surrogate-and-inf", "world-2^31"])
def test_hostile_rank_json(tmp_path, capsys, name, content):
    d = copy_sample(tmp_path)
    (d / "rank-00000" / name).write_text(content)
    before = snapshot(d)
    rc, out, err = run(capsys, "analyze", str(d))
    assert rc in (0, 1) and "Traceback" not in err and "internal error" not in err, err
    assert out.startswith(("OK", "HANG", "DEAD", "WRONG", "MISMATCH", "STRAGGLER", "DEADLOCK", "STUCK", "GROUP",
                           "UNMATCHED", "DIVERGED", "NAN", "GRAD", "SLOW", "MOE")), out
    assert snapshot(d) == before
    assert len(out.splitlines()) < 200        # no world of 2**31 ranks


def test_world_size_2_31_in_run_json(tmp_path, capsys):
    d = copy_sample(tmp_path)
    run_json = json.loads((d / "run.json").read_text())
    run_json["world_size"] = 2**31
    (d / "run.json").write_text(json.dumps(run_json))
    rc, out, err = check_partial(capsys, d, "world_size 2147483648")
    assert "Ranks (2)" in out


def test_run_json_fields_of_the_wrong_type(tmp_path, capsys):
    """run.json is typed once (load/run_info.py): a field of the wrong type is its empty value and a
    warning, and every face that reads the run info (analyze, the TUI's first screen, the report) works."""
    from ncclscope.load.run_info import RunInfo
    from ncclscope.tui.model import preliminary_model
    d = copy_sample(tmp_path)
    run_json = json.loads((d / "run.json").read_text())
    run_json.update({"config": 5, "ranks": "x", "end_reason": [1], "n_params": "many", "source": {}})
    (d / "run.json").write_text(json.dumps(run_json))
    check_partial(capsys, d, "config (int)", "ranks (str)", "end_reason (list)", "source (dict)")
    info = RunInfo.from_dict(run_json)
    assert (info.config, info.exits, info.end_reason, info.n_params, info.source) == ({}, {}, "", None, "")
    assert info.raw is run_json and info.world_size == 2
    assert preliminary_model(d, info).world_size == 2
    rc, out, err = run(capsys, "report", str(d), "-o", str(tmp_path / "r.html"))
    assert rc in (0, 1) and "Traceback" not in err, err


@pytest.mark.parametrize("name", ["rank-1000000000", "rank-" + "9" * 30, "rank-5000"])
def test_stray_rank_directory(tmp_path, capsys, name):
    d = copy_sample(tmp_path)
    shutil.copytree(d / "rank-00001", d / name)
    rc, out, err = check_partial(capsys, d, name)
    assert "Ranks (2)" in out


def test_run_dir_special_files(tmp_path, capsys):
    d = copy_sample(tmp_path)
    r0 = d / "rank-00000"
    (r0 / "rank.json").unlink()
    os.symlink("/dev/zero", r0 / "rank.json")
    (r0 / "events.arrows").unlink()
    os.mkfifo(r0 / "events.arrows")                      # a named pipe must not hang the reader
    rc, out, err = check_partial(capsys, d, "named pipe")
    assert "not a regular file" in err


def test_events_linked_to_urandom(tmp_path, capsys):
    d = copy_sample(tmp_path)
    (d / "rank-00001" / "events.arrows").unlink()
    os.symlink("/dev/urandom", d / "rank-00001" / "events.arrows")
    check_partial(capsys, d, "device")


def _load_reads_safely() -> bool:
    """Whether trace.load reads groups.json and stacks.txt through safe_io (then /dev/zero is safe to try)."""
    import inspect

    from ncclscope.load import trace
    src = inspect.getsource(trace.load)
    return "read_bytes()" not in src and ".read_text(errors" not in src


@pytest.mark.parametrize("name, kind", [("stacks.txt", "dir"), ("stacks.txt", "zero"), ("groups.json", "zero"),
                                        ("groups.json", "deep"), ("groups.json", "surrogate")])
def test_stacks_and_groups_hostile(tmp_path, capsys, name, kind):
    if kind == "zero" and not _load_reads_safely():
        pytest.skip("trace.load reads this file without a size limit: /dev/zero would exhaust memory")
    d = copy_sample(tmp_path)
    p = d / "rank-00000" / name
    p.unlink(missing_ok=True)
    if kind == "dir":
        p.mkdir()
    elif kind == "zero":
        os.symlink("/dev/zero", p)
    elif kind == "deep":
        p.write_text(_deep())
    else:
        p.write_text('[{"name": "\\ud800", "kind": "world", "ranks": [0, 1], "creation_order": 0}]')
    rc, out, err = run(capsys, "analyze", str(d))
    assert rc in (0, 1) and "Traceback" not in err and "internal error" not in err, err


# --------------------------------------------------------------------------
# Flight Recorder and profiler shapes
# --------------------------------------------------------------------------
def _entry(rank: int, i: int, **kw):
    e = {"record_id": i, "process_group": ("0", "default_pg"), "collective_seq_id": i + 1, "p2p_seq_id": 0,
         "profiling_name": "nccl:all_reduce", "input_sizes": [[1024]], "input_dtypes": ["Float"],
         "state": "completed", "time_created_ns": 1_700_000_000_000_000_000 + i * 1000 + rank,
         "time_discovered_started_ns": 1_700_000_000_000_000_000 + i * 1000 + 10,
         "time_discovered_completed_ns": 1_700_000_000_000_000_000 + i * 1000 + 500, "timeout_ms": 600000,
         "is_p2p": False, "thread_id": "1", "frames": []}
    e.update(kw)
    return e


def _fr_dir(tmp_path: Path, dumps: dict[int, dict], fmt: str = "pickle", name: str = "nccl_trace_rank_") -> Path:
    d = tmp_path / "fr"
    d.mkdir(exist_ok=True)
    for r, dump in dumps.items():
        if fmt == "pickle":
            (d / f"{name}{r}").write_bytes(pickle.dumps(dump, protocol=2))
        else:
            (d / f"{name}{r}.json").write_text(dump if isinstance(dump, str) else json.dumps(dump))
    return d


def _dump(rank: int, world: int = 2, entries=None, **kw):
    d = {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": str(list(range(world)))}},
         "pg_status": {}, "entries": entries if entries is not None else [_entry(rank, i) for i in range(3)]}
    d.update(kw)
    return d


def test_fr_state_list_and_self_reference(tmp_path, capsys):
    bad = _dump(1, entries=[_entry(1, 0, state=[]), _entry(1, 1, process_group=[["x"], {"y": 1}])])
    loop: dict = {"filename": "a.py"}
    loop["self"] = loop
    bad["entries"].append(_entry(1, 2, frames=[loop], input_sizes=loop))
    d = _fr_dir(tmp_path, {0: _dump(0), 1: bad})
    before = snapshot(d)
    rc, out, err = run(capsys, "analyze", str(d))
    assert rc in (0, 1) and "Traceback" not in err and "internal error" not in err, err
    assert snapshot(d) == before


def test_fr_huge_numbers_and_ranks(tmp_path, capsys):
    dumps = {0: _dump(0, pg_config={"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, ..., 100000000000]"},
                                    "1": {"name": "1", "desc": "x", "ranks": [0, 10**74]}}),
             1: _dump(1, entries=[_entry(1, 0, time_created_ns=10**30), _entry(1, 1, time_created_ns=float("inf")),
                                  _entry(1, 2, record_id=-(10**40), input_sizes=[[10**30, 10**30]])])}
    d = _fr_dir(tmp_path, dumps)
    shutil.copy(d / "nccl_trace_rank_1", d / "nccl_trace_rank_1000000")      # a dump copied as a huge rank
    rc, out, err = run(capsys, "analyze", str(d))
    assert rc in (0, 1) and "Traceback" not in err and "internal error" not in err, err
    assert "rank_1000000" in err
    assert "Ranks (2)" in out


def test_fr_json_deep_and_nonfinite(tmp_path, capsys):
    good = json.dumps(_dump(0))
    deep = '{"version": "2.10", "entries": [' + _deep() + "]}"
    nonfinite = good.replace('"timeout_ms": 600000', '"timeout_ms": -Infinity')
    d = _fr_dir(tmp_path, {0: nonfinite, 1: deep}, fmt="json")
    rc, out, err = run(capsys, "analyze", str(d))
    assert rc in (0, 1) and "Traceback" not in err and "internal error" not in err, err
    assert "nested too deeply" in err or "nested more than" in err


def test_fr_all_dumps_unreadable(tmp_path, capsys):
    d = _fr_dir(tmp_path, {0: '{"entries": [' + _deep() + "]}"}, fmt="json")
    check_unreadable(capsys, d)


def _prof(rank: int, **header) -> dict:
    doc = {"schemaVersion": 1, "distributedInfo": {"rank": rank, "world_size": 2}, "baseTimeNanoseconds": 10**18,
           "traceEvents": [{"ph": "X", "cat": "user_annotation", "name": "gloo:all_reduce", "pid": 1, "tid": 1,
                            "ts": 100.0 + i * 50, "dur": 10.0, "args": {}} for i in range(3)]}
    doc.update(header)
    return doc


def test_profiler_hostile_numbers(tmp_path, capsys):
    d = tmp_path / "prof"
    d.mkdir()
    a = _prof(0)
    a["traceEvents"][0]["ts"] = 1e308
    a["traceEvents"][1]["dur"] = 1e308
    (d / "rank0.json").write_text(json.dumps(a))
    b = json.dumps(_prof(1, distributedInfo={"rank": 10**11, "world_size": 2**31,
                                             "pg_config": [{"pg_name": "0", "pg_desc": "default_pg",
                                                            "ranks": list(range(3)) + [10**74]}]}))
    (d / "rank1.json").write_text(b.replace('"baseTimeNanoseconds": 1000000000000000000',
                                            '"baseTimeNanoseconds": -Infinity'))
    (d / "rank2.json").write_text('{"traceEvents": [' + _deep(1200) + "]}")
    with gzip.open(d / "rank3.json.gz", "wb") as fh:
        fh.write(b'{"traceEvents": [')                      # cut off
    before = snapshot(d)
    rc, out, err = run(capsys, "analyze", str(d))
    assert rc in (0, 1) and "Traceback" not in err and "internal error" not in err, err
    assert snapshot(d) == before
    assert len(out.splitlines()) < 100


def test_hostile_strings_in_output(tmp_path, capsys):
    """HTML, Rich markup and control characters from a trace reach the terminal defanged."""
    d = tmp_path / "prof"
    d.mkdir()
    doc = _prof(0)
    doc["host_name"] = "[/bold]<script>\x1b[31m"
    for e in doc["traceEvents"]:
        e["name"] = "gloo:all_reduce"
    doc["distributedInfo"]["pg_config"] = [{"pg_name": "[/bold]\x1b]0;x\x07", "pg_desc": "<b>", "ranks": [0]}]
    doc["distributedInfo"]["world_size"] = 1
    (d / "rank0.json").write_text(json.dumps(doc))
    rc, out, err = run(capsys, "analyze", str(d))
    assert rc in (0, 1) and "Traceback" not in err, err
    assert "\x1b" not in out and "\x07" not in out and "\x1b" not in err


# --------------------------------------------------------------------------
# usage and internal errors
# --------------------------------------------------------------------------
def test_missing_path_and_special_path(tmp_path, capsys):
    check_unreadable(capsys, tmp_path / "nope", "no such file")
    os.mkfifo(tmp_path / "fifo")
    check_unreadable(capsys, tmp_path / "fifo", "named pipe")


def test_internal_error_is_exit_3_with_one_line(tmp_path, capsys, monkeypatch):
    import ncclscope.verdict as A

    def boom(trace):
        raise ZeroDivisionError("synthetic bug")
    monkeypatch.setattr(A, "run", boom)
    rc, out, err = run(capsys, "analyze", str(SAMPLES / "healthy"))
    assert rc == 3 and len(err.strip().splitlines()) == 1 and "internal error" in err and "Traceback" not in err
    rc, out, err = run(capsys, "--debug", "analyze", str(SAMPLES / "healthy"))
    assert rc == 3 and "Traceback" in err and "ZeroDivisionError" in err


def test_exit_codes_are_documented():
    doc = cli.__doc__ or ""
    for code in ("0 ", "1 ", "2 ", "3 "):
        assert f"\n    {code}" in doc
    guide = (ROOT / "docs" / "guide" / "analyze.md").read_text()
    assert "Exit codes" in guide and "| 3 |" in guide


def test_a_rank_json_two_writes_left_over_each_other_is_read_up_to_its_first_object(tmp_path, capsys):
    """Seed 20261217 #78: two writes of rank 0's rank.json over each other left the later, shorter document
    whole and the tail of the earlier one after it ("extra data at character 1923"); the whole file was
    ignored, the rank's Flight Recorder group names with it, and the verdict named rank 0 (a victim) instead of
    rank 1 (os._exit). The object is what the rank last wrote: it is read, with one warning."""
    d = copy_sample(tmp_path)
    path = d / "rank-00000" / "rank.json"
    whole = path.read_text()
    path.write_text(whole + whole[-40:])
    before = snapshot(d)
    rc, out, err = run(capsys, "analyze", str(d))
    assert rc == 0 and out.startswith("OK"), out
    assert "rank.json: a complete JSON object, then 40 characters of something else" in err, err
    assert "unreadable JSON" not in err, err
    assert snapshot(d) == before
    path.write_text(whole[:-40])                 # cut short: no object to read, ignored as before
    rc, out, err = run(capsys, "analyze", str(d))
    assert "rank.json: unreadable JSON" in err and "ignored" in err, err
