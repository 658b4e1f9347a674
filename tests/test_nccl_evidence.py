"""NCCL's own evidence: NCCL Inspector, NCCL RAS and the torch debug server's dumps, alone and beside
Flight Recorder dumps or a run directory of the same job, each giving one verdict.

Every sample is written in the real format by tests/data/nccl/make_samples.py (field for field as
the writers in NVIDIA/nccl and pytorch print them) into a temporary folder; the few kept files are
small. Each case runs `ncclscope analyze` in-process and checks the verdict's kind, root rank and,
where RAS is the evidence, that the verdict names RAS.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from ncclscope.cli.main import main
from ncclscope.load.foreign.detect import detect, load_any
from ncclscope.load.foreign.nccl_ras import comm_key, read_ras
from ncclscope.load.trace import TraceError

DATA = ROOT / "tests" / "data" / "nccl"
sys.path.insert(0, str(DATA))
import make_samples as M  # noqa: E402

pytestmark = pytest.mark.timeout(180)


def analyze(capsys, *paths: Path | str, text: bool = False) -> tuple[int, dict | str, str]:
    """rc, the JSON report (or the text output), stderr."""
    capsys.readouterr()
    rc = main(["analyze", *map(str, paths), *([] if text else ["--json"])])
    cap = capsys.readouterr()
    return rc, (cap.out if text else json.loads(cap.out) if cap.out.strip() else {}), cap.err


def head(report: dict) -> dict | None:
    serious = [f for f in report["findings"] if f["severity"] in ("error", "warning")]
    return next((f for f in serious if f["title"] in report["verdict"]), serious[0] if serious else None)


def verdict_of(capsys, *paths: Path | str) -> tuple[int, str, str, list[int], dict]:
    rc, rep, err = analyze(capsys, *paths)
    assert "Traceback" not in err, err
    top = head(rep)
    return rc, rep["verdict"], top["kind"] if top else "ok", sorted(top["ranks"]) if top else [], rep


def snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


# --------------------------------------------------------------------------
# NCCL Inspector alone
# --------------------------------------------------------------------------
def test_inspector_alone_names_the_gpu_straggler(tmp_path, capsys):
    d = M.straggler_job(tmp_path / "nccl-inspector-1234")
    before = snapshot(d)
    assert detect(d) == "nccl"
    rc, verdict, kind, ranks, rep = verdict_of(capsys, d)
    assert (rc, kind, ranks) == (1, "straggler", [2]), verdict
    assert verdict.startswith("STRAGGLER: rank 2 ") and not rep["warnings"]
    assert snapshot(d) == before


def test_inspector_verbose_two_hosts_skewed_clocks(tmp_path, capsys):
    """Kernel times from two hosts whose clocks differ by 0.25 s: aligned on the collectives' ends."""
    d = M.straggler_job(tmp_path / "v", slow=1, verbose=True, hosts=("gpu-node-01", "gpu-node-02"),
                        skew_us=250_000, late_us=25_000)
    rc, verdict, kind, ranks, _ = verdict_of(capsys, d)
    assert (rc, kind, ranks) == (1, "straggler", [1]), verdict
    assert "by a median 25.0 ms" in verdict


def test_inspector_v43_markers_read_like_per_record_lines(tmp_path, capsys):
    old = verdict_of(capsys, M.straggler_job(tmp_path / "v40"))
    d = M.straggler_job(tmp_path / "v43", version="v4.3")
    new = verdict_of(capsys, d)
    assert new[:4] == old[:4]
    # an op line with no marker before it names no rank: skipped, said once; ring losses are said
    f = next(d.iterdir())
    lines = f.read_text().splitlines()
    marker = json.loads(lines[0])
    marker["dump_stats"]["coll_dropped_total"] = 7
    f.write_text("\n".join([lines[1], json.dumps(marker), *lines[1:]]) + "\n")
    rc, verdict, kind, ranks, rep = verdict_of(capsys, d)
    assert (kind, ranks) == ("straggler", [2]), verdict
    warned = "\n".join(rep["warnings"])
    assert "line 1 (no header and metadata" in warned and "dropped 7 record(s)" in warned


def test_inspector_healthy_is_silent(tmp_path, capsys):
    rc, verdict, kind, _, rep = verdict_of(capsys, M.straggler_job(tmp_path / "ok", late_us=0))
    assert (rc, kind) == (0, "ok") and verdict.startswith("OK"), verdict


# --------------------------------------------------------------------------
# NCCL RAS alone
# --------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["ras_laggard.json", "ras_laggard.txt"])
def test_ras_alone_names_the_rank_behind(name, capsys):
    """RAS's collective counts: rank 3 launched one AllReduce fewer; its peers wait in the next."""
    rc, verdict, kind, ranks, _ = verdict_of(capsys, DATA / name)
    assert (rc, kind, ranks) == (1, "hang", [3]), verdict
    assert verdict.startswith("HANG: rank 3 never posted all_reduce")
    assert "rank 3 launched 41 AllReduce where its peers launched 42 (NCCL RAS, one snapshot)" in verdict


@pytest.mark.parametrize("why,words", [("dead", "is considered dead"), ("unresponsive", "did not answer")])
def test_ras_alone_dead_or_unresponsive_rank(tmp_path, capsys, why, words):
    (tmp_path / "ras.json").write_text(M.ras_json(missing={2: why}))
    rc, verdict, kind, ranks, _ = verdict_of(capsys, tmp_path)
    assert (rc, kind, ranks) == (1, "dead_rank", [2]), verdict
    assert f"NCCL RAS: process 41002 on 10.0.0.2 {words}" in verdict


def test_ras_healthy_is_silent(tmp_path, capsys):
    (tmp_path / "ras.json").write_text(M.ras_json())
    rc, verdict, kind, _, _ = verdict_of(capsys, tmp_path)
    assert (rc, kind) == (0, "ok") and verdict.startswith("OK"), verdict


def test_ras_monitor_event_beside_status(tmp_path, capsys):
    """A PEER_DEAD monitor event names a process: mapped through the pids RAS's status lists."""
    (tmp_path / "status.json").write_text(M.ras_json(missing={1: "unresponsive"}))
    (tmp_path / "events.json").write_text(M.ras_peer_dead(1))
    rc, verdict, kind, ranks, _ = verdict_of(capsys, tmp_path)
    assert (kind, ranks) == ("dead_rank", [1]) and "is considered dead" in verdict, verdict


def test_comm_key_is_shared_by_ras_and_inspector():
    assert comm_key(f"0x{M.RAS_HASH:x}") == comm_key(M.COMM) == comm_key(f"{M.RAS_HASH:016x}")[:14]
    snap = read_ras([DATA / "ras_laggard.txt"])
    assert list(snap.comms) == [comm_key(M.COMM)] and snap.comms[comm_key(M.COMM)].size == 4


# --------------------------------------------------------------------------
# Beside other evidence of the same job
# --------------------------------------------------------------------------
def test_inspector_and_ras_together(tmp_path, capsys):
    """The sample_traces/ story: a healthy Inspector record, then RAS's snapshot of the hang."""
    d = M.inspector_ras_sample(tmp_path / "job")
    rc, verdict, kind, ranks, rep = verdict_of(capsys, d)
    assert (rc, kind, ranks) == (1, "hang", [3]), verdict
    assert "all_reduce #25 on DP Group 0[0-3]" in verdict and "(NCCL RAS, unchanged in 2 snapshots)" in verdict


def test_ras_counts_still_moving_are_a_running_job(tmp_path, capsys):
    """NCCL's guide: collectives outpace RAS's query; counts that moved between snapshots are no hang."""
    behind = {**{r: {"AllReduce": 42} for r in range(3)}, 3: {"AllReduce": 41}}
    later = {**{r: {"AllReduce": 57} for r in range(3)}, 3: {"AllReduce": 56}}
    (tmp_path / "ras-1.json").write_text(M.ras_json(counts=behind))
    (tmp_path / "ras-2.json").write_text(M.ras_json(counts=later, when="2025-12-06 10:16:00"))
    rc, verdict, kind, _, rep = verdict_of(capsys, tmp_path)
    assert (rc, kind) == (0, "ok") and verdict.startswith("OK"), verdict
    assert any("still moved between the last two snapshots" in w for w in rep["warnings"])


def test_flight_recorder_beside_ras_laggard(tmp_path, capsys):
    d = M.fr_dumps(tmp_path / "fr")
    alone = verdict_of(capsys, d)
    (d / "ncclras.json").write_text(M.ras_json(counts={**{r: {"AllReduce": 6} for r in range(3)},
                                                       3: {"AllReduce": 5}}))
    rc, verdict, kind, ranks, rep = verdict_of(capsys, d)
    assert (kind, ranks) == (alone[2], alone[3]) == ("hang", [3]), verdict
    assert verdict.startswith(alone[1])
    assert verdict.endswith("rank 3 launched 5 AllReduce where its peers launched 6 (NCCL RAS, one snapshot)")
    assert any(w.startswith("NCCL RAS: rank(s) 3 launched 5 AllReduce") for w in rep["warnings"])


def test_flight_recorder_missing_dump_beside_ras_dead(tmp_path, capsys):
    d = M.fr_dumps(tmp_path / "fr", absent=(3,))
    assert "left no Flight Recorder dump" in verdict_of(capsys, d)[1]
    sub = d / "ras"
    sub.mkdir()
    (sub / "status.json").write_text(M.ras_json(missing={3: "dead"}))
    rc, verdict, kind, ranks, _ = verdict_of(capsys, d)
    assert (rc, kind, ranks) == (1, "dead_rank", [3]), verdict
    assert "rank 3 failed (NCCL RAS: process 41003 on 10.0.0.2 is considered dead" in verdict
    assert "ranks 0-2 waiting" in verdict


def test_flight_recorder_and_inspector_of_one_job(tmp_path, capsys):
    """Inspector's records join as groups of their own ("nccl:..."); the verdict is one."""
    arrivals: list = []
    job = tmp_path / "job"
    M.straggler_job(job / "nccl-inspector-77", arrivals=arrivals, late_us=30_000)
    M.fr_dumps(job, arrivals=arrivals)
    trace = load_any(job)
    assert {"default_pg", "nccl:DP Group 0"} <= set(trace.groups["process_group"])
    assert trace.run.source == "flight_recorder" and trace.world_size == 4
    rc, verdict, kind, ranks, _ = verdict_of(capsys, job)
    assert (rc, kind, ranks) == (1, "straggler", [2]), verdict
    hung = M.fr_dumps(tmp_path / "hung")
    shutil.copytree(job / "nccl-inspector-77", hung / "nccl-inspector-77")
    assert verdict_of(capsys, hung)[2:4] == ("hang", [3])


def test_run_directory_beside_ras(tmp_path, capsys):
    """A run directory knows how its ranks ended; RAS's count is cited on the root it already names."""
    d = tmp_path / "run"
    shutil.copytree(ROOT / "sample_traces" / "stuck-in-compute", d)
    alone = verdict_of(capsys, d)
    (d / "ras.txt").write_text(M.ras_text(world=2, behind=1))
    rc, verdict, kind, ranks, _ = verdict_of(capsys, d)
    assert (rc, kind, ranks) == (alone[0], alone[2], alone[3]) == (1, "stuck_in_compute", [1]), verdict
    assert verdict.startswith(alone[1])
    assert "rank 1 launched 41 AllReduce where its peers launched 42 (NCCL RAS, one snapshot)" in verdict


def test_evidence_given_as_further_paths(tmp_path, capsys):
    d = M.fr_dumps(tmp_path / "fr")
    trace = load_any(d, DATA / "ras_laggard.txt")
    assert trace.run.raw["rank_notes"] == {"3": ["launched 41 AllReduce where its peers launched 42 (NCCL RAS, one snapshot)"]}
    with pytest.raises(TraceError, match="a second source of ops"):
        load_any(d, M.fr_dumps(tmp_path / "other"))


# --------------------------------------------------------------------------
# torch debug server dumps
# --------------------------------------------------------------------------
def test_debug_server_dumps_beside_flight_recorder(tmp_path, capsys):
    d = M.debug_dumps(M.fr_dumps(tmp_path / "dbg"), silent=3)
    trace = load_any(d)
    assert sorted(trace.stacks) == [0, 1, 2]
    # after the in-flight op's Flight Recorder stack, the debug server's dump under a dated header
    assert "\n=== ncclscope rank 0: torch debug server stacks_20251206_101500.txt at " in trace.stacks[0]
    assert 'File "/job/train.py", line 88 in train_step' in trace.stacks[0]
    warned = "\n".join(trace.warnings)
    assert "rank(s) 3 (Error: 408) did not answer" in warned and "fr_trace file(s)" in warned
    rc, verdict, kind, ranks, _ = verdict_of(capsys, d)
    assert (rc, kind, ranks) == (1, "hang", [3]), verdict


def test_debug_server_stacks_alone_are_one_line(tmp_path, capsys):
    d = M.debug_dumps(tmp_path / "only")
    rc, _, err = analyze(capsys, d)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "nothing readable" in err, err


# --------------------------------------------------------------------------
# Torn, hostile and unusable input
# --------------------------------------------------------------------------
HOSTILE = "\x1b[31m[bold red]<script>alert(1)</script>"


def test_torn_and_hostile_inspector_and_ras(tmp_path, capsys):
    d = M.straggler_job(tmp_path / "job", comm_name=HOSTILE)
    files = sorted(d.iterdir())
    with files[0].open("a") as fh:
        fh.write("garbage\n" + files[0].read_text().splitlines()[-1][:57])     # a garbage line, a torn last one
    (d / "ras.json").write_text(M.ras_json()[:900])                             # cut off mid-communicator
    before = snapshot(d)
    rc, out, err = analyze(capsys, d, text=True)
    assert rc == 1 and "Traceback" not in err, err
    assert out.startswith("STRAGGLER: rank 2 ")
    assert "\x1b" not in out + err                                       # escapes never reach the terminal
    assert "line 25 (not JSON: cut off or garbage) and 1 more not an NCCL Inspector record" in err
    assert "NCCL RAS JSON cut off or damaged; read 0 whole communicator(s)" in err
    assert snapshot(d) == before


def test_report_escapes_inspector_strings(tmp_path, capsys):
    d = M.straggler_job(tmp_path / "job", comm_name=HOSTILE)
    out = tmp_path / "r.html"
    assert main(["report", str(d), "-o", str(out)]) in (0, 1)
    html = out.read_text()
    assert "&lt;script&gt;alert(1)" in html and "<script>alert(1)" not in html
    assert "\x1b" not in html          # the readers keep no control character in a name


@pytest.mark.parametrize("what", ["garbage", "prometheus"])
def test_unusable_nccl_output_is_one_line(tmp_path, capsys, what):
    if what == "garbage":
        d = M.straggler_job(tmp_path / "job", steps=1)
        for f in d.iterdir():
            f.write_text(f.read_text().replace('"coll_sn"', '"coll_sn":"x","_"'))
    else:
        d = tmp_path / "prom"
        d.mkdir()
        (d / "nccl_inspector_metrics_GPU-1.prom").write_text(
            'nccl_bus_bandwidth_gbs{version="v5.1",node="n1",gpu="GPU0",comm_name="DP Group 0",nranks="4",'
            'collective="AllReduce",message_size="4-5GB",algo_proto="Ring_ll"} 678.2\n')
    rc, _, err = analyze(capsys, d)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert ("NCCL Inspector" in err) if what == "garbage" else ("Prometheus" in err)


def test_sample_trace_gives_its_recorded_verdict(analyze_json):
    rec = json.loads((ROOT / "sample_traces" / "verdicts.json").read_text())["nccl-ras-inspector"]
    res = analyze_json(ROOT / "sample_traces" / "nccl-ras-inspector")   # `analyze IT --json`, once per session
    assert "Traceback" not in res.stderr, res.stderr
    rep = json.loads(res.stdout) if res.stdout.strip() else {}
    top = head(rep)
    kind, ranks = (top["kind"], sorted(top["ranks"])) if top else ("ok", [])
    rc, verdict = res.returncode, rep["verdict"]
    assert (verdict, kind, ranks, rc) == (rec["verdict"], rec["kind"], rec["root_ranks"], 1)
    assert not rep["warnings"]
