"""Stack excerpts without the recorder's own frames.

A rank's stack is dumped by the recorder from inside its own plumbing (the
dump itself, the comm wrapper's wait loop), so the top frames of a raw dump
are always `dump_stacks`, `_finish`, `_run`: true, and useless. The frame a
person wants first is the call the training code made (`recv`, `all_reduce`)
and the code that made it; those are kept, ncclscope's internals above them
are folded into one "N recorder frames hidden" line.
"""
from __future__ import annotations

import re

_FRAME = re.compile(r'^\s*File "(?P<file>[^"]*)", line \d+ in (?P<func>\S+)')


def is_own_frame(file: str, func: str) -> bool:
    """A frame of ncclscope's recorder / comm wrapper internals (not an API the training code called)."""
    f = file.replace("\\", "/").replace("/ncclscope/runtime/", "/runtime/")   # the runtime is training code
    if "/ncclscope/" in f or f.endswith("runtime/recorder.py") or func == "dump_stacks":
        return True
    return f.endswith("runtime/comm.py") and func.startswith("_")


def hide_own_frames(text: str) -> str:
    """Drop the recorder's frames at the top of each thread's block (most recent call first)."""
    out: list[str] = []
    hidden = 0
    at_top = False
    for line in text.splitlines():
        m = _FRAME.match(line)
        if m is None:
            if hidden:
                out.append(f"  ({hidden} recorder frame{'s' if hidden != 1 else ''} hidden)")
                hidden = 0
            at_top = "thread" in line.lower() or "most recent call first" in line
            out.append(line)
            continue
        if at_top and is_own_frame(m["file"], m["func"]):
            hidden += 1
            continue
        if hidden:
            out.append(f"  ({hidden} recorder frame{'s' if hidden != 1 else ''} hidden)")
            hidden = 0
        at_top = False
        out.append(line)
    if hidden:
        out.append(f"  ({hidden} recorder frame{'s' if hidden != 1 else ''} hidden)")
    return "\n".join(out)
