"""Per-rank summary: how far each rank got, what it did last, what it was in.

The first table a person reads after a failed job: steps done, op count, the
last op and the op still in flight (if any) per rank, and how the process
ended. Vectorised over the ops table (one groupby, no per-event loop).
"""
from __future__ import annotations

import pandas as pd

from ..trace import STATUS_INFLIGHT, Trace

SUMMARY_COLUMNS = ["rank", "state", "exit", "steps", "ops", "last_op", "inflight_op", "coords"]


def describe_op(row: pd.Series | dict) -> str:
    """`all_reduce #17 on dp1 (timeout)` / `irecv #3 peer 2` / `forward`."""
    name = str(row["op_name"])
    seq = int(row["collective_seq_id"]) if int(row["collective_seq_id"]) >= 0 else int(row["p2p_seq_id"])
    text = name + (f" #{seq}" if seq >= 0 else "")
    if row["process_group"] and str(row["kind"]) in ("collective", "p2p"):
        text += f" on {row['process_group']}"
    if int(row["peer"]) >= 0 and str(row["kind"]) == "p2p":
        text += f" peer {int(row['peer'])}"
    if int(row["step"]) >= 0:
        text += f" step {int(row['step'])}"
    status = str(row["status"])
    if status not in ("ok", ""):
        text += f" ({status})"
    return text


def exit_text(info) -> str:
    if not info.present:
        return "no trace"
    if info.signal:
        return info.signal + (" (by launcher)" if info.stopped_by_launcher else "")
    if info.exitcode is not None:
        return f"exit {info.exitcode}"
    return info.end_status or "?"


def rank_summary(trace: Trace) -> pd.DataFrame:
    ops = trace.ops
    real = ops[ops["kind"] != "marker"]
    last = real.groupby("rank", observed=True).tail(1).set_index("rank")
    inflight = real[real["status"] == STATUS_INFLIGHT].groupby("rank", observed=True).tail(1).set_index("rank")
    counts = real.groupby("rank", observed=True).size()
    steps = trace.metrics.groupby("rank", observed=True)["step"].max() + 1 if len(trace.metrics) else pd.Series(dtype=int)
    rows = []
    for r, info in trace.ranks.items():
        rows.append({
            "rank": r,
            "state": info.state,
            "exit": exit_text(info),
            "steps": int(steps.get(r, 0)),
            "ops": int(counts.get(r, 0)),
            "last_op": describe_op(last.loc[r]) if r in last.index else "",
            "inflight_op": describe_op(inflight.loc[r]) if r in inflight.index else "",
            "coords": " ".join(f"{k}{v}" for k, v in info.coords.items() if k in ("pp", "dp", "cp", "tp", "ep")),
        })
    return pd.DataFrame(rows, columns=SUMMARY_COLUMNS)
