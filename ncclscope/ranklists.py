"""Rank lists as people write them ("0-3,5"): a leaf both the readers (load/) and the analyses (index/,
hang/) word ranks with, so a warning and a verdict name the same ranks the same way."""
from __future__ import annotations

from typing import Iterable


def fmt_ranks(ranks: Iterable[int], limit: int = 12) -> str:
    """0,1,2,3,5 -> "0-3,5"; long lists are cut with a count."""
    rs = sorted({int(r) for r in ranks})
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(f"{rs[i]}-{rs[j]}" if j - i >= 2 else ",".join(str(r) for r in rs[i:j + 1]))
        i = j + 1
    text = ",".join(parts)
    if len(parts) > limit:
        text = ",".join(parts[:limit]) + f",... ({len(rs)} ranks)"
    return text
