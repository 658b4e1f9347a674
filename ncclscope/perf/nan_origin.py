"""Where a NaN came from in a traced user job: the tracer's `nonfinite` markers, the earliest named.

`ncclscope run` checks what each rank puts into a reduction (runtime/usertrace/nancheck.py) and writes
one `nonfinite` marker at a rank's first non-finite input. The origin is the earliest step's markers
that no other rank's marker happens-before (an instance, collective or p2p, that the other rank entered
after its marker and this rank completed before its own); the rest inherited the NaN.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ncclscope.findings import Evidence, Finding
from ncclscope.index.labels import rank_label
from ncclscope.load.trace import Trace


def nan_from_markers(trace: Trace) -> tuple[pd.DataFrame, Finding] | None:
    """(the non-finite table, the `nan` finding) from the `nonfinite` markers alone (see the module
    docstring); None without markers."""
    mk = nonfinite_markers(trace)
    if not len(mk):
        return None
    mk = mk.sort_values(["t_ns", "rank"]).drop_duplicates("rank").reset_index(drop=True)   # a rank's first
    step = int(mk["step"].min())
    first = mk[mk["step"] == step]
    later = _happens_after(trace, first)
    origin = first[~first["rank"].isin(later)]
    if not len(origin):   # times that contradict each other (inferred ends): every marker of that step
        origin = first
    ranks = sorted(int(r) for r in origin["rank"].unique())
    whats = {_marker_what(str(x)) for x in origin["message"]}
    what = whats.pop() if len(whats) == 1 else "inputs"
    spread = int(mk["rank"].nunique())
    nonfinite = pd.DataFrame({"rank": mk["rank"].astype("int64"), "step": mk["step"].astype("int64"),
                                  "metric": [_marker_what(str(x)) for x in mk["message"]], "order": -1,
                                  "value": float("nan"), "time_ns": mk["t_ns"].astype("int64")})
    ev = [Evidence(rank=int(x["rank"]), note=f"step {int(x['step'])}: {x['message'] or 'non-finite input'}",
                   op_name=str(x["op_name"]), time_ns=int(x["t_ns"]))
          for _, x in origin.head(8).iterrows()]
    rest = mk[~mk["rank"].isin(ranks)].sort_values(["step", "t_ns"])
    ev += [Evidence(rank=int(x["rank"]), note=f"step {int(x['step'])} (inherited): {x['message'] or 'non-finite input'}",
                    op_name=str(x["op_name"]), time_ns=int(x["t_ns"])) for _, x in rest.head(4).iterrows()]
    title = (f"first NaN/Inf at step {step} on {rank_label(trace, ranks)}, in "
             f"{'its' if len(ranks) == 1 else 'their'} own {what} before any reduction"
             + (f"; it spread to {spread} ranks" if spread > len(ranks) else ""))
    return nonfinite, Finding("nan", "error", title, ranks, ev,
                                {"step": step, "microbatch": -1, "ranks": ranks, "origin_known": True,
                                 "inherited": sorted(int(r) for r in rest["rank"].unique())})


def _marker_what(message: str) -> str:
    """What a tracer marker says was non-finite: 'gradient' or 'input to <op>' (nancheck.py's wording)."""
    if message.startswith("input"):
        after = message.split(" to ", 1)
        return "input to " + after[1].split(" ", 1)[0] if len(after) == 2 else "input"
    return "gradient"


def _happens_after(trace: Trace, first: pd.DataFrame) -> set[int]:
    """The ranks of `first` (one marker per rank) whose marker some other rank's marker happens-before:
    an instance (a collective's group and sequence number, or a p2p send/receive pair) that the other
    rank entered after its marker and this rank completed before its own."""
    ops = trace.ops
    if len(first) < 2 or not len(ops):
        return set()
    at = dict(zip(first["rank"].astype("int64"), first["t_ns"].astype("int64")))
    o = ops[ops["rank"].isin(list(at)) & ops["kind"].isin(["collective", "p2p"])]
    if not len(o):
        return set()
    t_mark = o["rank"].map(at).to_numpy(dtype="int64")
    after = o["start_ns"].to_numpy(dtype="int64") >= t_mark
    end = o["end_ns"].to_numpy(dtype="int64")
    before = (end >= 0) & (end <= t_mark) & (o["status"].astype(str).to_numpy() == "ok")
    is_p2p = (o["kind"] == "p2p").to_numpy()
    send = o["op_name"].astype(str).str.contains("send").to_numpy()
    rank, peer = o["rank"].to_numpy(dtype="int64"), o["peer"].to_numpy(dtype="int64")
    # one key per instance: collectives by (group, seq); p2p by (sender, receiver, per-pair seq)
    src, dst = np.where(send, rank, peer), np.where(send, peer, rank)
    key = np.where(is_p2p, "p2p:" + pd.Series(src).astype(str) + ">" + pd.Series(dst).astype(str) + "#"
                   + o["p2p_seq_id"].astype(str).to_numpy(),
                   o["process_group"].astype(str).to_numpy() + "#" + o["collective_seq_id"].astype(str).to_numpy())
    # a p2p instance carries data from its sender (entered after) to its receiver (completed before)
    x = pd.DataFrame({"key": key, "rank": rank, "after": after & ~(is_p2p & ~send), "before": before & ~(is_p2p & send)})
    x = x[x["after"] | x["before"]]
    entered = x[x["after"]].groupby("key")["rank"].agg(["min", "max"])
    done = x[x["before"]].join(entered, on="key", how="inner")
    # someone other than this rank entered it after its marker
    hit = done[(done["min"] != done["rank"]) | (done["max"] != done["rank"])]
    return set(int(r) for r in hit["rank"].unique())


def nonfinite_markers(trace: Trace) -> pd.DataFrame:
    """The `nonfinite` (and `nan`) marker rows: rank, step, microbatch, op_name, message, t_ns."""
    cols = ["rank", "step", "microbatch", "op_name", "message", "t_ns"]
    ev = trace.marks
    if not len(ev):
        return pd.DataFrame(columns=cols)
    # markers first, on the categorical kind: decoding 10 M op names to strings costs hundreds of MB
    mk = ev.loc[(ev["kind"] == "marker").to_numpy(), cols]
    mk = mk[mk["op_name"].astype(str).isin(["nonfinite", "nan"]).to_numpy()]
    return mk if len(mk) else pd.DataFrame(columns=cols)
