"""Textual TUI for post-mortem of hung jobs and following live ones (`ncclscope tui RUN [--follow]`).

Importing this package does not import Textual: the CLI calls `run_tui`, which does.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any


def run_tui(path: str | Path, follow: bool = False, poll_s: float = 1.0, trace: Any = None) -> int:
    """Open the TUI on a run directory (or on `trace`, already loaded from it); returns the process exit
    code (2: not a run directory)."""
    from ncclscope.tui.app import run_tui as _run_tui
    return _run_tui(path, follow=follow, poll_s=poll_s, trace=trace)
