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

Where things are: `parser.py` (subcommands, flags, help text),
`commands.py` (one `cmd_<name>` per subcommand), `output.py` (the text and
JSON faces), `inputs.py` (reading input, checking output paths, the exit
codes); `main` here turns every outcome into an exit code.
"""
from __future__ import annotations

import os
import sys
import traceback
from typing import Sequence

from ncclscope.cli.inputs import EXIT_INTERNAL, EXIT_OK, EXIT_UNREADABLE, UsageError, debug_wanted, first_line, set_debug
from ncclscope.cli.memory_guard import Watchdog
from ncclscope.cli.output import clean
from ncclscope.cli.parser import build_parser

ANALYZER_COMMANDS = ("analyze", "report", "export")      # watched for memory (memory_guard.py)

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; every outcome is an exit code from the module docstring.
    No exception leaves here: bad input and unusable paths are one line and
    exit 2, a bug is one line and exit 3 (the traceback only with --debug)."""
    ns = build_parser().parse_args(argv)
    set_debug(bool(getattr(ns, "debug", False)))
    from ncclscope.load.trace import TraceError
    try:
        if ns.command in ANALYZER_COMMANDS:       # not the TUI (a terminal in raw mode) nor the runtime's jobs
            with Watchdog(ns.command):
                return int(ns.func(ns))
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
        print(f"ncclscope: {clean(first_line(exc))}", file=sys.stderr)
        return EXIT_UNREADABLE
    except Exception as exc:   # noqa: BLE001 - the one place that turns a bug into exit 3
        print(f"ncclscope: internal error ({type(exc).__name__}: {clean(first_line(exc))}); "
              "run with --debug for the traceback", file=sys.stderr)
        if debug_wanted():
            traceback.print_exc()
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
