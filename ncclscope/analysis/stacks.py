"""Stack excerpts: the root rank's main-thread frames, from the faulthandler dump in stacks.txt."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from ..trace import Trace

_THREAD_RE = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+")



def stack_excerpt(text: str, max_frames: int = 12, max_chars: int = 2000) -> str:
    """The main thread's top frames from a faulthandler dump (the last dump in the file)."""
    blocks: list[list[str]] = []
    for line in text.splitlines():
        if _THREAD_RE.match(line):
            blocks.append([line])
        elif blocks and line.strip().startswith("File "):
            blocks[-1].append(line.rstrip())
    if not blocks:
        return "\n".join(text.strip().splitlines()[-30:])[-max_chars:]

    def is_main(block: list[str]) -> bool:
        body = "\n".join(block[1:])
        return "<module>" in body or ("threading.py" not in body and "_bootstrap" not in body)

    main = next((b for b in reversed(blocks) if is_main(b)), blocks[-1])
    excerpt = main[: max_frames + 1]
    if len(main) > max_frames + 1:
        excerpt.append(f"  ... {len(main) - max_frames - 1} more frames")
    return "\n".join(excerpt)[:max_chars]


def stack_for(trace: Trace, ranks: Iterable[int], limit: int = 2) -> str:
    """Stack excerpts of the first `limit` root ranks that have a stacks.txt."""
    parts = []
    for r in sorted(ranks):
        if r in trace.stacks and trace.stacks[r].strip():
            parts.append(f"rank {r}:\n{stack_excerpt(trace.stacks[r])}")
        if len(parts) >= limit:
            break
    return "\n\n".join(parts)

