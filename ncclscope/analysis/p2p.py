"""Point-to-point matching: every send needs its recv, and a missing one is a hang.

Flight Recorder does not follow p2p at all (and on gloo it does not even
record it), yet pipeline parallelism hangs through p2p more than anything
else: a stage that posts `recv` from the next stage while that stage posts
`recv` from it, or one microbatch too few sends. We match sends and recvs by
(src, dst, tag, p2p_seq_id): `p2p_seq_id` counts this rank's ops in that
direction with that peer, so the k-th send a -> b pairs with the k-th recv on b
from a. What is left over is the evidence:

- a send or recv with no counterpart whose own status is inflight / timeout /
  error: `unmatched_p2p` naming the rank that never posted the counterpart;
- a matched pair that did not finish ok on both sides (in-flight pair): both
  sides posted, so the wait is not about a missing op (sizes, transport).

Vectorised: one outer merge of the sends against the recvs.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from .. import schema as S
from ..findings import Evidence, Finding
from .groups import rank_label, seconds

if TYPE_CHECKING:
    from ..trace import Trace

KEY = ["src", "dst", "tag", "seq"]
SIDE_COLUMNS = ["rank", "op_id", "op_name", "status", "start_ns", "input_sizes", "step", "microbatch", "stage",
                "process_group"]


def direction(op_name: pd.Series) -> np.ndarray:
    """"send" for send/isend/..., "recv" for recv/irecv/..., "" otherwise."""
    if isinstance(op_name.dtype, pd.CategoricalDtype):     # decide per category, not per row
        cats = pd.Series(op_name.cat.categories.astype(str))
        if not len(cats):
            return np.full(len(op_name), "", dtype=object)
        per_cat = direction(cats)
        codes = op_name.cat.codes.to_numpy()
        return np.where(codes >= 0, per_cat[np.clip(codes, 0, None)], "")
    name = op_name.astype(str).str.lower()
    return np.where(name.str.endswith("recv"), "recv", np.where(name.str.endswith("send"), "send", ""))


def _categorical(s: pd.Series) -> pd.Categorical:
    """A string column as a categorical with "" for nulls: merges and row selections on millions of
    p2p rows move int codes instead of strings. Built from codes: nothing is decoded per row."""
    if isinstance(s.dtype, pd.CategoricalDtype):
        codes, cats = s.cat.codes.to_numpy(), s.cat.categories
    else:
        codes, cats = pd.factorize(s)
    names = [str(c) for c in cats]
    if (codes < 0).any():
        if "" not in names:
            names.append("")
        codes = np.where(codes < 0, names.index(""), codes)
    return pd.Categorical.from_codes(codes, categories=pd.Index(names, dtype=object))


def p2p_ops(ops: pd.DataFrame) -> pd.DataFrame:
    """The p2p ops with `direction`, `src`, `dst`, `seq` (int64); string columns are categoricals
    ("" for nulls: compare them with strings, use .astype(str) on small subsets)."""
    mask = (ops["kind"] == S.KIND_P2P).to_numpy()
    sub = ops.loc[mask, ["rank", "op_id", "op_name", "process_group", "peer", "tag", "p2p_seq_id", "status",
                         "start_ns", "end_ns", "input_sizes", "step", "microbatch", "stage", "call_site"]]
    out = pd.DataFrame({
        "rank": sub["rank"].to_numpy(np.int64), "op_id": sub["op_id"].to_numpy(),
        "op_name": _categorical(sub["op_name"]), "process_group": _categorical(sub["process_group"]),
        "peer": sub["peer"].to_numpy(np.int64), "tag": sub["tag"].to_numpy(np.int64),
        "seq": sub["p2p_seq_id"].to_numpy(np.int64), "status": _categorical(sub["status"]),
        "start_ns": sub["start_ns"].to_numpy(), "end_ns": sub["end_ns"].to_numpy(),
        "input_sizes": _categorical(sub["input_sizes"]), "step": sub["step"].to_numpy(),
        "microbatch": sub["microbatch"].to_numpy(), "stage": sub["stage"].to_numpy(),
        "call_site": _categorical(sub["call_site"]),
    })
    d = direction(out["op_name"])
    keep = (d != "") & (out["peer"].to_numpy() >= 0)
    out = out[keep].reset_index(drop=True)
    d = d[keep]
    is_send = d == "send"
    out["direction"] = pd.Categorical.from_codes(is_send.astype(np.int8), categories=["recv", "send"])
    out["src"] = np.where(is_send, out["rank"], out["peer"])
    out["dst"] = np.where(is_send, out["peer"], out["rank"])
    return out


def match_p2p(p2p: pd.DataFrame) -> pd.DataFrame:
    """Outer-join sends with recvs on (src, dst, tag, seq).

    Columns: src, dst, tag, seq, send_* and recv_* (op_id, op_name, status,
    start_ns, ... NaN where that side was never posted) and `state`:
    matched | send_only | recv_only.
    """
    sends = p2p[p2p["direction"] == "send"]
    recvs = p2p[p2p["direction"] == "recv"]
    s = sends[KEY + SIDE_COLUMNS].rename(columns={c: f"send_{c}" for c in SIDE_COLUMNS})
    r = recvs[KEY + SIDE_COLUMNS].rename(columns={c: f"recv_{c}" for c in SIDE_COLUMNS})
    s = s.drop_duplicates(KEY)
    r = r.drop_duplicates(KEY)
    pairs = s.merge(r, on=KEY, how="outer", indicator=True)
    pairs["state"] = pairs["_merge"].cat.rename_categories({"both": "matched", "left_only": "send_only",
                                                            "right_only": "recv_only"})
    return pairs.drop(columns="_merge").reset_index(drop=True)


@dataclass
class P2PReport:
    findings: list[Finding] = field(default_factory=list)
    pairs: pd.DataFrame = field(default_factory=pd.DataFrame)      # every send/recv, matched or not
    unmatched: pd.DataFrame = field(default_factory=pd.DataFrame)  # one side never posted
    inflight: pd.DataFrame = field(default_factory=pd.DataFrame)   # both posted, not both ok


def _unfinished(status: pd.Series) -> pd.Series:
    return status.notna() & (status != S.STATUS_OK)


def analyze_p2p(trace: Trace, p2p: pd.DataFrame | None = None, max_findings: int = 16) -> P2PReport:
    """Match p2p ops; `unmatched_p2p` for blocked ops whose counterpart was never posted."""
    if p2p is None:
        p2p = p2p_ops(trace.ops)
    if not len(p2p):
        return P2PReport(pairs=match_p2p(p2p) if len(p2p.columns) else pd.DataFrame())
    pairs = match_p2p(p2p)
    unmatched = pairs[pairs["state"] != "matched"].reset_index(drop=True)
    inflight = pairs[(pairs["state"] == "matched")
                     & (_unfinished(pairs["send_status"]) | _unfinished(pairs["recv_status"]))].reset_index(drop=True)
    findings = _unmatched_findings(trace, unmatched, max_findings)
    return P2PReport(findings=findings, pairs=pairs, unmatched=unmatched, inflight=inflight)


def _unmatched_findings(trace: Trace, unmatched: pd.DataFrame, max_findings: int) -> list[Finding]:
    if not len(unmatched):
        return []
    so = unmatched[(unmatched["state"] == "send_only") & _unfinished(unmatched["send_status"])]
    ro = unmatched[(unmatched["state"] == "recv_only") & _unfinished(unmatched["recv_status"])]
    rows = []
    for side, df, poster_col, absent_col, other in (("send", so, "src", "dst", "recv"), ("recv", ro, "dst", "src", "send")):
        if not len(df):
            continue
        rows.append(pd.DataFrame({
            "side": side, "other": other, "poster": df[poster_col].astype("int64"),
            "absent": df[absent_col].astype("int64"), "src": df["src"], "dst": df["dst"],
            "tag": df["tag"], "seq": df["seq"], "op_id": df[f"{side}_op_id"].astype("int64"),
            "op_name": df[f"{side}_op_name"].astype(str), "status": df[f"{side}_status"].astype(str),
            "start_ns": df[f"{side}_start_ns"].astype("int64"),
            "process_group": df[f"{side}_process_group"].astype(str),
        }))
    if not rows:
        return []
    u = pd.concat(rows, ignore_index=True)
    # A counterpart posted with the same (src, dst, seq) but another tag explains many "missing" ops.
    other_side = unmatched.assign(
        other_side=np.where(unmatched["state"] == "send_only", "send", "recv"))[["src", "dst", "seq", "tag",
                                                                                 "other_side"]]
    hint = u.merge(other_side.rename(columns={"tag": "other_tag", "other_side": "other"}),
                   on=["src", "dst", "seq", "other"], how="left")
    hint = hint[hint["other_tag"].notna() & (hint["other_tag"] != hint["tag"])]
    hint = hint.drop_duplicates(["side", "src", "dst", "seq", "tag"]).set_index(["side", "src", "dst", "seq", "tag"])
    end = trace.end_ns
    findings = []
    u = u.sort_values(["start_ns", "seq"])
    for (poster, absent, side), sub in u.groupby(["poster", "absent", "side"], sort=False):
        first = sub.iloc[0]
        other = "recv" if side == "send" else "send"
        prep = "to" if side == "send" else "from"
        prep2 = "from" if side == "send" else "to"
        tag_note = ""
        hk = (side, int(first["src"]), int(first["dst"]), int(first["seq"]), int(first["tag"]))
        if hk in hint.index:
            tag_note = (f" (rank {int(absent)} posted {other} #{int(first['seq'])} {prep2} rank {int(poster)} "
                        f"with tag {int(hint.loc[hk, 'other_tag'])} instead)")
        title = (f"{rank_label(trace, [int(absent)])} never posted the {other} matching rank {int(poster)}'s "
                 f"{first['op_name']} #{int(first['seq'])} (tag {int(first['tag'])}) {prep} it{tag_note}; "
                 f"rank {int(poster)} waiting in it ({first['status']}) since {seconds(end - int(first['start_ns']))}")
        if len(sub) > 1:
            title += f" ({len(sub) - 1} more unmatched {side}s between them)"
        ev = [Evidence(rank=int(r.poster), note=f"{r.status}; no matching {other} on rank {int(r.absent)}",
                       op_name=str(r.op_name), process_group=str(r.process_group), seq=int(r.seq),
                       op_id=int(r.op_id), time_ns=int(r.start_ns), peer=int(r.absent))
              for r in sub.head(8).itertuples(index=False)]
        findings.append(Finding(
            kind="unmatched_p2p", severity="error", title=title, ranks=[int(absent)], evidence=ev,
            data={"poster": int(poster), "absent": int(absent), "side": str(side), "src": int(first["src"]),
                  "dst": int(first["dst"]), "tag": int(first["tag"]), "seq": int(first["seq"]),
                  "count": int(len(sub)), "tag_mismatch": bool(tag_note)}))
        if len(findings) >= max_findings:
            break
    return findings
