"""Schedules are evidence: each pipeline rank's observed order against its schedule's action list.

A pipeline rank runs a fixed list of actions per step (schedules.py: GPipe,
1F1B, interleaved 1F1B). Each action is, in this order: the receive of its
input (forward: the activation from stage s-1; backward: the gradient from
stage s+1) unless that stage lives on the same rank, the compute span, and the
send of its output to the next (forward) or previous (backward) stage. The
runtime tags every op and compute span with the stage and microbatch of the
action it belongs to, so the trace holds the order each rank really ran:

    expected  0F0 send->1 | 1F0 recv<-1 ...
    observed  0F0 recv<-1              <- rank 0 posted a recv where its schedule sends

The first position where a rank's observed sequence differs from the expected
one is its deviation; a sequence that simply stops (the rank blocked or died)
is a prefix and no deviation. When several ranks deviate, the earliest one
(aligned time) is named: the others' orders are consequences. A p2p deadlock
between a deviating rank and its neighbour is then *its* deviation, not the
cycle's (diagnose.py promotes this finding over the deadlock it explains).

Silent when the run has no pipeline (pp < 2), no schedule in its config, or
ops without stage/microbatch tags.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from ncclscope import schema as S
from ncclscope.findings import Evidence, Finding
from ncclscope.schedules import BACKWARD, FORWARD, build_schedule, stage_to_rank
from ncclscope.index.views import IndexLike, as_index
from ncclscope.index.labels import rank_label
from ncclscope.index.p2p_pairs import direction
from ncclscope.hang.schedule_fast import deviating_tokens

COMPUTE_KIND = {"forward": FORWARD, "backward": BACKWARD}
MAX_SHOWN = 3                     # deviating ranks listed in the data


@dataclass(frozen=True)
class Token:
    """One item of a rank's per-step order: a compute span or a p2p op of an action."""

    what: str          # "F" / "B" (compute) or "send" / "recv"
    peer: int          # pipeline index of the peer (-1 for compute)
    stage: int
    microbatch: int

    def describe(self) -> str:
        if self.what in (FORWARD, BACKWARD):
            name = "forward" if self.what == FORWARD else "backward"
            return f"{name} of stage {self.stage} microbatch {self.microbatch}"
        prep = "to" if self.what == "send" else "from"
        return f"{self.what} {prep} pipeline rank {self.peer} for stage {self.stage}, microbatch {self.microbatch}"


def expected_tokens(actions: list[Any], q: int, p: int, n_stages: int) -> list[Token]:
    """The order pipeline rank `q` should post its compute spans and remote p2p ops in, per step."""
    out: list[Token] = []
    for a in actions:
        s, mb = a.stage, a.microbatch
        prev_remote = s > 0 and stage_to_rank(s - 1, p) != q
        next_remote = s < n_stages - 1 and stage_to_rank(s + 1, p) != q
        if a.kind == FORWARD:
            if prev_remote:
                out.append(Token("recv", stage_to_rank(s - 1, p), s, mb))
            out.append(Token(FORWARD, -1, s, mb))
            if next_remote:
                out.append(Token("send", stage_to_rank(s + 1, p), s, mb))
        else:
            if next_remote:
                out.append(Token("recv", stage_to_rank(s + 1, p), s, mb))
            out.append(Token(BACKWARD, -1, s, mb))
            if prev_remote:
                out.append(Token("send", stage_to_rank(s - 1, p), s, mb))
    return out


def first_mismatch(observed: list[Token], expected: list[Token]) -> int:
    """Index of the first observed token that differs from the schedule; -1 when observed is a prefix."""
    for i, tok in enumerate(observed):
        if i >= len(expected) or tok != expected[i]:
            return i
    return -1


def pipeline_config(trace: Any) -> tuple[str, int, int, int] | None:
    """(schedule, pp, microbatches, vpp) from the run's config, or None when it is not a pipeline run."""
    cfg = trace.run.config
    try:
        p, v, m = int(cfg.get("pp", 1)), int(cfg.get("vpp", 1) or 1), int(cfg.get("microbatches", 1) or 1)
    except (TypeError, ValueError):
        return None
    name = str(cfg.get("schedule", "") or "")
    if p < 2 or not name:
        return None
    if p * v <= 1:
        name = "1f1b"
    return name, p, m, v


def observed_tokens(ops: pd.DataFrame, pp_of: dict[int, int]) -> pd.DataFrame:
    """Per (rank, step), the compute spans and p2p ops that carry a pipeline stage, in issue order, with
    `what` (F / B / send / recv), `peer_pp` (the peer's pipeline index) and `pos` (position in the step)."""
    cols = ["rank", "step", "op_id", "kind", "op_name", "peer", "stage", "microbatch", "start_ns", "call_site",
            "status"]
    sel = (ops["step"].to_numpy() >= 0) & (ops["stage"].to_numpy() >= 0) & (ops["microbatch"].to_numpy() >= 0)
    # compare the categoricals as they are: decoding 10 M strings to test them costs seconds and GBs
    kind = ops["kind"]
    is_comp = (kind == S.KIND_COMPUTE).to_numpy() & ops["op_name"].isin(list(COMPUTE_KIND)).to_numpy()
    is_p2p = (kind == S.KIND_P2P).to_numpy()
    sub = ops.loc[sel & (is_comp | is_p2p), cols].copy()
    extra = {"what": pd.Series(dtype=object), "peer_pp": pd.Series(dtype="int64"), "pos": pd.Series(dtype="int64")}
    if not len(sub):
        return sub.assign(**extra)
    sub["kind"] = sub["kind"].astype(str)
    sub["op_name"] = sub["op_name"].astype(str)
    for c in ("rank", "step", "peer", "stage", "microbatch", "op_id"):
        sub[c] = sub[c].astype("int64")
    comp = sub["op_name"].map(COMPUTE_KIND).fillna("").to_numpy()
    sub["what"] = np.where(sub["kind"] == S.KIND_COMPUTE, comp, direction(sub["op_name"]))
    pmap = pd.Series(pp_of, dtype="int64") if pp_of else pd.Series(dtype="int64")
    sub["peer_pp"] = np.where(sub["kind"] == S.KIND_P2P, sub["peer"].map(pmap).fillna(-1).astype("int64"), -1)
    # a pipeline's p2p goes to another stage: p2p with a peer at the rank's own pipeline index (context
    # parallelism's ring, an expert exchange) is not an action of the schedule
    own_pp = sub["rank"].map(pmap).fillna(-2).astype("int64").to_numpy()
    sub = sub[(sub["what"] != "") & ~((sub["kind"] == S.KIND_P2P).to_numpy() & (sub["peer_pp"].to_numpy() == own_pp))]
    sub = sub.sort_values(["rank", "step", "op_id"], kind="stable").reset_index(drop=True)
    sub["pos"] = sub.groupby(["rank", "step"], sort=False).cumcount().astype("int64")
    return sub


def expected_table(plan: list[list[Any]], p: int, n_stages: int) -> pd.DataFrame:
    """One row per (pp_rank, pos): the token the schedule has at that position of a step."""
    rows = [(q, i, t.what, t.peer, t.stage, t.microbatch)
            for q in range(p) for i, t in enumerate(expected_tokens(plan[q], q, p, n_stages))]
    return pd.DataFrame(rows, columns=["pp_rank", "pos", "e_what", "e_peer", "e_stage", "e_mb"])


def find_schedule_deviations(source: IndexLike) -> pd.DataFrame:
    """One row per (rank, step) whose order departs from the schedule: the first deviating op and the
    token the schedule had there. Sorted by the deviating op's start (the first deviation first)."""
    cols = ["rank", "step", "position", "op_id", "op_name", "kind", "peer", "start_ns", "call_site", "status",
            "observed", "expected", "pp_rank", "schedule"]
    ix = as_index(source)
    trace = ix.trace
    conf = pipeline_config(trace)
    if conf is None:
        return pd.DataFrame(columns=cols)
    name, p, m, v = conf
    try:
        plan = build_schedule(name, p, m, v)
    except ValueError:
        return pd.DataFrame(columns=cols)
    pp_of = {int(r): int(info.coords.get("pp", -1)) for r, info in trace.ranks.items()
             if isinstance(getattr(info, "coords", None), dict)}
    exp = expected_table(plan, p, p * v)
    j = deviating_tokens(trace.ops, pp_of, exp, p)
    if j is None:
        j = _deviating_tokens_merge(trace.ops, pp_of, exp, p)
    if not len(j):
        return pd.DataFrame(columns=cols)
    first = j.sort_values("pos", kind="stable").drop_duplicates(["rank", "step"])
    rows = []
    for d in first.itertuples(index=False):
        tok = Token(str(d.what), int(d.peer_pp), int(d.stage), int(d.microbatch))
        e = None if pd.isna(d.e_what) else Token(str(d.e_what), int(d.e_peer), int(d.e_stage), int(d.e_mb))
        rows.append({"rank": int(d.rank), "step": int(d.step), "position": int(d.pos), "op_id": int(d.op_id),
                     "op_name": str(d.op_name), "kind": str(d.kind), "peer": int(d.peer),
                     "start_ns": int(d.start_ns), "call_site": str(d.call_site), "status": str(d.status),
                     "observed": tok.describe(), "expected": e.describe() if e else "nothing more in this step",
                     "pp_rank": int(d.pp_rank), "schedule": name})
    return pd.DataFrame(rows, columns=cols).sort_values(["start_ns", "rank"], kind="stable").reset_index(drop=True)


def _deviating_tokens_merge(ops: pd.DataFrame, pp_of: dict[int, int], exp: pd.DataFrame, p: int) -> pd.DataFrame:
    """The observed tokens (pipeline ranks 0..p-1 only) that differ from `exp` at their position, joined with
    what `exp` has there (e_* columns, NaN past the end of the schedule): the pandas path."""
    obs = observed_tokens(ops, pp_of)
    if not len(obs):
        return obs
    obs["pp_rank"] = obs["rank"].map(pd.Series(pp_of, dtype="int64")).fillna(-1).astype("int64")
    obs = obs[obs["pp_rank"].between(0, p - 1)]
    j = obs.merge(exp, on=["pp_rank", "pos"], how="left")
    bad = (j["e_what"].isna() | (j["what"] != j["e_what"]) | (j["peer_pp"] != j["e_peer"])
           | (j["stage"] != j["e_stage"]) | (j["microbatch"] != j["e_mb"]))
    return j[bad.to_numpy()]


def analyze_schedule(source: IndexLike) -> list[Finding]:
    """A `schedule_deviation` error naming the first rank whose order departs from its schedule."""
    ix = as_index(source)
    dev = find_schedule_deviations(ix)
    if not len(dev):
        return []
    trace = ix.trace
    first = dev.iloc[0]
    r = int(first["rank"])
    where = f" at {first['call_site']}" if first["call_site"] else ""
    op = str(first["op_name"])
    if first["kind"] == S.KIND_P2P and int(first["peer"]) >= 0:
        op += f" {'to' if direction(pd.Series([op]))[0] == 'send' else 'from'} rank {int(first['peer'])}"
    title = (f"{rank_label(trace, [r])} broke the {first['schedule']} schedule at step {int(first['step'])}: "
             f"it posted {op}{where} where its schedule has {first['expected']}")
    others = sorted({int(x) for x in dev["rank"]} - {r})
    if others:
        title += f"; later deviations on {rank_label(trace, others[:MAX_SHOWN])}"
    ev = [Evidence(rank=int(d.rank), note=f"step {int(d.step)}, position {int(d.position)}: observed {d.observed}; "
                                          f"schedule: {d.expected}; {d.status}",
                   op_name=str(d.op_name), op_id=int(d.op_id), time_ns=int(d.start_ns),
                   peer=int(d.peer) if d.kind == S.KIND_P2P else -1)
          for d in dev.head(8).itertuples(index=False)]
    involved = sorted({r} | ({int(first["peer"])} if int(first["peer"]) >= 0 else set()))
    return [Finding(kind="schedule_deviation", severity="error", title=title, ranks=[r], evidence=ev,
                    involved=involved,
                    data={"schedule": str(first["schedule"]), "step": int(first["step"]),
                          "position": int(first["position"]), "call_site": str(first["call_site"]),
                          "observed": str(first["observed"]), "expected": str(first["expected"]),
                          "deviating_ranks": sorted(int(x) for x in dev["rank"].unique())})]
