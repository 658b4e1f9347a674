"""Judge one `ncclscope analyze --json` report against a program's ground truth.

Per program and evidence source ("run": the `ncclscope run` trace; "fr": the Flight Recorder dumps
alone):
  root   the headline's ranks are one of the truth's acceptable root sets (every culprit named, no
         innocent rank as root)
  cause  the headline's kind is in the class's acceptable kinds (catalogue.py); on "fr", where a
         culprit's dump is missing (it died), dead_rank is accepted too
  line   an expected `file:line` (or `file", line N` of a stack) appears in the headline (title, call
         site, data, stack) or the verdict; "n/a" where the class judges no line
  right  root and cause
A healthy program is right when no finding has severity error and the exit code is 0 (a warning
makes the exit code 1: counted as a false alarm too, and marked as "warned").
"""
from __future__ import annotations

from typing import Any

from .catalogue import FR_MISSING_DUMP_KINDS, HEALTHY
from .generator import Truth


def _strings(obj: Any) -> list[str]:
    """Every string inside a JSON value (raw, not JSON-escaped)."""
    if isinstance(obj, str):
        return [obj]
    if isinstance(obj, dict):
        return [s for v in obj.values() for s in _strings(v)]
    if isinstance(obj, list):
        return [s for v in obj for s in _strings(v)]
    return []


def headline(report: dict[str, Any]) -> dict[str, Any] | None:
    findings = report.get("findings", []) or []
    heads = [f for f in findings if (f.get("data") or {}).get("role") == "headline"]
    if heads:
        return heads[0]
    serious = [f for f in findings if f.get("severity") in ("error", "warning")]
    return serious[0] if serious else None


def user_stack(head: dict[str, Any] | None, filename: str) -> list[str]:
    """The lines of the headline's stack that are in the program itself (the short user stack)."""
    if not head:
        return []
    stack = str((head.get("data") or {}).get("stack", ""))
    return [ln.strip() for ln in stack.splitlines() if filename in ln]


def judge(truth: Truth, filename: str, rc: int, report: dict[str, Any], source: str,
          missing_dumps: list[int] | None = None) -> dict[str, Any]:
    head = headline(report)
    res: dict[str, Any] = {"source": source, "rc": rc, "verdict": str(report.get("verdict", ""))[:400],
                           "kind": head.get("kind") if head else "", "ranks": sorted(head.get("ranks", [])) if head else [],
                           "call_site": (head.get("data") or {}).get("call_site", "") if head else "",
                           "user_stack": user_stack(head, filename)}
    if report.get("no_json"):
        res.update(right=False, root=False, cause=False, line=False, note=str(report["no_json"])[:200])
        return res
    findings = report.get("findings", []) or []
    if truth.bug == HEALTHY:
        errors = [f for f in findings if f.get("severity") == "error"]
        warned = any(f.get("severity") == "warning" for f in findings)
        ok = not errors and rc == 0
        res.update(right=ok, root=ok, cause=ok, line=None, warned=warned, false_alarm=not ok)
        return res
    root = head is not None and sorted(head.get("ranks", [])) in [sorted(r) for r in truth.accept_roots]
    kinds = set(truth.accept_kinds)
    if source == "fr" and missing_dumps and set(truth.culprits) & set(missing_dumps):
        kinds |= set(FR_MISSING_DUMP_KINDS)
    cause = head is not None and head.get("kind") in kinds
    line: bool | None = None
    if truth.lines:
        text = "\n".join(_strings(head)) + "\n" + str(report.get("verdict", ""))
        line = any(f"{filename}:{n}" in text or f'{filename}", line {n}' in text for n in truth.lines)
    res.update(right=bool(root and cause), root=bool(root), cause=bool(cause), line=line)
    return res
