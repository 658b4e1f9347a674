"""A send and its recv that disagree on size or dtype: which side changed?

gloo pairs the k-th send a -> b with the k-th recv on b from a (NCCL the same). When the two
disagree on the buffer, gloo aborts the receiver ("Received data size doesn't match expected
size": SIGABRT), and NCCL hangs or delivers garbage. The dead receiver is the victim, and the
wait-for graph only sees its death. Training repeats itself: the side whose size (or dtype)
differs from what its own earlier calls from the same call site to the same peer passed (at
least MIN_HISTORY of them, all alike) changed, when the other side kept its own. Neither or
both: no verdict (a program that always sends 16 and receives into 24 keeps both histories).

Sizes are read from the ops table (the p2p view drops them); one merge of the sends against the
recvs on (src, dst, tag, seq), at most MAX_PAIRS disagreeing pairs looked at.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from .. import schema as S
from ..findings import Evidence, Finding
from ..trace import STATUS_INFLIGHT
from .index import TraceIndex
from .labels import plain_str, rank_label

MIN_HISTORY = 2        # earlier calls from the site (to that peer) whose sizes/dtypes must all agree
MAX_PAIRS = 8          # disagreeing pairs examined

_COLS = ["rank", "op_id", "op_name", "peer", "tag", "p2p_seq_id", "input_sizes", "input_dtypes", "call_site",
         "status", "start_ns"]


def _p2p_rows(ix: TraceIndex) -> pd.DataFrame:
    ops = ix.trace.ops
    if not len(ops) or "input_sizes" not in ops.columns:
        return pd.DataFrame(columns=_COLS + ["send", "src", "dst"])
    p = ops.loc[(ops["kind"] == S.KIND_P2P).to_numpy(), _COLS].copy()
    for c in ("op_name", "input_sizes", "input_dtypes", "call_site", "status"):
        p[c] = plain_str(p[c])
    send = p["op_name"].str.contains("send", regex=False).to_numpy()
    rank, peer = p["rank"].to_numpy(np.int64), p["peer"].to_numpy(np.int64)
    return p.assign(send=send, src=np.where(send, rank, peer), dst=np.where(send, peer, rank))


def _history(p: pd.DataFrame, op: pd.Series, col: str) -> set[str] | None:
    """The values of `col` in the rank's earlier calls from the same site to the same peer, or None
    when there are fewer than MIN_HISTORY of them."""
    sel = p[(p["rank"] == op["rank"]).to_numpy() & (p["send"] == op["send"]).to_numpy()
            & (p["peer"] == op["peer"]).to_numpy() & (p["call_site"] == op["call_site"]).to_numpy()
            & (p["p2p_seq_id"] < op["p2p_seq_id"]).to_numpy()]
    return set(sel[col]) if len(sel) >= MIN_HISTORY else None


def size_deviations(ix: TraceIndex) -> list[Finding]:
    """One `collective_mismatch` finding (data `p2p_pair`) per send/recv pair whose size or dtype one side
    changed against its own history; `died_inside` names the pair's dead ranks whose op never ended."""
    p = _p2p_rows(ix)
    if not len(p):
        return []
    key = ["src", "dst", "tag", "p2p_seq_id"]
    pairs = p[p["send"]].merge(p[~p["send"]], on=key, suffixes=("_s", "_r"))
    bad = pairs[(pairs["input_sizes_s"] != pairs["input_sizes_r"]) | (pairs["input_dtypes_s"] != pairs["input_dtypes_r"])]
    out: list[Finding] = []
    dead = {r for r, info in ix.trace.ranks.items() if info.died}
    for row in bad.head(MAX_PAIRS).itertuples(index=False):
        r = row._asdict()
        sides = {s: p[(p["op_id"] == r[f"op_id_{s}"]).to_numpy() & (p["rank"] == r[f"rank_{s}"]).to_numpy()].iloc[0]
                 for s in ("s", "r")}
        for col, word in (("input_sizes", "sizes"), ("input_dtypes", "dtype")):
            if sides["s"][col] == sides["r"][col]:
                continue
            hist = {s: _history(p, op, col) for s, op in sides.items()}
            changed = [s for s, h in hist.items() if h is not None and len(h) == 1 and sides[s][col] not in h]
            kept = [s for s, h in hist.items() if h is not None and h == {sides[s][col]}]
            if len(changed) == 1 and len(kept) == 1:
                out.append(_finding(ix, sides[changed[0]], sides[kept[0]], hist[changed[0]], col, word, dead))
                break
    return out


def _finding(ix: TraceIndex, mine: pd.Series, theirs: pd.Series, hist: set[str], col: str, word: str,
             dead: set[int]) -> Finding:
    trace = ix.trace
    r, peer, k = int(mine["rank"]), int(theirs["rank"]), int(mine["p2p_seq_id"])
    prep, prep2 = ("to", "from") if bool(mine["send"]) else ("from", "to")
    verb = "passed sizes" if word == "sizes" else "used dtype"
    site = str(mine["call_site"])
    title = (f"{rank_label(trace, [r])} deviates in {mine['op_name']} #{k} {prep} rank {peer}: {verb} {mine[col]} "
             f"where its own earlier {mine['op_name']}s {prep} rank {peer} from that line {verb.split()[0]} "
             f"{next(iter(hist))}, and rank {peer}'s {theirs['op_name']} #{k} {prep2} it "
             f"{'expects' if bool(mine['send']) else 'passed'} {theirs[col]}"
             + (f" (its call at {site})" if site else ""))
    inside = sorted(q for q, op in ((r, mine), (peer, theirs)) if q in dead and str(op["status"]) == STATUS_INFLIGHT)
    ev = [Evidence(rank=int(op["rank"]), note=f"{tag}: {word} {op[col]}; {op['status']}", op_name=str(op["op_name"]),
                   seq=k, op_id=int(op["op_id"]), time_ns=int(op["start_ns"]), peer=int(op["peer"]))
          for tag, op in (("deviant", mine), ("kept its own", theirs))]
    return Finding(kind="collective_mismatch", severity="error", title=title, ranks=[r], evidence=ev,
                   data={"p2p_pair": sorted({r, peer}), "seq": k, "categories": ["size" if word == "sizes" else "dtype"],
                         "deviant_ranks": [r], "basis": "history", "call_site": site, "died_inside": inside,
                         "later_instances": 0, "unfinished": str(mine["status"]) != "ok", "ambiguous": False})
