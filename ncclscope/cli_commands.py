"""What each `ncclscope` subcommand does once its arguments are parsed:
`cmd_<name>(ns) -> exit code`. Parsing is `cli_parser.py`; output is
`cli_output.py`; turning exceptions into exit codes is `cli.main`.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from .cli_io import (EXIT_OK, EXIT_PROBLEMS, EXIT_UNREADABLE, UsageError, _first_line, _load, _progress,
                     _writable_dir, _writable_file)
from .cli_output import _clean, _json_report, _plural, _print_report, _print_warnings


def run_analyses(trace: Any) -> Any:
    """The one Analysis of `trace` (ncclscope.analysis.run): every face shows this."""
    from .analysis import run
    return run(trace)


def cmd_analyze(ns: argparse.Namespace) -> int:
    trace = _load(ns.run)
    if trace is None:
        return EXIT_UNREADABLE
    _print_warnings(trace)
    analysis = run_analyses(trace)
    if ns.json:
        json.dump(_json_report(trace, analysis), sys.stdout, indent=1, default=str)
        print()
    else:
        _print_report(trace, analysis)
    return analysis.exit_code


def cmd_train(ns: argparse.Namespace) -> int:
    from .runtime import config as C
    try:
        cfg = C.from_args(ns)
        from .runtime.faults import parse_spec
        for spec in cfg.inject:
            parse_spec(spec)
    except ValueError as exc:   # ConfigError, FaultSpecError
        print(f"ncclscope: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    if getattr(ns, "out", ""):
        _train_out_ok(ns.out)
    from .runtime.launch import RunDirError, launch
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
    from .trace import load
    trace = load(run_dir)           # even an empty run is analyzed: run.json's exit codes tell who died
    _print_warnings(trace)
    analysis = run_analyses(trace)
    _print_report(trace, analysis)
    problems = analysis.exit_code != EXIT_OK or run["end_reason"] != "completed"
    return EXIT_PROBLEMS if problems else EXIT_OK


def _train_out_ok(out: str) -> None:
    """Check `train --out` before any process starts: a file as a parent, a
    directory that cannot be created (/proc/nope) is one line, exit 2."""
    _writable_dir(out, "--out")
    if not os.path.lexists(out):
        try:
            os.makedirs(out)        # launch accepts the empty directory and writes the run into it
        except OSError as exc:
            raise UsageError(f"--out {out}: cannot create the run directory ({_first_line(exc)})") from None


def cmd_report(ns: argparse.Namespace) -> int:
    from .report.html import write_report
    out = _writable_file(ns.output or "report.html", "-o")   # checked before minutes of analysis
    trace = _load(ns.run)
    if trace is None:
        return EXIT_UNREADABLE
    _print_warnings(trace)
    analysis = run_analyses(trace)
    try:
        with _progress(f"writing {out}"):
            stats = write_report(trace, out, analysis=analysis)
    except OSError as exc:
        raise UsageError(f"-o {out}: cannot write the report ({_first_line(exc)})") from None
    print(_clean(analysis.verdict))
    print(f"ncclscope report: wrote {stats['path']} ({stats['bytes'] / 1e6:.1f} MB, "
          f"{_plural(len(stats['sections']), 'section')}, {_plural(int(stats['findings']), 'finding')}) "
          f"in {stats['seconds']:.1f} s", file=sys.stderr)
    if stats.get("over_budget"):
        print("ncclscope report: the file is over its size budget; large sections were sampled", file=sys.stderr)
    return analysis.exit_code


def cmd_demo(ns: argparse.Namespace) -> int:
    from .demo import run_demo
    return run_demo(ns.out, quick=ns.quick)


def cmd_export(ns: argparse.Namespace) -> int:
    from .export import export_parquet, export_perfetto
    if not ns.perfetto and not ns.parquet:
        print("ncclscope export: give --perfetto OUT.json and/or --parquet DIR", file=sys.stderr)
        return EXIT_UNREADABLE
    if ns.perfetto:
        _writable_file(ns.perfetto, "--perfetto")
    if ns.parquet:
        _writable_dir(ns.parquet, "--parquet")
        from .export import DATASET_MARKER
        if (os.path.isdir(ns.parquet) and os.listdir(ns.parquet)
                and not os.path.exists(os.path.join(ns.parquet, DATASET_MARKER))):
            raise UsageError(f"--parquet {ns.parquet}: exists, is not empty and is not an ncclscope dataset; "
                             "refusing to write into it")
    trace = _load(ns.run)
    if trace is None:
        return EXIT_UNREADABLE
    _print_warnings(trace)
    from .trace import TraceError
    if ns.perfetto:
        try:
            with _progress(f"writing {ns.perfetto}"):
                stats = export_perfetto(trace, ns.perfetto)
        except OSError as exc:
            raise UsageError(f"--perfetto {ns.perfetto}: cannot write ({_first_line(exc)})") from None
        print(f"ncclscope export: wrote {ns.perfetto} ({stats.get('bytes', 0) / 1e6:.1f} MB): "
              f"{_plural(int(stats.get('slices', 0)), 'op slice')}, {_plural(int(stats.get('flows', 0)), 'send->recv flow')}, "
              f"{_plural(int(stats.get('counters', 0)), 'counter sample')} on "
              f"{_plural(int(stats.get('processes', 0)), 'rank')}; open it in https://ui.perfetto.dev")
    if ns.parquet:
        try:
            with _progress(f"writing {ns.parquet}"):
                stats = export_parquet(trace, ns.parquet)
        except TraceError as exc:       # refuses to write into a directory that is not a dataset
            raise UsageError(f"--parquet {_clean(exc)}") from None
        except OSError as exc:
            raise UsageError(f"--parquet {ns.parquet}: cannot write ({_first_line(exc)})") from None
        counts = ", ".join(_plural(int(stats.get(k, 0)), k[:-1] if k.endswith("s") else k, k)
                           for k in ("events", "ops", "metrics", "samples", "groups"))
        print(f"ncclscope export: wrote the Parquet dataset {ns.parquet}/ ({counts}), partitioned by rank")
    return EXIT_OK


def cmd_tui(ns: argparse.Namespace) -> int:
    from .tui import run_tui
    return int(run_tui(ns.run, follow=ns.follow, poll_s=ns.poll_s) or 0)



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
    from .runtime.launch import RunDirError
    from .runtime.usertrace.launcher import launch
    try:
        run_dir, run, code = launch(cmd[0], cmd[1:], nproc=ns.nproc, out=ns.out, timeout_s=ns.timeout_s)
    except RunDirError as exc:
        print(f"ncclscope: {exc}", file=sys.stderr)
        return EXIT_UNREADABLE
    print(f"ncclscope run: {run['end_reason']} in {run['duration_s']:.1f} s (exit code {code}); "
          f"run directory {run_dir}", file=sys.stderr)
    if not ns.no_analyze:
        try:
            from .trace import load
            trace = load(run_dir)
            _print_report(trace, run_analyses(trace), out=sys.stderr)
        except Exception as exc:   # the job's exit code is what matters here
            print(f"ncclscope run: analysis failed ({type(exc).__name__}: {exc}); "
                  f"run `ncclscope analyze {run_dir}`", file=sys.stderr)
    return code
