"""Findings: what an analysis concludes, with the evidence that makes it checkable.

A finding without evidence is an opinion, so `Finding` insists on evidence rows
(rank, op, group, sequence, time) that the CLI prints and the TUI and report
jump to. Plain dataclasses: the presenters never need the analyses' internals.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

SEVERITIES = ("error", "warning", "info")
_SEVERITY_RANK = {s: i for i, s in enumerate(SEVERITIES)}


@dataclass(frozen=True)
class Evidence:
    """One row that supports a finding: usually one op on one rank."""

    rank: int
    note: str
    op_name: str = ""
    process_group: str = ""
    seq: int = -1              # collective_seq_id or p2p_seq_id, -1 if none
    op_id: int = -1
    time_ns: int = -1          # aligned to rank 0's clock
    peer: int = -1

    def describe(self) -> str:
        """A compact one-line rendering for terminals."""
        parts = [f"rank {self.rank}"]
        if self.op_name:
            op = self.op_name + (f" #{self.seq}" if self.seq >= 0 else "")
            if self.process_group:
                op += f" on {self.process_group}"
            if self.peer >= 0:
                op += f" peer {self.peer}"
            parts.append(op)
        parts.append(self.note)
        return ": ".join(p for p in parts if p)


@dataclass
class Finding:
    """A conclusion a person can act on.

    `ranks` lists the root-cause ranks (who to look at), never the ranks that
    merely waited: those appear in `evidence`.
    """

    kind: str
    severity: str
    title: str
    ranks: list[int]
    evidence: list[Evidence] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.severity not in _SEVERITY_RANK:
            raise ValueError(f"finding severity must be one of {SEVERITIES}, got {self.severity!r}")
        if not self.evidence:
            raise ValueError(f"finding {self.kind!r} has no evidence: {self.title}")

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["ranks"] = [int(r) for r in self.ranks]
        return out


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Most severe first; stable otherwise so analyses control their own order."""
    return sorted(findings, key=lambda f: _SEVERITY_RANK[f.severity])


def has_errors(findings: list[Finding]) -> bool:
    return any(f.severity == "error" for f in findings)
