"""The TUI's tabs as data: their ids in order, key and title, the widget that
takes focus when a tab is shown, and the view each tab holds.
"""
from __future__ import annotations

from typing import Any

from ncclscope.tui.screens.collectives import CollectivesView
from ncclscope.tui.screens.metrics import MetricsView
from ncclscope.tui.screens.overview import OverviewView
from ncclscope.tui.screens.rank import RankView
from ncclscope.tui.screens.ranks import RanksView
from ncclscope.tui.screens.timeline import TimelineView

TABS = ("overview", "grid", "rank", "colls", "timeline", "metrics")
TAB_TITLES = {"overview": ("o", "Overview"), "grid": ("g", "Ranks"), "rank": ("r", "Rank"),
              "colls": ("c", "Collectives"), "timeline": ("t", "Timeline"), "metrics": ("m", "Metrics")}
FOCUS = {"overview": "#ov-findings", "grid": "#rg-grid", "rank": "#rk-ops", "colls": "#co-matrix",
         "timeline": "#tl-box", "metrics": "#mx-table"}
VIEWS: dict[str, Any] = {"overview": OverviewView, "grid": RanksView, "rank": RankView, "colls": CollectivesView,
                         "timeline": TimelineView, "metrics": MetricsView}
