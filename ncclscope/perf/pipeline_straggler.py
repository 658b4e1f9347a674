"""A pipeline rank that holds the other stages up with work outside its schedule.

Why a question of its own: `stragglers.py` compares a rank with peers doing the
same work (its data-parallel replicas at the same position), and a pipeline
with one rank per position has none. Yet a rank that, every step, computes
outside its schedule's microbatch actions (logging or evaluation on one rank,
a slow host-side step, a sleep) makes every other stage wait for its
activations or gradients, and the bubble analysis sees only their wait, as
"communication". The evidence is two-sided and must hold in every steady
step, so one descheduling on shared cores cannot make it:

- the rank's compute spans that belong to no microbatch (the schedule's
  actions carry one) take at least OFF_FRAC of its step window, and at least
  OFF_RATIO times what any other rank of the pipeline spends so (every rank
  runs an optimizer step outside the schedule: that cancels out), in each of
  at least MIN_STEPS steady steps (step 0 warms up);
- the other ranks spend, over those steps and the one after (a rank late at
  the end of step s is waited for at the start of s + 1), at least WAIT_SHARE
  of that time blocked in communication.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ncclscope import schema as S
from ncclscope.findings import Evidence, Finding
from ncclscope.load.trace import Trace
from ncclscope.perf.bubbles import union_length
from ncclscope.index.labels import rank_label

OFF_FRAC = 0.20
OFF_RATIO = 3.0
WAIT_SHARE = 0.5
MIN_STEPS = 2
MS = 1e6


def analyze_pipeline_stragglers(trace: Trace) -> list[Finding]:
    """Findings (kind straggler) for the ranks that fit the module docstring; [] without a pipeline.

    Cheap on a large trace: summed over the steady steps, the per-step test implies that the rank's
    off-schedule compute is OFF_RATIO times every other rank's, so at most one rank can pass; that
    rank is found with one bincount, and only then are its steps and the others' waits measured."""
    ops = trace.ops
    if not len(ops) or "microbatch" not in ops.columns:
        return []
    if not any(info.coords.get("pp", 0) > 0 for info in trace.ranks.values()):
        return []                                         # no rank off pipeline position 0: no pipeline
    rank = ops["rank"].to_numpy(np.int64)
    step = ops["step"].to_numpy(np.int64)
    start = ops["start_ns"].to_numpy(np.int64)
    end = ops["end_ns"].to_numpy(np.int64)
    mb = ops["microbatch"].to_numpy(np.int64)
    done = (end >= 0) & (step >= 0)
    comp = done & (ops["kind"] == S.KIND_COMPUTE).to_numpy()
    if not (comp & (mb >= 0)).any():
        return []                                         # no schedule labels: nothing is "outside" it
    steps = sorted(int(x) for x in np.unique(step[done & (step >= 1)]))
    if len(steps) < MIN_STEPS:
        return []
    n = int(rank.max()) + 1
    dur = (end - start).astype(np.float64)
    off_rows = comp & (mb < 0) & (step >= 1)
    off_tot = np.bincount(rank[off_rows], weights=dur[off_rows], minlength=n)
    r = int(np.argmax(off_tot))
    rest = np.delete(off_tot, r)
    if off_tot[r] <= 0 or not len(rest) or off_tot[r] < OFF_RATIO * float(rest.max()):
        return []
    # r's steps: its window, its off-schedule compute, and the most any other rank spent so
    off = pd.DataFrame({"rank": rank[off_rows], "step": step[off_rows], "dur": dur[off_rows]})
    off = off.groupby(["rank", "step"])["dur"].sum()
    mine = done & (rank == r)
    win = pd.DataFrame({"step": step[mine], "start": start[mine], "end": end[mine]}).groupby("step")
    window = (win["end"].max() - win["start"].min()).astype(np.float64)
    others = off.drop(index=r, level="rank", errors="ignore").groupby(level="step").max()
    rows = []
    for s_ in steps:
        o = float(off.get((r, s_), 0.0))
        w = float(window.get(s_, 0.0))
        if w <= 0 or o < OFF_FRAC * w or o < OFF_RATIO * float(others.get(s_, 0.0)):
            return []
        rows.append((s_, o, w))
    # the others' time blocked in communication over those steps and the next (they wait at its start)
    span = set(steps) | {steps[-1] + 1}
    comm = done & (rank != r) & np.isin(step, list(span)) & \
        ops["kind"].isin([S.KIND_P2P, S.KIND_COLLECTIVE]).to_numpy()
    if not comm.any():
        return []
    order = np.lexsort((start[comm], rank[comm]))
    waited = union_length(rank[comm][order], start[comm][order], end[comm][order], n)
    waited = pd.Series(waited, index=np.arange(n))
    waited = waited[waited.index.isin(np.unique(rank[comm]))]
    off_total = sum(o for _, o, _ in rows)
    if float(waited.median()) < WAIT_SHARE * off_total:
        return []
    return [_finding(trace, ops[mine & comp & (mb < 0) & np.isin(step, steps)], r, rows, off_total, waited)]


def _finding(trace: Trace, mine: pd.DataFrame, r: int, rows: list[tuple[int, float, float]], off_total: float,
             waited: pd.Series) -> Finding:
    steps = [s for s, _, _ in rows]
    n = len(steps)
    per = off_total / n
    frac = off_total / sum(w for _, _, w in rows)
    by_name = (mine["end_ns"] - mine["start_ns"]).groupby(mine["op_name"].astype(str)).sum().sort_values(ascending=False)
    names = ", ".join(f"{name} {ns / n / MS:.1f} ms" for name, ns in by_name.head(3).items())
    wait_per = float(waited.median()) / n
    title = (f"{rank_label(trace, [r])} holds up the pipeline: {per / MS:.1f} ms per step of compute outside its "
             f"schedule's microbatches ({names}), {frac:.0%} of its step, in each of steps {steps[0]}-{steps[-1]}; "
             f"the other stages wait {wait_per / MS:.1f} ms per step in communication")
    ev = [Evidence(rank=r, note=f"step {s}: {o / MS:.1f} ms of compute outside the schedule in a {w / MS:.1f} ms step")
          for s, o, w in rows[:4]]
    ev += [Evidence(rank=int(q), note=f"waited {w / n / MS:.1f} ms per step in communication")
           for q, w in waited.sort_values(ascending=False).head(4).items()]
    return Finding("straggler", "warning", title, [r], ev,
                   {"rank": r, "basis": "off_schedule", "off_schedule_ns_per_step": per, "off_schedule_frac": frac,
                    "saving_ns": off_total, "saving_frac": frac, "saving_per_step_ns": per,
                    "others_wait_ns_per_step": wait_per, "steps": steps, "significant": True,
                    "compute_ratio": None, "last_frac": None})
