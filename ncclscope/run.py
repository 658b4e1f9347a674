"""Per-rank entry point for tracing a user's script (see runtime/usertrace/bootstrap.py).

    python -m ncclscope.run [--out DIR] [--timeout-s T] SCRIPT [ARGS...]
    torchrun --standalone --nproc-per-node 2 -m ncclscope.run examples/ddp.py --steps 3
    srun python -m ncclscope.run train.py

On one node, `ncclscope run --nproc N -- SCRIPT ARGS` starts the ranks for you.
"""
from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    from ncclscope.runtime.usertrace.bootstrap import main as _main
    return _main(argv)


if __name__ == "__main__":
    sys.exit(main())
