"""A call site as the tracer writes it: the user's line, then up to two user frames that called it.

    "train.py:20 < train.py:58 < train.py:90"     line 20, called from 58, called from 90

The built-in runtime and foreign evidence write one frame ("runtime/pipeline.py:120"). Sites are
compared whole (a helper's line called from two loop lines is two sites); these functions split one
for matching against a stack dump's frames and for naming the frame a user edits.
"""
from __future__ import annotations

SEP = " < "


def frames(site: str) -> list[str]:
    """The site's "path:line" frames, innermost first."""
    return [f for f in site.split(SEP) if f] if site else []


def inner(site: str) -> str:
    """The innermost frame (the line that issued the op)."""
    return site.split(SEP, 1)[0] if site else ""


def path_line(frame: str) -> tuple[str, int]:
    """("path", line) of one "path:line" frame; line -1 when it has none."""
    path, _, line = frame.rpartition(":")
    return (path, int(line)) if path and line.isdigit() else (frame, -1)


def same_frame(stack_frame: str, frame: str) -> bool:
    """A stack dump's absolute "path:line" is the site's (relative) frame."""
    return bool(frame) and (stack_frame == frame or stack_frame.endswith("/" + frame))


def in_stack(stack: list[str], site: str) -> bool:
    """The site's frames appear as consecutive frames of `stack` (innermost first), starting anywhere:
    the stack is inside that call, called from those lines."""
    fs = frames(site)
    if not fs:
        return False
    for i in range(len(stack) - len(fs) + 1):
        if all(same_frame(stack[i + j], f) for j, f in enumerate(fs)):
            return True
    return False
