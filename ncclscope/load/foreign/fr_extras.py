"""The rows and texts a Flight Recorder trace carries beside its ops: one marker row per dump (when it
was written, so a waiter's "waiting since" has an end) and the recorded stacks of each rank's in-flight
ops (the stacks a person reads). Split from `flight_recorder` to keep that module to the loader."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ncclscope import schema as S
from ncclscope.ranklists import fmt_ranks
from ncclscope.load.foreign.fr_entries import Entries
from ncclscope.load.foreign.fr_read import format_stack
from ncclscope.load.foreign.vocab import events_table

DUMP_MARKER = "flight_recorder_dump"


def dump_markers(stats: dict[int, tuple[int, int, int, int, int]], files: dict[int, tuple[Path, str]],
                  present: set[int], warnings: list[str] | None = None) -> pa.Table:
    """One marker row per rank at its dump file's mtime: when the dump was taken, so a
    waiter's "waiting since" has an end. Dumps carry no timestamp of their own; an mtime
    outside [last op, last op + 2 x timeout + 10 min] (a copied file) is not trusted, and
    `warnings` gets one line naming the ranks whose write time is therefore unknown.
    `stats`: Entries.rank_stats (per rank: ..., max created, max timeout_ms, max record_id)."""
    rows: dict[str, list[Any]] = {"rank": [], "op_id": [], "time_ns": [], "message": []}
    untrusted: list[int] = []
    for r in sorted(present):
        if r not in stats:
            continue
        _, _, last, timeout, record = stats[r]
        try:
            mtime = files[r][0].stat().st_mtime_ns
        except OSError:
            continue
        window = (2 * max(timeout, 0) + 600_000) * 1_000_000
        if last <= mtime <= last + window:
            rows["rank"].append(r)
            rows["op_id"].append(record + 1)
            rows["time_ns"].append(mtime)
            rows["message"].append(f"Flight Recorder dump {files[r][0].name} written (file mtime)")
        else:
            untrusted.append(r)
    if untrusted and warnings is not None:
        who = f"rank{'s' if len(untrusted) > 1 else ''} {fmt_ranks(untrusted)}"
        warnings.append(f"{who}: the Flight Recorder dump's file time is not within 2 x its collective timeout "
                        f"+ 10 min of its last op (a copied file keeps no write time): when "
                        f"{'it was' if len(untrusted) == 1 else 'they were'} written is unknown")
    return events_table({**rows, "phase": S.PHASE_INSTANT, "kind": S.KIND_MARKER, "op_name": DUMP_MARKER},
                        len(rows["rank"]))


def pending_stacks(ents: Entries, pending: np.ndarray, op_names: list[str], op: np.ndarray, labels: list[str],
            label: np.ndarray, peer: np.ndarray, p2p_seq: np.ndarray, is_p2p: np.ndarray) -> dict[int, str]:
    """Per rank: the recorded stacks of its in-flight ops (newest last, at most 4)."""
    out: dict[int, str] = {}
    pend = np.flatnonzero(pending)
    pend = pend[np.argsort(ents.rank[pend], kind="stable")]          # grouped by rank, entry order kept
    pr = ents.rank[pend]
    cuts = np.flatnonzero(np.r_[True, pr[1:] != pr[:-1]]) if len(pend) else np.zeros(0, np.int64)
    for a, b in zip(cuts, np.r_[cuts[1:], len(pend)]):
        r = pr[a]
        idx = pend[a:b]
        idx = idx[np.argsort(ents.record_id[idx], kind="stable")][-4:]
        parts = []
        for i in idx:
            seq = p2p_seq[i] if is_p2p[i] else ents.cseq[i]
            what = f"{op_names[op[i]]} #{seq} on {labels[label[i]]}" + (f" peer {peer[i]}" if peer[i] >= 0 else "")
            parts.append(f"Flight Recorder: {what} (record {ents.record_id[i]}, state {ents.states[ents.state_code[i]] or '?'}, "
                         f"thread {_thread(ents, i)}) was created here:\n"
                         f"{format_stack(ents.frames.get((int(ents.rank[i]), int(ents.record_id[i]))))}")
        out[int(r)] = "\n".join(parts)
    return out


def _thread(ents: Entries, i: int) -> str:
    """"140213 (pt_autograd_0)": the thread id, "?" where not recorded, and its name where the dump has one
    (format 2.9+: an op a backward hook issued says so)."""
    name, tid = ents.thread_names[ents.thread_name_code[i]], ents.threads[ents.thread_code[i]]
    return f"{tid or '?'} ({name})" if name else (tid or "?")
