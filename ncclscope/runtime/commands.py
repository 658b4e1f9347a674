"""The job-running subcommands (`train`, `run`, `demo`), registered into the `ncclscope` CLI.

The analyzer half (`ncclscope/`) never imports this package: its parser finds
these commands through the `ncclscope.commands` entry point (pyproject.toml),
so the dependency points one way, runtime -> analyzer. An install without the
runtime (or a copy of `ncclscope/` alone) still has `analyze`, `report`,
`tui` and `export`; the job commands are simply absent.

Each `cmd_*` returns the command's exit code (`ncclscope.cli.inputs`' EXIT_*); `ncclscope.cli.main`
turns exceptions into exit codes for these exactly as for the analyzer's own.
"""
from __future__ import annotations

import argparse
import os
import sys

from ncclscope.cli.commands import run_analyses
from ncclscope.cli.inputs import EXIT_OK, EXIT_PROBLEMS, EXIT_UNREADABLE, UsageError, first_line, writable_dir
from ncclscope.cli.output import print_report, print_warnings
from ncclscope.runtime import config as C


def register(sub: argparse._SubParsersAction) -> None:
    """Add `train`, `run` and `demo` to the `ncclscope` subcommand parser `sub`."""
    t = sub.add_parser("train", help="run an instrumented multi-rank training job on this machine")
    C.add_arguments(t)
    t.add_argument("--dump-grads", default="", help=argparse.SUPPRESS)
    t.set_defaults(func=cmd_train)

    n = sub.add_parser("run", help="trace your own torch.distributed script, unchanged: ncclscope run --nproc 2 -- "
                       "train.py ARGS (under torchrun: torchrun ... -m ncclscope.run train.py ARGS)")
    n.add_argument("--nproc", type=int, default=1, help="ranks to start on this node (default 1)")
    n.add_argument("--timeout-s", type=float, default=60.0, help="an op in flight this long gets its evidence "
                   "dumped (stacks, Flight Recorder, trace); the op continues, nothing is raised (default 60)")
    n.add_argument("--out", default="", help="run directory (default runs/run-TIME)")
    n.add_argument("--no-analyze", action="store_true", help="do not print the verdict after the job")
    nan = n.add_mutually_exclusive_group()
    nan.add_argument("--nan-check", dest="nan_check", action="store_const", const="on", default="auto",
                     help="check the inputs of reducing collectives and DDP's gradients for NaN/Inf on every "
                     "device, CUDA included (each check then waits for the GPU); by default CPU tensors only")
    nan.add_argument("--no-nan-check", dest="nan_check", action="store_const", const="off",
                     help="no NaN/Inf check (it names the rank a NaN came from; ~3 us per reducing op)")
    n.add_argument("script_argv", nargs=argparse.REMAINDER, metavar="-- SCRIPT [ARGS...]",
                   help="the script and its arguments, passed to it unparsed")
    n.set_defaults(func=cmd_run)

    d = sub.add_parser("demo", help="a short tour of real multi-rank jobs with injected faults")
    d.add_argument("--out", default="", help="directory for the tour's runs and reports (default runs/demo-TIME)")
    d.add_argument("--quick", action="store_true", help="a reduced tour (two jobs)")
    d.set_defaults(func=cmd_demo)


def cmd_train(ns: argparse.Namespace) -> int:
    """`ncclscope train`: check the configuration and the drills before any process starts, run the job,
    print the verdict; exit 1 when the job did not complete or the verdict found a problem."""
    try:
        cfg = C.from_args(ns)
        from ncclscope.runtime.faults import parse_spec
        for spec in cfg.inject:
            parse_spec(spec)
    except ValueError as exc:   # ConfigError, FaultSpecError
        print(f"ncclscope: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    if getattr(ns, "out", ""):
        _train_out_ok(ns.out)
    from ncclscope.runtime.launch import RunDirError, launch
    try:
        run_dir, run = launch(cfg, dump_grads=ns.dump_grads)
    except RunDirError as exc:
        print(f"ncclscope: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    print(f"ncclscope train: {run['end_reason']} in {run['duration_s']:.1f} s; run directory {run_dir}",
          file=sys.stderr)
    if not cfg.trace:
        codes = [v["exitcode"] for v in run["ranks"].values()]
        return EXIT_OK if run["end_reason"] == "completed" and all(c == 0 for c in codes) else EXIT_PROBLEMS
    from ncclscope.load.trace import load
    trace = load(run_dir)           # even an empty run is analyzed: run.json's exit codes tell who died
    print_warnings(trace)
    analysis = run_analyses(trace)
    print_report(trace, analysis)
    problems = analysis.exit_code != EXIT_OK or run["end_reason"] != "completed"
    return EXIT_PROBLEMS if problems else EXIT_OK


def _train_out_ok(out: str) -> None:
    """Check `train --out` before any process starts: a file as a parent, a
    directory that cannot be created (/proc/nope) is one line, exit 2."""
    writable_dir(out, "--out")
    if not os.path.lexists(out):
        try:
            os.makedirs(out)        # launch accepts the empty directory and writes the run into it
        except OSError as exc:
            raise UsageError(f"--out {out}: cannot create the run directory ({first_line(exc)})") from None


def cmd_demo(ns: argparse.Namespace) -> int:
    from ncclscope.runtime.demo import run_demo
    return run_demo(ns.out, quick=ns.quick)


def cmd_run(ns: argparse.Namespace) -> int:
    """`ncclscope run`: start the ranks, write run.json, print the verdict (stderr); return the job's exit code."""
    cmd = list(ns.script_argv or [])
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        print("ncclscope run: give the script to run: ncclscope run [--nproc N] -- SCRIPT [ARGS...]", file=sys.stderr)
        return EXIT_UNREADABLE
    if not os.path.isfile(cmd[0]):
        print(f"ncclscope run: {cmd[0]}: no such script", file=sys.stderr)
        return EXIT_UNREADABLE
    if ns.nproc < 1:
        print("ncclscope run: --nproc must be at least 1", file=sys.stderr)
        return EXIT_UNREADABLE
    from ncclscope.runtime.launch import RunDirError
    from ncclscope.runtime.usertrace.launcher import launch
    try:
        run_dir, run, code = launch(cmd[0], cmd[1:], nproc=ns.nproc, out=ns.out, timeout_s=ns.timeout_s,
                                    nan_check=getattr(ns, "nan_check", "auto"))
    except RunDirError as exc:
        print(f"ncclscope: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    print(f"ncclscope run: {run['end_reason']} in {run['duration_s']:.1f} s (exit code {code}); "
          f"run directory {run_dir}", file=sys.stderr)
    if not ns.no_analyze:
        try:
            from ncclscope.load.trace import load
            trace = load(run_dir)
            print_report(trace, run_analyses(trace), out=sys.stderr)
        except Exception as exc:   # the job's exit code is what matters here
            print(f"ncclscope run: analysis failed ({type(exc).__name__}: {exc}); "
                  f"run `ncclscope analyze {run_dir}`", file=sys.stderr)
    return code
