"""Shapes that cannot be right, whatever the other ranks did: a collective's output against its own input,
and a send against its receive.

The instance vote (instances.py) compares what the members passed; it is blind where they all passed the
same wrong thing, or where a pair ties 1 vs 1. Flight Recorder records each op's output next to its input
(the loader writes "[[8]] -> [[16]]" where the output says more, fr_read.with_output), and some ops fix
the output by the input and the group's size W:

- all_reduce (and all_reduce_coalesced): the output has the input's shapes;
- all_gather: one input; a list output holds W tensors of the input's size, a flat (or stacked) one
  W times its elements; all_gather_into_tensor flat, *_coalesced pairwise;
- reduce_scatter: the mirror (the input W times the output);
- every op but broadcast, scatter and gather keeps its dtype.

Any other shape would have been refused or hangs (NCCL exchanges the byte counts each rank passed). A
rank breaking a rule deviated on its own: a `collective_mismatch` (size or dtype) naming it, no vote.
W is the group's size where pg_config listed its members; a group Flight Recorder left without members
(gloo: rebuilt from the ranks seen using it, run info `members_rebuilt`) has no trusted W, and only the
rules without W apply there.

A send and its receive that disagree on size or dtype (and so on bytes: both backends move bytes) while one
of them never completed are the reason the pair hangs (NCCL) or the receiver aborts (gloo). `p2p_sizes.size_deviations` names the side that
changed against its own history; where it cannot (no history: a Flight Recorder dump of one step, a
receive from any source), `pair_disagreements` names both, ambiguous. A pair that completed is left
alone (a program that always receives into a larger buffer is the program).

Work per distinct (group, op, sizes, dtypes), never per row: the rows are only masked and grouped.
"""
from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pandas as pd

from ncclscope import schema as S
from ncclscope.findings import Cause, CauseBasis, Evidence, Finding, InstanceRef
from ncclscope.hang.collectives import MISMATCH_LAYOUT
from ncclscope.index.labels import rank_label
from ncclscope.index.views import TraceIndex
from ncclscope.load.foreign.fr_read import IO_SEP

MAX_FINDINGS = 8        # per question
_SAME = frozenset({"all_reduce", "all_reduce_coalesced"})
_GATHER = frozenset({"all_gather", "all_gather_into_tensor", "all_gather_into_tensor_coalesced"})
_SCATTER = frozenset({"reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced"})
_DTYPE_FREE = ("broadcast", "scatter", "gather", "all_gather_coalesced", "coalesced(")   # prefixes
_COLS = ["process_group", "op_name", "input_sizes", "input_dtypes"]
PAIR_LAYOUT = ("p2p_pair", "seq", "categories", "ambiguous", "deviant_ranks", "unfinished", "call_site")


def shape_deviations(ix: TraceIndex, decided: list[Finding] | None = None) -> list[Finding]:
    """The within-rank rule breaks (`rule_breaks`), then the send/recv pairs `decided` (p2p_sizes'
    findings) leaves open (`pair_disagreements`)."""
    return rule_breaks(ix) + pair_disagreements(ix, decided or [])


# --------------------------------------------------------------------------
# A collective's output against its input
# --------------------------------------------------------------------------
def rule_breaks(ix: TraceIndex) -> list[Finding]:
    """One error per (group, op, sizes, dtypes) whose shapes break their op's rule: the ranks that passed
    them, the first instance, how many later ones."""
    coll = ix.coll
    if not len(coll):
        return []
    rows = coll[_with_output(coll["input_sizes"]) | _with_output(coll["input_dtypes"])]
    if not len(rows):
        return []
    rebuilt = _rebuilt(ix)
    combos = rows[_COLS].drop_duplicates()
    out: list[Finding] = []
    for c in combos.itertuples(index=False):
        g, op = str(c.process_group), str(c.op_name)
        w = len(ix.members.get(g, [])) if g not in rebuilt else 0
        why, cat = _size_rule(op, str(c.input_sizes), w), "size"
        if why is None:
            why, cat = _dtype_rule(op, str(c.input_dtypes)), "dtype"
        if why is None:
            continue
        sub = rows[(rows["process_group"] == g).to_numpy() & (rows["op_name"] == op).to_numpy()
                   & (rows["input_sizes"] == c.input_sizes).to_numpy()
                   & (rows["input_dtypes"] == c.input_dtypes).to_numpy()]
        out.append(_rule_finding(ix, g, op, sub, why, cat))
        if len(out) >= MAX_FINDINGS:
            break
    return out


def _with_output(col: pd.Series) -> np.ndarray:
    """Rows whose text carries an output (IO_SEP), decided per distinct text (a categorical's categories)."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        per_cat = np.append([IO_SEP in str(c) for c in col.cat.categories], False)
        return per_cat[col.cat.codes.to_numpy()]
    return col.astype(str).str.contains(IO_SEP, regex=False).to_numpy()


def _rebuilt(ix: TraceIndex) -> set[str]:
    """Groups whose members the dumps did not list (run info `members_rebuilt`): their size is not known."""
    raw = ix.trace.run.raw.get("members_rebuilt") if isinstance(ix.trace.run.raw, dict) else None
    return {str(g) for g in raw} if isinstance(raw, list) else set()


def _shapes(text: str) -> list[list[int]] | None:
    """"[[4, 4], [8]]" -> [[4, 4], [8]]; None for anything that is not a list of int lists."""
    try:
        v = json.loads(text)
    except (ValueError, RecursionError):
        return None
    if not isinstance(v, list) or not all(isinstance(s, list) and all(type(d) is int for d in s) for s in v):
        return None
    return v


def _numel(shape: list[int]) -> int:
    return math.prod(shape)


def _size_rule(op: str, text: str, w: int) -> str | None:
    """Why `text` (input IO_SEP output) cannot be right for `op` on a group of `w` (0: unknown), or None."""
    ins_text, sep, outs_text = text.partition(IO_SEP)
    ins, outs = _shapes(ins_text), _shapes(outs_text)
    if not sep or ins is None or outs is None:
        return None
    if op in _SAME:
        return f"{_a(op)} {op}'s output has its input's shapes"
    if w <= 0 or not ins or not outs:
        return None
    if op in _GATHER:
        return _grown(ins, outs, w, "all_gather", "output", "input")
    if op in _SCATTER:
        return _grown(outs, ins, w, "reduce_scatter", "input", "output")
    return None


def _grown(small: list[list[int]], big: list[list[int]], w: int, what: str, big_name: str,
           small_name: str) -> str | None:
    """The shared rule of all_gather (small: its input) and reduce_scatter (small: its output): one small
    tensor and a list of `w` like it, or one tensor of `w` times its elements; several small tensors
    (the coalesced ops) each with its own big one."""
    if len(small) == 1:
        n = _numel(small[0])
        if len(big) > 1 and (len(big) != w or any(_numel(b) != n for b in big)):
            return (f"a list {what}'s {big_name} holds {w} tensors (one per member) of the {small_name}'s {n} "
                    f"elements, not {len(big)} of {', '.join(str(_numel(b)) for b in big[:4])}")
        if len(big) == 1 and _numel(big[0]) != w * n:
            return (f"{_a(what)} {what}'s {big_name} holds {w} x {n} = {w * n} elements on a group of {w}, "
                    f"not {_numel(big[0])}")
        return None
    if len(big) == len(small) and any(_numel(b) != w * _numel(s) for s, b in zip(small, big)):
        return f"each {big_name} of a coalesced {what} holds {w} times its {small_name}'s elements"
    return None


def _dtype_rule(op: str, text: str) -> str | None:
    """Why the dtypes `text` (input IO_SEP output) cannot be right for `op`, or None."""
    ins, sep, outs = text.partition(IO_SEP)
    if not sep or not ins or not outs or op.startswith(_DTYPE_FREE):
        return None
    return f"{_a(op)} {op} keeps its dtype"


def _a(word: str) -> str:
    return "an" if word[:1] in "aeiou" else "a"


def _rule_finding(ix: TraceIndex, g: str, op: str, sub: pd.DataFrame, why: str, cat: str) -> Finding:
    """The error for the rows `sub` (one group, op and shape), at its first instance."""
    trace = ix.trace
    ranks = sorted({int(r) for r in sub["rank"]})
    seqs = sorted({int(k) for k in sub["collective_seq_id"]})
    k = seqs[0]
    first = sub[sub["collective_seq_id"] == k].sort_values("rank")
    col = "input_sizes" if cat == "size" else "input_dtypes"
    value = str(first[col].iloc[0])
    ins, _, outs = value.partition(IO_SEP)
    word = "sizes" if cat == "size" else "dtype"
    title = (f"{rank_label(trace, ranks)} passed {op} #{k} on {ix.label(g)} {word} {ins} in, {outs} out: {why}")
    site = next((s for s in first["call_site"].astype(str) if s), "")
    if site:
        title += f" ({'its' if len(ranks) == 1 else 'their'} call at {site})"
    if len(seqs) > 1:
        title += f" (and in {len(seqs) - 1} later instance{'s' if len(seqs) > 2 else ''})"
    unfinished = bool((first["status"].astype(str) != S.STATUS_OK).any())
    ev = [Evidence(rank=int(r.rank), note=f"{word} {value}; {r.status}", op_name=op, process_group=g, seq=k,
                   op_id=int(r.op_id), time_ns=int(r.start_ns)) for r in first.head(24).itertuples(index=False)]
    return Finding(kind="collective_mismatch", severity="error", title=title, ranks=ranks, evidence=ev,
                   instance=InstanceRef(g, k),
                   data={"process_group": g, "seq": k, "categories": [cat], "call_site": site, "rule": why},
                   cause=Cause(basis=CauseBasis.INSTANCE, ambiguous=False, deviant_ranks=tuple(ranks),
                               unfinished=unfinished, later_instances=len(seqs) - 1),
                   layout=MISMATCH_LAYOUT)


# --------------------------------------------------------------------------
# A send against its receive
# --------------------------------------------------------------------------
def pair_disagreements(ix: TraceIndex, decided: list[Finding]) -> list[Finding]:
    """One ambiguous error per matched send/recv pair, one side unfinished, whose sizes or dtypes differ,
    unless `decided` (p2p_sizes' findings) already names a side of that pair."""
    pairs = ix.p2p_pairs
    if not len(pairs) or "state" not in pairs:
        return []
    open_ = pairs[(pairs["state"] == "matched").to_numpy()
                  & ((pairs["send_status"].astype(str) != S.STATUS_OK).to_numpy()
                     | (pairs["recv_status"].astype(str) != S.STATUS_OK).to_numpy())]
    if not len(open_):
        return []
    known = {tuple(sorted(f.cause.p2p_pair)) for f in decided if f.cause.p2p_pair}
    rows = _p2p_rows(ix.trace.ops, open_)
    out: list[Finding] = []
    for p in open_.head(64).itertuples(index=False):
        src, dst = int(p.src), int(p.dst)
        s, r = rows.get((src, int(p.send_op_id))), rows.get((dst, int(p.recv_op_id)))
        if s is None or r is None or tuple(sorted((src, dst))) in known:
            continue
        cats = _pair_categories(s, r)
        if cats:
            out.append(_pair_finding(ix, s, r, int(p.seq), cats))
            known.add(tuple(sorted((src, dst))))
        if len(out) >= MAX_FINDINGS:
            break
    return out


def _pair_categories(s: dict[str, Any], r: dict[str, Any]) -> list[str]:
    """What a send and its receive disagree on: "size" (elements), "dtype". Only where the bytes differ
    (or are not known): both backends move bytes, so a receive of the same bytes in another shape or dtype
    completes and is no defect of the pair."""
    if s["bytes"] > 0 and s["bytes"] == r["bytes"]:
        return []
    numel = [None if (v := _shapes(o["input_sizes"])) is None else sum(map(_numel, v)) for o in (s, r)]
    cats = []
    if s["input_sizes"] and r["input_sizes"] and (numel[0] != numel[1] if None not in numel
                                                  else s["input_sizes"] != r["input_sizes"]):
        cats.append("size")
    if s["input_dtypes"] and r["input_dtypes"] and s["input_dtypes"] != r["input_dtypes"]:
        cats.append("dtype")
    return cats


def _p2p_rows(ops: pd.DataFrame, pairs: pd.DataFrame) -> dict[tuple[int, int], dict[str, Any]]:
    """(rank, op_id) -> the row's fields, for both sides of `pairs` only (one masked pass over the ops)."""
    keys = set(zip(pairs["src"].astype(int), pairs["send_op_id"].astype(int))) | set(
        zip(pairs["dst"].astype(int), pairs["recv_op_id"].astype(int)))
    cols = ["rank", "op_id", "op_name", "peer", "input_sizes", "input_dtypes", "call_site", "status", "start_ns",
            "bytes"]
    sub = ops[(ops["kind"] == S.KIND_P2P).to_numpy() & ops["op_id"].isin({k[1] for k in keys}).to_numpy()][cols]
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for r in sub.itertuples(index=False):
        key = (int(r.rank), int(r.op_id))
        if key in keys:
            out[key] = {"rank": key[0], "op_id": key[1], "peer": int(r.peer), "start_ns": int(r.start_ns),
                        "bytes": _int(r.bytes), **{c: _text(getattr(r, c)) for c in cols[4:8] + ["op_name"]}}
    return out


def _int(v: Any) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):         # NaN, None: not recorded
        return -1


def _text(v: Any) -> str:
    return "" if v is None or (isinstance(v, float) and v != v) else str(v)


def _pair_finding(ix: TraceIndex, s: dict[str, Any], r: dict[str, Any], k: int, cats: list[str]) -> Finding:
    """The pair's error in words: what the send passed against what its receive expects."""
    src, dst = int(s["rank"]), int(r["rank"])
    parts = [f"{'sizes' if c == 'size' else 'dtype'} {s['input_' + ('sizes' if c == 'size' else 'dtypes')]} "
             f"where rank {dst}'s {r['op_name']} #{k} from it expects "
             f"{r['input_' + ('sizes' if c == 'size' else 'dtypes')]}" for c in cats]
    title = (f"ambiguous (neither side's own history says which changed), naming both: rank {src}'s "
             f"{s['op_name']} #{k} to rank {dst} passed " + "; ".join(parts))
    site = s["call_site"] or r["call_site"]
    if site:
        title += f" (the send's call at {s['call_site']})" if s["call_site"] else f" (the receive's at {site})"
    ev = [Evidence(rank=int(o["rank"]), note=f"{tag}: sizes {o['input_sizes']} {o['input_dtypes']}; {o['status']}",
                   op_name=str(o["op_name"]), seq=k, op_id=int(o["op_id"]), time_ns=int(o["start_ns"]),
                   peer=int(o["peer"])) for tag, o in (("send", s), ("recv", r))]
    return Finding(kind="collective_mismatch", severity="error", title=title,
                   ranks=sorted({src, dst}), evidence=ev,
                   data={"seq": k, "categories": cats, "call_site": site},
                   cause=Cause(p2p_pair=(min(src, dst), max(src, dst)), ambiguous=True,
                               deviant_ranks=(min(src, dst), max(src, dst)), unfinished=True),
                   layout=PAIR_LAYOUT)
