"""The words of a verdict line: the kind prefix and the hang diagnosis' headline.

A leaf both `diagnose` (its Diagnosis.verdict) and `compose` (the one verdict
every face shows) import, so neither imports the other for it.
"""
from __future__ import annotations

from ncclscope.findings import PREFIX, Finding, FindingKind, Role, Severity

OK_VERDICT = "OK: no hang, deadlock or mismatch found"


def prefix(kind: FindingKind | str) -> str:
    """The verdict's capitalised kind word(s): DEADLOCK, WRONG GROUP, STRAGGLER, ..."""
    try:
        return PREFIX[FindingKind(kind)]
    except (ValueError, KeyError):
        return str(kind).upper()


def hang_verdict(findings: list[Finding]) -> str:
    """The hang diagnosis' line: the first error headline, prefixed by its kind, or OK."""
    heads = [f for f in findings if f.role == Role.HEADLINE and f.severity == Severity.ERROR]
    if not heads:
        warnings = sum(1 for f in findings if f.severity == Severity.WARNING)
        return OK_VERDICT + (f" ({warnings} warning{'s' if warnings != 1 else ''})" if warnings else "")
    text = f"{prefix(heads[0].kind)}: {heads[0].title}"
    if len(heads) > 1:
        text += f" (+{len(heads) - 1} more root cause{'s' if len(heads) > 2 else ''})"
    return text
