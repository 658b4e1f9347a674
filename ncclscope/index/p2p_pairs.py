"""P2p ops and their pairing: every send needs its recv, matched by (src, dst, tag, p2p_seq_id).

`p2p_seq_id` counts a rank's ops in one direction with one peer, so the k-th
send a -> b pairs with the k-th recv on b from a. `p2p_ops` builds the p2p
rows (categorical strings, int32 ranks and tags, int64 seq); `match_p2p` outer-joins the
sends with the recvs. The p2p question (p2p.py) and the wait-for graph read
both from the index, built once per trace.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ncclscope import schema as S

KEY = ["src", "dst", "tag", "seq"]
# match_p2p's `state`, in the order (and dtype) of a merge indicator's renamed categories
STATES = pd.Index(["send_only", "recv_only", "matched"], dtype="str")


# Each side's columns in the pairs. Its rank is not among them: a send's rank is `src`, a recv's `dst`.
SIDE_COLUMNS = ["op_id", "op_name", "status", "start_ns", "step", "microbatch", "process_group"]
# p2p_ops' integer columns that hold ranks or tags: int32, as in the schema (the tables' own dtype)
NARROW = ("rank", "peer", "tag", "src", "dst")


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


def _is_send_or_recv(op_name: pd.Series) -> np.ndarray:
    """direction(op_name) != "" as a bool array; on a categorical decided per category (no string per row)."""
    if isinstance(op_name.dtype, pd.CategoricalDtype):
        cats = pd.Series(op_name.cat.categories.astype(str))
        per_cat = np.append(direction(cats) != "", False) if len(cats) else np.zeros(1, dtype=bool)
        return per_cat[op_name.cat.codes.to_numpy()]          # code -1 (null) -> the appended False
    return direction(op_name) != ""


def _categorical(s: pd.Series, rows: np.ndarray | None = None) -> pd.Categorical:
    """A string column (its `rows`, all without) as a categorical with "" for nulls: merges and row
    selections on millions of p2p rows move int codes instead of strings. Built from codes: nothing is
    decoded per row, and only the selected rows' codes are copied."""
    if isinstance(s.dtype, pd.CategoricalDtype):
        codes, cats = s.cat.codes.to_numpy(), s.cat.categories
        if rows is not None:
            codes = codes[rows]
    else:
        codes, cats = pd.factorize(s if rows is None else s.iloc[rows])
    names = [str(c) for c in cats]
    if (codes < 0).any():
        if "" not in names:
            names.append("")
        codes = np.where(codes < 0, names.index(""), codes)
    return pd.Categorical.from_codes(codes, categories=pd.Index(names, dtype=object))


def p2p_ops(ops: pd.DataFrame) -> pd.DataFrame:
    """The p2p ops (send/recv with a peer) with `direction`, `src`, `dst` and `seq`: int64 seq, int32
    rank/peer/tag/src/dst (their schema dtype); string columns are categoricals ("" for nulls: compare them
    with strings, use .astype(str) on small subsets). Each column is taken once at the selected rows (no
    intermediate frame: at 10 M events the p2p rows are ~1.7 M), and only the columns a reader uses are
    kept (the op's end, sizes and stage stay in `ops`)."""
    mask = (ops["kind"] == S.KIND_P2P).to_numpy()
    mask = mask & _is_send_or_recv(ops["op_name"]) & (ops["peer"].to_numpy() >= 0)
    rows = np.flatnonzero(mask)
    del mask
    op_name = _categorical(ops["op_name"], rows)
    is_send = direction(pd.Series(op_name, copy=False)) == "send"
    rank, peer = ops["rank"].to_numpy()[rows].astype(np.int32), ops["peer"].to_numpy()[rows].astype(np.int32)
    out = pd.DataFrame({
        "rank": rank, "op_id": ops["op_id"].to_numpy()[rows],
        "op_name": op_name, "process_group": _categorical(ops["process_group"], rows),
        "peer": peer, "tag": ops["tag"].to_numpy()[rows].astype(np.int32),
        "seq": ops["p2p_seq_id"].to_numpy()[rows].astype(np.int64), "status": _categorical(ops["status"], rows),
        "start_ns": ops["start_ns"].to_numpy()[rows], "step": ops["step"].to_numpy()[rows],
        "microbatch": ops["microbatch"].to_numpy()[rows],
        "call_site": _categorical(ops["call_site"], rows),
        "direction": pd.Categorical.from_codes(is_send.astype(np.int8), categories=["recv", "send"]),
        "src": np.where(is_send, rank, peer), "dst": np.where(is_send, peer, rank),
    }, copy=False)
    return out


def match_p2p(p2p: pd.DataFrame) -> pd.DataFrame:
    """Outer-join sends with recvs on (src, dst, tag, seq).

    Columns: src, dst, tag, seq, send_* and recv_* (op_id, op_name, status,
    start_ns, ... NaN where that side was never posted) and `state`:
    matched | send_only | recv_only. (A repeated key keeps its first row on each side.)
    """
    fast = _outer_by_keys(p2p)
    if fast is not None:
        return fast
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


def _side(p2p: pd.DataFrame, pos: np.ndarray, prefix: str) -> dict[str, object]:
    """The SIDE_COLUMNS of `p2p` taken at row positions `pos` (-1: that side was never posted), as a merge
    fills them: NaN, and int columns become float64 when a row is missing."""
    missing = pos < 0
    out: dict[str, object] = {}
    for c in SIDE_COLUMNS:
        col = p2p[c]
        if isinstance(col.dtype, pd.CategoricalDtype):
            out[prefix + c] = col.array.take(pos, allow_fill=True)
        elif missing.any():
            out[prefix + c] = np.where(missing, np.nan, col.to_numpy()[np.maximum(pos, 0)].astype(np.float64))
        else:
            out[prefix + c] = col.to_numpy()[pos]
    return out


def _outer_by_keys(p2p: pd.DataFrame) -> pd.DataFrame | None:
    """match_p2p on numpy columns, the same frame as its merge: each side's rows deduplicated on the key
    (first row kept), keys packed into one int64, their union sorted (an outer merge sorts its keys
    lexicographically, as the packing does) and each side's columns taken once at its positions: no copy of
    the sends and recvs, no merge. None (the merge does it) when a side is empty, a key is not an integer
    column or does not pack into an int64, or a column is neither an integer nor a categorical."""
    if "direction" not in p2p or any(c not in p2p for c in KEY + SIDE_COLUMNS):
        return None
    if any(not np.issubdtype(p2p[c].dtype, np.integer) for c in KEY) or not all(
            isinstance(p2p[c].dtype, pd.CategoricalDtype) or np.issubdtype(p2p[c].dtype, np.integer)
            for c in SIDE_COLUMNS):
        return None
    d = p2p["direction"]
    srows = np.flatnonzero((d == "send").to_numpy())
    rrows = np.flatnonzero((d == "recv").to_numpy())
    if not len(srows) or not len(rrows):
        return None
    both = np.concatenate([srows, rrows])
    vals = [p2p[c].to_numpy()[both] for c in KEY]
    lo = [int(v.min()) for v in vals]
    width = [int(v.max()) - low + 1 for v, low in zip(vals, lo)]
    if float(np.prod([float(w) for w in width])) >= 2.0**62:
        return None
    key = np.zeros(len(both), dtype=np.int64)
    for v, low, w in zip(vals, lo, width):
        key *= w
        key += v - low
    del vals

    def first_rows(k: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Sorted distinct keys and, for each, the first of `rows` holding it (drop_duplicates' choice)."""
        order = np.argsort(k, kind="stable")
        k = k[order]
        first = np.r_[True, k[1:] != k[:-1]]
        return k[first], rows[order[first]]

    sk, s_at = first_rows(key[:len(srows)], srows)
    rk, r_at = first_rows(key[len(srows):], rrows)
    del key, both
    keys = np.concatenate([sk, rk])
    keys.sort()                                   # (np.union1d hashes first: 5x slower on 2 M keys)
    keys = keys[np.r_[True, keys[1:] != keys[:-1]]]

    def positions(k: np.ndarray, at: np.ndarray) -> np.ndarray:
        i = np.minimum(np.searchsorted(k, keys), len(k) - 1)
        return np.where(k[i] == keys, at[i], -1)

    ps, pr = positions(sk, s_at), positions(rk, r_at)
    cols: dict[str, object] = {}
    rest = keys
    for c, low, w in reversed(list(zip(KEY, lo, width))):
        cols[c] = (rest % w + low).astype(p2p[c].dtype, copy=False)   # the key's own dtype, as a merge keeps it
        rest = rest // w
    cols = {c: cols[c] for c in KEY}
    cols.update(_side(p2p, ps, "send_"))
    cols.update(_side(p2p, pr, "recv_"))
    state = np.where(ps < 0, 1, np.where(pr < 0, 0, 2)).astype(np.int8)
    cols["state"] = pd.Categorical.from_codes(state, categories=STATES)
    return pd.DataFrame(cols, copy=False)        # every column is a fresh array: no stacked copy
