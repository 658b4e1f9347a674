"""The `ncclscope` command line.

    ncclscope train --dp 4 --steps 5 --out runs/a     run a traced job (imports torch)
    ncclscope analyze runs/a [--json]                  verdict, findings, per-rank summary
    ncclscope report runs/a -o a.html                  self-contained HTML report
    ncclscope tui runs/a [--follow]                    terminal UI for post-mortems
    ncclscope export runs/a --perfetto a.json          Perfetto / Parquet export
    ncclscope demo                                     a tour of real jobs with injected faults

Exit codes of `analyze`: 0 nothing wrong found, 1 problems found, 2 input
unreadable. `train` returns 0 when the job completed and nothing is wrong, 1
otherwise, 2 on a bad configuration.
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any, Sequence

from . import __version__
from .findings import Finding

EXIT_OK, EXIT_PROBLEMS, EXIT_UNREADABLE = 0, 1, 2


def run_analyses(trace: Any) -> Any:
    """The one Analysis of `trace` (ncclscope.analysis.run): every face shows this."""
    from .analysis import run
    return run(trace)


def _print_report(trace: Any, analysis: Any, out: Any = None) -> None:
    from .analysis.summary import rank_summary
    out = sys.stdout if out is None else out   # looked up per call, so callers can redirect stdout
    findings: list[Finding] = analysis.findings
    print(analysis.verdict, file=out)
    for e in analysis.errors:
        print(f"  (analysis error: {e})", file=out)
    if findings:
        print("\nFindings:", file=out)
        for f in findings:
            print(f"  [{f.severity}] {f.kind}: {f.title}", file=out)
            for ev in f.evidence[:6]:
                print(f"      - {ev.describe()}", file=out)
            if len(f.evidence) > 6:
                print(f"      ... {len(f.evidence) - 6} more evidence rows (see --json)", file=out)
    table = rank_summary(trace)
    print(f"\nRanks ({len(table)}):", file=out)
    if len(table) > 64:
        shown = table[table["state"] != "finished"].head(64)
        print(f"  ({len(table) - len(shown)} finished ranks not shown)", file=out)
    else:
        shown = table
    print(shown.to_string(index=False, max_colwidth=60), file=out)
    if trace.warnings:
        print(f"\nWarnings ({len(trace.warnings)}):", file=out)
        for w in trace.warnings[:20]:
            print(f"  {w}", file=out)
        if len(trace.warnings) > 20:
            print(f"  ... {len(trace.warnings) - 20} more", file=out)


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
    traces), or None after a one-line error on stderr."""
    from .ingest import load_any
    from .trace import TraceError
    try:
        return load_any(path)
    except TraceError as exc:
        print(f"ncclscope: {exc}", file=sys.stderr)
        return None


def cmd_analyze(ns: argparse.Namespace) -> int:
    trace = _load(ns.run)
    if trace is None:
        return EXIT_UNREADABLE
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
    trace = load(run_dir)
    analysis = run_analyses(trace)
    _print_report(trace, analysis)
    problems = analysis.exit_code != EXIT_OK or run["end_reason"] != "completed"
    return EXIT_PROBLEMS if problems else EXIT_OK


def cmd_report(ns: argparse.Namespace) -> int:
    from .report.html import write_report
    trace = _load(ns.run)
    if trace is None:
        return EXIT_UNREADABLE
    out = ns.output or "report.html"   # never inside the run directory: it is the user's evidence
    analysis = run_analyses(trace)
    stats = write_report(trace, out, analysis=analysis)
    print(analysis.verdict)
    print(f"ncclscope report: wrote {stats['path']} ({stats['bytes'] / 1e6:.1f} MB, {len(stats['sections'])} sections, "
          f"{stats['findings']} findings) in {stats['seconds']:.1f} s", file=sys.stderr)
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
    trace = _load(ns.run)
    if trace is None:
        return EXIT_UNREADABLE
    for w in trace.warnings[:20]:
        print(f"ncclscope: warning: {w}", file=sys.stderr)
    if ns.perfetto:
        stats = export_perfetto(trace, ns.perfetto)
        print(f"ncclscope export: wrote {ns.perfetto}: {json.dumps(stats, default=str)}")
    if ns.parquet:
        stats = export_parquet(trace, ns.parquet)
        print(f"ncclscope export: wrote {ns.parquet}/: {json.dumps(stats, default=str)}")
    return EXIT_OK


def cmd_tui(ns: argparse.Namespace) -> int:
    from .tui import run_tui
    return int(run_tui(ns.run, follow=ns.follow, poll_s=ns.poll_s) or 0)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ncclscope", description="Debugger and trace analyzer for distributed training.")
    p.add_argument("--version", action="version", version=f"ncclscope {__version__}")
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
    return p


def main(argv: Sequence[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return int(ns.func(ns))
    except BrokenPipeError:   # `ncclscope analyze RUN | head`
        return EXIT_OK
    except KeyboardInterrupt:
        print("ncclscope: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
