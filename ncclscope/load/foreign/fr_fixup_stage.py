"""Stage 2 of the Flight Recorder loader (read -> fix up -> assemble): per-entry columns a dump does not
hold directly, vectorised over all entries of all ranks.

`FixedUp(ents, dumps, world, world_size, warnings)` computes, in order:
- op names, backends and p2p direction, once per distinct profiling name;
- groups: one label per distinct (rank, pg name), with its members (`fr_fixups.group_members`);
- peers of p2p entries, once per distinct (profiling name, rank, pg);
- completion, with gloo's inferred (`fr_fixups.infer_gloo`);
- the per-group trim of what a wrapped ring buffer no longer shows (module docstring of
  `flight_recorder`);
- p2p sequence numbers (`fr_fixups.p2p_sequences`).
Warnings are appended in that order. Stage 3 (`flight_recorder._assemble`) turns the result into rows.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ncclscope.load.foreign.fr_entries import Entries
from ncclscope.load.foreign.fr_fixups import group_members, infer_gloo, p2p_sequences, parse_profiling_name, peer_of
from ncclscope.load.foreign.fr_read import factorize_texts
from ncclscope.load.foreign.vocab import P2P_OPS, GroupNamer

_SIZES_MAY_DIFFER = frozenset({"all_to_all", "all_to_all_single", "alltoall", "alltoall_base", "alltoallv", "scatter",
                               "gather", "all_gather_v", "reduce_scatter_v", "barrier", "monitored_barrier"})


class FixedUp:
    """The fixed-up per-entry columns of `ents` (arrays of length ents.n) and the per-group tables."""

    def __init__(self, ents: Entries, dumps: dict[int, dict[str, Any]], world: int, world_size: int | None,
                 warnings: list[str]) -> None:
        self.warnings = warnings
        self.present = set(dumps)
        self._ops(ents)
        self.world = self._groups(ents, dumps, world, world_size)
        self._peers(ents)
        self._completion(ents)
        self._trim_wrapped(ents)
        self._p2p(ents)

    def _ops(self, ents: Entries) -> None:
        """op names, backends, p2p direction: once per distinct profiling name."""
        self.parsed = parsed = [parse_profiling_name(x) for x in ents.pnames]
        op_code, self.op_names = factorize_texts([p[1] for p in parsed])
        self.op = op_code[ents.pn_code]                      # op_code: op_names index per profiling-name code
        op_is_p2p = np.array([o in P2P_OPS for o in self.op_names], dtype=bool)
        self.op_is_send = np.array([o.endswith("send") for o in self.op_names], dtype=bool)
        self.op_is_recv = np.array([o.endswith("recv") for o in self.op_names], dtype=bool)
        self.is_p2p = ents.is_p2p | op_is_p2p[self.op]
        self.pn_gloo = np.array([p[0] == "gloo" for p in parsed], dtype=bool)
        self.backend_of_pn = [p[0] for p in parsed]

    def _groups(self, ents: Entries, dumps: dict[int, dict[str, Any]], world: int, world_size: int | None) -> int:
        """groups: once per distinct (rank, pg name). Returns the world, grown by a completed group."""
        n_pg = max(len(ents.pg_names), 1)
        pair_key = ents.rank * n_pg + ents.pg_code
        self.pair_uniq, first, self.pair_code = np.unique(pair_key, return_index=True, return_inverse=True)
        del pair_key
        self.pair_rank = (self.pair_uniq // n_pg).astype(int).tolist()
        self.pair_pg = [ents.pg_names[i] for i in (self.pair_uniq % n_pg)]
        pair_desc = [ents.descs[i] for i in ents.desc_code[first]]
        self.pair_members = pm = group_members(self.pair_rank, self.pair_pg, pair_desc, dumps, world, self.warnings)
        if not world_size:      # a group completed with a rank that left no dump (fr_fixups.complete_groups)
            world = max([world] + [max(m) + 1 for m in pm if m])
        namer = GroupNamer(zip(self.pair_pg, pair_desc, pm))
        label_code_of_pair, self.labels = factorize_texts([namer(g, d, m) for g, d, m in zip(self.pair_pg, pair_desc, pm)])
        self.label = label_code_of_pair[self.pair_code]
        self.members_of_label: list[tuple[int, ...]] = [()] * len(self.labels)
        self.info_of_label: list[tuple[str, str]] = [("", "")] * len(self.labels)
        for i, lc in enumerate(label_code_of_pair):
            if not self.members_of_label[lc]:
                self.members_of_label[lc] = pm[i]
                self.info_of_label[lc] = (self.pair_pg[i], pair_desc[i])
        return world

    def _peers(self, ents: Entries) -> None:
        """peers: once per distinct (profiling name, rank, pg) among p2p entries."""
        self.peer = np.full(ents.n, -1, np.int64)
        self.p2p_idx = p2p_idx = np.flatnonzero(self.is_p2p)
        if len(p2p_idx):
            combo = ents.pn_code[p2p_idx] * len(self.pair_uniq) + self.pair_code[p2p_idx]
            _, cfirst, cinv = np.unique(combo, return_index=True, return_inverse=True)
            vals = []
            for i in p2p_idx[cfirst]:
                pn, pc = int(ents.pn_code[i]), int(self.pair_code[i])
                direction = "send" if self.op_is_send[self.op[i]] else "recv"
                vals.append(peer_of(self.parsed[pn][2], direction, self.pair_rank[pc], self.pair_members[pc]))
            self.peer[p2p_idx] = np.array(vals, dtype=np.int64)[cinv]

    def _completion(self, ents: Entries) -> None:
        """completed / end_ns / inferred per entry, and the ring-buffer facts the later steps need."""
        n = ents.n
        # per-rank minima in one pass each (a mask per rank was ranks x entries: minutes at 1,024 ranks)
        stats = ents.rank_stats        # per rank: (min record, min created, max created, max timeout, max record)
        first_record = {r: st[0] for r, st in sorted(stats.items())}
        self.wrapped = wrapped = {r for r, v in first_record.items() if v > 0}
        self.first_created = {r: st[1] for r, st in sorted(stats.items())}
        self.coll = coll = ~self.is_p2p
        self.first_seq: dict[tuple[int, int], int] = {}
        if wrapped:
            n_lab = max(len(self.labels), 1)   # one int64 key per (rank, group): a 2-key groupby costs ~5x more
            fs = pd.Series(ents.cseq[coll]).groupby(ents.rank[coll] * n_lab + self.label[coll]).min()
            self.first_seq = {(r, g): int(v) for r, g, v in zip((fs.index // n_lab).tolist(),
                                                                 (fs.index % n_lab).tolist(), fs.tolist())
                              if r in wrapped}
        state_completed = np.array([st.lower() == "completed" for st in ents.states], dtype=bool)
        self.completed = state_completed[ents.state_code].copy() if len(ents.states) else np.zeros(n, bool)
        self.end_ns = np.where(ents.completed_ns > 0, ents.completed_ns,
                               np.where(ents.started > 0, ents.started, ents.created))
        self.inferred = np.zeros(n, bool)
        gloo = self.pn_gloo[ents.pn_code] & coll & ~self.completed
        if gloo.any():
            self._infer_gloo(ents, np.flatnonzero(gloo))

    def _infer_gloo(self, ents: Entries, g_idx: np.ndarray) -> None:
        op, op_names = self.op, self.op_names
        # what must agree for an instance to complete: the op, and its size and dtype where those must match
        # (gloo aborts on a size mismatch; the members all "recorded" it but it never completed)
        fixed = ~np.isin(np.asarray(op_names, dtype=object)[op[g_idx]], list(_SIZES_MAY_DIFFER))
        agree = np.where(fixed, (ents.size_code[g_idx].astype(np.int64) * (len(ents.dtype_texts) + 1)
                                 + ents.dtype_code[g_idx] + 1) * (len(op_names) + 1), 0) + op[g_idx]
        c, e = infer_gloo(ents.rank[g_idx], ents.thread_code[g_idx], ents.record_id[g_idx], ents.created[g_idx],
                          self.label[g_idx], ents.cseq[g_idx], agree, self.members_of_label, self.present,
                          self.first_seq, self.wrapped)
        self.completed[g_idx] = c
        self.end_ns[g_idx] = np.maximum(e, ents.created[g_idx])
        self.inferred[g_idx] = c
        self.warnings.append(
            "gloo Flight Recorder dump: no op leaves state 'scheduled', so completion is inferred "
            "(a collective every member entered counts as completed; otherwise a later op on the same "
            "thread means it returned); see docs/ingest.md")

    def _trim_wrapped(self, ents: Entries) -> None:
        """keep: False for completed collectives older than what every member of their group still holds."""
        self.keep = np.ones(ents.n, bool)
        if not self.wrapped:
            return
        # per group: the seq cut (the highest first seq a wrapped member still holds) and the time cut (the
        # latest first op of a wrapped member with nothing on the group); then one pass over the rows
        members_of_label, first_seq = self.members_of_label, self.first_seq
        lo = np.iinfo(np.int64).min
        cut = np.full(len(members_of_label), lo, np.int64)
        t_cut = np.full(len(members_of_label), lo, np.int64)
        for g, mem in enumerate(members_of_label):
            w = [r for r in mem if r in self.wrapped]
            if not w:
                continue
            cut[g] = max((first_seq[(r, g)] for r in w if (r, g) in first_seq), default=lo)
            t_cut[g] = max((self.first_created[r] for r in w if (r, g) not in first_seq), default=lo)
        gmask = self.coll & self.completed
        lab = np.clip(self.label, 0, len(members_of_label) - 1)
        self.keep[gmask & (ents.cseq < cut[lab])] = False
        self.keep[gmask & (ents.created < t_cut[lab])] = False

    def _p2p(self, ents: Entries) -> None:
        """p2p sequence numbers (-1 for a p2p op that is neither a send nor a recv)."""
        self.p2p_seq = np.full(ents.n, -1, np.int64)
        i = self.p2p_idx
        if len(i):
            is_send = self.op_is_send[self.op[i]]
            s, k = p2p_sequences(ents.rank[i], ents.record_id[i], is_send, self.peer[i], self.completed[i],
                                 self.end_ns[i], ents.created[i], self.wrapped, self.first_created, self.warnings)
            self.p2p_seq[i] = s
            self.keep[i] &= k
            bad = ~(is_send | self.op_is_recv[self.op[i]])
            self.p2p_seq[i[bad]] = -1
        if self.wrapped:
            wrapped = self.wrapped
            self.warnings.append(
                f"ring buffer wrapped on rank(s) {sorted(wrapped)[:16]}{' ...' if len(wrapped) > 16 else ''}: ops "
                f"are aligned per process group by collective_seq_id; {int((~self.keep).sum())} completed op(s) "
                "older than what every member still holds were dropped")

    def backend_of_label(self, ents: Entries) -> dict[str, str]:
        """Each group label's backend: that of the first entry on it."""
        out: dict[str, str] = {}
        lab_first = np.unique(self.label, return_index=True)[1]
        for lc, i in zip(np.unique(self.label), lab_first):
            out[self.labels[lc]] = self.backend_of_pn[ents.pn_code[i]]
        return out

    def release(self) -> None:
        """Drop the per-entry columns once stage 3 has taken what it needs (~0.4 GB at 2 M entries)."""
        for name in ("op", "is_p2p", "label", "peer", "completed", "end_ns", "inferred", "keep", "p2p_seq",
                     "coll", "pair_code", "p2p_idx"):
            self.__dict__.pop(name, None)
