"""The `ncclscope` argument parser: every subcommand, flag and help text, each
bound to its `cmd_<name>` in `cli_commands.py`.
"""
from __future__ import annotations

import argparse

from . import __version__
from .cli_commands import cmd_analyze, cmd_demo, cmd_export, cmd_report, cmd_run, cmd_train, cmd_tui


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ncclscope", description="Debugger and trace analyzer for distributed training.")
    p.add_argument("--version", action="version", version=f"ncclscope {__version__}")
    p.add_argument("--debug", action="store_true",
                   help="show the traceback of an internal error (exit 3); also NCCLSCOPE_DEBUG=1")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="run an instrumented multi-rank training job on this machine")
    from .runtime.config import add_arguments   # torch-free
    add_arguments(t)
    t.add_argument("--dump-grads", default="", help=argparse.SUPPRESS)
    t.set_defaults(func=cmd_train)

    a = sub.add_parser("analyze", help="diagnose a run directory: verdict, findings, per-rank summary")
    a.add_argument("run", help="run directory (holds run.json and rank-NNNNN/), or a directory of Flight "
                   "Recorder dumps or PyTorch profiler traces (detected by content)")
    a.add_argument("--json", action="store_true", help="machine-readable output")
    a.set_defaults(func=cmd_analyze)

    r = sub.add_parser("report", help="write a self-contained HTML report (bubbles, stragglers, divergence, ...)")
    r.add_argument("run", help="run directory")
    r.add_argument("-o", "--output", default="", help="output HTML file (default: report.html)")
    r.set_defaults(func=cmd_report)

    e = sub.add_parser("export", help="export a trace to Perfetto (trace-event JSON) and/or Parquet")
    e.add_argument("run", help="run directory, Flight Recorder dump directory or profiler trace directory")
    e.add_argument("--perfetto", default="", metavar="OUT.json", help="Chrome/Perfetto trace-event JSON")
    e.add_argument("--parquet", default="", metavar="DIR", help="Parquet dataset partitioned by rank")
    e.set_defaults(func=cmd_export)

    u = sub.add_parser("tui", help="terminal UI: verdict, rank grid, stacks, collectives, timeline")
    u.add_argument("run", help="run directory")
    u.add_argument("--follow", action="store_true", help="follow a job that is still writing its run directory")
    u.add_argument("--poll-s", type=float, default=1.0, help=argparse.SUPPRESS)
    u.set_defaults(func=cmd_tui)

    d = sub.add_parser("demo", help="a short tour of real multi-rank jobs with injected faults")
    d.add_argument("--out", default="", help="directory for the tour's runs and reports (default runs/demo-TIME)")
    d.add_argument("--quick", action="store_true", help="a reduced tour (two jobs)")
    d.set_defaults(func=cmd_demo)

    n = sub.add_parser("run", help="trace your own torch.distributed script, unchanged: ncclscope run --nproc 2 -- "
                       "train.py ARGS (under torchrun: torchrun ... -m ncclscope.run train.py ARGS)")
    n.add_argument("--nproc", type=int, default=1, help="ranks to start on this node (default 1)")
    n.add_argument("--timeout-s", type=float, default=60.0, help="an op in flight this long gets its evidence "
                   "dumped (stacks, Flight Recorder, trace); the op continues, nothing is raised (default 60)")
    n.add_argument("--out", default="", help="run directory (default runs/run-TIME)")
    n.add_argument("--no-analyze", action="store_true", help="do not print the verdict after the job")
    n.add_argument("script_argv", nargs=argparse.REMAINDER, metavar="-- SCRIPT [ARGS...]",
                   help="the script and its arguments, passed to it unparsed")
    n.set_defaults(func=cmd_run)
    return p
