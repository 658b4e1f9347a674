"""The `ncclscope` argument parser: the analyzer's subcommands, flags and help
text, each bound to its `cmd_<name>` in `commands.py`, plus the commands
other packages register through the `ncclscope.commands` entry point group
(the runtime's `train`, `run` and `demo`: `ncclscope.runtime.commands`).

The analyzer never imports the runtime; an entry point is a name in the
installed metadata, loaded only to build the parser.
"""
from __future__ import annotations

import argparse
import sys
from importlib.metadata import entry_points

from ncclscope import __version__
from ncclscope.cli.commands import cmd_analyze, cmd_export, cmd_report, cmd_tui
from ncclscope.cli.engine_args import add_engine_args

ENTRY_POINT_GROUP = "ncclscope.commands"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ncclscope", description="Debugger and trace analyzer for distributed training.")
    p.add_argument("--version", action="version", version=f"ncclscope {__version__}")
    p.add_argument("--debug", action="store_true",
                   help="show the traceback of an internal error (exit 3); also NCCLSCOPE_DEBUG=1")
    sub = p.add_subparsers(dest="command", required=True)

    a = sub.add_parser("analyze", help="diagnose a run directory: verdict, findings, per-rank summary")
    a.add_argument("run", help="run directory (holds run.json and rank-NNNNN/), or a directory of Flight "
                   "Recorder dumps or PyTorch profiler traces (detected by content)")
    a.add_argument("--json", action="store_true", help="machine-readable output")
    _world_size_arg(a)
    add_engine_args(a)
    a.set_defaults(func=cmd_analyze)

    r = sub.add_parser("report", help="write a self-contained HTML report (bubbles, stragglers, divergence, ...)")
    r.add_argument("run", help="run directory")
    r.add_argument("-o", "--output", default="", help="output HTML file (default: report.html)")
    _world_size_arg(r)
    add_engine_args(r)
    r.set_defaults(func=cmd_report)

    e = sub.add_parser("export", help="export a trace to Perfetto (trace-event JSON) and/or Parquet")
    e.add_argument("run", help="run directory, Flight Recorder dump directory or profiler trace directory")
    e.add_argument("--perfetto", default="", metavar="OUT.json", help="Chrome/Perfetto trace-event JSON")
    e.add_argument("--parquet", default="", metavar="DIR", help="Parquet dataset partitioned by rank")
    _world_size_arg(e)
    add_engine_args(e)
    e.set_defaults(func=cmd_export)

    u = sub.add_parser("tui", help="terminal UI: verdict, rank grid, stacks, collectives, timeline")
    u.add_argument("run", help="run directory")
    u.add_argument("--follow", action="store_true", help="follow a job that is still writing its run directory")
    u.add_argument("--poll-s", type=float, default=1.0, help=argparse.SUPPRESS)
    add_engine_args(u)
    u.set_defaults(func=cmd_tui)

    _register_plugins(sub)
    return p


def _world_size_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--world-size", type=int, default=None, metavar="N",
                   help="the job's number of ranks, for Flight Recorder dumps: ranks that left no dump are then "
                        "seen as missing even when they are the highest (gloo's dumps list no group members)")


def _register_plugins(sub: argparse._SubParsersAction) -> None:
    """Let each installed `ncclscope.commands` entry point add its subcommands. One that fails to load
    (a broken install, a missing dependency) is one line on stderr; the analyzer's commands still work."""
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            ep.load()(sub)
        except Exception as exc:  # noqa: BLE001 - a plugin must not take `analyze` down with it
            print(f"ncclscope: the {ep.name!r} commands ({ep.value}) could not be loaded: "
                  f"{type(exc).__name__}: {exc}", file=sys.stderr)
