"""A send and its recv that disagree on size or dtype: which side changed?

gloo pairs the k-th send a -> b with the k-th recv on b from a (NCCL the same). When the two
disagree on the buffer, gloo aborts the receiver ("Received data size doesn't match expected
size": SIGABRT), and NCCL hangs or delivers garbage. The dead receiver is the victim, and the
wait-for graph only sees its death. Training repeats itself: the side whose size (or dtype)
differs from what its own earlier calls from the same call site to the same peer passed (at
least MIN_HISTORY of them, all alike) changed, when the other side kept its own. Neither or
both: no verdict (a program that always sends 16 and receives into 24 keeps both histories).

Sizes are read from the ops table (the p2p view drops them) as int codes, never strings; the sends are
paired with the recvs on (src, dst, tag, seq) by one sort, at most MAX_PAIRS disagreeing pairs looked at.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ncclscope import schema as S
from ncclscope.findings import Cause, CauseBasis, Evidence, Finding
from ncclscope.load.opsjoin import STATUS_INFLIGHT
from ncclscope.index.views import TraceIndex
from ncclscope.index.labels import rank_label

MIN_HISTORY = 2        # earlier calls from the site (to that peer) whose sizes/dtypes must all agree
MAX_PAIRS = 8          # disagreeing pairs examined

_STR = ("op_name", "input_sizes", "input_dtypes", "call_site")
# The JSON order of the finding's `data` (its cause's claims among them), as earlier releases wrote it.
PAIR_LAYOUT = ("p2p_pair", "seq", "categories", "deviant_ranks", "basis", "call_site", "died_inside",
               "later_instances", "unfinished", "ambiguous")


def _codes(col: pd.Series, rows: np.ndarray) -> np.ndarray:
    """Int codes of `col` at `rows`, equal where the values are (a categorical's own codes: no strings)."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        return col.cat.codes.to_numpy()[rows]
    return pd.factorize(col.to_numpy()[rows])[0]


def _p2p_codes(ops: pd.DataFrame) -> dict[str, np.ndarray]:
    """One entry per p2p op, as int arrays (no frame): its position in the ops table, rank, peer, send,
    src, dst, tag, seq, and codes of its sizes, dtype and call site. At 10 M events (1.8 M p2p rows)
    strings here were +470 MB, a frame of int64 columns and its merge +233 MB."""
    rows = np.flatnonzero((ops["kind"] == S.KIND_P2P).to_numpy())
    name = ops["op_name"]
    if isinstance(name.dtype, pd.CategoricalDtype):
        is_send = np.asarray(["send" in str(c) for c in name.cat.categories] + [False])
        send = is_send[name.cat.codes.to_numpy()[rows]]
    else:
        send = np.asarray(["send" in str(v) for v in name.to_numpy()[rows]], dtype=bool)
    rank, peer = ops["rank"].to_numpy()[rows], ops["peer"].to_numpy()[rows]
    return {"pos": rows, "rank": rank, "peer": peer, "send": send,
            "src": np.where(send, rank, peer), "dst": np.where(send, peer, rank),
            "tag": ops["tag"].to_numpy()[rows], "seq": ops["p2p_seq_id"].to_numpy()[rows],
            "size": _codes(ops["input_sizes"], rows), "dtype": _codes(ops["input_dtypes"], rows),
            "site": _codes(ops["call_site"], rows)}


def _pairs(p: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(send, recv) indexes into `p` of each matched pair, the k-th send a -> b with the k-th recv on b
    from a (same src, dst, tag, seq), in the sends' order. One lexsort (recvs before sends within a key):
    a key holding both starts with its first recv, and its first send follows its last recv."""
    send = p["send"]
    order = np.lexsort((send, p["seq"], p["tag"], p["dst"], p["src"]))
    n = len(order)
    new = np.ones(n, dtype=bool)
    for c in ("src", "dst", "tag", "seq"):
        v = p[c][order]
        new[1:] &= v[1:] == v[:-1]
    new = ~new                                        # the first row of each key (in sorted order)
    s = send[order]
    first_send = np.flatnonzero(s[1:] & ~s[:-1] & ~new[1:]) + 1
    start = np.maximum.accumulate(np.where(new, np.arange(n), 0))
    sends, recvs = order[first_send], order[start[first_send]]
    keep = np.argsort(sends, kind="stable")
    return sends[keep], recvs[keep]


def _history(p: dict[str, np.ndarray], i: int, col: str) -> set[int] | None:
    """The codes of `col` in p2p op i's rank's earlier calls from the same site to the same peer, or None
    when there are fewer than MIN_HISTORY of them."""
    sel = ((p["rank"] == p["rank"][i]) & (p["send"] == p["send"][i]) & (p["peer"] == p["peer"][i])
           & (p["site"] == p["site"][i]) & (p["seq"] < p["seq"][i]))
    vals = p[col][sel]
    return {int(v) for v in vals} if len(vals) >= MIN_HISTORY else None


def size_deviations(ix: TraceIndex) -> list[Finding]:
    """One `collective_mismatch` finding (data `p2p_pair`) per send/recv pair whose size or dtype one side
    changed against its own history; `died_inside` names the pair's dead ranks whose op never ended."""
    ops = ix.trace.ops
    if not len(ops) or "input_sizes" not in ops.columns:
        return []
    p = _p2p_codes(ops)
    if not len(p["pos"]):
        return []
    si, ri = _pairs(p)
    differ = (p["size"][si] != p["size"][ri]) | (p["dtype"][si] != p["dtype"][ri])
    out: list[Finding] = []
    dead = {r for r, info in ix.trace.ranks.items() if info.died}
    for s_i, r_i in list(zip(si[differ], ri[differ]))[:MAX_PAIRS]:
        sides = {"s": int(s_i), "r": int(r_i)}
        for col, word in (("size", "sizes"), ("dtype", "dtype")):
            if p[col][sides["s"]] == p[col][sides["r"]]:
                continue
            hist = {s: _history(p, i, col) for s, i in sides.items()}
            value = {s: int(p[col][i]) for s, i in sides.items()}
            changed = [s for s, h in hist.items() if h is not None and len(h) == 1 and value[s] not in h]
            kept = [s for s, h in hist.items() if h is not None and h == {value[s]}]
            if len(changed) == 1 and len(kept) == 1:
                mine, theirs = sides[changed[0]], sides[kept[0]]
                was = int(np.flatnonzero(p[col] == next(iter(hist[changed[0]])))[0])
                out.append(_finding(ix, ops, int(p["pos"][mine]), int(p["pos"][theirs]), int(p["pos"][was]),
                                    word, dead))
                break
    return out


def _finding(ix: TraceIndex, ops: pd.DataFrame, mine_pos: int, theirs_pos: int, was_pos: int, word: str,
             dead: set[int]) -> Finding:
    """The finding, in words, from the two ops' rows (and a row holding the value the deviant used to pass)."""
    cols = ["rank", "op_id", "op_name", "peer", "p2p_seq_id", "input_sizes", "input_dtypes", "call_site",
            "status", "start_ns"]
    rows = ops.iloc[[mine_pos, theirs_pos, was_pos]][cols]
    mine, theirs, was = (rows.iloc[i].to_dict() for i in range(3))
    col = "input_sizes" if word == "sizes" else "input_dtypes"
    trace = ix.trace
    r, peer, k = int(mine["rank"]), int(theirs["rank"]), int(mine["p2p_seq_id"])
    sends = "send" in str(mine["op_name"])
    prep, prep2 = ("to", "from") if sends else ("from", "to")
    verb = "passed sizes" if word == "sizes" else "used dtype"
    site = str(mine["call_site"])
    title = (f"{rank_label(trace, [r])} deviates in {mine['op_name']} #{k} {prep} rank {peer}: {verb} {mine[col]} "
             f"where its own earlier {mine['op_name']}s {prep} rank {peer} from that line {verb.split()[0]} "
             f"{was[col]}, and rank {peer}'s {theirs['op_name']} #{k} {prep2} it "
             f"{'expects' if sends else 'passed'} {theirs[col]}"
             + (f" (its call at {site})" if site else ""))
    inside = sorted(q for q, op in ((r, mine), (peer, theirs)) if q in dead and str(op["status"]) == STATUS_INFLIGHT)
    ev = [Evidence(rank=int(op["rank"]), note=f"{tag}: {word} {op[col]}; {op['status']}", op_name=str(op["op_name"]),
                   seq=k, op_id=int(op["op_id"]), time_ns=int(op["start_ns"]), peer=int(op["peer"]))
          for tag, op in (("deviant", mine), ("kept its own", theirs))]
    return Finding(kind="collective_mismatch", severity="error", title=title, ranks=[r], evidence=ev,
                   data={"seq": k, "categories": ["size" if word == "sizes" else "dtype"], "call_site": site},
                   cause=Cause(basis=CauseBasis.HISTORY, p2p_pair=tuple(sorted({r, peer})), deviant_ranks=(r,),
                               died_inside=tuple(inside), later_instances=0,
                               unfinished=str(mine["status"]) != "ok", ambiguous=False),
                   layout=PAIR_LAYOUT)
