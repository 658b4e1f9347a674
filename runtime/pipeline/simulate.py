"""Dry-run pipeline simulator: re-exported from `ncclscope.pipesim` (pure Python,
no torch, so the analyzer can replay a schedule on a machine without torch)."""
from ncclscope.pipesim import *  # noqa: F401,F403
from ncclscope.pipesim import Blocked, SimResult, TimedAction, simulate, validate_actions  # noqa: F401
