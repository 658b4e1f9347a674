"""The CLI's text and JSON faces of an analysis: verdict, findings, the Ranks
table, the loader's warnings. Every string from a trace passes `clean` before
it reaches a terminal; nothing here decides anything (`verdict.run` does).
"""
from __future__ import annotations

import re
import sys
from collections import Counter
from typing import Any

from ncclscope.findings import Finding

MAX_WARNINGS_SHOWN = 20
MAX_RANK_ROWS = 64          # the Ranks table of a bigger job shows this many, the rest counted


_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def clean(text: Any) -> str:
    """A string from a trace made safe for a terminal: control characters (escape
    sequences a hostile trace could carry) and lone surrogates become U+FFFD.
    Public: every face of the CLI (and its error lines) prints trace text through it."""
    return _CONTROL.sub("\ufffd", text if isinstance(text, str) else str(text))


def plural(n: int, word: str, plural: str = "") -> str:
    """`1 finding`, `3 findings` (or the given irregular plural): the commands' summary lines use it."""
    return f"{n} {word if n == 1 else (plural or word + 's')}"


_NO_STEP = re.compile(r" \(step -1\)|,? step -1\b")


def _evidence_text(text: str) -> str:
    """An evidence line without the "(step -1)" of rows outside any step."""
    return _NO_STEP.sub("", text)


def print_warnings(trace: Any, err: Any = None) -> None:
    """The loader's warnings, on stderr, before anything else is printed. Public: every command
    that loads a trace (the analyzer's and the runtime's `train`) prints them first."""
    err = sys.stderr if err is None else err
    warnings = list(getattr(trace, "warnings", []) or [])
    if not warnings:
        return
    print(f"ncclscope: the input is only partly readable ({plural(len(warnings), 'warning')}):", file=err)
    for w in warnings[:MAX_WARNINGS_SHOWN]:
        print(f"  warning: {clean(w)}", file=err)
    if len(warnings) > MAX_WARNINGS_SHOWN:
        print(f"  ... {len(warnings) - MAX_WARNINGS_SHOWN} more (all of them in --json)", file=err)



def print_report(trace: Any, analysis: Any, out: Any = None) -> None:
    """The text face: verdict, findings, the Ranks table. The loader's warnings
    go to stderr first (`print_warnings`), so stdout's first line is the verdict.
    Public: `analyze` and the runtime's `train` / `run` end with it."""
    out = sys.stdout if out is None else out   # looked up per call, so callers can redirect stdout
    findings: list[Finding] = analysis.findings
    print(clean(analysis.verdict), file=out)
    for e in analysis.errors:
        print(f"  (analysis error: {clean(e)})", file=out)
    if findings:
        print(f"\n{plural(len(findings), 'finding')}:", file=out)
        for f in findings:
            print(f"  [{f.severity}] {f.kind}: {clean(f.title)}", file=out)
            for ev in f.evidence[:6]:
                print(f"      - {clean(_evidence_text(ev.describe()))}", file=out)
            if len(f.evidence) > 6:
                print(f"      ... {plural(len(f.evidence) - 6, 'more evidence row')} (see --json)", file=out)
    _print_ranks(trace, out)
    if trace.warnings:
        print(f"\n{plural(len(trace.warnings), 'loader warning')} (printed first, on stderr; all in --json)",
              file=out)


def _print_ranks(trace: Any, out: Any) -> None:
    """The per-rank summary as a rich table (columns sized to their content)."""
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    from ncclscope.index.summary import rank_summary
    table = rank_summary(trace)
    print(f"\nRanks ({len(table)}):", file=out)
    untraced = table["rank"].isin(untraced_ranks(trace)).to_numpy()
    traced, world = traced_of(trace)
    if traced < world:
        hidden = f"; the {int(untraced.sum())} untraced are not shown" if untraced.any() else ""
        print(f"  {traced} of {world} ranks traced{hidden}", file=out)
    shown, note = _rows_shown(table[~untraced])
    if note:
        print(f"  ({note})", file=out)
    grid = Table(box=None, show_edge=False, pad_edge=False, header_style="bold", padding=(0, 1))
    numeric = {"rank", "steps", "ops"}
    for col in shown.columns:
        grid.add_column(str(col), justify="right" if col in numeric else "left", overflow="fold", max_width=60)
    for row in shown.itertuples(index=False):
        grid.add_row(*(Text(clean("" if v is None else v)) for v in row))   # Text: never parsed as markup
    import io
    import shutil
    is_tty = hasattr(out, "isatty") and out.isatty()
    buf = io.StringIO()
    width = shutil.get_terminal_size((200, 24)).columns if is_tty else 200
    Console(file=buf, width=max(width, 80), highlight=False, markup=False, emoji=False, no_color=True,
            force_terminal=False, soft_wrap=False).print(grid)
    for line in buf.getvalue().splitlines():
        print(line.rstrip(), file=out)


def traced_of(trace: Any) -> tuple[int, int]:
    """(ranks with a trace, ranks in the job): the "N of M ranks traced" of the text and JSON faces.
    Public: profiling a sample of ranks is the norm, so every face says how many were seen."""
    traced = len(trace.present_ranks)
    return traced, max(int(trace.world_size), traced)


def untraced_ranks(trace: Any) -> list[int]:
    """Ranks an input that records a sample of ranks (profiler traces) has no data of: the index's rule
    (`rank_states.untraced`), read from the RankInfos, so the faces never rebuild the index for it.
    Public: the text face leaves them out of the Ranks table, which has nothing to say of them."""
    from ncclscope.index.rank_states import SAMPLED_SOURCES
    if trace.run.source not in SAMPLED_SOURCES:
        return []
    return [r for r, info in trace.ranks.items() if not info.present]


def _rows_shown(table: Any) -> tuple[Any, str]:
    """At most MAX_RANK_ROWS rows in rank order, the ranks that need a look first (then finished ones),
    and a note that counts the rows left out by their state, so "not shown" names what they are."""
    if len(table) <= MAX_RANK_ROWS:
        return table, ""
    states = [str(st) for st in table["state"]]
    keep = sorted(sorted(range(len(states)), key=lambda i: (states[i] == "finished", i))[:MAX_RANK_ROWS])
    kept = set(keep)
    left = Counter(st for i, st in enumerate(states) if i not in kept)
    counts = ", ".join(f"{n} {st}" for st, n in sorted(left.items(), key=lambda item: (-item[1], item[0])))
    return table.iloc[keep], f"{plural(sum(left.values()), 'rank')} not shown: {counts}"


def json_report(trace: Any, analysis: Any) -> dict[str, Any]:
    """The `analyze --json` document (verdict, findings, how many ranks were traced, ranks, warnings).
    Public: the scale benchmark and tests compare it byte for byte with the CLI's output."""
    from ncclscope.index.summary import rank_summary
    from ncclscope.schema import SCHEMA_VERSION
    return {
        "schema": SCHEMA_VERSION,
        "run": str(trace.path),
        "verdict": analysis.verdict,
        "level": analysis.level,
        "world_size": traced_of(trace)[1],
        "traced_ranks": traced_of(trace)[0],       # "N of M ranks traced": profilers trace a sample
        "findings": [f.to_json() for f in analysis.findings],
        "analysis_errors": list(analysis.errors),
        "ranks": rank_summary(trace).to_dict(orient="records"),
        "warnings": list(trace.warnings),
    }
