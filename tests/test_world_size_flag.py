"""`--world-size N` (analyze, report, export): the job's number of ranks, for Flight Recorder dumps.

gloo's dumps list no group members, so a rank that left no dump is only seen as missing when something else
counts it (a lower rank's file, an all_gather's shape). Seed 20261210 #155: 2 ranks, rank 1 calls os._exit(2)
and leaves no dump; rank 0's dump alone was read as a healthy one-rank job, and the verdict read OK. Torch
writes these dumps on a timeout or an error, and one rank has nothing to hang on: a lone dump of rank 0 is now
read as a job of at least 2 ranks, rank 1 without a dump. Its user knows how many ranks the job had.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ncclscope.cli.main import main

DUMPS = Path(__file__).parent / "data" / "randprog" / "rp20261210_155_exit_fr"


def test_the_world_size_names_the_highest_rank_that_left_no_dump(capsys) -> None:
    assert main(["analyze", str(DUMPS), "--world-size", "2"]) == 1
    out = capsys.readouterr().out
    assert "DEAD RANK: rank 1 left no Flight Recorder dump" in out, out


def test_without_it_a_lone_dump_is_a_job_of_at_least_two_ranks(capsys) -> None:
    """One dump of rank 0 and nothing counting a rank 1: never OK, and it says what it assumed."""
    assert main(["analyze", str(DUMPS)]) == 1
    out, err = capsys.readouterr()
    assert "DEAD RANK: rank 1 left no Flight Recorder dump" in out, out
    assert "only rank 0's dump, and nothing in it counts another rank: read as a job of at least 2 ranks, rank 1 " \
           "(and any above it) without a dump; give --world-size N for the job's number of ranks" in err, err


def test_a_world_of_one_given_is_a_world_of_one(capsys) -> None:
    """--world-size 1 is the user's word: nothing is assumed missing."""
    main(["analyze", str(DUMPS), "--world-size", "1"])
    out, err = capsys.readouterr()
    assert "DEAD RANK" not in out and "at least 2 ranks" not in err, (out, err)


def test_a_world_size_below_the_dumps_ranks_is_corrected_with_a_warning(tmp_path, capsys) -> None:
    import shutil
    d = tmp_path / "two"
    d.mkdir()
    shutil.copy(DUMPS / "nccl_trace_rank_0", d / "nccl_trace_rank_0")
    shutil.copy(DUMPS / "nccl_trace_rank_0", d / "nccl_trace_rank_3")
    main(["analyze", str(d), "--world-size", "2"])
    err = capsys.readouterr().err
    assert "world size 2 given, but there is a dump of rank 3: the world is taken as 4" in err, err


def test_bad_values_and_other_inputs(tmp_path, capsys) -> None:
    assert main(["analyze", str(DUMPS), "--world-size", "0"]) == 2
    assert "--world-size 0: give the job's number of ranks" in capsys.readouterr().err
    run = tmp_path / "run"
    run.mkdir()
    from ncclscope.load.foreign.detect import load_any
    import pytest
    from ncclscope.load.trace import TraceError
    with pytest.raises(TraceError):         # nothing readable stays exit 2 whatever the flag
        load_any(run, world_size=4)


def test_the_real_command_line() -> None:
    proc = subprocess.run([sys.executable, "-m", "ncclscope", "analyze", "--json", str(DUMPS), "--world-size", "2"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert '"dead_rank"' in proc.stdout


def test_a_run_directory_keeps_its_own_world_and_says_the_flag_was_not_used(healthy_dp2) -> None:
    from ncclscope.load.foreign.detect import load_any
    trace = load_any(healthy_dp2, world_size=8)
    assert int(trace.world_size) == 2
    assert any("world size 8 given: it applies to Flight Recorder dumps only; this input says 2" in w
               for w in trace.warnings), trace.warnings
