"""Loader step: a rank's Flight Recorder snapshot + its Python-traced rows = one event log.

`ncclscope run` traces the public torch.distributed API in Python; what the
backend issues by itself (DDP's reducer, DTensor's functional collectives,
FSDP2's internals on some paths) never passes through Python, but Flight
Recorder records it. The tracer writes the rank's FR buffer into the rank
directory (`flight_recorder.pkl`; NCCL's own dump on timeout is
`flight_recorder_nccl_<rank>`), and `trace.load` calls `merge_rank` for every
rank directory: FR entries the tracer did not see become begin (and, when
they completed, end) rows with `message` "flight_recorder", so every analysis
sees the backend's ops numbered on the same per-group sequence.

Why the dedup key is (group, collective_seq_id): the tracer numbers a
collective with its process group's own counter
(`_get_sequence_number_for_group() + 1`), which is what FR stores, so the same
op has the same key on both sides. FR's group names (`pg_name` "0", "1") map
to the tracer's ("world", "dp0", ...) through the `pg_name` the tracer stores
in each group-table entry.

Completion: on NCCL FR says it (`state` completed). On gloo `state` stays
`scheduled` (platform-notes.md); an entry counts as completed when this rank
issued a later op on the same group (its blocking call returned) or the rank
ended cleanly, with the end time the next op's creation. The last op on a
group of a rank that died or hung stays in flight: the evidence.

p2p entries are skipped: gloo records none, and the tracer sees every public
p2p call (its per-pair numbering is the one the analyses use). So are a group's
entries from its first monitored barrier on: FR's numbering then counts the
sends and receives the barrier is made of, which the tracer's does not (it
keeps one numbering on every rank), so the dedup key no longer pairs them.

Torch-free (the analyzer's side).
"""
from __future__ import annotations

import bisect
import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from ncclscope import schema as S
from ncclscope.load.foreign.errors import TraceError
from ncclscope.load.foreign.fr_read import dtype_and_bytes as fr_dtype_and_bytes
from ncclscope.load.foreign.fr_read import read_dump
from ncclscope.load.foreign.vocab import events_table, normalize_op

FR_FILE = "flight_recorder.pkl"
FR_NCCL_PREFIX = "flight_recorder_nccl_"
FR_MESSAGE = "flight_recorder"
INFERRED = "completion inferred"   # the note on an entry whose end is inferred (late_arrival reads it)
OP_ID_BASE = 1 << 32          # FR rows' op ids: above any tracer op id, below build_ops' 40-bit key


def dump_path(rank_dir: Path) -> Path | None:
    """The newest Flight Recorder dump in a rank directory, or None."""
    best: tuple[int, Path] | None = None
    try:
        for entry in rank_dir.iterdir():
            name = entry.name
            if name == FR_FILE or (name.startswith(FR_NCCL_PREFIX) and not name.endswith(".tmp")):
                m = entry.stat().st_mtime_ns
                if best is None or m > best[0]:
                    best = (m, entry)
    except OSError:
        return None
    return None if best is None else best[1]


def _group_names(rank_dir: Path) -> dict[str, str]:
    """FR pg_name -> the tracer's group name: rank.json's `fr_pg_names`, else `pg_name` in the group table."""
    raw: Any = None
    gpath = rank_dir / S.GROUPS_JSON
    try:
        meta = json.loads((rank_dir / S.RANK_JSON).read_text())
        if isinstance(meta.get("fr_pg_names"), dict):
            return {str(k): str(v) for k, v in meta["fr_pg_names"].items()}
    except (OSError, ValueError):
        pass
    try:
        if gpath.exists():
            raw = json.loads(gpath.read_text())
        else:
            meta = json.loads((rank_dir / S.RANK_JSON).read_text())
            raw = meta.get("groups")
    except (OSError, ValueError):
        return {}
    if isinstance(raw, dict):          # a per-rank format keyed by something: take its list of groups
        raw = raw.get("groups", [])
    out: dict[str, str] = {}
    for g in raw if isinstance(raw, list) else []:
        if isinstance(g, dict) and g.get("pg_name") not in (None, "") and "name" in g:
            out[str(g["pg_name"])] = str(g["name"])
    return out


def _ended_ok(rank_dir: Path) -> bool:
    try:
        meta = json.loads((rank_dir / S.RANK_JSON).read_text())
    except (OSError, ValueError):
        return False
    end = meta.get("end")
    return isinstance(end, dict) and end.get("status") == "ok"


_LIB = ("/torch/", "\\torch\\", "/ncclscope/", "/runtime/recorder.py", "/runtime/usertrace/", "typing_extensions")
_STDLIB = re.compile(r"[/\\]lib[/\\]python\d+(\.\d+)?[/\\](?!site-packages|dist-packages)")


def is_user_file(filename: str) -> bool:
    """A frame's file is the user's: not torch, ncclscope, the stdlib or the interpreter's own (<frozen ...>)."""
    # a relative frame path ("runtime/usertrace/ops.py") matches as an absolute one; the built-in
    # runtime's own model and parallel code (under ncclscope/runtime/) is the training code here
    path = ("/" + filename).replace("/ncclscope/runtime/", "/runtime/")
    return bool(filename) and not filename.startswith("<") and not any(m in path for m in _LIB) \
        and not _STDLIB.search(path)


def _site(frames: Any) -> str:
    """file:line of the first FR frame (innermost first) outside torch, ncclscope and the stdlib,
    relative to the working directory when under it (as the tracer writes call sites)."""
    if not isinstance(frames, (list, tuple)):
        return ""
    for fr in frames:
        if isinstance(fr, dict):
            fn = str(fr.get("filename", ""))
            if is_user_file(fn):
                return f"{_rel(fn)}:{_int(fr.get('line'))}"
    return ""


def _rel(filename: str) -> str:
    try:
        rel = os.path.relpath(filename)
        return filename if rel.startswith("..") else rel
    except ValueError:
        return filename


def _int(v: Any, default: int = -1) -> int:
    try:
        return int(v)
    except (TypeError, ValueError):
        return default


def _dtype_and_bytes(sizes: Any, dtypes: Any) -> tuple[str, int]:
    """(dtypes, bytes) of an FR entry, computed as the FR ingest does (bounded against hostile values)."""
    return fr_dtype_and_bytes(sizes, tuple(dtypes) if isinstance(dtypes, (list, tuple)) else (dtypes,))


def _read_dump(path: Path) -> dict[str, Any]:
    return read_dump(path, "pickle" if path.name == FR_FILE else None)


def merge_rank(rank_dir: Path, events: pa.Table, warnings: list[str]) -> pa.Table:
    """`events` plus the FR-only collectives of this rank (unchanged when there is no dump)."""
    path = dump_path(rank_dir)
    if path is None:
        return events
    try:
        dump = _read_dump(path)
    except TraceError as exc:
        if type(exc) is not TraceError:   # UnsafePickleError: never load it
            warnings.append(f"{path}: refused ({exc}); Flight Recorder entries of this rank not merged")
        else:
            warnings.append(f"{exc}; Flight Recorder entries of this rank not merged")
        return events
    traced = _Traced(events)
    new = traced.fr_only(dump, _group_names(rank_dir))
    if not new:
        return events
    begin_cols, end_cols = _rows(new, _later_creations(traced.times), _ended_ok(rank_dir), traced)
    rank = int(rank_dir.name[5:]) if rank_dir.name[5:].isdigit() else -1
    nb, ne = len(begin_cols["op_id"]), len(end_cols["op_id"])
    begin = events_table({**{k: np.asarray(v) if k not in ("op_name", "process_group", "input_dtypes",
                                                           "input_sizes", "call_site") else v
                             for k, v in begin_cols.items()},
                          "rank": rank, "phase": S.PHASE_BEGIN, "kind": S.KIND_COLLECTIVE,
                          "message": FR_MESSAGE}, nb)
    end = events_table({**{k: np.asarray(v) if k in ("op_id", "time_ns", "collective_seq_id") else v
                           for k, v in end_cols.items()},
                        "rank": rank, "phase": S.PHASE_END, "kind": "", "status": S.STATUS_OK}, ne)
    parts = [events] + [pa.Table.from_arrays(t.columns, schema=events.schema) for t in (begin, end) if t.num_rows]
    return pa.concat_tables(parts)


class _Traced:
    """What the tracer's own rows of the rank say: its step markers (the step each FR row belongs to),
    the collectives it saw (`seen`, by (group, seq): FR's copies of those are dropped) and the creation
    times of every op on each group (`times`: tracer + FR, for "a later op returned")."""

    def __init__(self, events: pa.Table) -> None:
        cols = events.select(["phase", "kind", "op_name", "process_group", "collective_seq_id", "time_ns",
                              "step"]).to_pydict()
        # the step each FR row belongs to: the tracer's step markers (optimizer hook / ncclscope.step())
        marks = sorted((t, s) for ph, name, t, s in zip(cols["phase"], cols["op_name"], cols["time_ns"], cols["step"])
                       if ph == S.PHASE_INSTANT and name == "step" and t is not None and s is not None)
        self.has_marks = bool(marks)
        # with no markers the tracer's own rows still carry a step (0 where no optimizer hook ran): FR rows
        # take the same, so a rank's FR-only row never reads as past its training loop (census.passed_steps)
        own = [int(s) for ph, k, s in zip(cols["phase"], cols["kind"], cols["step"])
               if ph == S.PHASE_BEGIN and k in (S.KIND_COLLECTIVE, S.KIND_P2P) and s is not None]
        self.default_step = max(own) if own and min(own) >= 0 and max(own) == min(own) else -1
        self.mark_t = np.array([m[0] for m in marks], dtype=np.int64)
        self.mark_s = [int(m[1]) for m in marks]
        self.seen: set[tuple[str, int]] = set()
        self.times: dict[str, list[tuple[int, int]]] = {}
        # group -> when its first monitored barrier began: from there on FR numbers its collectives otherwise
        # (gloo's counter counts the sends and receives the barrier is made of, the tracer's numbering does not)
        self.barrier_from: dict[str, int] = {}
        for ph, kind, g, seq, t in zip(cols["phase"], cols["kind"], cols["process_group"], cols["collective_seq_id"],
                                       cols["time_ns"]):
            if ph == S.PHASE_BEGIN and g and (base := S.barrier_group(g)) and t is not None:
                self.barrier_from[base] = min(int(t), self.barrier_from.get(base, int(t)))
            if ph == S.PHASE_BEGIN and kind == S.KIND_COLLECTIVE and seq is not None and seq >= 0:
                self.seen.add((g, int(seq)))
                self.times.setdefault(g, []).append((int(seq), int(t)))

    def step_at(self, created: int) -> int:
        """The step of the last marker at or before `created` (0 before the first; with no markers, the one
        step the tracer's rows all carry, else -1)."""
        k = int(np.searchsorted(self.mark_t, created, side="right"))
        return self.mark_s[k - 1] if k > 0 else (0 if self.has_marks else self.default_step)

    def fr_only(self, dump: dict[str, Any], names: dict[str, str]) -> list[dict[str, Any]]:
        """The dump's collectives the tracer did not see, one dict each (p2p skipped: the module says why);
        each is added to `seen` and `times`."""
        new: list[dict[str, Any]] = []
        for e in dump.get("entries", []):
            if not isinstance(e, dict) or e.get("is_p2p"):
                continue
            pname = str(e.get("profiling_name", ""))
            op = normalize_op(pname)
            if op in ("send", "recv", "isend", "irecv", "sendrecv"):
                continue
            pg = e.get("process_group")
            pg_name = str(pg[0]) if isinstance(pg, (list, tuple)) and pg else str(pg or "")
            group = names.get(pg_name, f"pg{pg_name}")
            try:
                seq = int(e.get("collective_seq_id", -1))
                created = int(e.get("time_created_ns", 0) or 0)
            except (TypeError, ValueError):
                continue
            if seq < 0 or (group, seq) in self.seen or created <= 0 or created >= self.barrier_from.get(group, 1 << 62):
                continue                   # after a monitored barrier FR's numbers no longer say which op is ours
            self.seen.add((group, seq))
            self.times.setdefault(group, []).append((seq, created))
            dt = e.get("input_dtypes") or []
            dtypes, nbytes = _dtype_and_bytes(e.get("input_sizes"), dt)
            new.append({"group": group, "seq": seq, "op": op, "created": created, "state": str(e.get("state", "")),
                        "completed": int(e.get("time_discovered_completed_ns") or 0),
                        "record": int(e.get("record_id", len(new)) or 0), "sizes": json.dumps(e.get("input_sizes", [])),
                        "dtypes": dtypes, "bytes": nbytes, "timeout_ms": int(e.get("timeout_ms", -1) or -1),
                        "site": _site(e.get("frames")), "backend": pname.partition(":")[0]})
        return new


def _later_creations(times: dict[str, list[tuple[int, int]]]) -> dict[str, tuple[list[int], list[int]]]:
    """Per group: its seqs sorted, and the earliest creation time at or after each position."""
    after: dict[str, tuple[list[int], list[int]]] = {}
    for g, lst in times.items():
        lst.sort()
        seqs = [q for q, _ in lst]
        suffix_min, cur = [0] * len(lst), None
        for i in range(len(lst) - 1, -1, -1):
            cur = lst[i][1] if cur is None else min(cur, lst[i][1])
            suffix_min[i] = cur
        after[g] = (seqs, suffix_min)
    return after


def _rows(new: list[dict[str, Any]], after: dict[str, tuple[list[int], list[int]]], ok_end: bool, traced: _Traced
          ) -> tuple[dict[str, list[Any]], dict[str, list[Any]]]:
    """The begin columns of every FR-only entry and the end columns of those that completed (said by FR,
    or inferred from a later op on the group or from the rank's clean exit: the module says why)."""
    begin_cols: dict[str, list[Any]] = {k: [] for k in (
        "op_id", "time_ns", "op_name", "process_group", "collective_seq_id", "bytes", "input_dtypes", "input_sizes",
        "timeout_ms", "call_site", "step")}
    end_cols: dict[str, list[Any]] = {k: [] for k in ("op_id", "time_ns", "op_name", "process_group",
                                                      "collective_seq_id", "message")}
    for r in new:
        seqs, suffix_min = after[r["group"]]
        i = bisect.bisect_right(seqs, r["seq"])
        later = suffix_min[i] if i < len(seqs) else None
        if r["state"] == "completed" and r["completed"] > 0:
            end_t, note = r["completed"], FR_MESSAGE
        elif later is not None:
            end_t, note = max(later, r["created"]), FR_MESSAGE + "; " + INFERRED + " from a later op"
        elif ok_end:
            end_t, note = r["created"], FR_MESSAGE + "; " + INFERRED + " from the rank's clean exit"
        else:
            end_t, note = -1, ""
        op_id = OP_ID_BASE + r["record"]
        step = traced.step_at(r["created"])
        for k, v in (("op_id", op_id), ("time_ns", r["created"]), ("op_name", r["op"]),
                     ("process_group", r["group"]), ("collective_seq_id", r["seq"]), ("bytes", r["bytes"]),
                     ("input_dtypes", r["dtypes"]), ("input_sizes", r["sizes"]), ("timeout_ms", r["timeout_ms"]),
                     ("call_site", r["site"]), ("step", step)):
            begin_cols[k].append(v)
        if end_t >= 0:
            for k, v in (("op_id", op_id), ("time_ns", end_t), ("op_name", r["op"]), ("process_group", r["group"]),
                         ("collective_seq_id", r["seq"]), ("message", note)):
                end_cols[k].append(v)
    return begin_cols, end_cols
