"""Findings: what an analysis concludes, with the evidence that makes it checkable.

A finding without evidence is an opinion, so `Finding` insists on evidence rows
(rank, op, group, sequence, time) that the CLI prints and the TUI and report
jump to. Plain dataclasses: the presenters never need the analyses' internals.

The contract between modules is typed: `FindingKind`, `Severity` and `Role`
are enums (str-valued, so `f.kind == "deadlock"` and the JSON stay as they
were), and the payloads other modules read — the collective instance a
finding is about, the instances the waiters are blocked in, the ranks
involved, the wait summary, the root rank's stack, what a headline explains —
are typed fields. So is the causal link between findings: `Cause` says what a
finding claims to cause and on what basis (`CauseBasis`: a skip in the rank's
own sequence, a late arrival, a departure from its routine, ...), with the
wrong call, the ranks that died inside the instance, the p2p poster and absent
side; `verdict.diagnose` reads only that record to decide which finding
explains which. `data` keeps analysis-specific extras (the op a finding is
about, its call site, categories) for the JSON output and the faces. `to_json`
writes the typed fields back under their old `data` keys, in the order each
analysis laid out (`Finding.layout`), so the JSON does not change byte for
byte; a finding built with one of those keys in `data` raises, so a producer
cannot bypass the typed field.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
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


class CauseBasis(_StrEnum):
    """What a causal claim rests on (the JSON's `basis`)."""

    # a collective mismatch: the instance's own majority, or the rank's own earlier calls
    INSTANCE = "instance"
    HISTORY = "history"
    # a skip (skips.py): its call sites out of sequence with its previous step, the step's census,
    # its stack dump (exactly / ahead of the skipped call), its traceback, its last compute span
    SEQUENCE = "sequence"
    CENSUS = "census"
    STACK = "stack"
    STACK_AHEAD = "stack-ahead"
    TRACEBACK = "traceback"
    SPAN = "span"
    # a wrong group: the call site's usual group; a group the rank is not a member of
    CALL_SITE = "call_site"
    NOT_MEMBER = "not_member"
    # a group created in another order, told by its description (group_order.py), or by the number each
    # process gave the group it stopped in (group_ids.py)
    DESC = "desc"
    GROUP_ID = "group_id"
    # a peer's collective that timed out waiting for this rank (late_arrival.py)
    LATE_ARRIVAL = "late-arrival"
    # a departure from the rank's own routine: its previous step, or its loop's previous iteration
    STEP = "step"
    LOOP = "loop"
    # ranks a monitored barrier reported as never arriving (barrier_report.py)
    BARRIER = "barrier-report"
    # a 1 vs 1 tie decided by gloo's abort of the member that received more bytes than it posted (abort_ties.py)
    ABORT = "abort"


@dataclass(frozen=True)
class WrongCall:
    """The call a wrong_group finding's rank made instead: on `group` ("" for a group it is not a
    member of), as that group's #`seq`, at `ns` (aligned), where known."""

    group: str
    seq: int | None = None
    ns: int | None = None


@dataclass(frozen=True)
class Departure:
    """Where an unmatched p2p's absent rank left its own routine (p2p.with_departure): in `step` it
    went to `went_op` at `went_site`, position `position` of the step, instead of the counterpart at
    `call_site` it posted there the step (or loop iteration: basis LOOP) before. `skipped_first`: the
    collective (op at site) that step posted between the departure and the counterpart and this one never
    did, where there was one: the first op the rank failed to post, so the departure's first consequence."""

    step: int
    call_site: str
    went_site: str
    went_op: str
    position: int
    basis: CauseBasis
    skipped_first: str = ""

    def to_json(self) -> dict[str, Any]:
        out = {"step": self.step, "call_site": self.call_site, "went_site": self.went_site,
               "went_op": self.went_op, "position": self.position, "basis": self.basis.value}
        if self.skipped_first:
            out["skipped_first"] = self.skipped_first
        return out


@dataclass(frozen=True)
class Cause:
    """What a finding claims as a cause, and on what basis: what `verdict.diagnose` reads to decide which
    finding explains which wait-for root (`explains`), files under it (`supports`) or ranks first.

    Every field is optional (None / False / empty: not claimed). `to_json` writes the claimed ones under
    the `data` keys of earlier releases (`JSON_KEYS`)."""

    basis: CauseBasis | None = None
    before_death: bool = False                    # a deviation its rank (or its partner) died after
    summary: bool = False                         # a count of further findings, never a cause itself
    ambiguous: bool | None = None                 # a tied vote: no one rank named for sure
    deviant_ranks: tuple[int, ...] | None = None
    absent_ranks: tuple[int, ...] | None = None   # members that left no record of the instance
    unfinished: bool | None = None                # the instance never completed
    later_instances: int | None = None            # how many later instances the deviation persisted into
    died_inside: tuple[int, ...] | None = None    # dead ranks whose begin row for the instance never ended
    next_instances: tuple[tuple[str, int], ...] | None = None   # what its recording members issued next
    wrong: WrongCall | None = None                # the wrong call of a wrong_group finding
    partner_deaths: tuple[int, ...] | None = None # members of either group that died of the wrong call
    poster: int | None = None                     # unmatched p2p: the rank that posted its side ...
    absent: int | None = None                     # ... and the rank that never posted the counterpart
    departure: Departure | None = None
    tag_deviant: bool = False                     # the absent side changed its tag (p2p_tags.py)
    p2p_pair: tuple[int, int] | None = None       # a send/recv whose sizes disagree (p2p_sizes.py)

    def to_json(self) -> dict[str, Any]:
        """The claimed fields under their `data` keys, in field order."""
        out: dict[str, Any] = {}
        if self.basis is not None:
            out["basis"] = self.basis.value
        for key in ("before_death", "summary"):
            if getattr(self, key):
                out[key] = True
        for key in ("ambiguous", "deviant_ranks", "absent_ranks", "unfinished", "later_instances", "died_inside",
                    "next_instances"):
            _put(out, key, getattr(self, key))
        if self.wrong is not None:
            out["wrong_group"] = self.wrong.group
            _put(out, "wrong_seq", self.wrong.seq)
            _put(out, "wrong_ns", self.wrong.ns)
        for key in ("partner_deaths", "poster", "absent"):
            _put(out, key, getattr(self, key))
        if self.departure is not None:
            out["departure"] = self.departure.to_json()
        if self.tag_deviant:
            out["tag_deviant"] = True
        _put(out, "p2p_pair", self.p2p_pair)
        return out


def _put(out: dict[str, Any], key: str, value: Any) -> None:
    if value is not None:
        out[key] = list(value) if isinstance(value, tuple) else value


# The `data` keys `to_json` writes from the typed fields. An analysis that passes one of them in
# `data` is refused: the field is the contract (a key there would be silently shadowed). `basis` and
# `ambiguous` are not among them: performance findings keep their own (a `Cause` must not clash).
TYPED_DATA_KEYS = ("role", "supports", "instance", "instances", "involved", "stack", "explains",
                   "wait_summary", "waiting_ranks", "direct_waiters", "wait_s")
CAUSE_KEYS = ("before_death", "summary", "deviant_ranks", "absent_ranks", "unfinished", "later_instances",
              "died_inside", "next_instances", "wrong_group", "wrong_seq", "wrong_ns", "partner_deaths", "poster",
              "absent", "departure", "tag_deviant", "p2p_pair")


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
    cause: Cause = field(default_factory=Cause)          # what this finding claims to cause, on what basis
    layout: tuple[str, ...] = ()                         # the JSON's order of `data` and `cause` keys (see to_json)

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
        clash = [k for k in CAUSE_KEYS if k in self.data] + [k for k in self.cause.to_json() if k in self.data]
        if clash:
            raise ValueError(f"finding {self.kind.value!r} passes {', '.join(clash)} in data: a cause's claims "
                             f"are the typed record cause=Cause(...)")

    @property
    def involved_ranks(self) -> set[int]:
        """Every rank in the story; the root ranks when the analysis named no others."""
        return set(self.involved) or set(int(r) for r in self.ranks)

    def json_data(self) -> dict[str, Any]:
        """`data` and the cause's claims in one dict, ordered as the analysis laid them out: the keys in
        `layout` first (in its order), then the rest of `data`, then the rest of the cause's."""
        merged = {**self.data, **self.cause.to_json()}
        if not self.layout:
            return merged
        out = {k: merged[k] for k in self.layout if k in merged}
        out.update((k, v) for k, v in merged.items() if k not in out)
        return out

    def to_json(self) -> dict[str, Any]:
        """The JSON shape of earlier releases: typed payloads under their `data` keys."""
        out: dict[str, Any] = {
            "kind": self.kind.value, "severity": self.severity.value, "title": self.title,
            "ranks": [int(r) for r in self.ranks], "evidence": [asdict(e) for e in self.evidence],
        }
        data = self.json_data()
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


def sort_findings(findings: list[Finding]) -> list[Finding]:
    """Most severe first; stable otherwise so analyses control their own order."""
    return sorted(findings, key=lambda f: _SEVERITY_RANK[f.severity.value])

