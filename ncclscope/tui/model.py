"""The overview and rank-grid model: a `Trace` plus the composed `Analysis` -> `RunModel`.

The verdict line, the findings and the root-cause ranks are the composer's
(`ncclscope.verdict.run`), shown verbatim: nothing here decides what is wrong
with the run. This module lays the ranks out on the mesh, colours them, and
writes the run's config / mesh / steps lines. The presenter dataclasses live
in `presenters.py`, the trace-column helpers in `frame.py`; the views import
them from there.

    from ncclscope.load.trace import load
    from ncclscope.verdict import run
    from ncclscope.tui.model import build_run_model
    trace = load("runs/hung")
    m = build_run_model(trace, run(trace))
    print(m.verdict, [c.state for c in m.grid.cells])
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import numpy as np
import pandas as pd

from ncclscope.findings import Finding
from ncclscope.index.labels import fmt_ranks
from ncclscope.load.trace import RankInfo, RunInfo, Tables, Trace, apply_exit, assemble
from ncclscope.tui.frame import cell_states, coords_of, degrees, rank_frame
from ncclscope.tui.presenters import (COMPACT_PER_ROW, MAX_MESH_ROWS, MESH_KEYS, STATE_LABEL, STATES, FindingView,
                                      GridModel, RankCell, RunModel)

if TYPE_CHECKING:
    from ncclscope.verdict.compose import Analysis


# ---- Grid layout -----------------------------------------------------------
def build_grid(trace: Trace, states: pd.Series, notes: pd.Series, roots: Iterable[int]) -> GridModel:
    """pp x dp rows by tp x cp columns; a compact 64-wide grid when that does not fit 80 columns."""
    deg = degrees(trace.run, trace.ranks)
    roots = set(int(r) for r in roots)
    states_of, notes_of = states.to_dict(), notes.to_dict()      # one lookup per rank, not a Series.get
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
        cells.append(RankCell(rank=r, state=str(states_of.get(r, "unknown")), row=row, col=col,
                              coords=" ".join(f"{k}{c[k]}" for k in keys), note=str(notes_of.get(r, "")),
                              root=r in roots))
    counts = {s: int(n) for s, n in pd.Series([c.state for c in cells]).value_counts().items()}
    return GridModel(rows=n_rows, cols=n_cols, row_labels=row_labels, col_labels=col_labels, cells=cells,
                     compact=compact, counts=counts)


# ---- The run model ---------------------------------------------------------
def _config_line(run: RunInfo, deg: dict[str, int]) -> str:
    cfg = run.config
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


def finding_views(findings: list[Finding]) -> list[FindingView]:
    out = []
    for i, f in enumerate(findings):
        d = f.data or {}
        seq = d.get("seq", -1)
        out.append(FindingView(
            index=i, kind=str(f.kind), severity=str(f.severity), title=f.title, ranks=[int(r) for r in f.ranks],
            evidence=list(f.evidence), role=f.role.value, stack=f.stack,
            group=str(d.get("process_group", "") or (f.instance.group if f.instance else "")),
            seq=int(seq) if isinstance(seq, (int, np.integer)) else -1))
    return out


def build_run_model(trace: Trace, analysis: "Analysis | None" = None, live: bool = False,
                    stage: str = "ready", frame: pd.DataFrame | None = None) -> RunModel:
    """The overview + grid model. `analysis` is `ncclscope.verdict.run(trace)` (None while it runs):
    its verdict, findings and root ranks are shown as they are. `frame` is `rank_frame(trace)` when the
    caller has it already (the loading worker builds one per trace for all its stages: 0.4 s at 16,384 ranks)."""
    findings: list[Finding] = list(analysis.findings) if analysis is not None else []
    tables = getattr(getattr(analysis, "diagnosis", None), "tables", {}) or {}
    frame = rank_frame(trace) if frame is None else frame
    states = cell_states(trace, frame, findings, live, tables.get("rank_states"))
    roots = list(analysis.root_ranks) if analysis is not None else []
    notes = frame["inflight_op"].where(frame["inflight_op"] != "", frame["last_op"])
    notes = notes.where(notes == "", np.where(frame["inflight_op"] != "", "in ", "last ") + notes)
    grid = build_grid(trace, states, notes, roots)
    deg = degrees(trace.run, trace.ranks)
    cfg_steps = trace.run.config.get("steps")
    steps = frame["steps"]
    lo, hi = (int(steps.min()), int(steps.max())) if len(steps) else (0, 0)
    steps_line = f"steps done {lo}" + (f"–{hi}" if hi != lo else "") + (f" of {cfg_steps}" if cfg_steps else "")
    if lo != hi:
        behind = steps.index[steps == lo].tolist()
        steps_line += f" (behind: rank{'s' if len(behind) > 1 else ''} {fmt_ranks(behind)})"
    end = trace.run.end_reason or ("running" if live else "unknown (no end reason in run.json)")
    counts = ", ".join(f"{grid.counts[s]} {STATE_LABEL[s]}" for s in STATES[::-1] if grid.counts.get(s))
    verdict, level = ("analysing…", "pending") if analysis is None else (analysis.verdict, analysis.level)
    warnings = list(trace.warnings) + (list(analysis.errors) if analysis is not None else [])
    return RunModel(
        name=Path(str(trace.path)).name, world_size=trace.world_size, config_line=_config_line(trace.run, deg),
        mesh_line=_mesh_line(trace.world_size, deg), steps_line=steps_line, end_line=f"end {end} · {counts}",
        verdict=verdict, verdict_level=level, findings=finding_views(findings), grid=grid,
        root_ranks=roots, warnings=warnings, stage=stage, live=live, n_events=len(trace.events))


def preliminary_model(path: Path, run: RunInfo) -> RunModel:
    """From run.json alone (milliseconds even at 1,024 ranks): the first screen while the trace loads."""
    world = run.world_size
    ranks: dict[int, RankInfo] = {}
    for r in range(world):
        ranks[r] = RankInfo(rank=r, present=True)
        ex = run.exits.get(r)
        if ex is not None:
            apply_exit(ranks[r], ex)
    model = build_run_model(assemble(path, run, world, ranks, Tables(events=[])), None, stage="preliminary")
    model.steps_line, model.verdict = "steps: loading…", "loading trace…"
    return model
