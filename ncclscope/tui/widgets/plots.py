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

from ncclscope.tui.presenters import TimelineModel

BLOCKS = "▁▂▃▄▅▆▇█"
IDLE = "·"
CODES = ("F", "B", "C", "P", "O")   # forward, backward, collective, p2p, other compute


def use_log_scale(lo: float, hi: float) -> bool:
    """A log scale when the values span more than 10x (a grad-norm spike would flatten the rest)."""
    return bool(np.isfinite(lo) and np.isfinite(hi) and lo > 0 and hi / lo > 10)


def resample(values: np.ndarray, width: int, bad: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """At most `width` points: one per step when they fit, else the largest value of each bucket of
    steps (a one-step spike survives any width); `bad` is true where any step of the bucket is."""
    v = np.asarray(values, dtype=float)
    b = np.zeros(len(v), bool) if bad is None else np.asarray(bad, bool)
    if len(v) <= width or width <= 0:
        return v, b
    edges = np.linspace(0, len(v), width + 1).astype(int)[:-1]
    finite = np.where(np.isnan(v), -np.inf, v)
    out = np.maximum.reduceat(finite, edges)
    allnan = np.logical_and.reduceat(np.isnan(v), edges)
    out = np.where(allnan, np.nan, out)
    return out, np.logical_or.reduceat(b, edges)


def sparkline(values: np.ndarray, lo: float, hi: float, width: int = 20, bad: np.ndarray | None = None,
              bad_style: Style | str = "bold red", style: Style | str = "", log: bool | None = None) -> Text:
    """Every value (bucketed to `width` when there are more) as block characters on a shared scale [lo, hi].

    A shared scale across ranks is the point: a diverging rank's line sits
    visibly apart from its replicas'. The scale is logarithmic when the data
    span more than 10x (`log=None`: decide from lo, hi). NaN is a blank, inf
    a `!`; `bad` marks red."""
    v, marks = resample(values, width, bad)
    if log is None:
        log = use_log_scale(lo, hi)
    if log:
        pos_inf = np.isposinf(v)
        with np.errstate(divide="ignore", invalid="ignore"):
            v = np.where(v > 0, np.log10(np.where(v > 0, v, 1.0)), np.where(np.isnan(v), np.nan, -np.inf))
        v = np.where(pos_inf, np.inf, v)
        lo, hi = float(np.log10(lo)), float(np.log10(hi))
    span = hi - lo
    if not np.isfinite(span) or span <= 0:
        idx = np.full(len(v), 3)
    else:
        with np.errstate(invalid="ignore"):
            idx = np.clip(np.rint((v - lo) / span * (len(BLOCKS) - 1)), 0, len(BLOCKS) - 1)
        idx = np.where(np.isfinite(idx), idx, 0).astype(int)
    chars = np.array(list(BLOCKS))[idx.astype(int)]
    chars = np.where(np.isfinite(v), chars, " ")
    chars = np.where(np.isnan(v) | np.isfinite(v), chars, "!")   # inf
    out = Text(no_wrap=True)
    for ch, b in zip(chars, marks | ~np.isfinite(v) & ~np.isnan(v)):
        out.append(str(ch), style=bad_style if b else style)
    return out


# Which span wins a column two spans share: compute over p2p over collectives, then the latest start.
# Tensor-parallel all-reduces run inside every forward / backward; drawn on top they turn the 1F1B
# pattern into CcccCCCC. A collective still shows wherever the rank was doing nothing else.
PRIORITY = {"C": 0, "P": 1, "O": 2, "F": 3, "B": 3}


def raster(tl: TimelineModel, width: int) -> tuple[np.ndarray, np.ndarray]:
    """(span index or -1, first-column flag) per (rank row, column): compute wins over communication
    (`PRIORITY`), then the latest-started span.

    Each span covers at least one column, so a 1 ms all_reduce inside a 2 s
    step is still visible where no compute covers it."""
    n_rows = len(tl.ranks)
    grid = np.full((n_rows, max(width, 1)), -1, dtype=np.int64)
    first = np.zeros_like(grid, dtype=bool)
    if not len(tl.start) or width <= 0:
        return grid, first
    dt = max(tl.t1 - tl.t0, 1) / width
    cs = np.clip(((tl.start - tl.t0) / dt).astype(np.int64), 0, width - 1)
    ce = np.clip(np.ceil((tl.end - tl.t0) / dt).astype(np.int64), 0, width)
    ce = np.maximum(ce, cs + 1)
    code = np.asarray(tl.code, dtype=object)
    prio = np.zeros(len(tl.start), dtype=np.int64)
    for c, p in PRIORITY.items():
        prio[code == c] = p
    order = np.lexsort((tl.start, prio))         # later assignments win: priority, then latest start
    cs, ce, rows = cs[order], ce[order], tl.rank_idx[order]
    lengths = ce - cs
    span = np.repeat(order, lengths)
    offs = np.repeat(np.cumsum(lengths) - lengths, lengths)
    cols = np.repeat(cs, lengths) + (np.arange(lengths.sum()) - offs)
    grid[np.repeat(rows, lengths), cols] = span
    won = grid[rows, cs] == order                # a span hidden under compute marks no first column
    first[rows[won], cs[won]] = True
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
