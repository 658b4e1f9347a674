"""Ranks blocked in an op every counterpart posted: the wait-for chains that end in a stalled op.

Nobody is missing, yet the op does not finish: a mismatch the vote names
(diagnose then puts the deviant first) or the transport. One `hang` per
stalled op (a collective instance, or one send/recv pair), naming the ranks
in it and who waits on them (waitfor.py's graph gives the waiters).
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ncclscope import schema as S
from ncclscope.findings import Finding
from ncclscope.hang.wording import (MAX_EVIDENCE, WaitContext, op_desc, op_evidence, payload, since, sort_key,
                                    waiter_evidence, waiting_summary)
from ncclscope.index.labels import rank_label
from ncclscope.index.p2p_pairs import direction


def stalled_findings(ctx: WaitContext, stalled: list[int], comps: list[list[int]], comp_of: dict[int, int],
                      waiters_of: dict[int, set[int]]) -> list[tuple[tuple, Finding]]:
    """Ranks blocked in an op every counterpart posted: one `hang` per stalled op."""
    if not stalled:
        return []
    b = ctx.blocking[ctx.blocking["rank"].isin(stalled)].drop_duplicates("rank", keep="last")
    is_coll = b["kind"] == S.KIND_COLLECTIVE
    is_send = direction(b["op_name"]) == "send"
    src = np.where(is_send, b["rank"], b["peer"])
    dst = np.where(is_send, b["peer"], b["rank"])
    unit = np.where(is_coll, "c:" + b["process_group"].astype(str) + "#" + b["collective_seq_id"].astype(str),
                    "p:" + pd.Series(src, index=b.index).astype(str) + ">" + pd.Series(dst, index=b.index).astype(str)
                    + ":" + b["tag"].astype(str) + "#" + b["p2p_seq_id"].astype(str))
    out = []
    for _, sub in b.assign(unit=unit).groupby("unit", sort=False):
        ranks = sorted(int(r) for r in sub["rank"])
        waiters = set().union(*(waiters_of.get(comp_of[r], set()) for r in ranks)) - set(ranks)
        row = sub.iloc[0]
        summary, start, direct = waiting_summary(ctx, waiters, ranks)
        start_all = int(sub["start_ns"].min())
        if row["kind"] == S.KIND_COLLECTIVE:
            g, k = str(row["process_group"]), int(row["collective_seq_id"])
            done = ctx.coll[(ctx.coll["process_group"] == g) & (ctx.coll["collective_seq_id"] == k)
                            & (ctx.coll["status"] == S.STATUS_OK)]["rank"]
            title = (f"{rank_label(ctx.trace, ranks)} stuck in {row['op_name']} #{k} on "
                     f"{ctx.ix.label(g)}{since(ctx.end, start_all, ' for ')} although every "
                     f"member posted it")
            if len(done):
                title += f" ({rank_label(ctx.trace, done)} completed it)"
            title += ": no rank is missing; look for a mismatch or a transport fault"
            extra, inst = {"stalled": [g, k]}, (g, k)
        else:
            title = (f"{rank_label(ctx.trace, ranks)} stuck in {op_desc(ctx, row)}{since(ctx.end, start_all, ' for ')}"
                     f" although the peer posted the matching op: "
                     f"look for a size mismatch or a transport fault")
            extra = {"stalled_p2p": [int(row["rank"]), str(row["op_name"]), int(row["peer"]), int(row["p2p_seq_id"])]}
            inst = None
        if summary:
            title += f"; {summary}"
        ev = [op_evidence(r, f"{r.status}, stalled{since(ctx.end, r.start_ns)}")
              for r in sub.head(MAX_EVIDENCE).itertuples(index=False)]
        ev += waiter_evidence(ctx, waiters, direct, ranks)
        pl = payload(ctx, ranks, waiters, direct, start_all, summary, ambiguous=len(ranks) > 1, instance=inst, **extra)
        out.append((sort_key(waiters | set(ranks), start_all),
                    Finding(kind="hang", severity="error", title=title, ranks=ranks, evidence=ev, **pl)))
    return out

