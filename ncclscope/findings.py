"""Findings: what an analysis concludes, with the evidence that makes it checkable.

A finding without evidence is an opinion, so `Finding` insists on evidence rows
(rank, op, group, sequence, time) that the CLI prints and the TUI and report
jump to. Plain dataclasses: the presenters never need the analyses' internals.

The contract between modules is typed: `FindingKind`, `Severity` and `Role`
are enums (str-valued, so `f.kind == "deadlock"` and the JSON stay as they
were), and the payloads other modules read — the collective instance a
finding is about, the instances the waiters are blocked in, the ranks
involved, the wait summary, the root rank's stack, what a headline explains —
are typed fields. `data` keeps only analysis-specific extras that nothing but
the JSON output reads. `to_json` writes the typed fields back under their old
`data` keys, so the JSON shape does not change; a finding built with one of
those keys in `data` raises, so a producer cannot bypass the typed field.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any


class _StrEnum(str, Enum):
    """A str-valued enum that prints and formats as its value on every Python >= 3.10."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Severity(_StrEnum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"


class Role(_StrEnum):
    """Where a finding stands in the verdict: the root cause, a view of it, or unrelated."""

    HEADLINE = "headline"
    SUPPORTING = "supporting"
    INDEPENDENT = "independent"


class FindingKind(_StrEnum):
    # hang diagnosis: wait-for roots
    DEADLOCK = "deadlock"
    HANG = "hang"
    DEAD_RANK = "dead_rank"
    STUCK_IN_COMPUTE = "stuck_in_compute"
    # hang diagnosis: specific causes
    COLLECTIVE_MISMATCH = "collective_mismatch"
    WRONG_GROUP = "wrong_group"
    GROUP_MISMATCH = "group_mismatch"
    UNMATCHED_P2P = "unmatched_p2p"
    SCHEDULE_DEVIATION = "schedule_deviation"
    NO_OP_IN_FLIGHT = "no_op_in_flight"
    # performance and numerics
    GRAD_DIVERGENCE = "grad_divergence"
    NAN = "nan"
    GRAD_SPIKE = "grad_spike"
    STRAGGLER = "straggler"
    PIPELINE_BUBBLE = "pipeline_bubble"
    STAGE_IMBALANCE = "stage_imbalance"
    SLOW_COLLECTIVE = "slow_collective"
    EXPERT_IMBALANCE = "expert_imbalance"
    # the input itself
    UNREADABLE_INPUT = "unreadable_input"


# The verdict's prefix per kind; one table, read by the one verdict composer.
PREFIX: dict[FindingKind, str] = {
    FindingKind.DEADLOCK: "DEADLOCK", FindingKind.HANG: "HANG", FindingKind.DEAD_RANK: "DEAD RANK",
    FindingKind.STUCK_IN_COMPUTE: "STUCK IN COMPUTE", FindingKind.COLLECTIVE_MISMATCH: "MISMATCH",
    FindingKind.WRONG_GROUP: "WRONG GROUP", FindingKind.GROUP_MISMATCH: "GROUP MISMATCH",
    FindingKind.UNMATCHED_P2P: "UNMATCHED P2P", FindingKind.SCHEDULE_DEVIATION: "SCHEDULE DEVIATION",
    FindingKind.NO_OP_IN_FLIGHT: "STOPPED", FindingKind.GRAD_DIVERGENCE: "DIVERGED", FindingKind.NAN: "NAN",
    FindingKind.STRAGGLER: "STRAGGLER", FindingKind.PIPELINE_BUBBLE: "SLOW PIPELINE",
    FindingKind.STAGE_IMBALANCE: "SLOW PIPELINE", FindingKind.SLOW_COLLECTIVE: "SLOW COLLECTIVE",
    FindingKind.EXPERT_IMBALANCE: "MOE IMBALANCE", FindingKind.GRAD_SPIKE: "GRAD SPIKE",
    FindingKind.UNREADABLE_INPUT: "UNREADABLE",
}

SEVERITIES = tuple(s.value for s in Severity)
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


@dataclass(frozen=True)
class InstanceRef:
    """One collective instance: the `seq`-th collective on `group` (collective_seq_id)."""

    group: str
    seq: int

    def to_json(self) -> list[Any]:
        return [self.group, self.seq]

    @classmethod
    def of(cls, raw: Any) -> "InstanceRef | None":
        """From an InstanceRef or a (group, seq) pair; None for anything else."""
        if isinstance(raw, InstanceRef):
            return raw
        if isinstance(raw, (list, tuple)) and len(raw) == 2:
            try:
                return cls(str(raw[0]), int(raw[1]))
            except (TypeError, ValueError):
                return None
        return None


@dataclass(frozen=True)
class WaitSummary:
    """Who waits on the root ranks, since when, and the sentence that says it."""

    text: str = ""                       # "ranks 0,1,3 waiting since 5.0 s in all_reduce #5 on dp0[0-3]"
    waiting_ranks: tuple[int, ...] = ()
    direct_waiters: tuple[int, ...] = ()
    wait_s: float | None = None          # None where the input holds no usable time


@dataclass(frozen=True)
class Explains:
    """What a promoted headline explains: the wait-for root it replaced."""

    kind: str
    title: str
    ranks: tuple[int, ...]


# The `data` keys `to_json` writes from the typed fields. An analysis that passes one of them in
# `data` is refused: the field is the contract (a key there would be silently shadowed).
TYPED_DATA_KEYS = ("role", "supports", "instance", "instances", "involved", "stack", "explains",
                   "wait_summary", "waiting_ranks", "direct_waiters", "wait_s")


@dataclass
class Finding:
    """A conclusion a person can act on.

    `ranks` lists the root-cause ranks (who to look at), never the ranks that
    merely waited: those appear in `evidence` and `wait`.
    """

    kind: FindingKind
    severity: Severity
    title: str
    ranks: list[int]
    evidence: list[Evidence] = field(default_factory=list)
    data: dict[str, Any] = field(default_factory=dict)
    role: Role = Role.INDEPENDENT
    supports: str = ""                                   # the headline's title, for supporting findings
    instance: InstanceRef | None = None                  # the collective instance this finding is about
    instances: list[InstanceRef] = field(default_factory=list)   # instances the waiters are blocked in
    involved: list[int] = field(default_factory=list)    # every rank in the story (roots and waiters)
    wait: WaitSummary | None = None
    stack: str = ""                                      # the root ranks' stack excerpt
    explains: Explains | None = None

    def __post_init__(self) -> None:
        try:
            self.kind = FindingKind(self.kind)
        except ValueError:
            raise ValueError(f"unknown finding kind {self.kind!r}: add it to FindingKind") from None
        try:
            self.severity = Severity(self.severity)
        except ValueError:
            raise ValueError(f"finding severity must be one of {SEVERITIES}, got {self.severity!r}") from None
        self.role = Role(self.role)
        if not self.evidence:
            raise ValueError(f"finding {self.kind!r} has no evidence: {self.title}")
        if self.instance is not None and not isinstance(self.instance, InstanceRef):
            self.instance = InstanceRef.of(self.instance)
        self.instances = [i for i in (InstanceRef.of(x) for x in self.instances) if i is not None]
        self.involved = [int(r) for r in self.involved]
        clash = [k for k in TYPED_DATA_KEYS if k in self.data]
        if clash:
            raise ValueError(f"finding {self.kind.value!r} passes {', '.join(clash)} in data: these are typed "
                             f"fields of Finding (role=, supports=, instance=InstanceRef(group, seq), instances=, "
                             f"involved=, stack=, explains=Explains(...), wait=WaitSummary(...))")

    @property
    def involved_ranks(self) -> set[int]:
        """Every rank in the story; the root ranks when the analysis named no others."""
        return set(self.involved) or set(int(r) for r in self.ranks)

    def to_json(self) -> dict[str, Any]:
        """The JSON shape of earlier releases: typed payloads under their `data` keys."""
        out: dict[str, Any] = {
            "kind": self.kind.value, "severity": self.severity.value, "title": self.title,
            "ranks": [int(r) for r in self.ranks], "evidence": [asdict(e) for e in self.evidence],
        }
        data = dict(self.data)
        data["role"] = self.role.value
        if self.supports:
            data["supports"] = self.supports
        if self.instance is not None:
            data["instance"] = self.instance.to_json()
        if self.instances:
            data["instances"] = [i.to_json() for i in self.instances]
        if self.involved:
            data["involved"] = list(self.involved)
        if self.wait is not None:
            data["wait_summary"] = self.wait.text
            data["waiting_ranks"] = list(self.wait.waiting_ranks)
            data["direct_waiters"] = list(self.wait.direct_waiters)
            data["wait_s"] = self.wait.wait_s
        if self.stack:
            data["stack"] = self.stack
        if self.explains is not None:
            data["explains"] = {"kind": self.explains.kind, "title": self.explains.title,
                                "ranks": list(self.explains.ranks)}
        out["data"] = data
        return out


def finding_fields() -> list[str]:
    """Names of Finding's fields (for `dataclasses.replace` callers and tests)."""
    return [f.name for f in fields(Finding)]


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Most severe first; stable otherwise so analyses control their own order."""
    return sorted(findings, key=lambda f: _SEVERITY_RANK[f.severity.value])


def has_errors(findings: list[Finding]) -> bool:
    return any(f.severity == Severity.ERROR for f in findings)
