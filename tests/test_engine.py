"""The three ways to run an analysis (in this process, `--workers N`, `--scheduler ADDRESS`) give the same
`analyze --json`, byte for byte, on every sample trace, a small synthetic scale trace and Flight Recorder dumps
(one folder, and one folder per node). One local Dask cluster of 2 workers is started and stopped here."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("distributed")

from conftest import cli_in_process                                 # noqa: E402
from ncclscope.cli.output import json_report                       # noqa: E402
from ncclscope.engine.cluster import Engine, open_engine           # noqa: E402
from ncclscope.load.foreign import load_any                        # noqa: E402
from ncclscope.verdict import run                                  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = sorted(p for p in (ROOT / "sample_traces").iterdir() if p.is_dir())
BENCH = ROOT / "benchmarks"
pytestmark = pytest.mark.timeout(300)


def _doc(path: Path, engine: Engine | None, ops_only: bool = False) -> str:
    trace = load_any(str(path), engine=engine, ops_only=ops_only)
    return json.dumps(json_report(trace, run(trace)), indent=1, default=str)


@pytest.fixture(scope="module")
def engine():
    """One local cluster for the module: 2 worker processes, one thread each; tasks forced small so that
    even the sample traces are split into several chunks (the merge is what is under test)."""
    seen: list[tuple[str, int, int]] = []
    with open_engine(workers=2, progress=lambda what, done, total: seen.append((what, done, total))) as e:
        e.seen = seen
        yield e


@pytest.fixture(scope="module")
def synth(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("synth") / "s64"
    subprocess.run([sys.executable, str(BENCH / "synth.py"), str(out), "--ranks", "64", "--events", "60000"],
                   check=True, capture_output=True, timeout=120)
    return out


@pytest.fixture(scope="module")
def synth_doc(synth) -> str:
    """`_doc(synth, None)`: the scale trace's report read in this process, computed once and shared by the tests
    that compare against it (read-only)."""
    return _doc(synth, None)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> Path:
    sys.path.insert(0, str(BENCH))
    from ingest import make_fr_dumps
    out = tmp_path_factory.mktemp("fr") / "dumps"
    make_fr_dumps(out, 32, 200, 13, skip="all_reduce")
    (out / "inputs.json").unlink(missing_ok=True)
    import pickle
    for r, keep in ((5, 120), (20, 60)):        # smaller ring buffers on some ranks: their oldest entries gone
        f = next(p for p in out.iterdir() if p.name.endswith(f"_{r}"))
        d = pickle.loads(f.read_bytes())
        d["entries"] = d["entries"][-keep:]
        f.write_bytes(pickle.dumps(d))
    return out


@pytest.mark.parametrize("sample", SAMPLES, ids=[p.name for p in SAMPLES])
def test_every_sample_trace_reads_the_same_on_workers(sample, engine, monkeypatch):
    monkeypatch.setattr("ncclscope.engine.rank_chunks.chunk_size", lambda n, w: 1)   # one rank per task
    # as analyze and report read it: joined on the workers, no event rows here (the stage-1 merge of the event
    # rows themselves, as the TUI and export read them, is held equal on the scale trace and the dumps below)
    assert _doc(sample, engine, ops_only=True) == _doc(sample, None)


def _same_tables(a, b) -> None:
    """Two Traces hold the same ops and marks (values, dtypes, categories in order) and event times."""
    import pandas as pd
    for x, y in ((a.ops, b.ops), (a.marks, b.marks)):
        pd.testing.assert_frame_equal(x, y, check_exact=True, check_categorical=True)
        for c in x.columns:
            if isinstance(x[c].dtype, pd.CategoricalDtype):
                assert list(x[c].cat.categories) == list(y[c].cat.categories), c
    assert (a.start_ns, a.end_ns) == (b.start_ns, b.end_ns)
    pd.testing.assert_series_equal(a.last_event_ns(), b.last_event_ns())
    from ncclscope.perf.utilization import analyze_utilization
    ua, ub = analyze_utilization(a), analyze_utilization(b)      # b's per-rank half was computed on the workers
    assert "utilization" in b.partials and not a.partials
    for name in ("per_rank", "idle", "waits", "series"):
        pd.testing.assert_frame_equal(getattr(ua, name), getattr(ub, name), check_exact=True)
    assert ua.source == ub.source
    with pytest.raises(ValueError, match="idle_pct"):         # the samples are not here to use another threshold
        analyze_utilization(b, idle_pct=50.0)


def test_ops_joined_on_workers_are_the_ops_one_process_joins(synth, engine, tmp_path, monkeypatch):
    """Chunks of several ranks, clocks with offsets, a rank with no directory and a torn events file: the driver
    that gets ops and marks from the workers holds the tables one process builds from every event row."""
    run_dir = tmp_path / "odd"
    shutil.copytree(synth, run_dir)
    for r in (3, 17, 40):
        meta = run_dir / f"rank-{r:05d}" / "rank.json"
        d = json.loads(meta.read_text())
        d["clock_offset_ns"] = 1_000_000 * r
        meta.write_text(json.dumps(d))
    shutil.rmtree(run_dir / "rank-00021")
    ev = run_dir / "rank-00030" / "events.arrows"
    ev.write_bytes(ev.read_bytes()[: ev.stat().st_size // 2])
    monkeypatch.setattr("ncclscope.engine.rank_chunks.chunk_size", lambda n, w: 7)
    one = load_any(str(run_dir))
    joined = load_any(str(run_dir), engine=engine, ops_only=True)
    assert joined.ops_only and not one.ops_only
    assert len(joined.events) == len(joined.marks) < len(one.events)
    assert not len(joined.samples) and len(one.samples)          # read through the utilization's half only
    _same_tables(one, joined)
    assert joined.warnings == one.warnings
    assert _doc(run_dir, engine, ops_only=True) == _doc(run_dir, None)


def test_a_scale_trace_reads_the_same_on_workers_and_reports_progress(synth, synth_doc, engine):
    engine.seen.clear()
    a, b = _doc(synth, engine), synth_doc             # b: _doc(synth, None), once per module
    assert a == b
    truth = json.loads((synth / "run.json").read_text())["synthetic"]["hang_rank"]
    assert f"rank {truth} " in json.loads(a)["verdict"]
    assert engine.seen and engine.seen[-1] == ("rank directories read", 64, 64)
    assert [d for _, d, _ in engine.seen] == sorted(d for _, d, _ in engine.seen)


def test_flight_recorder_dumps_read_the_same_on_workers_also_one_folder_per_node(dumps, engine, tmp_path,
                                                                                monkeypatch):
    monkeypatch.setattr("ncclscope.engine.dump_chunks.chunk_size", lambda n, w: 3)
    one = _doc(dumps, None)
    assert _doc(dumps, engine) == one
    assert "rank 13 " in json.loads(one)["verdict"]            # make_fr_dumps' culprit
    nodes = tmp_path / "per-node"
    files = sorted(dumps.iterdir())
    for i, f in enumerate(files):            # 4 nodes of 8 ranks, the host name in each file's name
        node = nodes / f"node-{i // 8:02d}"
        node.mkdir(parents=True, exist_ok=True)
        shutil.copy(f, node / f"{f.name.rsplit('_', 1)[0]}_node-{i // 8:02d}_{f.name.rsplit('_', 1)[1]}")
    per_node = json.loads(_doc(nodes, engine))
    assert per_node["verdict"] == json.loads(one)["verdict"]
    assert _doc(nodes, None) == json.dumps(per_node, indent=1, default=str)


def _cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "ncclscope", "analyze", *args], capture_output=True, text=True,
                          timeout=240, env=env, cwd=cwd)


def test_a_relative_path_names_the_same_files_on_the_cluster_s_workers(engine):
    """The workers' own working directory is not the driver's: a relative input path must still be read,
    and every warning worded as in one process."""
    here = ROOT / "sample_traces"
    assert Path(os.getcwd()) != here
    # the reference: the same command through the CLI's `main` in this process, from `here` (the analyzer never
    # imports torch; an interpreter start per command is spared); the cluster run is a real child process
    plain = cli_in_process(["analyze", "hung-pipeline", "--json", "--workers", "0"], cwd=here)
    remote = _cli("hung-pipeline", "--json", "--scheduler", engine.client.scheduler.address, cwd=here)
    assert remote.returncode == plain.returncode == 1, remote.stderr
    assert remote.stdout == plain.stdout


def test_the_cli_gives_one_document_in_process_on_local_workers_and_on_a_cluster(synth, engine):
    """In this process, on the cluster at --scheduler, and on a local cluster the command starts (--workers 2,
    text output: its verdict line is the JSON's)."""
    address = engine.client.scheduler.address
    plain = cli_in_process(["analyze", str(synth), "--json", "--workers", "0"])   # `main` here, in this process
    remote = _cli(str(synth), "--json", "--scheduler", address)
    assert plain.returncode == remote.returncode == 1, remote.stderr
    assert plain.stdout == remote.stdout
    assert "rank directories read" not in remote.stderr          # --json: quiet
    text = _cli(str(synth), "--workers", "2")
    assert text.returncode == 1 and "ncclscope: rank directories read 64/64" in text.stderr
    assert json.loads(plain.stdout)["verdict"] in text.stdout


def test_engine_flags_that_cannot_work_are_one_line_exit_2(synth, monkeypatch, capsys):
    from ncclscope.cli.main import main
    from ncclscope.engine import cluster
    monkeypatch.setattr(cluster, "CONNECT_TIMEOUT_S", 2)              # the CLI waits 10 s; the test need not

    def cli(*args: str) -> tuple[int, str]:
        rc = main(["analyze", str(synth), *args])
        return rc, capsys.readouterr().err
    rc, err = cli("--scheduler", "tcp://127.0.0.1:9")                  # nothing listens there
    assert rc == 2 and err.count("\n") == 1 and "--scheduler tcp://127.0.0.1:9" in err, err
    rc, err = cli("--workers", "2", "--scheduler", "tcp://127.0.0.1:9")
    assert rc == 2 and "give one" in err
    rc, err = cli("--workers", "-1")
    assert rc == 2 and "--workers -1" in err
    rc, err = cli("--workers", "2", "--worker-memory", "lots")
    assert rc == 2 and err.count("\n") == 1 and "'lots'" in err, err
    # a worker past the memory limit Dask enforces: it is restarted, the task retried, then one line, exit 2
    small = _cli(str(synth), "--json", "--workers", "2", "--worker-memory", "100MB")
    assert small.returncode == 2 and small.stdout == "" and small.stderr.count("\n") == 1, small.stderr
    assert "a worker died while reading it" in small.stderr and "--worker-memory" in small.stderr


def test_an_input_bigger_than_the_free_memory_is_one_line_exit_2_before_any_reading(synth, monkeypatch, capsys):
    import types

    from ncclscope.cli import memory_guard
    from ncclscope.cli.main import main
    fake = types.SimpleNamespace(available=1 << 20, total=1 << 50)     # 1 MB free of a huge machine
    monkeypatch.setattr(memory_guard.psutil, "virtual_memory", lambda: fake)
    monkeypatch.setattr("ncclscope.cli.inputs.load_input", lambda *a: pytest.fail("read despite the check"))
    assert main(["analyze", str(synth), "--json"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs at least" in err and "1 MB" not in err and "--workers" in err


def test_the_memory_check_asks_less_of_a_run_directory_joined_on_workers(synth, dumps, monkeypatch):
    """On an engine a run directory's events are joined on the workers (the driver holds ops and marks):
    an input refused in one process passes the check there, with advice that names --workers in one process
    only; Flight Recorder dumps are held whole in every mode."""
    import types

    from ncclscope.cli import memory_guard
    from ncclscope.cli.inputs import UsageError
    size = memory_guard.input_bytes(str(synth))
    fake = types.SimpleNamespace(available=size, total=1 << 50)        # between 0.7 and 1.2 bytes per byte
    monkeypatch.setattr(memory_guard.psutil, "virtual_memory", lambda: fake)
    with pytest.raises(UsageError, match="--workers N"):
        memory_guard.check_fits(str(synth))
    assert memory_guard.check_fits(str(synth), joined=lambda n: True) == size
    fake.available = int(size * 0.5)
    with pytest.raises(UsageError, match="more memory") as err:
        memory_guard.check_fits(str(synth), joined=lambda n: True)
    assert "--workers" not in str(err.value)
    fake.available = memory_guard.input_bytes(str(dumps))
    with pytest.raises(UsageError):
        memory_guard.check_fits(str(dumps), joined=lambda n: True)


def test_the_watchdog_stops_the_analysis_with_one_line_before_the_machine_runs_out(monkeypatch, capsys):
    import threading
    import types

    from ncclscope.cli import memory_guard
    rss = memory_guard.psutil.Process().memory_info().rss
    fake = types.SimpleNamespace(available=rss // 100, total=rss + rss // 100)   # this process holds it all
    monkeypatch.setattr(memory_guard.psutil, "virtual_memory", lambda: fake)
    exited = threading.Event()
    codes: list[int] = []

    def fake_exit(code: int) -> None:
        codes.append(code)
        exited.set()
    monkeypatch.setattr(memory_guard.os, "_exit", fake_exit)
    with memory_guard.Watchdog("analyze"):
        assert exited.wait(5)
    assert codes == [2]
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "analyze: out of memory" in err
    # another process eating the memory is not ours to stop
    fake.total = rss * 10
    fake.available = 0
    exited.clear()
    with memory_guard.Watchdog("analyze"):
        assert not exited.wait(1.2)


def test_the_tui_opens_on_the_trace_the_workers_read(synth, synth_doc, monkeypatch, capsys):
    """`tui --workers 2`: the input is read on the workers first (progress on stderr), the workers stop, then
    the app opens on that trace; its verdict is the in-process one."""
    from ncclscope.cli.main import main
    seen: dict = {}

    def fake_tui(path, follow=False, poll_s=1.0, trace=None):
        seen.update(path=path, trace=trace)
        return 1
    monkeypatch.setattr("ncclscope.tui.run_tui", fake_tui)
    assert main(["tui", str(synth), "--workers", "2"]) == 1
    assert seen["trace"] is not None and "rank directories read 64/64" in capsys.readouterr().err
    assert not seen["trace"].ops_only and len(seen["trace"].samples)      # the TUI shows event rows and samples
    assert run(seen["trace"]).verdict == json.loads(synth_doc)["verdict"]   # run(load_any(synth)), once per module
    seen.clear()
    assert main(["tui", str(synth), "--workers", "0"]) == 1 and seen["trace"] is None   # the app loads it
