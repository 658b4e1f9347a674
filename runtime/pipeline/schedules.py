"""Per-rank pipeline action tables: re-exported from `ncclscope.schedules`.

The tables are pure functions over integers (no torch), so they live in the
analyzer package, which must import on a machine without torch; the executor
and the tests keep importing them from here.
"""
from ncclscope.schedules import *  # noqa: F401,F403
from ncclscope.schedules import (  # noqa: F401  (names outside __all__)
    BACKWARD, FORWARD, SCHEDULE_NAMES, Action, build_schedule, format_actions, gpipe, interleaved_1f1b,
    num_stages, one_f_one_b, parse_action, stage_to_rank, theoretical_bubble,
)
