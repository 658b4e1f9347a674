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

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa

from ncclscope.load import safe_io
from ncclscope import schema as S
from ncclscope.load.heap import trim
from ncclscope.load.trace import RankInfo, Trace, TraceError, assemble
from ncclscope.load.foreign.fr_fixups import _group_members, _infer_gloo, _p2p_sequences, _parse_profiling_name, _peer
from ncclscope.load.foreign.fr_entries import Entries
from ncclscope.load.foreign.fr_groups import _config_disagreements, _group_rows
from ncclscope.load.foreign.fr_extras import DUMP_MARKER, _dump_markers, _stacks
from ncclscope.load.foreign.fr_memory import slim_tables
from ncclscope.load.foreign.fr_read import (SNIFF_BYTES, SUPPORTED_MAJOR, DumpBuffer, _factorize, call_site, dump_files, format_stack,
                      rank_from_name, read_dump, sniff)
from ncclscope.load.foreign.vocab import P2P_OPS, GroupNamer, coded, events_table, parse_ranks

__all__ = ["load_flight_recorder", "sniff", "rank_from_name", "dump_files", "read_dump", "call_site", "format_stack",
           "Entries", "SUPPORTED_MAJOR", "SNIFF_BYTES", "INFERRED_NOTE", "DUMP_MARKER"]

INFERRED_NOTE = "completion inferred: gloo Flight Recorder records none"
_SIZES_MAY_DIFFER = frozenset({"all_to_all", "all_to_all_single", "alltoall", "alltoall_base", "alltoallv", "scatter",
                               "gather", "all_gather_v", "reduce_scatter_v", "barrier", "monitored_barrier"})


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
        if rank is not None and rank > 4095:
            warnings.append(f"{root}: rank {rank} from the file name is not plausible for a single dump; read as rank 0")
            rank = None
        files = {rank if rank is not None else 0: (root, fmt)}
    else:
        raise TraceError(f"{root}: no such file or directory")

    dumps: dict[int, dict[str, Any]] = {}          # everything but the entries
    versions: dict[str, list[int]] = {}
    ents = Entries()
    buffer = DumpBuffer()                          # one read buffer for all the dumps
    for rank, (file, fmt) in sorted(files.items()):
        try:
            dump = read_dump(file, fmt, buffer)
        except TraceError as exc:
            if type(exc) is not TraceError:   # UnsafePickleError: refuse the whole input, loudly
                raise
            warnings.append(f"{exc}; rank {rank} treated as having no dump")
            continue
        try:
            ents.add(rank, dump.pop("entries"))
        except Exception as exc:   # noqa: BLE001 - a hostile field: this dump is lost, not the analysis
            warnings.append(f"{file}: entries unusable ({type(exc).__name__}: {safe_io.short(exc)}); "
                            f"rank {rank} treated as having no dump")
            continue
        dumps[rank] = dump
        versions.setdefault(str(dump.get("version", "?")), []).append(rank)
    del buffer
    if not dumps:
        raise TraceError(f"{root}: no readable Flight Recorder dump")
    for v, rs in versions.items():
        if v.split(".", 1)[0] != SUPPORTED_MAJOR:
            warnings.append(f"dump format version {v} (ranks {rs[:8]}): this reader knows {SUPPORTED_MAJOR}.x; "
                            "reading what it recognises")
    if len(versions) > 1:
        warnings.append(f"ranks wrote different dump versions: {sorted(versions)}")

    ents.finish()
    trim()             # the per-dump pieces' heap (~0.25 GB at 2 M entries) goes back before the next stage
    world = max(max(files) + 1, world_size or 0)
    cap = safe_io.plausible_world(1, len(files), max(max(files), world - 1))
    implausible: set[str] = set()
    for dump in dumps.values():
        cfg = dump.get("pg_config")
        if isinstance(cfg, dict):
            for pg_name, info in cfg.items():
                members = parse_ranks(info.get("ranks")) if isinstance(info, dict) else None
                if members and max(members) >= cap:     # 10**11: not a rank of a job with these dumps
                    implausible.add(safe_io.clean_text(pg_name)[:40])
                    info["ranks"] = []                   # the in-memory copy; the file is not touched
                elif members:
                    world = max(world, max(members) + 1)
    if implausible:
        names = sorted(implausible)
        warnings.append(f"pg_config of group(s) {', '.join(names[:8])}{' ...' if len(names) > 8 else ''} names "
                        f"ranks of {cap} or more next to {len(files)} dump(s); those member lists are ignored")
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
    if not world_size:      # a group completed with a rank that left no dump (fr_fixups._complete_groups)
        world = max([world] + [max(m) + 1 for m in pair_members if m])
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
    # per-rank minima in one pass each (a mask per rank was ranks x entries: minutes at 1,024 ranks)
    stats = ents.rank_stats            # per rank: (min record, min created, max created, max timeout, max record)
    first_record = {r: st[0] for r, st in sorted(stats.items())}
    wrapped = {r for r, v in first_record.items() if v > 0}
    first_created = {r: st[1] for r, st in sorted(stats.items())}
    coll = ~is_p2p
    first_seq: dict[tuple[int, int], int] = {}
    if wrapped:
        n_lab = max(len(labels), 1)        # one int64 key per (rank, group): a 2-key groupby costs ~5x more
        fs = pd.Series(ents.cseq[coll]).groupby(ents.rank[coll] * n_lab + label[coll]).min()
        first_seq = {(r, g): int(v) for r, g, v in zip((fs.index // n_lab).tolist(), (fs.index % n_lab).tolist(),
                                                        fs.tolist()) if r in wrapped}
    state_completed = np.array([st.lower() == "completed" for st in ents.states], dtype=bool)
    completed = state_completed[ents.state_code].copy() if len(ents.states) else np.zeros(n, bool)
    end_ns = np.where(ents.completed_ns > 0, ents.completed_ns, np.where(ents.started > 0, ents.started, ents.created))
    inferred = np.zeros(n, bool)
    gloo = pn_gloo[ents.pn_code] & coll & ~completed
    if gloo.any():
        g_idx = np.flatnonzero(gloo)
        # what must agree for an instance to complete: the op, and its size and dtype where those must match
        # (gloo aborts on a size mismatch; the members all "recorded" it but it never completed)
        fixed = ~np.isin(np.asarray(op_names, dtype=object)[op[g_idx]], list(_SIZES_MAY_DIFFER))
        agree = np.where(fixed, (ents.size_code[g_idx].astype(np.int64) * (len(ents.dtype_texts) + 1)
                                 + ents.dtype_code[g_idx] + 1) * (len(op_names) + 1), 0) + op[g_idx]
        c, e = _infer_gloo(ents.rank[g_idx], ents.thread_code[g_idx], ents.record_id[g_idx], ents.created[g_idx], label[g_idx],
                           ents.cseq[g_idx], agree, members_of_label, present, first_seq, wrapped)
        completed[g_idx] = c
        end_ns[g_idx] = np.maximum(e, ents.created[g_idx])
        inferred[g_idx] = c
        warnings.append(
            "gloo Flight Recorder dump: no op leaves state 'scheduled', so completion is inferred "
            "(a collective every member entered counts as completed; otherwise a later op on the same "
            "thread means it returned); see docs/ingest.md")
    del gloo

    # per-group trim of what a wrapped buffer no longer shows -----------------------------
    keep = np.ones(n, bool)
    if wrapped:
        # per group: the seq cut (the highest first seq a wrapped member still holds) and the time cut (the
        # latest first op of a wrapped member with nothing on the group); then one pass over the rows
        lo = np.iinfo(np.int64).min
        cut = np.full(len(members_of_label), lo, np.int64)
        t_cut = np.full(len(members_of_label), lo, np.int64)
        for g, mem in enumerate(members_of_label):
            w = [r for r in mem if r in wrapped]
            if not w:
                continue
            cut[g] = max((first_seq[(r, g)] for r in w if (r, g) in first_seq), default=lo)
            t_cut[g] = max((first_created[r] for r in w if (r, g) not in first_seq), default=lo)
        gmask = coll & completed
        lab = np.clip(label, 0, len(members_of_label) - 1)
        keep[gmask & (ents.cseq < cut[lab])] = False
        keep[gmask & (ents.created < t_cut[lab])] = False
        del gmask, lab

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

    # everything that needs the per-entry columns of every entry, then the rows ---------
    markers = _dump_markers(ents.rank_stats, files, present)
    stacks = _stacks(ents, ~completed, op_names, op, labels, label, peer, p2p_seq, is_p2p)
    backend_of_label: dict[str, str] = {}
    lab_first = np.unique(label, return_index=True)[1]
    for lc, i in zip(np.unique(label), lab_first):
        backend_of_label[labels[lc]] = backend_of_pn[ents.pn_code[i]]
    cols = {"rank": ents.rank, "op_id": ents.record_id, "kind": is_p2p, "op_name": op, "process_group": label,
            "collective_seq_id": ents.cseq, "p2p_seq_id": p2p_seq, "peer": peer, "bytes": ents.nbytes,
            "input_dtypes": ents.dtype_code, "input_sizes": ents.size_code, "timeout_ms": ents.timeout_ms,
            "call_site": ents.site_code, "time_ns": ents.created, "ended": completed, "end_ns": end_ns,
            "inferred": inferred}
    texts = {"op_name": op_names, "process_group": labels, "input_dtypes": ents.dtype_texts,
             "input_sizes": ents.size_texts, "call_site": ents.sites}
    # the per-entry columns are spent but for `cols`: free them before the tables are built (~0.4 GB at 2 M entries)
    del ents, label, op, is_p2p, completed, end_ns, inferred, p2p_seq, peer, coll, pair_code, pair_key, state_completed
    tables = _event_tables(cols, keep, texts)
    del cols, keep
    trim()
    tables.append(markers)

    ranks: dict[int, RankInfo] = {}
    for r in range(world):
        ranks[r] = RankInfo(rank=r, present=r in present)
    for r in range(world):
        if r not in files:
            warnings.append(f"rank {r}: no Flight Recorder dump (the rank died or never dumped); "
                            "analyzing the other ranks")
    group_rows = _group_rows(labels, members_of_label, info_of_label, present, backend_of_label)
    group_rows += _config_disagreements(dumps, set(labels), set(pair_pg))
    run = {
        "source": "flight_recorder", "format": sorted({fmt for _, fmt in files.values()}),
        "version": sorted(versions), "backend": ",".join(sorted(set(backend_of_pn) - {""})), "world_size": world,
        "dumps": {str(r): str(files[r][0]) for r in sorted(files)},
        "comm_lib_version": next((str(d.get("comm_lib_version", "")) for d in dumps.values()), ""),
    }
    return slim_tables(assemble(root, run, world, ranks, tables, None, None, group_rows, stacks, warnings))


def _kept(cols: dict[str, np.ndarray], keep: np.ndarray) -> dict[str, Any]:
    """The event columns of the kept entries, each source column dropped as soon as its kept copy
    is made (the peak is the kept columns plus what is left of the sources, not both in full)."""
    all_kept = bool(keep.all())
    kept = None if all_kept else np.flatnonzero(keep)
    out: dict[str, Any] = {}
    for name in list(cols):
        col = cols.pop(name)
        out[name] = col if all_kept else col[kept]
        del col
    return out


def _event_tables(cols: dict[str, np.ndarray], keep: np.ndarray, texts: dict[str, list[str]]) -> list[pa.Table]:
    """Begin rows for the kept entries, end rows for those that completed. String columns stay
    dictionary-encoded (codes into the few distinct values) up to trace.assemble; the end rows are
    the begin rows filtered, with their own phase, time, status and message."""
    c = _kept(cols, keep)
    n = len(c["rank"])
    is_p2p = c.pop("kind")
    common: dict[str, Any] = {
        "rank": c.pop("rank"), "op_id": c.pop("op_id"),
        "kind": coded(is_p2p.astype(np.int32), [S.KIND_COLLECTIVE, S.KIND_P2P], decode=False),
        "collective_seq_id": np.where(is_p2p, -1, c.pop("collective_seq_id")), "p2p_seq_id": c.pop("p2p_seq_id"),
        "peer": c.pop("peer"), "tag": np.where(is_p2p, 0, -1), "bytes": c.pop("bytes"),
        "timeout_ms": c.pop("timeout_ms"),
    }
    del is_p2p
    for name in ("op_name", "process_group", "input_dtypes", "input_sizes", "call_site"):
        common[name] = coded(c.pop(name), texts[name], decode=False)
    ended, end_ns, inferred = c.pop("ended"), c.pop("end_ns"), c.pop("inferred")
    begin = events_table({**common, "phase": S.PHASE_BEGIN, "time_ns": c.pop("time_ns")}, n, dictionary=True)
    del common
    end = begin.filter(pa.array(ended))
    m = end.num_rows
    note = coded(inferred[ended].astype(np.int32), ["", INFERRED_NOTE][:1 + int(inferred.any())], decode=False)
    own = events_table({"phase": S.PHASE_END, "time_ns": end_ns[ended], "status": S.STATUS_OK, "message": note}, m,
                       dictionary=True)
    for name in ("phase", "time_ns", "status", "message"):
        i = end.schema.get_field_index(name)
        end = end.set_column(i, own.schema.field(name), own.column(name))
    return [begin, end]
