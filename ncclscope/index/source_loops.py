"""The loop around a user's line, read from the script's source where it is still on disk.

A rank whose data ran out leaves its training loop early; its peers wait in the loop's next
collective. The line a user edits is the loop's header (`for batch in loader:`), which no
trace records: every op row names the line that issued it. The source does: the innermost
`for` / `while` whose body holds the line. Read-only, bounded (files over MAX_BYTES and
anything that does not parse are skipped), cached per file; "" whenever the file is gone.
"""
from __future__ import annotations

import ast
import functools
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ncclscope import schema as S
from ncclscope import sites

if TYPE_CHECKING:
    from ncclscope.load.trace import Trace

MAX_BYTES = 4 << 20


@functools.lru_cache(maxsize=64)
def _loops(path: str) -> tuple[tuple[int, int, int], ...]:
    """(header line, first line, last line) of every for/while loop in the file, () when unreadable."""
    try:
        p = Path(path)
        if not p.is_file() or p.stat().st_size > MAX_BYTES:
            return ()
        tree = ast.parse(p.read_text(errors="replace"), filename=path)
    except (OSError, SyntaxError, ValueError, RecursionError):
        return ()
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.For, ast.AsyncFor, ast.While)):
            out.append((node.lineno, node.lineno, getattr(node, "end_lineno", node.lineno) or node.lineno))
    return tuple(out)


def _resolve(path: str, cwds: list[str]) -> str:
    if os.path.isabs(path):
        return path
    for c in cwds:
        if c and os.path.isfile(os.path.join(c, path)):
            return os.path.join(c, path)
    return path


def in_span(span: tuple[str, int, int], site: str) -> bool:
    """Whether any frame of `site` lies in the loop's body."""
    path, header, last = span
    return any(p == path and header < line <= last for p, line in map(sites.path_line, sites.frames(site)))


def _nest(site: str, cwds: list[str]) -> tuple[str, list[tuple[int, int]]] | None:
    """(path, [(header, last line), ...] outermost first) of every loop around the site's innermost frame
    that is inside one; None when none is, or the source is not readable."""
    for frame in sites.frames(site):
        path, line = sites.path_line(frame)
        if line < 0:
            continue
        around = sorted(lp for lp in _loops(_resolve(path, cwds)) if lp[1] < line <= lp[2])
        if around:
            return path, [(header, last) for header, _, last in around]
    return None


def left_loop_note(cwds: list[str], others_site: str, own_sites: list[str] | None = None,
                   history: list[str] | None = None) -> str:
    """", in the loop at L; it left that loop early" where the peers' op (`others_site`) sits in a loop
    and none of the deviant rank's own sites (`own_sites`; None or empty: it finished) lies in it;
    "" otherwise: the reader then sees only where the others are.

    Which loop of a nest: the innermost one that holds the last place the deviant was inside the nest
    (`history`: its call sites, newest first). Its peers went from there round that loop's back edge to
    their op; it did not. A rank whose last op was a barrier after the inner loop left the outer loop (it
    ran the inner loop out, then the rest of the body); one whose last op was in the inner loop broke out
    of it. Without such a site, the innermost loop it is not in."""
    nest = _nest(others_site, cwds) if others_site else None
    if nest is None:
        return ""
    path, loops = nest
    free = [lp for lp in loops if not any(in_span((path, *lp), s) for s in (own_sites or []) if s)]
    if not free:
        return ""
    chosen = free[-1]
    for s in history or []:
        inside = [lp for lp in free if in_span((path, *lp), s)]
        if inside:
            chosen = inside[-1]
            break
    return f", in the loop at {path}:{chosen[0]}; it left that loop early"


def recent_sites(trace: "Trace", rank: int, limit: int = 256) -> list[str]:
    """The call sites of a rank's last `limit` communication ops, newest first ("" where none is recorded)."""
    ops = trace.ops
    if "call_site" not in ops.columns or not len(ops):
        return []
    mine = np.flatnonzero((ops["rank"].to_numpy() == rank)
                          & ops["kind"].isin([S.KIND_COLLECTIVE, S.KIND_P2P]).to_numpy())[-limit:]
    return [str(s) for s in ops["call_site"].to_numpy()[mine[::-1]]]


def cwds_of(trace) -> list[str]:
    """Every rank's recorded working directory (rank.json `cwd`), for relative call-site paths."""
    return sorted({i.cwd for i in trace.ranks.values() if getattr(i, "cwd", "")})
