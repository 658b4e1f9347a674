"""`ncclscope run` end to end: users' own scripts (examples/), traced unchanged, diagnosed.

Each test starts real gloo ranks through `ncclscope run` (torch's elastic
launch underneath) or torchrun itself, in its own session with a hard
timeout; on expiry the whole session is SIGKILLed, so no rank outlives it.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from ncclscope.sites import inner as inner_site

from conftest import ROOT, cli_env, cli_in_process

pytestmark = [pytest.mark.spawn, pytest.mark.e2e]


def _run(cmd: list[str], timeout: float = 120.0) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(),
                            cwd=ROOT, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} did not finish in {timeout} s\n{out[-3000:]}\n{err[-3000:]}")
    finally:
        try:   # reap anything the session left behind
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


_ZYGOTE: list = []      # the module's warm process (the `zygote` fixture), when it is up


@pytest.fixture(scope="module", autouse=True)
def _warm_launcher(zygote):
    """`ncclscope run` launched from a fork of the suite's warm process (conftest's `zygote`): its
    launcher does not import torch again for each job (~3 s of each job here). The ranks themselves are
    still fresh interpreters started by torch's elastic agent, as under a user's `ncclscope run`."""
    _ZYGOTE.append(zygote)
    try:
        yield
    finally:
        _ZYGOTE.clear()


def ncclscope_run(out: Path, nproc: int, script: str, *args: str, timeout_s: float = 3.0,
                  timeout: float = 120.0) -> subprocess.CompletedProcess:
    argv = ["run", "--nproc", str(nproc), "--timeout-s", str(timeout_s), "--out", str(out), "--no-analyze", "--",
            script, *args]
    if _ZYGOTE:
        return _ZYGOTE[0].cli(f"{out.parent.name}-{out.name}", argv, timeout)
    return _run([sys.executable, "-m", "ncclscope", *argv], timeout)


def analyze(run_dir: Path) -> tuple[int, dict]:
    """`ncclscope analyze RUN --json` through the CLI's `main`, here (the analyzer never imports torch)."""
    res = cli_in_process(["analyze", str(run_dir), "--json"])
    assert res.stdout.strip(), res.stderr[-3000:]
    return res.returncode, json.loads(res.stdout)


def analyze_failed(run_dir: Path, proc: subprocess.CompletedProcess) -> dict:
    """The report of a job that failed: `ncclscope run` exited non-zero and `analyze` found problems (exit 1)."""
    assert proc.returncode != 0
    code, rep = analyze(run_dir)
    assert code == 1
    return rep


def line_of(path: str, marker: str) -> int:
    for i, line in enumerate((ROOT / path).read_text().splitlines(), 1):
        if marker in line:
            return i
    raise AssertionError(f"{marker!r} not in {path}")


def ops(run_dir: Path):
    from ncclscope.load.trace import load
    return load(run_dir).ops


def assert_healthy(run_dir: Path, proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-4000:]
    code, rep = analyze(run_dir)
    bad = [f for f in rep["findings"] if f["severity"] in ("error", "warning")]
    assert code == 0 and not bad, (rep["verdict"], bad)
    return rep


def headline(rep: dict) -> dict:
    heads = [f for f in rep["findings"] if (f.get("data") or {}).get("role") == "headline"] or rep["findings"]
    assert heads, rep["verdict"]
    return heads[0]


def deviating_sites(run_dir: Path, finding: dict) -> set[str]:
    """Call sites of the root ranks' evidence ops (the user's line the verdict points at)."""
    t = ops(run_dir)
    sites = set()
    for ev in finding["evidence"]:
        if ev["rank"] in finding["ranks"] and ev.get("op_id", -1) >= 0:
            hit = t[(t["rank"] == ev["rank"]) & (t["op_id"] == ev["op_id"])]
            sites.update(inner_site(str(s)) for s in hit["call_site"])
    return sites


# ---- DDP -------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ddp_healthy(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One healthy DDP job under `ncclscope run`, shared by the tests that read it (each job costs
    ~12 s here: the launcher and every rank import torch)."""
    out = tmp_path_factory.mktemp("ddp-healthy") / "ddp"
    return out, ncclscope_run(out, 2, "examples/ddp.py", "--steps", "3")


def test_ddp_healthy_traced_directly_and_through_flight_recorder(ddp_healthy):
    out, proc = ddp_healthy
    assert "ddp: 3 steps on 2 ranks" in proc.stdout
    assert_healthy(out, proc)
    t = ops(out)
    direct = t[~t["op_id"].ge(1 << 32)]
    fr = t[t["op_id"].ge(1 << 32)]
    for r in (0, 1):
        assert (direct["rank"] == r).sum() == 1          # the script's own all_reduce
        assert ((fr["rank"] == r) & (fr["op_name"] == "all_reduce")).sum() == 3   # DDP's reducer, once per step
    assert {inner_site(s) for s in direct["call_site"]} == {f"examples/ddp.py:{line_of('examples/ddp.py', 'the job' + chr(39) + 's own')}"}
    assert (t["status"] == "ok").all()
    run = json.loads((out / "run.json").read_text())
    assert run["end_reason"] == "completed" and {v["exitcode"] for v in run["ranks"].values()} == {0}
    for r in (0, 1):
        groups = json.loads((out / f"rank-0000{r}" / "groups.json").read_text())
        assert [g["name"] for g in groups] == ["world"] and groups[0]["ranks"] == [0, 1]


def test_ddp_extra_all_reduce_on_one_rank_is_diagnosed(tmp_path):
    out = tmp_path / "ddp-bug"
    proc = ncclscope_run(out, 3, "examples/ddp.py", "--steps", "4", "--bug", "extra-allreduce", "--timeout", "5")
    rep = analyze_failed(out, proc)
    f = headline(rep)
    assert f["kind"] == "collective_mismatch" and f["ranks"] == [0], rep["verdict"]
    bug_line = line_of("examples/ddp.py", "BUG: only rank 0")
    assert f"examples/ddp.py:{bug_line}" in deviating_sites(out, f)


def test_ddp_rank_sleeping_past_the_timeout_is_the_root_with_its_line(tmp_path):
    """Rank 1 sleeps 5 s in its own loop; rank 0 times out after 2 s inside DDP's reducer (an op only
    Flight Recorder sees). Both end dead, neither waiting on the other: the order of arrival names rank 1,
    and its stack dump inside the gap names the user's line."""
    out = tmp_path / "ddp-sleep-past"
    proc = ncclscope_run(out, 2, "examples/ddp.py", "--steps", "3", "--bug", "sleep", "--sleep", "5",
                         "--timeout", "2", timeout_s=1.0)
    rep = analyze_failed(out, proc)
    f = headline(rep)
    assert f["kind"] == "stuck_in_compute" and f["ranks"] == [1], rep["verdict"]
    assert f"examples/ddp.py:{line_of('examples/ddp.py', 'time.sleep(args.sleep)')}" in f["title"]


# ---- the job's own failure reaches the user unchanged ------------------------------
RAISES = """
    import datetime, os, sys
    import torch, torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    t = torch.ones(4)
    for i in range(3):
        dist.all_reduce(t)
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.all_reduce(t)
    print("not reached on rank 1")
"""


def test_a_script_that_raises_on_one_rank_keeps_its_exception_and_exit_code(tmp_path):
    script = tmp_path / "raises.py"
    script.write_text(textwrap.dedent(RAISES))
    out = tmp_path / "raises-run"
    proc = ncclscope_run(out, 2, str(script))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "ValueError: boom on rank 1" in proc.stderr
    assert re.search(r'raises\.py", line 10, in <module>', proc.stderr)
    t = ops(out)
    for r in (0, 1):
        mine = t[(t["rank"] == r) & (t["op_name"] == "all_reduce") & (t["op_id"] < (1 << 32))]
        assert len(mine) >= 3 and (mine["status"].head(3) == "ok").all()
    meta = json.loads((out / "rank-00001" / "rank.json").read_text())
    assert meta["end"]["status"] == "error" and "ValueError" in meta["end"]["message"]
    # the evidence of where it raised, for the went-past-a-collective rule: its frames, and each site's function
    assert re.search(r'raises\.py", line 10 in <module> \(def line 1\)', (out / "rank-00001" / "stacks.txt").read_text())
    assert {inner_site(s).rsplit(":", 1)[1]: f for s, f in meta["call_sites"].items()} == {"8": ["<module>", 1]}   # line 11 never ran there
    run = json.loads((out / "run.json").read_text())
    assert run["end_reason"] == "rank_failed" and run["ranks"]["1"]["exitcode"] == 1


# ---- torchrun writes the same run directory -------------------------------------------
def _shape(run_dir: Path) -> dict:
    t = ops(run_dir)
    files = {d.name: sorted(p.name for p in d.iterdir() if p.name != "stacks.txt")
             for d in sorted(run_dir.iterdir()) if d.is_dir()}
    counts = t.groupby(["rank", "op_name", "process_group"], observed=True).size().to_dict()
    return {"files": files, "counts": counts}


def torchrun(name: str, argv: list[str], timeout: float = 120.0) -> subprocess.CompletedProcess:
    """`torchrun ARGV`: torch's launcher (`torch.distributed.run.main(ARGV)`) in a fork of the suite's warm
    process when it is up, as `ncclscope run` is here (`_warm_launcher`: the launcher does not import torch
    again; its ranks are still fresh interpreters it starts), else `python -m torch.distributed.run`.
    tests/test_dp_runtime.py::test_entry_point_runs_unchanged_under_torchrun starts torchrun's own process."""
    if _ZYGOTE:
        return _ZYGOTE[0].call(name, "torch.distributed.run:main", [argv], timeout)
    return _run([sys.executable, "-m", "torch.distributed.run", *argv], timeout)


def test_torchrun_writes_the_same_run_directory_as_ncclscope_run(tmp_path, ddp_healthy):
    (a, pa_), b = ddp_healthy, tmp_path / "b"
    assert pa_.returncode == 0, pa_.stderr[-3000:]
    pb = torchrun(f"torchrun-{tmp_path.name}", ["--standalone", "--nproc-per-node", "2", "-m", "ncclscope.run",
                                                "--out", str(b), "examples/ddp.py", "--steps", "3"])
    assert pb.returncode == 0, pb.stderr[-3000:]
    assert _shape(a) == _shape(b)
    assert (b / "run.json").exists() and json.loads((b / "run.json").read_text())["launcher"] == "torchrun"


# ---- FSDP2, DTensor TP on a 2-D mesh, pipelining -----------------------------------------
def test_fsdp2_healthy_its_all_gathers_and_reduce_scatters_are_traced(tmp_path):
    out = tmp_path / "fsdp2"
    proc = ncclscope_run(out, 2, "examples/fsdp2.py", "--steps", "2")
    assert "fsdp2: 2 steps on 2 ranks" in proc.stdout
    assert_healthy(out, proc)
    t = ops(out)
    direct = t[t["op_id"] < (1 << 32)]
    names = set(direct["op_name"])
    assert {"all_gather_into_tensor", "reduce_scatter_tensor"} <= names
    # FSDP2 issues them through the Python API: their call site is the user's forward/backward line
    assert all(str(s).startswith("examples/fsdp2.py:") for s in direct["call_site"])


def test_fsdp2_uneven_data_is_diagnosed(tmp_path):
    out = tmp_path / "fsdp2-bug"
    proc = ncclscope_run(out, 3, "examples/fsdp2.py", "--steps", "3", "--bug", "uneven-data", "--timeout", "3")
    rep = analyze_failed(out, proc)
    f = headline(rep)
    # rank 1 ran out of batches and went to the end-of-run all_reduce where its peers all-gather for FSDP2
    assert f["kind"] == "collective_mismatch" and f["ranks"] == [1], rep["verdict"]
    assert f"(its call at examples/fsdp2.py:{line_of('examples/fsdp2.py', 'dist.all_reduce(total)')} <" in f["title"]
    # the loop it left, read from the script's source: the line a user edits
    assert f"in the loop at examples/fsdp2.py:{line_of('examples/fsdp2.py', 'for x, y in batches:')}; it left that loop early" in f["title"]


def test_dtensor_2d_mesh_healthy_groups_recorded_on_every_rank(tmp_path):
    out = tmp_path / "dtensor"
    proc = ncclscope_run(out, 4, "examples/dtensor_tp.py", "--dp", "2", "--tp", "2", "--steps", "2")
    assert "dtensor_tp: 2 steps" in proc.stdout
    assert_healthy(out, proc)
    views = {(out / f"rank-0000{r}" / "groups.json").read_text() for r in range(4)}
    assert len(views) == 1   # the same table on every rank
    groups = {g["name"]: g["ranks"] for g in json.loads(views.pop())}
    assert groups == {"world": [0, 1, 2, 3], "dp0": [0, 2], "dp1": [1, 3], "tp0": [0, 1], "tp1": [2, 3]}
    t = ops(out)
    fr = t[t["op_id"] >= (1 << 32)]
    assert len(fr) and set(fr["process_group"]) <= {"tp0", "tp1"}   # DTensor's functional all-reduce: FR only


def test_dtensor_wrong_group_is_diagnosed_with_the_call_site(tmp_path):
    out = tmp_path / "dtensor-bug"
    proc = ncclscope_run(out, 4, "examples/dtensor_tp.py", "--steps", "2", "--bug", "wrong-group", "--timeout", "3")
    rep = analyze_failed(out, proc)
    line = line_of("examples/dtensor_tp.py", "dist.all_reduce(g, group=group)")
    wrong = [f for f in rep["findings"] if f["kind"] == "wrong_group"]
    assert wrong and wrong[0]["ranks"] == [3], rep["verdict"]
    assert f"examples/dtensor_tp.py:{line}" in wrong[0]["title"]
    # the headline is the wrong group, whatever gloo did next (an innocent tp1 member SIGABRTed, or a hang)
    heads = [f for f in rep["findings"] if f["data"].get("role") == "headline"]
    assert heads and (heads[0]["kind"], heads[0]["ranks"]) == ("wrong_group", [3]), rep["verdict"]
    assert rep["verdict"].startswith("WRONG GROUP: rank 3") and f"examples/dtensor_tp.py:{line}" in rep["verdict"]


def test_dtensor_foreign_group_is_a_wrong_group_at_the_call_site(tmp_path):
    """The last rank passes another replica's hand-made dp group, one it is not in: torch makes the call a
    no-op (with a warning), the tracer writes a `not_member` row, and its own replica's group waits."""
    out = tmp_path / "dtensor-foreign"
    proc = ncclscope_run(out, 4, "examples/dtensor_tp.py", "--steps", "2", "--bug", "foreign-group",
                         "--timeout", "3")
    rep = analyze_failed(out, proc)
    line = line_of("examples/dtensor_tp.py", "dist.all_reduce(g, group=group)")
    # the innermost user frame first, then its callers (" < "), then the cause
    assert rep["verdict"].startswith(f"WRONG GROUP: rank 3 called all_reduce at examples/dtensor_tp.py:{line} <"), rep["verdict"]
    assert "on a process group it is not a member of" in rep["verdict"]
    heads = [f for f in rep["findings"] if f["data"].get("role") == "headline"]
    assert heads and (heads[0]["kind"], heads[0]["ranks"]) == ("wrong_group", [3]), rep["verdict"]


def test_pipeline_1f1b_healthy(tmp_path):
    out = tmp_path / "pp"
    proc = ncclscope_run(out, 2, "examples/pipeline_1f1b.py", "--steps", "2")
    assert "pipeline_1f1b: 2 steps on 2 stages" in proc.stdout
    assert_healthy(out, proc)
    t = ops(out)
    sends = t[(t["rank"] == 0) & t["op_name"].isin(["isend", "send"])]
    recvs = t[(t["rank"] == 1) & t["op_name"].isin(["irecv", "recv"])]
    assert len(sends) == len(recvs) >= 8 and (sends["status"] == "ok").all()
    assert list(sends["p2p_seq_id"]) == list(range(1, len(sends) + 1))


def test_pipeline_skipped_batch_is_diagnosed(tmp_path):
    out = tmp_path / "pp-bug"
    proc = ncclscope_run(out, 2, "examples/pipeline_1f1b.py", "--steps", "2", "--bug", "skip-last-batch",
                         "--timeout", "3")
    rep = analyze_failed(out, proc)
    unmatched = [f for f in rep["findings"] if f["kind"] == "unmatched_p2p"]
    assert unmatched and unmatched[0]["ranks"] == [1], rep["verdict"]
    # the headline names the stage that skipped, where it should have received and where it went instead;
    # the deadlock between the two stages is its consequence
    heads = [f for f in rep["findings"] if f["data"].get("role") == "headline"]
    assert heads and (heads[0]["kind"], heads[0]["ranks"]) == ("unmatched_p2p", [1]), rep["verdict"]
    recv_at = line_of("examples/pipeline_1f1b.py", "schedule.step(target=y, losses=losses)")
    went_to = line_of("examples/pipeline_1f1b.py", "dist.barrier()")
    assert rep["verdict"].startswith("UNMATCHED P2P: rank 1 skipped the recv from rank 0"), rep["verdict"]
    assert f"examples/pipeline_1f1b.py:{recv_at}" in rep["verdict"], rep["verdict"]
    assert f"examples/pipeline_1f1b.py:{went_to}" in rep["verdict"], rep["verdict"]
    assert not any(f["kind"] == "deadlock" and f["data"].get("role") == "headline" for f in rep["findings"])


def test_timeout_s_dumps_evidence_and_lets_the_job_go_on(tmp_path):
    """Rank 1 sleeps 3 s; rank 0 waits inside DDP's reducer (an op only Flight Recorder sees).
    --timeout-s 1 dumps stacks + FR on the waiting rank, raises nothing: the job completes."""
    out = tmp_path / "ddp-sleep"
    proc = ncclscope_run(out, 2, "examples/ddp.py", "--steps", "3", "--bug", "sleep", "--sleep", "3",
                         timeout_s=1.0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    stacks = (out / "rank-00000" / "stacks.txt").read_text()
    assert "no traced op or step for" in stacks and "ddp.py" in stacks
    assert (out / "rank-00000" / "flight_recorder.pkl").exists()
    run = json.loads((out / "run.json").read_text())
    assert run["end_reason"] == "completed"
