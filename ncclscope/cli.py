"""The `ncclscope` command line.

    ncclscope train --dp 4 --steps 5 --out runs/a     run a traced job (imports torch)
    ncclscope analyze runs/a [--json]                  verdict, findings, per-rank summary
    ncclscope report runs/a -o a.html                  self-contained HTML report
    ncclscope tui runs/a [--follow]                    terminal UI for post-mortems
    ncclscope export runs/a --perfetto a.json          Perfetto / Parquet export
    ncclscope demo                                     a tour of real jobs with injected faults

Exit codes (every command):
    0  nothing wrong found (train: the job completed and nothing is wrong)
    1  problems found (a hang, a dead rank, a straggler, ...: see the verdict)
    2  the input is unreadable or the usage is wrong: nothing could be read
       from it, an output path cannot be written, a bad configuration. One
       line on stderr says what and where.
    3  internal error (a bug in ncclscope): one line on stderr; run with
       --debug (or NCCLSCOPE_DEBUG=1) for the traceback.
  130  interrupted (Ctrl-C).
Input that is only partly readable is analyzed; its warnings are printed
first (on stderr), before the verdict.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import traceback
from typing import Any, Sequence

from . import __version__
from .findings import Finding

EXIT_OK, EXIT_PROBLEMS, EXIT_UNREADABLE, EXIT_INTERNAL = 0, 1, 2, 3
MAX_WARNINGS_SHOWN = 20


class UsageError(Exception):
    """A command line that cannot work (an output path that cannot be written); exit 2, one line."""


_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def _clean(text: Any) -> str:
    """A string from a trace made safe for a terminal: control characters (escape
    sequences a hostile trace could carry) and lone surrogates become U+FFFD."""
    return _CONTROL.sub("\ufffd", text if isinstance(text, str) else str(text))


def _plural(n: int, word: str, plural: str = "") -> str:
    return f"{n} {word if n == 1 else (plural or word + 's')}"


_NO_STEP = re.compile(r" \(step -1\)|,? step -1\b")


def _evidence_text(text: str) -> str:
    """An evidence line without the "(step -1)" of rows outside any step."""
    return _NO_STEP.sub("", text)


def _print_warnings(trace: Any, err: Any = None) -> None:
    """The loader's warnings, on stderr, before anything else is printed."""
    err = sys.stderr if err is None else err
    warnings = list(getattr(trace, "warnings", []) or [])
    if not warnings:
        return
    print(f"ncclscope: the input is only partly readable ({_plural(len(warnings), 'warning')}):", file=err)
    for w in warnings[:MAX_WARNINGS_SHOWN]:
        print(f"  warning: {_clean(w)}", file=err)
    if len(warnings) > MAX_WARNINGS_SHOWN:
        print(f"  ... {len(warnings) - MAX_WARNINGS_SHOWN} more (all of them in --json)", file=err)


def run_analyses(trace: Any) -> Any:
    """The one Analysis of `trace` (ncclscope.analysis.run): every face shows this."""
    from .analysis import run
    return run(trace)


def _print_report(trace: Any, analysis: Any, out: Any = None) -> None:
    """The text face: verdict, findings, the Ranks table. The loader's warnings
    go to stderr first (`_print_warnings`), so stdout's first line is the verdict."""
    out = sys.stdout if out is None else out   # looked up per call, so callers can redirect stdout
    findings: list[Finding] = analysis.findings
    print(_clean(analysis.verdict), file=out)
    for e in analysis.errors:
        print(f"  (analysis error: {_clean(e)})", file=out)
    if findings:
        print(f"\n{_plural(len(findings), 'finding')}:", file=out)
        for f in findings:
            print(f"  [{f.severity}] {f.kind}: {_clean(f.title)}", file=out)
            for ev in f.evidence[:6]:
                print(f"      - {_clean(_evidence_text(ev.describe()))}", file=out)
            if len(f.evidence) > 6:
                print(f"      ... {_plural(len(f.evidence) - 6, 'more evidence row')} (see --json)", file=out)
    _print_ranks(trace, out)
    if trace.warnings:
        print(f"\n{_plural(len(trace.warnings), 'loader warning')} (printed first, on stderr; all in --json)",
              file=out)


def _print_ranks(trace: Any, out: Any) -> None:
    """The per-rank summary as a rich table (columns sized to their content)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from .analysis.summary import rank_summary
    table = rank_summary(trace)
    print(f"\nRanks ({len(table)}):", file=out)
    if len(table) > 64:
        shown = table[table["state"] != "finished"].head(64)
        print(f"  ({len(table) - len(shown)} finished ranks not shown)", file=out)
    else:
        shown = table
    grid = Table(box=None, show_edge=False, pad_edge=False, header_style="bold", padding=(0, 1))
    numeric = {"rank", "steps", "ops"}
    for col in shown.columns:
        grid.add_column(str(col), justify="right" if col in numeric else "left", overflow="fold", max_width=60)
    for row in shown.itertuples(index=False):
        grid.add_row(*(Text(_clean("" if v is None else v)) for v in row))   # Text: never parsed as markup
    import io
    import shutil
    is_tty = hasattr(out, "isatty") and out.isatty()
    buf = io.StringIO()
    width = shutil.get_terminal_size((200, 24)).columns if is_tty else 200
    Console(file=buf, width=max(width, 80), highlight=False, markup=False, emoji=False, no_color=True,
            force_terminal=False, soft_wrap=False).print(grid)
    for line in buf.getvalue().splitlines():
        print(line.rstrip(), file=out)


def _json_report(trace: Any, analysis: Any) -> dict[str, Any]:
    from .analysis.summary import rank_summary
    from .schema import SCHEMA_VERSION
    return {
        "schema": SCHEMA_VERSION,
        "run": str(trace.path),
        "verdict": analysis.verdict,
        "level": analysis.level,
        "findings": [f.to_json() for f in analysis.findings],
        "analysis_errors": list(analysis.errors),
        "ranks": rank_summary(trace).to_dict(orient="records"),
        "warnings": list(trace.warnings),
    }


def _load(path: str) -> Any:
    """Any supported input (run directory, Flight Recorder dumps, profiler
    traces), or None after a one-line error on stderr. A spinner on stderr
    (only when stderr is a terminal) shows a load that takes a while."""
    from .ingest import load_any
    from .trace import TraceError
    try:
        with _progress(f"reading {path}"):
            return load_any(path)
    except TraceError as exc:
        print(f"ncclscope: {_clean(exc)}", file=sys.stderr)
    except (OSError, ValueError, RecursionError, MemoryError) as exc:   # a reader that did not word its error
        print(f"ncclscope: {_clean(path)}: unreadable input ({type(exc).__name__}: {_clean(_first_line(exc))})",
              file=sys.stderr)
        if _debug():
            traceback.print_exc()
    return None


class _progress:
    """A transient spinner on stderr for slow steps, shown after one second and
    only when stderr is a terminal (never in pipes, logs or tests)."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._status: Any = None
        self._timer: Any = None

    def __enter__(self) -> "_progress":
        if not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
            return self
        import threading

        from rich.console import Console

        def show() -> None:
            self._status = Console(stderr=True, highlight=False, markup=False).status(_clean(self.what) + " ...")
            self._status.start()

        self._timer = threading.Timer(1.0, show)
        self._timer.daemon = True
        self._timer.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer.join()
        if self._status is not None:
            self._status.stop()


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else type(exc).__name__


def _debug() -> bool:
    return bool(os.environ.get("NCCLSCOPE_DEBUG")) or _DEBUG[0]


_DEBUG = [False]


def _writable_file(path: str, flag: str) -> str:
    """`path` when a file can be written there, else UsageError naming why
    (a directory in its place, a parent that is missing or a file)."""
    target = os.path.abspath(path)
    if os.path.isdir(target):
        raise UsageError(f"{flag} {path}: is a directory; give a file name")
    _writable_parent(os.path.dirname(target) or ".", path, flag)
    return path


def _writable_dir(path: str, flag: str) -> str:
    """`path` when a directory can be created or written there, else UsageError."""
    target = os.path.abspath(path)
    if os.path.lexists(target) and not os.path.isdir(target):
        raise UsageError(f"{flag} {path}: exists and is not a directory")
    _writable_parent(target if os.path.isdir(target) else os.path.dirname(target), path, flag)
    return path


def _writable_parent(parent: str, path: str, flag: str) -> None:
    probe = parent
    while not os.path.lexists(probe):          # the nearest existing ancestor decides
        up = os.path.dirname(probe)
        if up == probe:
            break
        probe = up
    if not os.path.isdir(probe):
        raise UsageError(f"{flag} {path}: {probe} is not a directory")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: {probe} is not writable")


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


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; every outcome is an exit code from the module docstring.
    No exception leaves here: bad input and unusable paths are one line and
    exit 2, a bug is one line and exit 3 (the traceback only with --debug)."""
    ns = build_parser().parse_args(argv)
    _DEBUG[0] = bool(getattr(ns, "debug", False))
    from .trace import TraceError
    try:
        return int(ns.func(ns))
    except BrokenPipeError:   # `ncclscope analyze RUN | head`
        try:
            sys.stdout = open(os.devnull, "w")   # noqa: SIM115 - the interpreter flushes stdout at exit
        except OSError:
            pass
        return EXIT_OK
    except KeyboardInterrupt:
        print("ncclscope: interrupted", file=sys.stderr)
        return 130
    except (UsageError, TraceError) as exc:
        print(f"ncclscope: {_clean(_first_line(exc))}", file=sys.stderr)
        return EXIT_UNREADABLE
    except Exception as exc:   # noqa: BLE001 - the one place that turns a bug into exit 3
        print(f"ncclscope: internal error ({type(exc).__name__}: {_clean(_first_line(exc))}); "
              "run with --debug for the traceback", file=sys.stderr)
        if _debug():
            traceback.print_exc()
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
