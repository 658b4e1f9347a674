"""What each TUI screen renders: plain presenter dataclasses and the display constants.

Screens never touch pandas or the analyses: they render these objects, which
`model.py` (overview, grid) and the screens' `build_*` functions (rank,
collectives, timeline, metrics) make in the loading worker or on demand.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ncclscope.findings import Evidence

NS = 1_000_000_000
# Display states of a rank cell, most alarming last (the grid legend order).
STATES = ("finished", "running", "unknown", "suspect", "timeout", "failed", "stuck", "dead")
GLYPH = {"finished": "✓", "running": ">", "unknown": " ", "suspect": "?", "timeout": "T", "failed": "E",
         "stuck": "C", "dead": "X"}
STATE_LABEL = {"finished": "finished", "running": "running", "unknown": "unknown", "suspect": "suspect",
               "timeout": "timed out", "failed": "failed", "stuck": "stuck in compute", "dead": "dead"}
MESH_KEYS = ("pp", "dp", "cp", "tp")
MAX_MESH_ROWS = 16          # above this, or too wide, the grid goes compact (64 ranks a row)
COMPACT_PER_ROW = 64


# ---- Dataclasses the screens render ----------------------------------------
@dataclass
class FindingView:
    """One finding as the overview lists it, with where Enter jumps."""

    index: int
    kind: str
    severity: str
    title: str
    ranks: list[int]
    evidence: list[Evidence]
    role: str = ""              # headline | supporting | independent (Finding.role)
    stack: str = ""             # root rank's stack excerpt, when the analysis attached one
    group: str = ""             # process group the finding is about (collectives view target)
    seq: int = -1

    @property
    def jump_rank(self) -> int:
        """The rank Enter opens: the root cause, else the first evidence row's rank."""
        return int(self.ranks[0]) if self.ranks else (int(self.evidence[0].rank) if self.evidence else 0)

    @property
    def jump_op(self) -> int:
        """op_id to highlight on the jump rank (-1: none recorded in the evidence)."""
        return next((int(e.op_id) for e in self.evidence if e.rank == self.jump_rank and e.op_id >= 0), -1)


@dataclass
class RankCell:
    rank: int
    state: str                  # one of STATES
    row: int
    col: int
    coords: str                 # "pp1 dp0 tp1"
    note: str                   # what it was doing last (in-flight op, else last op)
    root: bool = False


@dataclass
class GridModel:
    rows: int
    cols: int
    row_labels: list[str]
    col_labels: list[str]
    cells: list[RankCell]
    compact: bool               # one character per rank, 64 a row (large worlds)
    counts: dict[str, int] = field(default_factory=dict)


@dataclass
class RunModel:
    """Everything the overview and the rank grid show; rebuilt on each update."""

    name: str
    world_size: int
    config_line: str
    mesh_line: str
    steps_line: str
    end_line: str
    verdict: str
    verdict_level: str          # error | warning | ok | pending
    findings: list[FindingView]
    grid: GridModel
    root_ranks: list[int]
    warnings: list[str]
    stage: str = "ready"        # preliminary | loaded | diagnosed | ready
    live: bool = False
    n_events: int = 0


@dataclass
class OpRow:
    """One op of the rank detail table (newest first); duration "4.0 s+" = still in flight."""

    op_id: int
    text: str                   # "backward mb 1" (the table has group / seq / peer columns)
    desc: str                   # "recv #3 on pp0 peer 0 mb 2" (for one-line mentions)
    group: str
    seq: int
    peer: int
    step: int
    duration: str
    status: str                 # ok | inflight | timeout | error | suspect


@dataclass
class RankDetail:
    rank: int
    header: str                 # "rank 2 · pp1 dp0 · stopped (SIGTERM by launcher)"
    state: str
    root: bool
    inflight: str               # "backward mb 1 for 4.0 s (suspect)" or ""
    ops: list[OpRow]
    n_ops: int                  # before the display limit
    stack: str
    metrics: list[str]
    findings: list[str]         # titles of findings naming this rank


@dataclass
class CollMatrix:
    """Who arrived at which collective of one group; cells: ok|inflight|timeout|error|missing."""

    group: str
    members: list[int]
    seqs: list[int]
    ops: list[str]              # op name per seq (majority)
    cells: list[list[str]]      # [seq row][member column]
    first_bad: int              # row of the first incomplete instance (-1: none)
    hidden: int = 0             # earlier seqs not shown


@dataclass
class P2PRow:
    src: int
    dst: int
    tag: int
    seq: int
    send: str                   # status of each side, "—" when never posted
    recv: str
    state: str                  # matched | send_only | recv_only
    where: str                  # "step 1 mb 2"


@dataclass
class TimelineModel:
    """Columnar spans of one step: numpy arrays, so thousands of spans stay one object.

    code: F forward, B backward, C collective, P p2p, O other compute."""

    step: int
    steps: list[int]
    t0: int
    t1: int
    ranks: list[int]
    labels: list[str]
    rank_idx: np.ndarray
    start: np.ndarray
    end: np.ndarray
    code: np.ndarray
    mb: np.ndarray
    open_: np.ndarray           # did not end ok (in flight, timeout, error)
    full_t1: int = 0            # end of the step's last wait when the view is zoomed (t1 < full_t1)


@dataclass
class MetricRow:
    rank: int
    label: str
    loss: np.ndarray            # per step (NaN where absent)
    gnorm: np.ndarray
    bad_steps: list[int]        # steps where it diverges from its replicas, or is not finite
    last_loss: float
    last_gnorm: float


@dataclass
class MetricsModel:
    steps: list[int]
    rows: list[MetricRow]
    loss_range: tuple[float, float]
    gnorm_range: tuple[float, float]
    notes: list[str]            # one line per divergence, for the header
