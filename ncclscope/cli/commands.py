"""What each analyzer subcommand does once its arguments are parsed:
`cmd_<name>(ns) -> exit code`. Parsing is `parser.py`; output is
`output.py`; turning exceptions into exit codes is `main.py`. The
job-running commands (`train`, `run`, `demo`) live with the runtime
(`ncclscope.runtime.commands`), which registers them into the parser.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from ncclscope.cli.inputs import (EXIT_OK, EXIT_UNREADABLE, UsageError, first_line, load_input, progress,
                                  writable_dir, writable_file)
from ncclscope.cli.engine_args import engine_for, engine_wanted
from ncclscope.cli.memory_guard import check_fits
from ncclscope.cli.output import clean, json_report, plural, print_report, print_warnings


def read_input(ns: argparse.Namespace, quiet: bool = False, ops_only: bool = False) -> Any:
    """`ns.run` read in the mode its flags ask for (engine_args.py), after the memory check; None after a
    one-line error. `quiet`: no progress lines (--json). `ops_only`: on an engine, no event rows come to this
    process, only the ops and marks every analysis reads (engine/ops_chunks.py; not for exports)."""
    # UsageError (exit 2) when the input alone is bigger than the free memory
    size = check_fits(ns.run, joined=lambda size: ops_only and engine_wanted(ns, size))
    world = getattr(ns, "world_size", None)
    if world is not None and world < 1:
        raise UsageError(f"--world-size {world}: give the job's number of ranks (1 or more)")
    with engine_for(ns, ns.run, quiet, size) as engine:
        return load_input(ns.run, engine, world, ops_only=ops_only)


def run_analyses(trace: Any) -> Any:
    """The one Analysis of `trace` (ncclscope.verdict.run): every face shows this."""
    from ncclscope.verdict import run
    return run(trace)


def cmd_analyze(ns: argparse.Namespace) -> int:
    trace = read_input(ns, quiet=ns.json, ops_only=True)
    if trace is None:
        return EXIT_UNREADABLE
    print_warnings(trace)
    analysis = run_analyses(trace)
    if ns.json:
        json.dump(json_report(trace, analysis), sys.stdout, indent=1, default=str)
        print()
    else:
        print_report(trace, analysis)
    return analysis.exit_code


def cmd_report(ns: argparse.Namespace) -> int:
    from ncclscope.report.html import write_report
    out = writable_file(ns.output or "report.html", "-o")   # checked before minutes of analysis
    trace = read_input(ns, ops_only=True)
    if trace is None:
        return EXIT_UNREADABLE
    print_warnings(trace)
    analysis = run_analyses(trace)
    try:
        with progress(f"writing {out}"):
            stats = write_report(trace, out, analysis=analysis)
    except OSError as exc:
        raise UsageError(f"-o {out}: cannot write the report ({first_line(exc)})") from None
    print(clean(analysis.verdict))
    print(f"ncclscope report: wrote {stats['path']} ({stats['bytes'] / 1e6:.1f} MB, "
          f"{plural(len(stats['sections']), 'section')}, {plural(int(stats['findings']), 'finding')}) "
          f"in {stats['seconds']:.1f} s", file=sys.stderr)
    if stats.get("over_budget"):
        print("ncclscope report: the file is over its size budget; large sections were sampled", file=sys.stderr)
    for failure in stats.get("failed", []):   # the report says so too, in its notes
        print(f"ncclscope report: a section could not be drawn: {clean(failure)}", file=sys.stderr)
    return analysis.exit_code


def cmd_export(ns: argparse.Namespace) -> int:
    from ncclscope.export import export_parquet, export_perfetto
    if not ns.perfetto and not ns.parquet:
        print("ncclscope export: give --perfetto OUT.json and/or --parquet DIR", file=sys.stderr)
        return EXIT_UNREADABLE
    if ns.perfetto:
        writable_file(ns.perfetto, "--perfetto")
    if ns.parquet:
        writable_dir(ns.parquet, "--parquet")
        from ncclscope.export import DATASET_MARKER
        if (os.path.isdir(ns.parquet) and os.listdir(ns.parquet)
                and not os.path.exists(os.path.join(ns.parquet, DATASET_MARKER))):
            raise UsageError(f"--parquet {ns.parquet}: exists, is not empty and is not an ncclscope dataset; "
                             "refusing to write into it")
    trace = read_input(ns)
    if trace is None:
        return EXIT_UNREADABLE
    print_warnings(trace)
    from ncclscope.load.trace import TraceError
    if ns.perfetto:
        try:
            with progress(f"writing {ns.perfetto}"):
                stats = export_perfetto(trace, ns.perfetto)
        except OSError as exc:
            raise UsageError(f"--perfetto {ns.perfetto}: cannot write ({first_line(exc)})") from None
        print(f"ncclscope export: wrote {ns.perfetto} ({stats.get('bytes', 0) / 1e6:.1f} MB): "
              f"{plural(int(stats.get('slices', 0)), 'op slice')}, {plural(int(stats.get('flows', 0)), 'send->recv flow')}, "
              f"{plural(int(stats.get('counters', 0)), 'counter sample')} on "
              f"{plural(int(stats.get('processes', 0)), 'rank')}; open it in https://ui.perfetto.dev")
    if ns.parquet:
        try:
            with progress(f"writing {ns.parquet}"):
                stats = export_parquet(trace, ns.parquet)
        except TraceError as exc:       # refuses to write into a directory that is not a dataset
            raise UsageError(f"--parquet {clean(exc)}") from None
        except OSError as exc:
            raise UsageError(f"--parquet {ns.parquet}: cannot write ({first_line(exc)})") from None
        counts = ", ".join(plural(int(stats.get(k, 0)), k[:-1] if k.endswith("s") else k, k)
                           for k in ("events", "ops", "metrics", "samples", "groups"))
        print(f"ncclscope export: wrote the Parquet dataset {ns.parquet}/ ({counts}), partitioned by rank")
    return EXIT_OK


def cmd_tui(ns: argparse.Namespace) -> int:
    """The TUI loads its input itself, in stages; a large input asked for on an engine (--workers,
    --scheduler, or its size) is read first, here, with progress lines, and the app opens on that trace."""
    from ncclscope.tui import run_tui
    trace, used = None, False
    if not ns.follow:
        size = check_fits(ns.run)
        with engine_for(ns, ns.run, False, size) as engine:       # the workers stop before the app starts
            if engine is not None:
                used, trace = True, load_input(ns.run, engine)
        if used and trace is None:
            return EXIT_UNREADABLE
    return int(run_tui(ns.run, follow=ns.follow, poll_s=ns.poll_s, trace=trace) or 0)

