"""Text plots for a terminal over SSH: sparklines and a one-step Gantt chart.

No plotting library: a login node has no browser and often no extra
packages, and both plots are a few numpy lines. Everything is computed from
columnar arrays (no per-span Python loop over thousands of spans), so a
1,024-rank step rasterises in milliseconds.
"""
from __future__ import annotations

import numpy as np
from rich.style import Style
from rich.text import Text

from ..model import TimelineModel

BLOCKS = "▁▂▃▄▅▆▇█"
IDLE = "·"
CODES = ("F", "B", "C", "P", "O")   # forward, backward, collective, p2p, other compute


def sparkline(values: np.ndarray, lo: float, hi: float, width: int = 20, bad: np.ndarray | None = None,
              bad_style: Style | str = "bold red", style: Style | str = "") -> Text:
    """The last `width` values as block characters on a shared scale [lo, hi].

    A shared scale across ranks is the point: a diverging rank's line sits
    visibly apart from its replicas'. NaN is a blank; `bad` marks red."""
    v = np.asarray(values, dtype=float)[-width:]
    marks = np.zeros(len(v), bool) if bad is None else np.asarray(bad, bool)[-width:]
    span = hi - lo
    if not np.isfinite(span) or span <= 0:
        idx = np.full(len(v), 3)
    else:
        idx = np.clip(np.rint((v - lo) / span * (len(BLOCKS) - 1)), 0, len(BLOCKS) - 1)
        idx = np.where(np.isfinite(idx), idx, 0).astype(int)
    chars = np.array(list(BLOCKS))[idx.astype(int)]
    chars = np.where(np.isfinite(v), chars, " ")
    chars = np.where(np.isnan(v) | np.isfinite(v), chars, "!")   # inf
    out = Text(no_wrap=True)
    for ch, b in zip(chars, marks | ~np.isfinite(v) & ~np.isnan(v)):
        out.append(str(ch), style=bad_style if b else style)
    return out


def raster(tl: TimelineModel, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(span index or -1, first-column flag) per (rank row, column): the latest-started span wins.

    Each span covers at least one column, so a 1 ms all_reduce inside a 2 s
    step is still visible."""
    n_rows = len(tl.ranks)
    grid = np.full((n_rows, max(width, 1)), -1, dtype=np.int64)
    first = np.zeros_like(grid, dtype=bool)
    if not len(tl.start) or width <= 0:
        return grid, first
    dt = max(tl.t1 - tl.t0, 1) / width
    cs = np.clip(((tl.start - tl.t0) / dt).astype(np.int64), 0, width - 1)
    ce = np.clip(np.ceil((tl.end - tl.t0) / dt).astype(np.int64), 0, width)
    ce = np.maximum(ce, cs + 1)
    order = np.argsort(tl.start, kind="stable")
    cs, ce, rows = cs[order], ce[order], tl.rank_idx[order]
    lengths = ce - cs
    span = np.repeat(order, lengths)
    offs = np.repeat(np.cumsum(lengths) - lengths, lengths)
    cols = np.repeat(cs, lengths) + (np.arange(lengths.sum()) - offs)
    grid[np.repeat(rows, lengths), cols] = span          # later assignments win: latest start on top
    first[rows, cs] = True
    return grid, first


def gantt_lines(tl: TimelineModel, width: int, styles: dict[str, Style]) -> list[Text]:
    """One Text per rank: `F` / `B` + microbatch digits, `C` collective, `P` p2p, `·` idle.

    `styles` maps each code, "idle" and "open" (an op still in flight at the
    end of the trace) to a Rich style."""
    grid, first = raster(tl, width)
    lines = []
    code = tl.code
    mb = tl.mb
    for row in range(len(tl.ranks)):
        g, f = grid[row], first[row]
        t = Text(no_wrap=True, overflow="crop")
        # run-length segments of equal span index
        change = np.flatnonzero(np.diff(g) != 0) + 1
        bounds = np.concatenate([[0], change, [len(g)]])
        for a, b in zip(bounds[:-1], bounds[1:]):
            s = int(g[a])
            if s < 0:
                t.append(IDLE * (b - a), style=styles["idle"])
                continue
            c = str(code[s])
            fill = str(int(mb[s]) % 10) if c in ("F", "B") and mb[s] >= 0 else c.lower()
            text = (c if f[a] else fill) + fill * (b - a - 1)
            style = styles.get(c, Style())
            if tl.open_[s]:
                style = style + styles["open"]
            t.append(text, style=style)
        lines.append(t)
    return lines
