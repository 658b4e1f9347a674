"""The presenter layer: what each TUI screen shows, as plain dataclasses.

Screens never touch pandas or the analyses: they render what this module
builds from a `Trace` plus the analyses' results (diagnosis, performance). The
split keeps the UI thread cheap (everything here is vectorised and runs in the
loading worker, or on demand for one rank / one group / one step) and lets the
tests check the numbers without a terminal.

    from ncclscope.trace import load
    from ncclscope.tui.model import build_run_model
    m = build_run_model(load("runs/hung"), diagnosis=None)
    print(m.verdict, [c.state for c in m.grid.cells])
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pandas as pd

from .. import schema as S
from ..analysis.groups import fmt_ranks
from ..findings import Evidence, Finding
from ..trace import STATUS_INFLIGHT, RankInfo, Trace, assemble

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
    role: str = ""              # headline | supporting | independent | "" (from diagnose)
    stack: str = ""             # root rank's stack excerpt, when the analysis attached one
    group: str = ""             # process group the finding is about (collectives view target)
    seq: int = -1
    source: str = "diagnosis"   # diagnosis | performance

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


# ---- Small helpers ---------------------------------------------------------
def plain(s: pd.Series) -> pd.Series:
    """Categorical or object column -> plain str values (vectorised via the codes)."""
    if isinstance(s.dtype, pd.CategoricalDtype):
        cats = np.append(s.cat.categories.astype(str).to_numpy(dtype=object), "")
        return pd.Series(cats.take(s.cat.codes.to_numpy()), index=s.index, dtype=object)
    return s.astype(object).where(s.notna(), "").astype(str)


def describe_ops(df: pd.DataFrame) -> pd.Series:
    """Vectorised `summary.describe_op`: `all_reduce #2 on dp0`, `recv #3 peer 2`, `backward mb 1`."""
    if not len(df):
        return pd.Series([], dtype=object, index=df.index)
    name = plain(df["op_name"])
    kind = plain(df["kind"])
    seq = np.where(df["collective_seq_id"] >= 0, df["collective_seq_id"], df["p2p_seq_id"])
    comm = kind.isin([S.KIND_COLLECTIVE, S.KIND_P2P])
    group = plain(df["process_group"])
    out = name + np.where(seq >= 0, " #" + pd.Series(seq, index=df.index).astype(str), "")
    out = out + np.where(comm & (group != ""), " on " + group, "")
    out = out + np.where((kind == S.KIND_P2P) & (df["peer"] >= 0), " peer " + df["peer"].astype(str), "")
    out = out + np.where(df["microbatch"] >= 0, " mb " + df["microbatch"].astype(str), "")
    return out.astype(str)


def fmt_seconds(ns: float) -> str:
    s = ns / NS
    if s < 0.001:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.1f} s"


def degrees(run: dict[str, Any], ranks: dict[int, RankInfo]) -> dict[str, int]:
    """Mesh degrees from run.json's config, else from the largest coordinate seen."""
    cfg = run.get("config") if isinstance(run.get("config"), dict) else {}
    out = {}
    for k in MESH_KEYS + ("ep",):
        v = cfg.get(k)
        if not isinstance(v, int) or v < 1:
            v = 1 + max((info.coords.get(k, 0) for info in ranks.values()), default=0)
        out[k] = int(v)
    return out


def coords_of(rank: int, info: RankInfo | None, deg: dict[str, int]) -> dict[str, int]:
    """The rank's recorded coordinates, else Megatron order (tp fastest, then cp, dp, pp)."""
    if info is not None and all(k in info.coords for k in MESH_KEYS):
        return {k: int(info.coords[k]) for k in MESH_KEYS}
    r, out = rank, {}
    for k in ("tp", "cp", "dp", "pp"):
        out[k] = r % deg[k]
        r //= deg[k]
    return out


# ---- Per-rank summary (one groupby pass) and cell states -------------------
def rank_frame(trace: Trace) -> pd.DataFrame:
    """Per rank: op count, last / in-flight op text, timeout, error and suspect flags, steps done."""
    idx = pd.Index(sorted(trace.ranks), name="rank")
    ops = trace.ops
    real = ops[(ops["kind"] != S.KIND_MARKER).to_numpy()]
    out = pd.DataFrame(index=idx)
    out["n_ops"] = real.groupby("rank", observed=True).size().reindex(idx).fillna(0).astype(int)
    status = plain(real["status"])
    last = real.groupby("rank", observed=True).tail(1).set_index("rank")
    out["last_op"] = describe_ops(last).reindex(idx).fillna("")
    infl = real[(status == STATUS_INFLIGHT).to_numpy()]
    infl_last = infl.groupby("rank", observed=True).tail(1).set_index("rank")
    out["inflight_op"] = describe_ops(infl_last).reindex(idx).fillna("")
    out["inflight_kind"] = plain(infl_last["kind"]).reindex(idx).fillna("") if len(infl_last) else ""
    out["inflight_start"] = infl_last["start_ns"].reindex(idx).fillna(-1).astype("int64")
    for flag, value in (("timeout", S.STATUS_TIMEOUT), ("error", S.STATUS_ERROR)):
        hit = real.loc[(status == value).to_numpy(), "rank"].unique()
        out[flag] = idx.isin(hit)
    ev = trace.events
    sus = ev[(ev["status"] == S.STATUS_SUSPECT).to_numpy()][["rank", "op_id"]]
    if len(sus) and len(infl):
        still = sus.merge(infl[["rank", "op_id"]], on=["rank", "op_id"])
        out["suspect"] = idx.isin(still["rank"].unique())
    else:
        out["suspect"] = False
    if len(trace.metrics):
        steps = trace.metrics.groupby("rank", observed=True)["step"].max() + 1
    else:
        steps = real.groupby("rank", observed=True)["step"].max() + 1 if len(real) else pd.Series(dtype=int)
    out["steps"] = steps.reindex(idx).fillna(0).astype(int).clip(lower=0)
    return out


def cell_states(trace: Trace, frame: pd.DataFrame, findings: list[Finding], live: bool,
                rank_states: pd.DataFrame | None = None) -> pd.Series:
    """Display state per rank, most specific evidence first.

    Findings win (dead_rank -> dead, stuck_in_compute -> stuck); then how the
    process ended; then what the trace shows (timeout rows, suspect markers,
    an op still in flight at the end of a post-mortem)."""
    idx = frame.index
    info = pd.Series([trace.ranks[r].state for r in idx], index=idx)
    dead = [r for f in findings if f.kind == "dead_rank" for r in f.ranks]
    stuck = [r for f in findings if f.kind == "stuck_in_compute" for r in f.ranks]
    role = rank_states["role"].reindex(idx) if rank_states is not None and "role" in rank_states else None
    post = ~pd.Series(live, index=idx) & info.isin(["stopped", "unknown", "failed"])   # post-mortem, unfinished
    conds = [
        (info == "killed") | ((info == "missing") & (not live)) | idx.isin(dead) | (role == "dead" if role is not None
                                                                                    else False),
        idx.isin(stuck) | (post & (frame["inflight_kind"] == S.KIND_COMPUTE) & ~frame["timeout"] & ~frame["error"]
                           & (info != "failed")),
        frame["timeout"],
        frame["suspect"] | (post & (frame["inflight_op"] != "") & ~frame["error"]),
        info == "finished",
        (info == "failed") | frame["error"],
        pd.Series(live, index=idx) & info.isin(["unknown", "missing"]),
    ]
    choices = ["dead", "stuck", "timeout", "suspect", "finished", "failed", "running"]
    return pd.Series(np.select([np.asarray(c, dtype=bool) for c in conds], choices, "unknown"), index=idx)


def root_ranks(findings: list[Finding]) -> list[int]:
    """Root-cause ranks: the headlines' (diagnose marks them), else the first error finding's."""
    heads = [f for f in findings if f.role == "headline" and f.severity == "error"]
    if not heads:
        heads = [f for f in findings if f.severity == "error"][:1]
    return sorted({int(r) for f in heads for r in f.ranks})


# ---- Grid layout -----------------------------------------------------------
def build_grid(trace: Trace, states: pd.Series, notes: pd.Series, roots: Iterable[int]) -> GridModel:
    """pp x dp rows by tp x cp columns; a compact 64-wide grid when that does not fit 80 columns."""
    deg = degrees(trace.run, trace.ranks)
    roots = set(int(r) for r in roots)
    world = trace.world_size
    n_rows, n_cols = deg["pp"] * deg["dp"], deg["tp"] * deg["cp"]
    cell_w = len(str(max(world - 1, 0))) + 3
    compact = (n_rows > MAX_MESH_ROWS or n_cols * cell_w > 70 or n_rows * n_cols != world)
    cells: list[RankCell] = []
    if compact:
        per = min(COMPACT_PER_ROW, max(world, 1))
        n_rows, n_cols = -(-world // per), per
        row_labels = [f"{i * per}-{min(world, (i + 1) * per) - 1}" for i in range(n_rows)]
        col_labels = []
    else:
        row_labels = [" ".join(p for p in (f"pp{p}" if deg["pp"] > 1 else "", f"dp{d}" if deg["dp"] > 1 else "")
                               if p) or "ranks" for p in range(deg["pp"]) for d in range(deg["dp"])]
        col_labels = [" ".join(p for p in (f"cp{c}" if deg["cp"] > 1 else "", f"tp{t}" if deg["tp"] > 1 else "")
                               if p) for c in range(deg["cp"]) for t in range(deg["tp"])]
    keys = [k for k in MESH_KEYS if deg[k] > 1]
    for r in range(world):
        c = coords_of(r, trace.ranks.get(r), deg)
        if compact:
            row, col = divmod(r, n_cols)
        else:
            row, col = c["pp"] * deg["dp"] + c["dp"], c["cp"] * deg["tp"] + c["tp"]
        cells.append(RankCell(rank=r, state=str(states.get(r, "unknown")), row=row, col=col,
                              coords=" ".join(f"{k}{c[k]}" for k in keys), note=str(notes.get(r, "")),
                              root=r in roots))
    counts = {s: int(n) for s, n in pd.Series([c.state for c in cells]).value_counts().items()}
    return GridModel(rows=n_rows, cols=n_cols, row_labels=row_labels, col_labels=col_labels, cells=cells,
                     compact=compact, counts=counts)


# ---- The run model ---------------------------------------------------------
def _config_line(run: dict[str, Any], deg: dict[str, int]) -> str:
    cfg = run.get("config") if isinstance(run.get("config"), dict) else {}
    if not cfg:
        return "no run.json config (foreign trace or still starting)"
    parts = [f"{k} {deg[k]}" for k in ("tp", "cp", "dp", "pp", "ep") if deg.get(k, 1) > 1] or ["single rank group"]
    if deg.get("pp", 1) > 1:
        parts.append(f"{cfg.get('schedule', '?')} × {cfg.get('microbatches', '?')} mb")
    elif int(cfg.get("microbatches", 1) or 1) > 1:
        parts.append(f"{cfg['microbatches']} mb")
    if cfg.get("steps") is not None:
        parts.append(f"steps {cfg['steps']}")
    if cfg.get("timeout_s") is not None:
        parts.append(f"timeout {float(cfg['timeout_s']):g} s")
    if cfg.get("inject"):
        parts.append("inject " + " ".join(map(str, cfg["inject"])))
    return " · ".join(parts)


def _mesh_line(world: int, deg: dict[str, int]) -> str:
    return (f"world {world} = pp {deg['pp']} × dp {deg['dp']} × cp {deg['cp']} × tp {deg['tp']}"
            + (f" (ep {deg['ep']} within dp)" if deg.get("ep", 1) > 1 else ""))


def finding_views(findings: list[Finding], source: str = "diagnosis", start: int = 0) -> list[FindingView]:
    out = []
    for i, f in enumerate(findings):
        d = f.data or {}
        out.append(FindingView(
            index=start + i, kind=f.kind, severity=f.severity, title=f.title, ranks=[int(r) for r in f.ranks],
            evidence=list(f.evidence), role=f.role.value, stack=f.stack,
            group=str(d.get("process_group", "") or (f.instance.group if f.instance else "")),
            seq=int(d.get("seq", -1) if isinstance(d.get("seq", -1), (int, np.integer)) else -1), source=source))
    return out


def build_run_model(trace: Trace, diagnosis: Any = None, performance: list[Finding] | None = None,
                    live: bool = False, stage: str = "ready") -> RunModel:
    """The overview + grid model. `diagnosis` is a diagnose.Diagnosis (or None while it runs)."""
    findings: list[Finding] = list(getattr(diagnosis, "findings", []) or [])
    tables = getattr(diagnosis, "tables", {}) or {}
    frame = rank_frame(trace)
    states = cell_states(trace, frame, findings, live, tables.get("rank_states"))
    roots = root_ranks(findings)
    notes = frame["inflight_op"].where(frame["inflight_op"] != "", frame["last_op"])
    notes = notes.where(notes == "", np.where(frame["inflight_op"] != "", "in ", "last ") + notes)
    grid = build_grid(trace, states, notes, roots)
    deg = degrees(trace.run, trace.ranks)
    cfg_steps = (trace.run.get("config") or {}).get("steps") if isinstance(trace.run.get("config"), dict) else None
    steps = frame["steps"]
    lo, hi = (int(steps.min()), int(steps.max())) if len(steps) else (0, 0)
    steps_line = f"steps done {lo}" + (f"–{hi}" if hi != lo else "") + (f" of {cfg_steps}" if cfg_steps else "")
    if lo != hi:
        behind = steps.index[steps == lo].tolist()
        steps_line += f" (behind: rank{'s' if len(behind) > 1 else ''} {fmt_ranks(behind)})"
    end = str(trace.run.get("end_reason", "") or ("running" if live else "unknown (no end reason in run.json)"))
    counts = ", ".join(f"{grid.counts[s]} {STATE_LABEL[s]}" for s in STATES[::-1] if grid.counts.get(s))
    perf = finding_views(performance or [], "performance", start=len(findings))
    verdict, level = "diagnosing…", "pending"
    if diagnosis is not None:
        verdict = str(getattr(diagnosis, "verdict", ""))
        level = "ok" if verdict.startswith("OK") else (findings[0].severity if findings else "warning")
    return RunModel(
        name=Path(str(trace.path)).name, world_size=trace.world_size, config_line=_config_line(trace.run, deg),
        mesh_line=_mesh_line(trace.world_size, deg), steps_line=steps_line, end_line=f"end {end} · {counts}",
        verdict=verdict, verdict_level=level, findings=finding_views(findings) + perf, grid=grid,
        root_ranks=roots, warnings=list(trace.warnings), stage=stage, live=live, n_events=len(trace.events))


def preliminary_model(path: Path, run: dict[str, Any]) -> RunModel:
    """From run.json alone (milliseconds even at 1,024 ranks): the first screen while the trace loads."""
    world = int(run.get("world_size", 0) or 0)
    exits = run.get("ranks") if isinstance(run.get("ranks"), dict) else {}
    ranks: dict[int, RankInfo] = {}
    for r in range(world):
        ex = exits.get(str(r)) if isinstance(exits.get(str(r)), dict) else {}
        code = ex.get("exitcode")
        ranks[r] = RankInfo(rank=r, present=True, exitcode=code if isinstance(code, int) else None,
                            signal=str(ex["signal"]) if ex.get("signal") else None,
                            stopped_by_launcher=bool(ex.get("stopped_by_launcher", False)))
    model = build_run_model(assemble(path, run, world, ranks, []), None, stage="preliminary")
    model.steps_line, model.verdict = "steps: loading…", "loading trace…"
    return model
