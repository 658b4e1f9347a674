"""The schedule check's comparison on integer codes: which observed ops depart from the schedule.

`schedule_check._deviating_tokens_merge` builds every rank's observed order as a frame of strings
(2.8 M rows at 1,024 ranks and 10 M events: +300-500 MB and seconds to decode, sort and merge) and
keeps the few rows that differ from the schedule. `deviating_tokens` answers the same on the loader's
categorical codes: each op's token kind is decided once per category, the rows are ordered by one
stable lexsort of (rank, step, op_id), positions in the step are run lengths, and the schedule is a
flat lookup table per pipeline rank. Only the deviating rows are made into a frame, with the columns
and values the pandas path gives them (tests/test_scale_paths.py compares the two). It declines
(returns None) on inputs it does not cover: string columns that are not categoricals, or a null
kind / op name among the candidate rows.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ncclscope import schema as S
from ncclscope.schedules import BACKWARD, FORWARD
from ncclscope.index.p2p_pairs import direction

WHAT = (FORWARD, BACKWARD, "send", "recv")     # token kinds, coded 1..4 (0: no token)
_COMPUTE = {"forward": FORWARD, "backward": BACKWARD}


def _code_of(what: np.ndarray) -> np.ndarray:
    out = np.zeros(len(what), dtype=np.int8)
    for i, w in enumerate(WHAT, start=1):
        out[what == w] = i
    return out


def _per_category(cat: pd.Series) -> tuple[np.ndarray, np.ndarray] | None:
    """(compute token code, p2p token code) per category of op_name, or None when not categorical."""
    if not isinstance(cat.dtype, pd.CategoricalDtype):
        return None
    names = np.asarray([str(c) for c in cat.cat.categories], dtype=object)
    comp = _code_of(np.asarray([_COMPUTE.get(n, "") for n in names], dtype=object))
    p2p = _code_of(np.asarray(direction(pd.Series(names, dtype=object)), dtype=object)) if len(names) \
        else np.zeros(0, dtype=np.int8)
    return comp, p2p


def deviating_tokens(ops: pd.DataFrame, pp_of: dict[int, int], exp: pd.DataFrame, p: int) -> pd.DataFrame | None:
    """The rows `_deviating_tokens_merge` returns, in its order, or None where this path does not apply."""
    tok = _schedule_tokens(ops, pp_of)
    if tok is None:
        return None
    rows, what, comp_r, pos, pp = _step_positions(ops, pp_of, p, *tok)
    del tok
    peer_pp = np.where(comp_r, -1, _lookup(pp_of, ops["peer"].to_numpy()[rows].astype(np.int64)))
    del comp_r
    # compared in their own (int32) dtype; the deviating rows' values are int64 in the frame below
    stage = ops["stage"].to_numpy()[rows]
    mb = ops["microbatch"].to_numpy()[rows]
    flat = _flat_schedule(exp, p)
    if flat is None:
        return None                             # a schedule with gaps in its positions: the merge handles it
    e, off, length, e_what, e_peer, e_stage, e_mb = flat
    has = pos < length[pp]
    at = np.where(has, off[pp] + pos, 0)
    if not len(e):
        bad = np.ones(len(rows), dtype=bool)
    else:      # one comparison at a time, or'ed in place: one full-length gather alive, not five
        bad = ~has
        for got, want in ((what, e_what), (peer_pp, e_peer), (stage, e_stage), (mb, e_mb)):
            bad |= got != want[at]
    b = np.flatnonzero(bad)
    del bad
    take = rows[b]
    out = pd.DataFrame({
        "rank": ops["rank"].to_numpy()[take].astype(np.int64), "step": ops["step"].to_numpy()[take].astype(np.int64),
        "op_id": ops["op_id"].to_numpy()[take].astype(np.int64),
        "kind": np.asarray([str(x) for x in ops["kind"].iloc[take]], dtype=object),
        "op_name": np.asarray([str(x) for x in ops["op_name"].iloc[take]], dtype=object),
        "peer": ops["peer"].to_numpy()[take].astype(np.int64), "stage": stage[b].astype(np.int64),
        "microbatch": mb[b].astype(np.int64),
        "start_ns": ops["start_ns"].to_numpy()[take],
        "call_site": ops["call_site"].iloc[take].to_numpy(), "status": ops["status"].iloc[take].to_numpy(),
        "what": np.asarray(WHAT, dtype=object)[what[b] - 1] if len(b) else np.zeros(0, dtype=object),
        "peer_pp": peer_pp[b], "pos": pos[b], "pp_rank": pp[b],
    })
    hb = has[b]
    ab = at[b]
    out["e_what"] = pd.Series(np.where(hb, np.asarray(e["e_what"].to_numpy(dtype=object))[ab] if len(e) else None,
                                       None), dtype=object).where(hb, np.nan)
    for c, arr in (("e_peer", e_peer), ("e_stage", e_stage), ("e_mb", e_mb)):
        out[c] = np.where(hb, arr[ab] if len(e) else 0, np.nan) if not hb.all() else arr[ab]
    return out


def _schedule_tokens(ops: pd.DataFrame, pp_of: dict[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """(rows, what code, is compute) of the ops that are actions of a pipeline schedule: compute spans and
    p2p to another stage, with a step, stage and microbatch; None where this path does not apply."""
    kind, name = ops["kind"], ops["op_name"]
    per = _per_category(name)
    if per is None or not isinstance(kind.dtype, pd.CategoricalDtype):
        return None
    comp_code, p2p_code = per
    kcats = [str(c) for c in kind.cat.categories]
    kc = kind.cat.codes.to_numpy()
    nc = name.cat.codes.to_numpy()
    sel = (ops["step"].to_numpy() >= 0) & (ops["stage"].to_numpy() >= 0) & (ops["microbatch"].to_numpy() >= 0)
    is_comp = kc == (kcats.index(S.KIND_COMPUTE) if S.KIND_COMPUTE in kcats else -2)
    is_p2p = kc == (kcats.index(S.KIND_P2P) if S.KIND_P2P in kcats else -2)
    rows = np.flatnonzero(sel & (is_comp | is_p2p))
    del sel
    ncr = nc[rows]
    if (ncr < 0).any():                         # a null op name: the pandas path decides what it means
        return None
    comp_r = is_comp[rows]
    del is_comp, is_p2p
    what = np.where(comp_r, comp_code[ncr] if len(comp_code) else 0, p2p_code[ncr] if len(p2p_code) else 0)
    keep = what > 0
    rows, what, comp_r = rows[keep], what[keep], comp_r[keep]
    # a pipeline's p2p goes to another stage: p2p with a peer at the rank's own pipeline index (context
    # parallelism's ring) is not an action of the schedule (the merge path's rule)
    same_pp = _lookup(pp_of, ops["rank"].to_numpy()[rows].astype(np.int64)) == \
        _lookup(pp_of, ops["peer"].to_numpy()[rows].astype(np.int64))
    keep = comp_r | ~same_pp
    return rows[keep], what[keep], comp_r[keep]


def _step_positions(ops: pd.DataFrame, pp_of: dict[int, int], p: int, rows: np.ndarray, what: np.ndarray,
                    comp_r: np.ndarray) -> tuple[np.ndarray, ...]:
    """(rows, what, is compute, position in the rank's step, pipeline rank), sorted by (rank, step, op_id),
    for the ranks at pipeline index 0 .. p-1."""
    # rank and step only compare: their own (int32) dtype, not int64 copies
    rank = ops["rank"].to_numpy()[rows]
    step = ops["step"].to_numpy()[rows]
    op_id = ops["op_id"].to_numpy()[rows]
    if not _in_order(rank, step, op_id):          # the loader's (rank, start) order usually is this one
        order = np.lexsort((op_id, step, rank))   # stable: ties keep row order
        rows, what, comp_r, rank, step = rows[order], what[order], comp_r[order], rank[order], step[order]
        del order
    del op_id
    n = len(rows)
    idx = np.arange(n, dtype=np.int64)
    start = np.ones(n, dtype=bool)
    start[1:] = (rank[1:] != rank[:-1]) | (step[1:] != step[:-1])
    pos = idx - np.maximum.accumulate(np.where(start, idx, 0)) if n else idx
    del start, idx, step
    pp = _lookup(pp_of, rank)
    keep = (pp >= 0) & (pp <= p - 1)
    return rows[keep], what[keep], comp_r[keep], pos[keep], pp[keep]


def _flat_schedule(exp: pd.DataFrame, p: int) -> tuple | None:
    """The schedule as flat arrays (frame, off, length, what, peer, stage, microbatch): pipeline rank q's
    tokens at off[q] .. off[q] + length[q] - 1; None for a schedule with gaps in its positions."""
    e = exp.sort_values(["pp_rank", "pos"], kind="stable")
    q_of, e_pos = e["pp_rank"].to_numpy(np.int64), e["pos"].to_numpy(np.int64)
    length = np.bincount(q_of, minlength=p)[:p] if len(e) else np.zeros(p, dtype=np.int64)
    if len(e) and not (e_pos == np.concatenate([np.arange(k) for k in length])).all():
        return None
    off = np.concatenate([[0], np.cumsum(length)[:-1]]).astype(np.int64)
    e_what = _code_of(e["e_what"].to_numpy(dtype=object))
    e_peer, e_stage, e_mb = (e[c].to_numpy(np.int64) for c in ("e_peer", "e_stage", "e_mb"))
    return e, off, length, e_what, e_peer, e_stage, e_mb


def _in_order(rank: np.ndarray, step: np.ndarray, op_id: np.ndarray) -> bool:
    """Whether rows are already sorted by (rank, step, op_id): then the stable lexsort is the identity and
    its five reordered copies (~2.8 M rows at 10 M events) are not needed."""
    if len(rank) < 2:
        return True
    r0, r1, s0, s1 = rank[:-1], rank[1:], step[:-1], step[1:]
    return bool(((r1 > r0) | ((r1 == r0) & ((s1 > s0) | ((s1 == s0) & (op_id[1:] >= op_id[:-1]))))).all())


def _lookup(table: dict[int, int], keys: np.ndarray) -> np.ndarray:
    """table[k] for each key, -1 for keys not in it (as `Series.map(...).fillna(-1)`)."""
    if not table or not len(keys):
        return np.full(len(keys), -1, dtype=np.int64)
    ks = np.fromiter(table.keys(), dtype=np.int64, count=len(table))
    vs = np.fromiter(table.values(), dtype=np.int64, count=len(table))
    o = np.argsort(ks, kind="stable")
    ks, vs = ks[o], vs[o]
    i = np.clip(np.searchsorted(ks, keys), 0, len(ks) - 1)
    return np.where(ks[i] == keys, vs[i], -1)
