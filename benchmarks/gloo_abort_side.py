"""Which rank gloo aborts on a size mismatch: the fact `ncclscope/hang/abort_ties.py` rests on.

    OMP_NUM_THREADS=1 python benchmarks/gloo_abort_side.py        # 12 jobs of 3 ranks, ~2 min on 2 cores

For each of all_reduce, all_gather_into_tensor and reduce_scatter_tensor, one rank (1 or 2) posts 16 or 4
elements where the others post 8; the job runs under torchrun (gloo, 5 s timeout, each job killed after 90 s).
Prints which rank died of SIGABRT and whether it was one that received more bytes than it posted: the
deviant itself when its tensor was the smaller, an innocent member when it was the larger. Exit 0 when that
holds in every job whose abort was seen.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

JOB = textwrap.dedent('''
    import datetime, sys, torch, torch.distributed as dist
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=5))
    torch.set_num_threads(1)
    r, w = dist.get_rank(), dist.get_world_size()
    op, dev, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    size = n if r == dev else 8
    if op == "all_reduce":
        dist.all_reduce(torch.ones(size))
    elif op == "all_gather_into_tensor":
        dist.all_gather_into_tensor(torch.empty(w * size), torch.ones(size))
    else:
        dist.reduce_scatter_tensor(torch.empty(size), torch.ones(w * size))
    dist.destroy_process_group()
''')


def aborted_ranks(out: str) -> set[int]:
    """Ranks torchrun's failure report lists with exit code -6 (SIGABRT)."""
    found = set()
    for block in out.split("[")[1:]:
        m = re.search(r"rank\s*:\s*(\d+).*?exitcode\s*:\s*(-?\d+)", block, re.S)
        if m and int(m.group(2)) == -6:
            found.add(int(m.group(1)))
    return found


def main() -> int:
    work = Path(tempfile.mkdtemp(prefix="ncclscope-abort-"))
    script = work / "job.py"
    script.write_text(JOB)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    held, seen = 0, 0
    for op in ("all_reduce", "all_gather_into_tensor", "reduce_scatter_tensor"):
        for n in (16, 4):
            for dev in (1, 2):
                try:
                    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                          "--nproc-per-node", "3", str(script), op, str(dev), str(n)],
                                         capture_output=True, text=True, timeout=90, env=env, cwd=work)
                    out = res.stdout + res.stderr
                except subprocess.TimeoutExpired:
                    out = ""
                dead = aborted_ranks(out)
                expect = "the deviant" if n < 8 else "an innocent member"
                ok = bool(dead) and ((dead == {dev}) if n < 8 else (dev not in dead))
                seen += bool(dead)
                held += ok
                print(f"{op:24s} deviant rank {dev} posts {n:2d} (others 8): SIGABRT on {sorted(dead) or 'none'}; "
                      f"expected {expect}: {'yes' if ok else 'NO'}", flush=True)
    print(f"\nthe rank that received more than it posted was the one aborted in {held} of {seen} jobs with an abort")
    return 0 if seen and held == seen else 1


if __name__ == "__main__":
    sys.exit(main())
