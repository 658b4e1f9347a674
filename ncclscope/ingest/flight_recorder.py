"""PyTorch Flight Recorder dumps -> Trace.

    ncclscope analyze /tmp/fr_dumps/          # one dump per rank, pickle or JSON

What a dump is: one file per rank, written by the NCCL watchdog on a timeout
(TORCH_FR_DUMP_TEMP_FILE=<prefix>, the file is <prefix><rank>) or on demand
(`torch._C._distributed_c10d._dump_fr_trace()` returns the pickle,
`_dump_fr_trace_json()` the JSON). Format version 2.x: a dict with `version`,
`pg_config` ({pg_name: {name, desc, ranks}}), `pg_status` and `entries`, one
per recorded op: `record_id` (process-wide ring-buffer index), `process_group`
(pg_name, desc), `collective_seq_id`, `p2p_seq_id`, `profiling_name`
("nccl:all_reduce", "nccl:send 0->1"), `input_sizes`, `input_dtypes`,
`state` (scheduled | started | completed), `time_created_ns`,
`time_discovered_*_ns`, `timeout_ms`, `is_p2p`, `thread_id`, `frames`.

Mapping (see docs/ingest.md for the whole table):
- every entry -> a begin row at `time_created_ns`; a completed one also gets an
  end row at `time_discovered_completed_ns` (status ok); `scheduled`/`started`
  entries get none, i.e. they are in flight, which is the evidence of a hang;
- p2p entries (is_p2p, or nccl:send / nccl:recv) -> kind p2p with the peer's
  global rank and `p2p_seq_id` = the k-th op of this rank in that direction
  with that peer (how our runtime and `analysis/p2p.py` count), aligned between
  the two sides when a ring buffer wrapped (see `_p2p_sequences`);
- groups come from `pg_config` when it lists members; otherwise (gloo writes an
  empty pg_config) they are rebuilt from the entries: default_pg spans the
  world, any other group the ranks that recorded an op on it;
- a rank with no dump is RankInfo(present=False): the hang analysis treats it
  as dead, which is what a missing dump usually means.

Ring buffers wrap (2000 entries by default), and they wrap at different
points on different ranks, so alignment is per process group by
`collective_seq_id`, never by `record_id` (which is process-local). Completed
ops older than what every member of their group still holds are dropped, so
an evicted entry never reads as "rank r never joined"; in-flight ops are
always kept.

gloo records much less (platform-notes.md): no p2p, `state` stays
`scheduled`, no completion time. Completion is inferred, see `_infer_gloo`.
"""
from __future__ import annotations

import functools
import gc
import json
import operator
import re
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from .. import schema as S
from ..trace import RankInfo, Trace, TraceError, assemble
from . import (GroupNamer, P2P_OPS, coded, dtype_itemsize, events_table, group_kind, normalize_dtype, normalize_op,
               parse_ranks)
from .safe_pickle import safe_loads

SUPPORTED_MAJOR = "2"
SNIFF_BYTES = 65536
INFERRED_NOTE = "completion inferred: gloo Flight Recorder records none"
DUMP_MARKER = "flight_recorder_dump"
_RANK_RE = re.compile(r"(\d+)$")
_SUFFIXES = (".json", ".pkl", ".pickle", ".bin")


# --------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------
def sniff(path: Path) -> str | None:
    """"pickle" or "json" when the file looks like a Flight Recorder dump, else None.
    Reads the first 64 KiB only; nothing is unpickled."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(SNIFF_BYTES)
    except OSError:
        return None
    if len(head) > 2 and head[0] == 0x80 and 2 <= head[1] <= 5:
        if b"version" in head or b"entries" in head or b"pg_config" in head:
            return "pickle"
        return None
    text = head.lstrip()
    if text.startswith(b"{") and b'"entries"' in head and b'"traceEvents"' not in head:
        return "json"
    if head[:1] in (b"(", b"}", b"c") and b"entries" in head and (b"version" in head or b"pg_config" in head):
        return "pickle"            # protocol 0/1: no header; torch never writes these, an attacker might
    return None


def rank_from_name(name: str) -> int | None:
    """The rank in a dump's file name: trailing digits, as torch writes <prefix><rank>."""
    stem = name
    for suffix in _SUFFIXES:
        if stem.lower().endswith(suffix):
            stem = stem[: -len(suffix)]
            break
    m = _RANK_RE.search(stem)
    return int(m.group(1)) if m else None


def dump_files(directory: Path, warnings: list[str] | None = None) -> dict[int, tuple[Path, str]]:
    """rank -> (file, "pickle" | "json") for every dump in `directory` (not recursive).
    Where a rank has both, the pickle wins (only it carries stack frames)."""
    warn = warnings if warnings is not None else []
    found: dict[int, tuple[Path, str]] = {}
    for entry in sorted(directory.iterdir()):
        if entry.name.startswith(".") or not entry.is_file():
            continue
        fmt = sniff(entry)
        if fmt is None:
            continue
        rank = rank_from_name(entry.name)
        if rank is None:
            warn.append(f"{entry}: looks like a Flight Recorder dump but its name carries no rank; skipped")
            continue
        if rank in found:
            old_path, old_fmt = found[rank]
            if old_fmt == "json" and fmt == "pickle":
                found[rank] = (entry, fmt)
            elif old_fmt == fmt:
                warn.append(f"{entry}: a second dump for rank {rank} (also {old_path.name}); using {old_path.name}")
            continue
        found[rank] = (entry, fmt)
    return found


def read_dump(path: Path, fmt: str | None = None) -> dict[str, Any]:
    """One dump as a dict. Pickles go through the restricted unpickler
    (UnsafePickleError for anything but plain data); TraceError if unreadable."""
    fmt = fmt or sniff(path)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TraceError(f"{path}: unreadable ({exc.strerror or exc})") from None
    if fmt == "json":
        try:
            dump = json.loads(data)
        except ValueError as exc:
            raise TraceError(f"{path}: not valid JSON ({str(exc)[:120]})") from None
    else:
        dump = safe_loads(data, str(path))
    if not isinstance(dump, dict) or not isinstance(dump.get("entries", None), list):
        raise TraceError(f"{path}: not a Flight Recorder dump (no 'entries' list)")
    return dump


# --------------------------------------------------------------------------
# Entries -> columns
# --------------------------------------------------------------------------
def _int(value: Any, default: int = -1) -> int:
    if value is None or isinstance(value, bool):
        return default if value is None else int(value)
    try:
        return int(value)
    except (TypeError, ValueError):
        return default


_LIB_MARKERS = ("/torch/", "\\torch\\", "typing_extensions", "/site-packages/apex/")
_STDLIB_RE = re.compile(r"[/\\]lib[/\\]python\d+(\.\d+)?[/\\](?!site-packages|dist-packages)")


@functools.lru_cache(maxsize=65536)
def _is_library(filename: str) -> bool:
    return (not filename or filename.startswith("<") or any(m in filename for m in _LIB_MARKERS)
            or bool(_STDLIB_RE.search(filename)))


def _short_path(filename: str) -> str:
    parts = re.split(r"[/\\]", filename)
    return "/".join(parts[-2:]) if filename.startswith(("/", "\\")) or ":" in filename[:3] else filename


def call_site(frames: Any) -> str:
    """file:line of the first frame (innermost first, as FR stores them) outside torch and the stdlib."""
    if not isinstance(frames, (list, tuple)):
        return ""
    for fr in frames:
        if isinstance(fr, dict):
            fn = fr.get("filename", "")
            if not _is_library(fn if isinstance(fn, str) else str(fn)):
                return _site(str(fn), fr.get("line"))
    return ""


@functools.lru_cache(maxsize=65536)
def _site(filename: str, line: Any) -> str:
    return f"{_short_path(filename)}:{_int(line, 0)}"


def format_stack(frames: Any) -> str:
    """A Python-traceback-style rendering (outermost first) of FR frames."""
    if not isinstance(frames, (list, tuple)):
        return "  (no frames recorded)\n"
    lines = []
    for fr in reversed(frames):
        if isinstance(fr, dict):
            lines.append(f'  File "{fr.get("filename", "?")}", line {_int(fr.get("line"), 0)}, in {fr.get("name", "?")}')
    return "\n".join(lines) + "\n" if lines else "  (no frames recorded)\n"


def _ints(values: list[Any] | tuple[Any, ...], default: int) -> np.ndarray:
    """Ints (None / junk -> default) as int64; fast when they are ints or None."""
    try:
        return np.array(values, dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        pass
    try:
        return pd.array(list(values), dtype="Int64").fillna(default).to_numpy(np.int64)
    except (TypeError, ValueError, OverflowError):
        return np.array([_int(v, default) for v in values], dtype=np.int64)


_KEYS = ("record_id", "process_group", "collective_seq_id", "p2p_seq_id", "profiling_name", "input_sizes",
         "input_dtypes", "state", "time_created_ns", "time_discovered_started_ns", "time_discovered_completed_ns",
         "timeout_ms", "is_p2p", "thread_id", "frames")
_GET_ALL = operator.itemgetter(*_KEYS)


def _rows(entries: list[Any]) -> list[tuple[Any, ...]]:
    """One tuple of _KEYS values per entry: one C call each when every key is there
    (format 2.x as torch writes it), else a tolerant per-key path (older versions)."""
    try:
        return [_GET_ALL(e) for e in entries]
    except (KeyError, TypeError):
        out = []
        for e in entries:
            if isinstance(e, dict):
                row = [e.get(k) for k in _KEYS]
                if row[2] is None:
                    row[2] = e.get("seq_id")
                out.append(tuple(row))
        return out


def _factorize(values: list[Any]) -> tuple[np.ndarray, list[str]]:
    """Codes and distinct strings of a list of str-ish values (None -> "")."""
    arr = np.empty(len(values), dtype=object)
    arr[:] = values
    codes, uniq = pd.factorize(arr, use_na_sentinel=False)
    return codes.astype(np.int64), ["" if u is None else str(u) for u in uniq]


class Entries:
    """All entries of all ranks as columns: numbers as int64 arrays, strings as
    codes into small tables (a job has few distinct group names, op names,
    states, threads, call sites, shapes), no pandas string columns (they are
    what would make a million-entry load slow).

    Dumps are added one at a time (`add`) and reduced right away: one C-level
    tuple per entry, one transpose, call site and payload size worked out, and
    the stack frames kept only for entries that had not completed (the stacks
    a person reads). So peak memory is one unpickled dump plus compact arrays,
    not every dump's objects at once."""

    def __init__(self) -> None:
        self._parts: dict[str, list[Any]] = {k: [] for k in (
            "rank", "record_id", "cseq", "created", "started", "completed_ns", "timeout_ms", "is_p2p", "pg_name",
            "pg_desc", "pname", "state", "thread", "site", "size_text", "dtype_text", "nbytes")}
        self.frames: dict[tuple[int, int], Any] = {}     # (rank, record_id) -> frames, unfinished entries only
        self._bytes_cache: dict[tuple[str, str], tuple[str, int]] = {}

    def add(self, rank: int, entries: list[Any]) -> None:
        rows = _rows(entries)
        n = len(rows)
        if not n:
            return
        c = dict(zip(_KEYS, zip(*rows)))
        del rows
        pgs = c["process_group"]
        try:
            pg_name, pg_desc = zip(*pgs)
            if len(pg_name) != n:
                raise ValueError
        except (TypeError, ValueError):
            fixed = [pg if isinstance(pg, (list, tuple)) and len(pg) >= 2 else (str(pg or ""), "") for pg in pgs]
            pg_name, pg_desc = tuple(p[0] for p in fixed), tuple(p[1] for p in fixed)
        parts = self._parts
        parts["rank"].append(np.full(n, rank, np.int64))
        record = _ints(c["record_id"], -1)
        parts["record_id"].append(record)
        parts["cseq"].append(_ints(c["collective_seq_id"], -1))
        parts["created"].append(_ints(c["time_created_ns"], 0))
        parts["started"].append(_ints(c["time_discovered_started_ns"], 0))
        parts["completed_ns"].append(_ints(c["time_discovered_completed_ns"], 0))
        parts["timeout_ms"].append(_ints(c["timeout_ms"], -1))
        parts["is_p2p"].append(np.array([bool(v) for v in c["is_p2p"]], dtype=bool))
        for key, values in (("pg_name", pg_name), ("pg_desc", pg_desc), ("pname", c["profiling_name"]),
                            ("state", c["state"]), ("thread", c["thread_id"])):
            parts[key].extend(values)
        parts["site"].extend(call_site(f) for f in c["frames"])
        texts = [str(sz) if type(sz) is list else json.dumps(sz, default=str) for sz in c["input_sizes"]]
        cache = self._bytes_cache
        dtypes_out, nbytes = [], np.zeros(n, np.int64)
        for i, (text, sz, dt) in enumerate(zip(texts, c["input_sizes"], c["input_dtypes"])):
            key = (text, str(dt))
            hit = cache.get(key)
            if hit is None:
                hit = cache[key] = _dtype_and_bytes(sz, tuple(dt) if isinstance(dt, (list, tuple)) else (dt,))
            dtypes_out.append(hit[0])
            nbytes[i] = hit[1]
        parts["size_text"].extend(texts)
        parts["dtype_text"].extend(dtypes_out)
        parts["nbytes"].append(nbytes)
        for i, (st, fr) in enumerate(zip(c["state"], c["frames"])):
            if st != "completed" and fr:
                self.frames[(rank, int(record[i]))] = fr

    def finish(self) -> "Entries":
        parts = self._parts
        self.n = sum(len(a) for a in parts["rank"])

        def cat(key: str, dtype: Any) -> np.ndarray:
            return np.concatenate(parts[key]) if parts[key] else np.zeros(0, dtype)

        self.rank, self.record_id, self.cseq = cat("rank", np.int64), cat("record_id", np.int64), cat("cseq", np.int64)
        self.created, self.started = cat("created", np.int64), cat("started", np.int64)
        self.completed_ns, self.timeout_ms = cat("completed_ns", np.int64), cat("timeout_ms", np.int64)
        self.is_p2p, self.nbytes = cat("is_p2p", bool), cat("nbytes", np.int64)
        self.pg_code, self.pg_names = _factorize(parts["pg_name"])
        self.desc_code, self.descs = _factorize(parts["pg_desc"])
        self.pn_code, self.pnames = _factorize(parts["pname"])
        self.state_code, self.states = _factorize(parts["state"])
        self.thread_code, self.threads = _factorize(parts["thread"])
        self.site_code, self.sites = _factorize(parts["site"])
        self.size_code, self.size_texts = _factorize(parts["size_text"])
        self.dtype_code, self.dtype_texts = _factorize(parts["dtype_text"])
        self._parts = {}
        return self


def _dtype_and_bytes(sz: Any, dt: tuple[Any, ...]) -> tuple[str, int]:
    names = [normalize_dtype(d) for d in dt if str(d)]
    items = [dtype_itemsize(x) for x in names]
    total = 0
    if isinstance(sz, (list, tuple)):
        for j, shape in enumerate(sz):
            if isinstance(shape, (list, tuple)):
                m = 1
                for d in shape:
                    m *= _int(d, 0)
                total += m * (items[j] if j < len(items) else (items[0] if items else 0))
    # a corrupt or hostile dump must not overflow the int64 column
    return ",".join(dict.fromkeys(names)), min(max(total, 0), 2**62)


# --------------------------------------------------------------------------
# Groups
# --------------------------------------------------------------------------
def _group_members(pair_rank: list[int], pair_pg: list[str], pair_desc: list[str], dumps: dict[int, dict[str, Any]],
                   world: int, warnings: list[str]) -> list[tuple[int, ...]]:
    """Members of each distinct (rank, pg_name): from pg_config where it lists them
    (this rank's view, else the view most ranks wrote), else rebuilt from the
    entries (default_pg = the world, any other group = the ranks that used it)."""
    config: dict[tuple[int, str], tuple[int, ...]] = {}
    votes: dict[str, dict[tuple[int, ...], int]] = {}
    for rank, dump in dumps.items():
        cfg = dump.get("pg_config")
        if not isinstance(cfg, dict):
            continue
        for pg_name, info in cfg.items():
            members = parse_ranks(info.get("ranks")) if isinstance(info, dict) else None
            if members is None:
                continue
            config[(rank, str(pg_name))] = members
            votes.setdefault(str(pg_name), {}).setdefault(members, 0)
            votes[str(pg_name)][members] += 1
    users: dict[str, set[int]] = {}
    desc_of: dict[str, str] = {}
    for rank, pg, desc in zip(pair_rank, pair_pg, pair_desc):
        users.setdefault(pg, set()).add(rank)
        desc_of.setdefault(pg, desc)
    out: list[tuple[int, ...]] = []
    reconstructed = set()
    for rank, pg_name in zip(pair_rank, pair_pg):
        members = config.get((rank, pg_name))
        if members is None and pg_name in votes:        # another rank's view of the same group
            members = max(votes[pg_name].items(), key=lambda kv: kv[1])[0]
        if members is None:
            desc = desc_of[pg_name]
            if desc == "default_pg" or (pg_name == "0" and desc in ("", "undefined")):
                members = tuple(range(world))
            else:
                members = tuple(sorted(users[pg_name]))
            reconstructed.add(pg_name)
        out.append(members)
    if reconstructed:
        names = sorted(reconstructed, key=lambda n: (len(n), n))
        warnings.append(
            f"pg_config lists no members for group(s) {', '.join(names[:8])}"
            f"{' ...' if len(names) > 8 else ''}: members rebuilt from the entries (default_pg = all "
            f"{world} ranks; other groups = the ranks that recorded an op on them)")
    return out


def _parse_profiling_name(name: str) -> tuple[str, str, str]:
    """"nccl:send 0->1" -> ("nccl", "send", "0->1")."""
    backend, _, body = name.partition(":") if ":" in name else ("", "", name)
    return backend, normalize_op(body), body.partition(" ")[2]


def _peer(meta: str, direction: str, rank: int, members: tuple[int, ...]) -> int:
    """Global peer rank of a p2p entry: "send 0->1" / "recv 1<-0" name group-local ranks."""
    local = -1
    if "->" in meta:                                  # src->dst
        a, b = meta.split("->", 1)
        local = _int(b.strip()) if direction == "send" else _int(a.strip())
    elif "<-" in meta:                                # dst<-src
        a, b = meta.split("<-", 1)
        local = _int(b.strip()) if direction == "recv" else _int(a.strip())
    if local >= 0:
        ordered = sorted(members)
        return ordered[local] if local < len(ordered) else local
    if len(members) == 2 and rank in members:         # no peer written: a 2-rank group has one other
        return members[0] if members[1] == rank else members[1]
    return -1


# --------------------------------------------------------------------------
# Completion on gloo
# --------------------------------------------------------------------------
def _infer_gloo(rank: np.ndarray, thread: np.ndarray, record: np.ndarray, created: np.ndarray, label: np.ndarray,
                seq: np.ndarray, op: np.ndarray, members: list[tuple[int, ...]], present: set[int],
                first_seq: dict[tuple[int, int], int], wrapped: set[int]) -> tuple[np.ndarray, np.ndarray]:
    """(completed, end_ns) for gloo collective entries, whose state never leaves `scheduled`.
    `label` indexes `members`; `op` is an op-name code.

    Two facts a gloo dump does support:
    (a) every member of a group recorded instance #k with the same op: all of
        them arrived, so it could complete (gloo pairs ranks by the per-group
        sequence number); one member missing it means it cannot have completed;
    (b) a rank recorded a later op on the same thread: its (blocking) call of
        #k returned.
    (a) decides whenever every member's dump exists and still holds #k;
    otherwise (b) decides. End time: the last member's arrival for (a), the
    next op's creation for (b). pg_status is no help: gloo reports every
    enqueued collective as completed.
    """
    n = len(rank)
    if n == 0:
        return np.zeros(0, bool), np.zeros(0, np.int64)
    order = np.lexsort((record, thread, rank))
    r_o, th_o, cr_o = rank[order], thread[order], created[order]
    same_next = np.zeros(n, bool)
    same_next[:-1] = (r_o[1:] == r_o[:-1]) & (th_o[1:] == th_o[:-1])
    next_created = np.full(n, -1, np.int64)
    next_created[:-1] = cr_o[1:]
    later = np.empty(n, bool)
    later[order] = same_next
    later_t = np.empty(n, np.int64)
    later_t[order] = np.where(same_next, next_created, -1)

    inst = pd.DataFrame({"g": label, "s": seq, "r": rank, "o": op, "t": created}).groupby(["g", "s"], sort=False)
    n_rec = inst["r"].transform("nunique").to_numpy()
    n_ops = inst["o"].transform("nunique").to_numpy()
    last_arrival = inst["t"].transform("max").to_numpy()
    n_members = np.array([len(m) for m in members], dtype=np.int64)[label]
    decidable = np.ones(n, bool)
    for g in np.unique(label):
        mem = members[g]
        mask = label == g
        if not mem or any(r not in present for r in mem):
            decidable[mask] = False
            continue
        for r in mem:
            if r in wrapped:
                first = first_seq.get((r, int(g)))
                if first is None:
                    decidable[mask] = False
                else:
                    decidable[mask & (seq < first)] = False
    all_in = (n_rec >= n_members) & (n_ops == 1)
    completed = np.where(decidable, all_in, later)
    end = np.where(decidable, last_arrival, later_t)
    return completed, end.astype(np.int64)


# --------------------------------------------------------------------------
# p2p sequence numbers
# --------------------------------------------------------------------------
def _score(t_send: np.ndarray, t_recv: np.ndarray, s: int) -> tuple[float, int, float] | None:
    """How well send i pairs with recv i - s: dispersion of the completion-time
    differences (a clock offset shifts them all alike), then overlap, then offset."""
    ns, nr = len(t_send), len(t_recv)
    i0, j0 = max(0, s), max(0, -s)
    m = min(ns - i0, nr - j0)
    if m <= 0:
        return None
    d = t_send[i0:i0 + m] - t_recv[j0:j0 + m]
    d = d[~np.isnan(d)]
    if not len(d):
        return None
    med = float(np.median(d))
    return (float(np.median(np.abs(d - med))) if len(d) > 1 else float("inf"), -len(d), abs(med))


def _best_shift(t_send: np.ndarray, t_recv: np.ndarray) -> int | None:
    """Shift s such that send i pairs with recv i - s (completion times, NaN where
    not completed). Candidates come from nearest-in-time neighbours (O(n log n));
    the few most common are scored by `_score`. None when nothing overlaps."""
    ok_s, ok_r = ~np.isnan(t_send), ~np.isnan(t_recv)
    if not ok_s.any() or not ok_r.any():
        return None
    i_s, i_r = np.flatnonzero(ok_s), np.flatnonzero(ok_r)
    ts = t_send[i_s]
    order = np.argsort(ts, kind="stable")
    pos = np.clip(np.searchsorted(ts[order], t_recv[i_r]), 0, len(ts) - 1)
    left = np.clip(pos - 1, 0, len(ts) - 1)
    nearer = np.where(np.abs(ts[order][left] - t_recv[i_r]) < np.abs(ts[order][pos] - t_recv[i_r]), left, pos)
    cand = i_s[order][nearer] - i_r
    values, counts = np.unique(cand, return_counts=True)
    top = values[np.argsort(-counts, kind="stable")][:3]
    shifts = sorted({int(c) + k for c in top for k in (-2, -1, 0, 1, 2)})
    scored = [(sc, s) for s in shifts if (sc := _score(t_send, t_recv, s)) is not None]
    return min(scored)[1] if scored else None


def _p2p_sequences(rank: np.ndarray, record: np.ndarray, is_send: np.ndarray, peer: np.ndarray, ended: np.ndarray,
                   end_ns: np.ndarray, created: np.ndarray, wrapped: set[int], first_created: dict[int, int],
                   warnings: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(p2p_seq_id, keep) for p2p entries: the k-th op of a rank in a direction
    with a peer, counted in record order (how our runtime and analysis/p2p.py
    count). When a side's ring buffer wrapped, its count does not start at the
    true first op; the two sides of the pair are then aligned by their
    completion times (`_best_shift`), and completed ops on the other side
    older than anything the wrapped side still holds are dropped (in-flight
    ones are always kept)."""
    n = len(rank)
    seq = np.full(n, -1, np.int64)
    keep = np.ones(n, bool)
    valid = peer >= 0
    if not valid.any():
        return seq, keep
    order = np.lexsort((record, rank))
    order = order[valid[order]]
    k = pd.DataFrame({"r": rank[order], "d": is_send[order], "p": peer[order]}).groupby(
        ["r", "d", "p"], sort=False).cumcount().to_numpy() + 1
    seq[order] = k
    src, dst = np.where(is_send, rank, peer), np.where(is_send, peer, rank)
    wr = np.array(sorted(wrapped), dtype=np.int64)
    touched = valid & (np.isin(src, wr) | np.isin(dst, wr))
    if not touched.any():
        return seq, keep
    end_f = end_ns.astype(np.float64)
    pos_all = np.flatnonzero(touched)
    pairs = pd.DataFrame({"a": src[pos_all], "b": dst[pos_all], "i": pos_all}).groupby(["a", "b"], sort=False)["i"]
    for (a, b), idx in pairs:
        idx = np.sort(idx.to_numpy())
        s_pos = idx[is_send[idx] & (rank[idx] == a)]
        r_pos = idx[~is_send[idx] & (rank[idx] == b)]
        s_pos = s_pos[np.argsort(seq[s_pos], kind="stable")]
        r_pos = r_pos[np.argsort(seq[r_pos], kind="stable")]
        if len(s_pos) and len(r_pos):
            shift = _best_shift(np.where(ended[s_pos], end_f[s_pos], np.nan), np.where(ended[r_pos], end_f[r_pos], np.nan))
            if shift is None:
                warnings.append(f"p2p {a}->{b}: a ring buffer wrapped and no completed ops overlap; "
                                "send/recv counted from the oldest op each side still holds (may not line up)")
                shift = 0
            seq[s_pos] += max(0, -shift)
            seq[r_pos] += max(0, shift)
            if b in wrapped:
                keep[s_pos[(seq[s_pos] < seq[r_pos].min()) & ended[s_pos]]] = False
            if a in wrapped:
                keep[r_pos[(seq[r_pos] < seq[s_pos].min()) & ended[r_pos]]] = False
        else:   # one side holds nothing of this pair: drop what the other did before its window
            if len(s_pos) and b in wrapped:
                keep[s_pos[(created[s_pos] < first_created.get(int(b), 0)) & ended[s_pos]]] = False
            if len(r_pos) and a in wrapped:
                keep[r_pos[(created[r_pos] < first_created.get(int(a), 0)) & ended[r_pos]]] = False
    return seq, keep


# --------------------------------------------------------------------------
# Loader
# --------------------------------------------------------------------------
def load_flight_recorder(path: str | Path, world_size: int | None = None) -> Trace:
    """Load a directory of per-rank Flight Recorder dumps (or one dump file).

    `world_size` overrides what the dumps imply (the largest rank seen, the
    members of default_pg); give it when the highest ranks' dumps are missing
    on gloo, whose dumps do not list group members."""
    enabled = gc.isenabled()
    gc.disable()            # millions of small containers, no cycles: the collector only costs time
    try:
        return _load(path, world_size)
    finally:
        if enabled:
            gc.enable()


def _load(path: str | Path, world_size: int | None) -> Trace:
    root = Path(path)
    warnings: list[str] = []
    if root.is_dir():
        files = dump_files(root, warnings)
        if not files:
            raise TraceError(f"{root}: no Flight Recorder dumps (files named <prefix><rank>, pickle or JSON)")
    elif root.is_file():
        fmt = sniff(root)
        rank = rank_from_name(root.name)
        if fmt is None:
            raise TraceError(f"{root}: not a Flight Recorder dump")
        files = {rank if rank is not None else 0: (root, fmt)}
    else:
        raise TraceError(f"{root}: no such file or directory")

    dumps: dict[int, dict[str, Any]] = {}          # everything but the entries
    versions: dict[str, list[int]] = {}
    ents = Entries()
    for rank, (file, fmt) in sorted(files.items()):
        try:
            dump = read_dump(file, fmt)
        except TraceError as exc:
            if type(exc) is not TraceError:   # UnsafePickleError: refuse the whole input, loudly
                raise
            warnings.append(f"{exc}; rank {rank} treated as having no dump")
            continue
        ents.add(rank, dump.pop("entries"))
        dumps[rank] = dump
        versions.setdefault(str(dump.get("version", "?")), []).append(rank)
    if not dumps:
        raise TraceError(f"{root}: no readable Flight Recorder dump")
    for v, rs in versions.items():
        if v.split(".", 1)[0] != SUPPORTED_MAJOR:
            warnings.append(f"dump format version {v} (ranks {rs[:8]}): this reader knows {SUPPORTED_MAJOR}.x; "
                            "reading what it recognises")
    if len(versions) > 1:
        warnings.append(f"ranks wrote different dump versions: {sorted(versions)}")

    ents.finish()
    world = max(max(files) + 1, world_size or 0)
    for dump in dumps.values():
        cfg = dump.get("pg_config")
        if isinstance(cfg, dict):
            for info in cfg.values():
                members = parse_ranks(info.get("ranks")) if isinstance(info, dict) else None
                if members:
                    world = max(world, max(members) + 1)
    if world_size:
        world = world_size
    if not ents.n:
        warnings.append(f"{root}: the dumps hold no entries (Flight Recorder off, or nothing ran yet)")
        ranks = {r: RankInfo(rank=r, present=r in dumps) for r in range(world)}
        return assemble(root, {"source": "flight_recorder", "world_size": world}, world, ranks, [], None, None,
                        [], {}, warnings)
    n = ents.n

    # op names, backends, p2p direction: once per distinct profiling name ---------------
    parsed = [_parse_profiling_name(x) for x in ents.pnames]
    op_code, op_names = _factorize([p[1] for p in parsed])
    op = op_code[ents.pn_code]                           # op_code: op_names index per profiling-name code
    op_is_p2p = np.array([o in P2P_OPS for o in op_names], dtype=bool)
    op_is_send = np.array([o.endswith("send") for o in op_names], dtype=bool)
    op_is_recv = np.array([o.endswith("recv") for o in op_names], dtype=bool)
    is_p2p = ents.is_p2p | op_is_p2p[op]
    pn_gloo = np.array([p[0] == "gloo" for p in parsed], dtype=bool)
    backend_of_pn = [p[0] for p in parsed]

    # groups: once per distinct (rank, pg name) -----------------------------------------
    n_pg = max(len(ents.pg_names), 1)
    pair_key = ents.rank * n_pg + ents.pg_code
    pair_uniq, first, pair_code = np.unique(pair_key, return_index=True, return_inverse=True)
    pair_rank = (pair_uniq // n_pg).astype(int).tolist()
    pair_pg = [ents.pg_names[i] for i in (pair_uniq % n_pg)]
    pair_desc = [ents.descs[i] for i in ents.desc_code[first]]
    pair_members = _group_members(pair_rank, pair_pg, pair_desc, dumps, world, warnings)
    namer = GroupNamer(zip(pair_pg, pair_desc, pair_members))
    label_code_of_pair, labels = _factorize([namer(g, d, m) for g, d, m in zip(pair_pg, pair_desc, pair_members)])
    label = label_code_of_pair[pair_code]
    members_of_label: list[tuple[int, ...]] = [()] * len(labels)
    info_of_label: list[tuple[str, str]] = [("", "")] * len(labels)
    for i, lc in enumerate(label_code_of_pair):
        if not members_of_label[lc]:
            members_of_label[lc] = pair_members[i]
            info_of_label[lc] = (pair_pg[i], pair_desc[i])

    # peers: once per distinct (profiling name, rank, pg) among p2p entries ---------------
    peer = np.full(n, -1, np.int64)
    p2p_idx = np.flatnonzero(is_p2p)
    if len(p2p_idx):
        combo = ents.pn_code[p2p_idx] * len(pair_uniq) + pair_code[p2p_idx]
        _, cfirst, cinv = np.unique(combo, return_index=True, return_inverse=True)
        vals = []
        for i in p2p_idx[cfirst]:
            pn, pc = int(ents.pn_code[i]), int(pair_code[i])
            direction = "send" if op_is_send[op[i]] else "recv"
            vals.append(_peer(parsed[pn][2], direction, pair_rank[pc], pair_members[pc]))
        peer[p2p_idx] = np.array(vals, dtype=np.int64)[cinv]

    # completion ----------------------------------------------------------------------
    present = set(dumps)
    rank_ids = np.unique(ents.rank)
    first_record = {int(r): int(ents.record_id[ents.rank == r].min()) for r in rank_ids}
    wrapped = {r for r, v in first_record.items() if v > 0}
    first_created = {int(r): int(ents.created[ents.rank == r].min()) for r in rank_ids}
    coll = ~is_p2p
    first_seq: dict[tuple[int, int], int] = {}
    if wrapped:
        fs = pd.DataFrame({"r": ents.rank[coll], "g": label[coll], "s": ents.cseq[coll]}).groupby(["r", "g"])["s"].min()
        first_seq = {(int(r), int(g)): int(v) for (r, g), v in fs.items() if int(r) in wrapped}
    state_completed = np.array([st.lower() == "completed" for st in ents.states], dtype=bool)
    completed = state_completed[ents.state_code].copy() if len(ents.states) else np.zeros(n, bool)
    end_ns = np.where(ents.completed_ns > 0, ents.completed_ns, np.where(ents.started > 0, ents.started, ents.created))
    inferred = np.zeros(n, bool)
    gloo = pn_gloo[ents.pn_code] & coll & ~completed
    if gloo.any():
        g_idx = np.flatnonzero(gloo)
        c, e = _infer_gloo(ents.rank[g_idx], ents.thread_code[g_idx], ents.record_id[g_idx], ents.created[g_idx], label[g_idx],
                           ents.cseq[g_idx], op[g_idx], members_of_label, present, first_seq, wrapped)
        completed[g_idx] = c
        end_ns[g_idx] = np.maximum(e, ents.created[g_idx])
        inferred[g_idx] = c
        warnings.append(
            "gloo Flight Recorder dump: no op leaves state 'scheduled', so completion is inferred "
            "(a collective every member entered counts as completed; otherwise a later op on the same "
            "thread means it returned); see docs/ingest.md")

    # per-group trim of what a wrapped buffer no longer shows -----------------------------
    keep = np.ones(n, bool)
    if wrapped:
        for g, mem in enumerate(members_of_label):
            w = [r for r in mem if r in wrapped]
            if not w:
                continue
            gmask = coll & (label == g) & completed
            cut = max((first_seq[(r, g)] for r in w if (r, g) in first_seq), default=None)
            if cut is not None:
                keep[gmask & (ents.cseq < cut)] = False
            t_cut = max((first_created[r] for r in w if (r, g) not in first_seq), default=None)
            if t_cut is not None:
                keep[gmask & (ents.created < t_cut)] = False

    # p2p sequence numbers ------------------------------------------------------------
    p2p_seq = np.full(n, -1, np.int64)
    if len(p2p_idx):
        i = p2p_idx
        s, k = _p2p_sequences(ents.rank[i], ents.record_id[i], op_is_send[op[i]], peer[i], completed[i], end_ns[i],
                              ents.created[i], wrapped, first_created, warnings)
        p2p_seq[i] = s
        keep[i] &= k
        bad = ~(op_is_send[op[i]] | op_is_recv[op[i]])
        p2p_seq[i[bad]] = -1
    if wrapped:
        warnings.append(
            f"ring buffer wrapped on rank(s) {sorted(wrapped)[:16]}{' ...' if len(wrapped) > 16 else ''}: ops are "
            f"aligned per process group by collective_seq_id; {int((~keep).sum())} completed op(s) older than "
            "what every member still holds were dropped")

    # rows ----------------------------------------------------------------------------
    kept = np.flatnonzero(keep)
    common = {
        "rank": ents.rank[kept], "op_id": ents.record_id[kept],
        "kind": coded(is_p2p[kept].astype(np.int32), [S.KIND_COLLECTIVE, S.KIND_P2P]),
        "op_name": coded(op[kept], op_names), "process_group": coded(label[kept], labels),
        "collective_seq_id": np.where(is_p2p[kept], -1, ents.cseq[kept]), "p2p_seq_id": p2p_seq[kept],
        "peer": peer[kept], "tag": np.where(is_p2p[kept], 0, -1), "bytes": ents.nbytes[kept],
        "input_dtypes": coded(ents.dtype_code[kept], ents.dtype_texts),
        "input_sizes": coded(ents.size_code[kept], ents.size_texts),
        "timeout_ms": ents.timeout_ms[kept], "call_site": coded(ents.site_code[kept], ents.sites),
    }
    tables = _event_tables(common, ents.created[kept], completed[kept], end_ns[kept], inferred[kept])
    tables.append(_dump_markers(ents, files, present))
    stacks = _stacks(ents, ~completed, op_names, op, labels, label, peer, p2p_seq, is_p2p)

    ranks: dict[int, RankInfo] = {}
    for r in range(world):
        ranks[r] = RankInfo(rank=r, present=r in present)
    for r in range(world):
        if r not in files:
            warnings.append(f"rank {r}: no Flight Recorder dump (the rank died or never dumped); "
                            "analyzing the other ranks")
    backend_of_label: dict[str, str] = {}
    lab_first = np.unique(label, return_index=True)[1]
    for lc, i in zip(np.unique(label), lab_first):
        backend_of_label[labels[lc]] = backend_of_pn[ents.pn_code[i]]
    group_rows = _group_rows(labels, members_of_label, info_of_label, present, backend_of_label)
    run = {
        "source": "flight_recorder", "format": sorted({fmt for _, fmt in files.values()}),
        "version": sorted(versions), "backend": ",".join(sorted(set(backend_of_pn) - {""})), "world_size": world,
        "dumps": {str(r): str(files[r][0]) for r in sorted(files)},
        "comm_lib_version": next((str(d.get("comm_lib_version", "")) for d in dumps.values()), ""),
    }
    return assemble(root, run, world, ranks, tables, None, None, group_rows, stacks, warnings)


def _event_tables(common: dict[str, Any], created: np.ndarray, ended: np.ndarray, end_ns: np.ndarray,
                  inferred: np.ndarray) -> list[pa.Table]:
    begin = events_table({**common, "phase": S.PHASE_BEGIN, "time_ns": created}, len(created))
    mask = pa.array(ended)
    e = {k: (v.filter(mask) if isinstance(v, pa.Array) else v[ended] if np.ndim(v) else v) for k, v in common.items()}
    end = events_table({**e, "phase": S.PHASE_END, "time_ns": end_ns[ended], "status": S.STATUS_OK,
                        "message": np.where(inferred[ended], INFERRED_NOTE, "").astype(object)}, int(ended.sum()))
    return [begin, end]


def _dump_markers(ents: Entries, files: dict[int, tuple[Path, str]], present: set[int]) -> pa.Table:
    """One marker row per rank at its dump file's mtime: when the dump was taken, so a
    waiter's "waiting since" has an end. Dumps carry no timestamp of their own; an mtime
    outside [last op, last op + 2 x timeout + 10 min] (a copied file) is not trusted."""
    rows: dict[str, list[Any]] = {"rank": [], "op_id": [], "time_ns": [], "message": []}
    for r in sorted(present):
        mine = ents.rank == r
        if not mine.any():
            continue
        last = int(ents.created[mine].max())
        try:
            mtime = files[r][0].stat().st_mtime_ns
        except OSError:
            continue
        window = (2 * max(int(ents.timeout_ms[mine].max()), 0) + 600_000) * 1_000_000
        if last <= mtime <= last + window:
            rows["rank"].append(r)
            rows["op_id"].append(int(ents.record_id[mine].max()) + 1)
            rows["time_ns"].append(mtime)
            rows["message"].append(f"Flight Recorder dump {files[r][0].name} written (file mtime)")
    return events_table({**rows, "phase": S.PHASE_INSTANT, "kind": S.KIND_MARKER, "op_name": DUMP_MARKER},
                        len(rows["rank"]))


def _stacks(ents: Entries, pending: np.ndarray, op_names: list[str], op: np.ndarray, labels: list[str],
            label: np.ndarray, peer: np.ndarray, p2p_seq: np.ndarray, is_p2p: np.ndarray) -> dict[int, str]:
    """Per rank: the recorded stacks of its in-flight ops (newest last, at most 4)."""
    out: dict[int, str] = {}
    for r in np.unique(ents.rank[pending]):
        idx = np.flatnonzero(pending & (ents.rank == r))
        idx = idx[np.argsort(ents.record_id[idx], kind="stable")][-4:]
        parts = []
        for i in idx:
            seq = p2p_seq[i] if is_p2p[i] else ents.cseq[i]
            what = f"{op_names[op[i]]} #{seq} on {labels[label[i]]}" + (f" peer {peer[i]}" if peer[i] >= 0 else "")
            parts.append(f"Flight Recorder: {what} (record {ents.record_id[i]}, state {ents.states[ents.state_code[i]] or '?'}, "
                         f"thread {ents.threads[ents.thread_code[i]] or '?'}) was created here:\n"
                         f"{format_stack(ents.frames.get((int(ents.rank[i]), int(ents.record_id[i]))))}")
        out[int(r)] = "\n".join(parts)
    return out


def _group_rows(labels: list[str], members: list[tuple[int, ...]], info: list[tuple[str, str]], present: set[int],
                backend_of: dict[str, str]) -> list[dict[str, Any]]:
    """Group table rows: every present member's view (all alike: FR has one view per group)."""
    order = sorted(range(len(labels)), key=lambda i: (_order_key(info[i][0]), labels[i]))
    rows = []
    for pos, i in enumerate(order):
        lab, mem = labels[i], members[i]
        kind = group_kind(info[i][1], lab)
        for r in mem:
            if r in present:
                rows.append({"rank": r, "process_group": lab, "group_kind": kind, "ranks": [int(x) for x in mem],
                             "creation_order": pos, "backend": str(backend_of.get(lab, ""))})
    return rows


def _order_key(name: str) -> tuple[int, Any]:
    return (0, int(name)) if str(name).isdigit() else (1, str(name))
