"""Stack excerpts: the root rank's main-thread frames, from the faulthandler dump in stacks.txt."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Iterable

from ncclscope.load.fr_merge import is_user_file

if TYPE_CHECKING:
    from ncclscope.load.trace import Trace

_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+) in (\S+)')
_THREAD_RE = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+")



_DUMP_RE = re.compile(r"^=== ncclscope rank \d+: .* at (\d+) ns ===$", re.M)


def _thread_blocks(text: str) -> list[list[str]]:
    """Per thread of a faulthandler dump: its header line, then its `File ...` lines (most recent first)."""
    blocks: list[list[str]] = []
    for line in text.splitlines():
        if _THREAD_RE.match(line):
            blocks.append([line])
        elif blocks and line.strip().startswith("File "):
            blocks[-1].append(line.rstrip())
    return blocks


def _is_main(block: list[str]) -> bool:
    body = "\n".join(block[1:])
    return "<module>" in body or ("threading.py" not in body and "_bootstrap" not in body)


def main_thread_dumps(text: str) -> list[tuple[int, list[str]]]:
    """(local time_ns of the dump, the main thread's `File ...` lines) for each dump in a stacks.txt."""
    heads = list(_DUMP_RE.finditer(text))
    out = []
    for i, h in enumerate(heads):
        blocks = _thread_blocks(text[h.end(): heads[i + 1].start() if i + 1 < len(heads) else len(text)])
        main = next((b for b in blocks if _is_main(b)), None)
        if main is not None:
            out.append((int(h.group(1)), main[1:]))
    return out


def user_frame(trace: "Trace", rank: int, lo_ns: int, hi_ns: int, latest: bool = False) -> tuple[str, int]:
    """(file:line in function, aligned dump time) of the main thread's innermost frame in the user's
    own code, from the first (`latest`: the last) dump of `rank` taken inside [lo_ns, hi_ns];
    ("", -1) when none. The first says where a late rank was when its peers began to wait; the
    last, where a rank still stuck at the end was when the job was stopped (SIGTERM's evidence)."""
    text = trace.stacks.get(rank, "")
    if not text:
        return "", -1
    info = trace.ranks.get(rank)
    offset = int(getattr(info, "clock_offset_ns", 0) or 0)
    dumps = main_thread_dumps(text)
    for local_ns, frames in (reversed(dumps) if latest else dumps):
        t = local_ns + offset
        if not (lo_ns <= t <= hi_ns):
            continue
        for line in frames:                            # most recent call first
            m = _FRAME.match(line)
            if m and is_user_file(m.group(1)):
                return f"{m.group(1)}:{m.group(2)} in {m.group(3)}", t
    return "", -1


def stack_excerpt(text: str, max_frames: int = 12, max_chars: int = 2000) -> str:
    """The main thread's top frames from a faulthandler dump (the last dump in the file)."""
    blocks = _thread_blocks(text)
    if not blocks:
        return "\n".join(text.strip().splitlines()[-30:])[-max_chars:]
    main = next((b for b in reversed(blocks) if _is_main(b)), blocks[-1])
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

