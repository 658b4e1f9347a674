"""What every report figure shares: escaping, the layout, integer axes.

Every string that came from a trace (op names, group names, messages) goes
through `esc` before it reaches a label, a hover text or a title: Plotly
renders a subset of HTML in those, and a trace is untrusted input.
"""
from __future__ import annotations

import functools
import html
import json
from typing import Any, Iterable

import plotly.graph_objects as go
import plotly.io as pio

MS = 1e6
TEMPLATE = "plotly_white"
MAX_TICK_LABELS = 48     # an integer axis with at most this many values labels every one


@functools.lru_cache(maxsize=1)
def _template() -> str:
    return json.dumps(pio.templates[TEMPLATE].to_plotly_json(), sort_keys=True)


def template_json() -> dict[str, Any]:
    """The layout template every figure uses, as plain JSON (the page carries it once)."""
    return json.loads(_template())


def esc(value: Any) -> str:
    """html.escape for anything from a trace (quote=True: also safe inside attributes)."""
    return html.escape(str(value), quote=True)


def layout(fig: go.Figure, title: str, height: int = 420, legend: dict | None = None,
           margin: dict | None = None, **kw: Any) -> go.Figure:
    fig.update_layout(template=TEMPLATE, title=dict(text=esc(title), x=0.01), height=height,
                      margin=margin or dict(l=70, r=20, t=60, b=50),
                      legend={"orientation": "h", "y": -0.18, **(legend or {})}, **kw)
    return fig


def int_axis(values: Iterable[Any], every: int = MAX_TICK_LABELS, pad: bool = True) -> dict[str, Any]:
    """Axis settings for integer values (steps, ranks, experts): a tick on each value when there
    are at most `every` of them, else integer ticks only; with `pad`, one value gets a range of
    one either side (Plotly would put ticks at -0.5, 0, 0.5; heat maps need no pad)."""
    vals = sorted({int(v) for v in values})
    if not vals:
        return {}
    out: dict[str, Any] = {"tickformat": "d"}
    if len(vals) <= every:
        out.update(tickmode="array", tickvals=vals, ticktext=[str(v) for v in vals])
    else:
        out.update(tickmode="auto", nticks=min(every, 20))
    if pad and len(vals) == 1:
        out["range"] = [vals[0] - 1, vals[0] + 1]
    return out
