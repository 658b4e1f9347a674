"""What a second source says about a root rank, cited in the finding that names it.

    findings = cite_sources(trace, findings)      # verdict/diagnose.py, after `combine`

Why: the hang questions find a root from the ops (who never posted the op its peers wait in); a
source without ops can still say *why* that rank is behind. NCCL RAS counts the collectives each
rank launched: "launched 41 AllReduce where its peers launched 42". The loader keeps such words in
the run record (`RunInfo.raw["rank_notes"]`: rank -> list of sentences, each naming its source), and
this step appends them to the error findings whose root ranks they are about, so the verdict line
says it with the source named. Dead ranks need no note: RAS's words are already their end message.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from ncclscope.findings import Evidence, Finding, Severity

if TYPE_CHECKING:
    from ncclscope.load.trace import Trace

NOTES_KEY = "rank_notes"
MAX_NOTES = 4


def rank_notes(trace: "Trace") -> dict[int, list[str]]:
    """rank -> the sentences other sources left about it (malformed entries are ignored)."""
    raw = getattr(getattr(trace, "run", None), "raw", None)
    notes = raw.get(NOTES_KEY) if isinstance(raw, dict) else None
    if not isinstance(notes, dict):
        return {}
    out: dict[int, list[str]] = {}
    for key, value in notes.items():
        if isinstance(key, str) and key.isdigit() and len(key) <= 9 and isinstance(value, list):
            texts = [v[:300] for v in value if isinstance(v, str)][:MAX_NOTES]
            if texts:
                out[int(key)] = texts
    return out


def cite_sources(trace: "Trace", findings: list[Finding]) -> list[Finding]:
    """Each error finding whose root ranks have notes gets them appended to its title (once) and as
    evidence rows; supporting findings keep pointing at the headline's new title."""
    notes = rank_notes(trace)
    if not notes:
        return findings
    renamed: dict[str, str] = {}
    for f in findings:
        said = [(r, n) for r in f.ranks if r in notes for n in notes[r] if n not in f.title]
        if f.severity != Severity.ERROR or not said:
            continue
        old = f.title
        f.title = old + "; " + "; ".join(f"rank {r} {n}" for r, n in said)
        f.evidence.extend(Evidence(rank=r, note=n) for r, n in said)
        renamed[old] = f.title
    for f in findings:
        if f.supports in renamed:
            f.supports = renamed[f.supports]
    return findings
