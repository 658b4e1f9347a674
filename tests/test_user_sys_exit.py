"""`ncclscope run` on a script that calls `sys.exit(N)` on one rank: the rank failed, and the verdict names the
line that exited, as for any uncaught exception (runtime/usertrace/bootstrap.py)."""
from __future__ import annotations

import textwrap

import pytest

SCRIPT = textwrap.dedent('''
    import datetime, sys, torch, torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    rank = dist.get_rank()
    MANIFEST = {0: "val-0"}                      # written for a 1-rank run
    for step in range(4):
        dist.all_reduce(torch.ones(4))
        if step == 2:
            try:
                name = MANIFEST[rank]
            except KeyError:
                sys.exit(3)
            dist.all_reduce(torch.ones(2))
    dist.destroy_process_group()
''')
EXIT_LINE = 13          # the sys.exit(3) line of SCRIPT (its first line is empty)


@pytest.mark.spawn
@pytest.mark.e2e
def test_a_rank_that_calls_sys_exit_is_named_with_its_line(tmp_path, zygote):
    script = tmp_path / "val.py"
    script.write_text(SCRIPT)
    assert SCRIPT.split("\n")[EXIT_LINE - 1].strip() == "sys.exit(3)"
    p = zygote.cli("user-sys-exit", ["run", "--nproc", "2", "--out", str(tmp_path / "run"), "--", str(script)],
                   timeout=300)
    verdict = next((ln for ln in p.stderr.splitlines() if ln.startswith("DEAD RANK")), "")
    assert verdict.startswith("DEAD RANK: rank 1 failed (exit code 3: SystemExit(3))"), p.stderr
    assert f"raised at {script}:{EXIT_LINE}" in verdict, verdict
