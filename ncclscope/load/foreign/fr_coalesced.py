"""Coalesced blocks in Flight Recorder dumps: several ops launched as one.

ProcessGroupNCCL records each op issued inside a coalescing context (DDP's
start-up broadcast of the model, `batch_isend_irecv`, the *_coalesced APIs, an
all_gather or reduce_scatter of uneven shapes done as broadcasts or reduces)
under the block's one sequence id (`collective_seq_id`, or `p2p_seq_id` for a
block of sends and receives), with no CUDA events of their own, so their state
never leaves `scheduled`. The block ends with a marker entry ("nccl:coalesced",
"nccl:ALLGATHER_coalesced", ...) with empty sizes that carries the block's
events: its state is every member's. Read entry by entry, a block looks like
ops that never completed (a hang) and a "coalesced" op where the other ranks
called broadcast (a mismatch); read as one launch, it is neither.

    coalesced_blocks(...)   the block number of each entry (-1: in none)
    block_op(...)           the op a block is, as one launch
    block_texts(...)        the block's sizes (or dtypes) as one text
    marker_like(name)       a profiling name that may be a block's marker
"""
from __future__ import annotations

import numpy as np

from ncclscope.load.foreign.fr_read import IO_SEP

__all__ = ["coalesced_blocks", "block_op", "block_texts", "marker_like", "MARKER_SIZES"]

# the sizes text of a marker: ProcessGroupNCCL records it with no tensors ("[]"); torch's own tests write [[]]
MARKER_SIZES = frozenset({"", "null", "[]", "None", "[[]]"})


def marker_like(op: str) -> bool:
    """Whether a (normalized) op name may be a block's marker: "coalesced" or "<op>_coalesced". The
    *_coalesced ops that carry tensors (all_reduce_coalesced, ...) are told apart by their sizes."""
    return op == "coalesced" or op.endswith("_coalesced")


def coalesced_blocks(rank: np.ndarray, label: np.ndarray, record: np.ndarray, is_p2p: np.ndarray, seq: np.ndarray,
                     marker: np.ndarray) -> np.ndarray:
    """Block number of each entry (-1: in none). A block is what torch's analyzer calls a coalesced group:
    consecutive entries of one rank on one group (in record order, other groups' entries skipped) sharing a
    sequence id (`seq`: the collective one, the p2p one for p2p entries) and p2p-ness, at least two, the
    last a `marker`. A sequence id below 0 (a dump without p2p ids) makes none. One sort of all entries,
    only where some entry is a marker."""
    n = len(rank)
    out = np.full(n, -1, np.int64)
    if not n or not marker.any():
        return out
    order = np.lexsort((record, label, rank))
    r, lab, p, q = rank[order], label[order], is_p2p[order], seq[order]
    new = np.ones(n, bool)
    new[1:] = (r[1:] != r[:-1]) | (lab[1:] != lab[:-1]) | (p[1:] != p[:-1]) | (q[1:] != q[:-1])
    run = np.cumsum(new) - 1
    last = np.flatnonzero(np.r_[new[1:], True])               # the last entry of each run
    length = np.bincount(run)
    closed = marker[order][last] & (length[run[last]] >= 2) & (q[last] >= 0)
    number = np.full(len(last), -1, np.int64)
    number[closed] = np.arange(int(closed.sum()))
    out[order] = number[run]
    return out


def block_op(marker_op: str, member_ops: list[str]) -> str:
    """The op a coalesced block is, as one launch: the marker's own name where it says more than
    "coalesced" (all_gather_coalesced: an uneven all_gather done as broadcasts), else the members' op
    with "_coalesced" where they share one ("broadcast_coalesced"), else every member's op in order
    ("coalesced(broadcast,all_reduce)"), so that ranks whose blocks hold other ops disagree on the type."""
    if marker_op != "coalesced":
        return marker_op
    ops = list(dict.fromkeys(member_ops))
    return f"{ops[0]}_coalesced" if len(ops) == 1 else f"coalesced({','.join(member_ops)})"


def block_texts(texts: list[str]) -> str:
    """One sizes (or dtypes) text for a block's members, in their order: shape lists concatenated
    ("[[4, 4]]", "[[5, 5]]" -> "[[4, 4], [5, 5]]"), dtypes joined distinct; each side of IO_SEP (a
    member's output, where it says more than its input) apart, so the block compares member by member."""
    ins, outs, has_out = [], [], False
    for t in texts:
        a, sep, b = t.partition(IO_SEP)
        ins.append(a)
        outs.append(b if sep else a)
        has_out |= bool(sep)
    joined = _join(ins)
    return f"{joined}{IO_SEP}{_join(outs)}" if has_out else joined


def _join(parts: list[str]) -> str:
    """Shape lists ("[[4, 4]]") concatenated into one list, anything else (dtype names) joined distinct."""
    lists = [p for p in parts if p.startswith("[") and p.endswith("]")]
    if lists and len(lists) == len(parts):
        return "[" + ", ".join(x for x in (p[1:-1] for p in lists) if x) + "]"
    return ",".join(dict.fromkeys(x for p in parts for x in p.split(",") if x))
