"""Stage 2 of the Flight Recorder loader (read -> fix up -> assemble): per-entry columns a dump does not
hold directly, vectorised over all entries of all ranks.

`FixedUp(ents, dumps, world, world_size, warnings, widths)` computes, in order:
- op names, backends and p2p direction, once per distinct profiling name; each op's sizes and dtypes
  texts, the output's added where it says more than the input (`fr_read.with_output`);
- groups: one label per distinct (rank, pg name), with its members (`fr_fixups.group_members`);
- peers of p2p entries, once per distinct (profiling name, rank, pg), a receive from any source
  given the sender that has a send to spare (`fr_fixups.any_source_peers`);
- completion, with gloo's inferred (`fr_fixups.infer_gloo`);
- coalesced blocks read as one launch (`fr_coalesced`): the marker's state is every member's; a
  collective block becomes one row, a p2p block keeps its sends and receives;
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
from ncclscope.load.foreign.fr_coalesced import MARKER_SIZES, block_op, block_texts, coalesced_blocks, marker_like
from ncclscope.load.foreign.fr_fixups import (any_source_peers, group_members, infer_gloo, p2p_sequences,
                                              parse_profiling_name, peer_of)
from ncclscope.load.foreign.fr_read import factorize_texts, with_output
from ncclscope.load.foreign.vocab import P2P_OPS, GroupNamer, parse_ranks

_SIZES_MAY_DIFFER = frozenset({"all_to_all", "all_to_all_single", "alltoall", "alltoall_base", "alltoallv", "scatter",
                               "gather", "all_gather_v", "reduce_scatter_v", "barrier", "monitored_barrier"})
# ops whose output the group shapes: their output is always written beside the input, even where equal
_SHAPED = frozenset({"all_gather", "all_gather_into_tensor", "all_gather_into_tensor_coalesced", "all_gather_v",
                     "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "reduce_scatter_v",
                     "all_to_all", "all_to_all_single"})


class FixedUp:
    """The fixed-up per-entry columns of `ents` (arrays of length ents.n) and the per-group tables."""

    def __init__(self, ents: Entries, dumps: dict[int, dict[str, Any]], world: int, world_size: int | None,
                 warnings: list[str], widths: dict[str, int]) -> None:
        """`widths`: each group's size by its all_gather shapes (fr_world.group_widths, read once by the loader)."""
        self.warnings = warnings
        self.present = set(dumps)
        self.keep = np.ones(ents.n, bool)
        self._ops(ents)
        self._io_texts(ents)
        self.world = self._groups(ents, dumps, world, world_size, widths)
        self._peers(ents)
        self._completion(ents)
        self._coalesced(ents)
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
        bare = [i for i, (name, p) in enumerate(zip(ents.pnames, parsed)) if name and not p[0]]
        if bare:               # torch's analyzer refuses these; the op they name is still plain
            ranks = sorted(set(ents.rank[np.isin(ents.pn_code, bare)].tolist()))
            self.warnings.append(
                f"rank(s) {ranks[:8]}{' ...' if len(ranks) > 8 else ''}: profiling name(s) "
                f"{', '.join(repr(ents.pnames[i][:40]) for i in bare[:4])} carry no backend prefix (as in "
                "'nccl:all_reduce'); read as the op they name")

    def _io_texts(self, ents: Entries) -> None:
        """Sizes and dtypes texts of each entry, the output's added where it says more than the input
        (`fr_read.with_output`; always for an op whose output the group shapes, so that the shape rules
        see it): what the ranks compare, output included."""
        shaped = np.isin(np.asarray(self.op_names, dtype=object), list(_SHAPED))[self.op]
        self.size_code, self.size_texts = _with_outputs(ents.size_code, ents.out_size_code, ents.size_texts,
                                                        ents.out_size_texts, shaped)
        self.dtype_code, self.dtype_texts = _with_outputs(ents.dtype_code, ents.out_dtype_code, ents.dtype_texts,
                                                          ents.out_dtype_texts, np.zeros(ents.n, bool))
        self.nbytes = ents.nbytes

    def _groups(self, ents: Entries, dumps: dict[int, dict[str, Any]], world: int, world_size: int | None,
                widths: dict[str, int]) -> int:
        """groups: once per distinct (rank, pg name). Returns the world, grown by a completed group."""
        n_pg = max(len(ents.pg_names), 1)
        self.pair_uniq, first, self.pair_code = ents.rank_pg_pairs()
        self.pair_rank = (self.pair_uniq // n_pg).astype(int).tolist()
        self.pair_pg = [ents.pg_names[i] for i in (self.pair_uniq % n_pg)]
        pair_desc = [ents.descs[i] for i in ents.desc_code[first]]
        self.pair_members = pm = group_members(self.pair_rank, self.pair_pg, pair_desc, dumps, world, self.warnings,
                                               widths)
        if not world_size:      # a group completed with a rank that left no dump (fr_fixups.complete_groups)
            world = max([world] + [max(m) + 1 for m in pm if m])
        namer = GroupNamer(zip(self.pair_pg, pair_desc, pm))
        label_code_of_pair, self.labels = factorize_texts([namer(g, d, m) for g, d, m in zip(self.pair_pg, pair_desc, pm)])
        self.label = label_code_of_pair[self.pair_code]
        # rank -> {label: the rank's own number of that group} where the dumps carry pg_id (hang/group_ids.py)
        self.group_ids: dict[int, dict[str, int]] = {}
        for r, code, lc in zip(self.pair_rank, (self.pair_uniq % n_pg).tolist(), label_code_of_pair.tolist()):
            gid = ents.group_ids.get((r, int(code)))
            if gid is not None:
                self.group_ids.setdefault(r, {})[self.labels[lc]] = gid
        self.members_of_label: list[tuple[int, ...]] = [()] * len(self.labels)
        self.info_of_label: list[tuple[str, str]] = [("", "")] * len(self.labels)
        for i, lc in enumerate(label_code_of_pair):
            if not self.members_of_label[lc]:
                self.members_of_label[lc] = pm[i]
                self.info_of_label[lc] = (self.pair_pg[i], pair_desc[i])
        listed = {str(name) for d in dumps.values() if isinstance(d.get("pg_config"), dict)
                  for name, info in d["pg_config"].items() if isinstance(info, dict) and parse_ranks(info.get("ranks"))}
        # groups whose members no dump listed (gloo): rebuilt from who used them, so their size is a guess
        self.rebuilt = sorted({self.labels[lc] for i, lc in enumerate(label_code_of_pair.tolist())
                               if self.pair_pg[i] not in listed})
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
            self._any_source(ents)

    def _any_source(self, ents: Entries) -> None:
        """A receive from any source ("recv 1<-?") names no peer: `fr_fixups.any_source_peers` gives it
        the sender with a send to spare (-1 where none has)."""
        j = self.p2p_idx
        anysrc = np.array(["?" in p[2] for p in self.parsed], dtype=bool)[ents.pn_code[j]]
        todo = np.flatnonzero(anysrc & (self.peer[j] < 0) & self.op_is_recv[self.op[j]])
        if len(todo):
            self.peer[j[todo]] = any_source_peers(todo, ents.rank[j], self.label[j], ents.created[j],
                                                  ents.record_id[j], self.op_is_send[self.op[j]],
                                                  self.op_is_recv[self.op[j]], self.peer[j])

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
        agree = np.where(fixed, (self.size_code[g_idx].astype(np.int64) * (len(self.dtype_texts) + 1)
                                 + self.dtype_code[g_idx] + 1) * (len(op_names) + 1), 0) + op[g_idx]
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

    def _coalesced(self, ents: Entries) -> None:
        """Coalesced blocks (`fr_coalesced`) as one launch: every member takes the marker's state and end
        (their own never leave `scheduled`) and the marker row goes; a p2p block keeps its sends and
        receives, a collective block becomes its first member's row, named and sized for the whole block,
        so ranks compare blocks member by member. A block whose first members a wrapped ring buffer
        evicted is not compared: dropped where it completed, its sizes unknown ("") where it did not.
        Vectorised but for the naming of collective blocks (once per distinct block)."""
        is_marker = np.array([marker_like(o) for o in self.op_names], dtype=bool)[self.op]
        if not is_marker.any():
            return
        is_marker &= np.isin(np.asarray(self.size_texts, dtype=object), list(MARKER_SIZES))[self.size_code]
        seq = np.where(self.is_p2p, ents.p2pseq, ents.cseq)
        block = coalesced_blocks(ents.rank, self.label, ents.record_id, self.is_p2p, seq, is_marker)
        idx = np.flatnonzero(block >= 0)
        if not len(idx):
            return
        idx = idx[np.lexsort((ents.record_id[idx], block[idx]))]       # each block in order, its marker last
        b = block[idx]
        first, last = np.r_[True, b[1:] != b[:-1]], np.r_[b[1:] != b[:-1], True]
        nth = np.cumsum(first) - 1                                      # each position's block, 0..
        marker = idx[last][nth]
        for col in (self.completed, self.end_ns, self.inferred):
            col[idx] = col[marker]
        self.keep[idx[last]] = False
        oldest = {r: st[0] if r in self.wrapped else -2 for r, st in ents.rank_stats.items()}
        heads = idx[first]
        partial = (ents.record_id[heads] == np.array([oldest.get(r, -2) for r in ents.rank[heads].tolist()]))[nth]
        p2p = self.is_p2p[idx]
        gone = partial & self.completed[idx]
        self.keep[idx[p2p & gone]] = False
        self.keep[idx[~p2p & (~first | gone)]] = False
        self._name_blocks(idx, first & ~p2p & ~gone, last, partial)

    def _name_blocks(self, idx: np.ndarray, head: np.ndarray, last: np.ndarray, partial: np.ndarray) -> None:
        """Each kept collective block's first row named and sized for the block (`block_op`, `block_texts`),
        its bytes the members' sum; worked out once per distinct (marker op, member ops, sizes, dtypes)."""
        starts = np.flatnonzero(head)
        if not len(starts):
            return
        ends = np.flatnonzero(last)[np.searchsorted(np.flatnonzero(last), starts)]    # each block's marker
        self.nbytes = self.nbytes.copy()
        op, size, dtype = self.op, self.size_code, self.dtype_code
        done: dict[tuple, tuple[int, int, int]] = {}
        for a, e in zip(starts.tolist(), ends.tolist()):
            mem = idx[a:e]
            key = (int(op[idx[e]]), tuple(op[mem].tolist()), tuple(size[mem].tolist()),
                   tuple(dtype[mem].tolist()), bool(partial[a]))
            if key not in done:
                done[key] = self._block_codes(*key)
            head_row = idx[a]
            op[head_row], size[head_row], dtype[head_row] = done[key]
            self.nbytes[head_row] = int(self.nbytes[mem].sum())

    def _block_codes(self, marker_op: int, ops: tuple, sizes: tuple, dtypes: tuple,
                     partial: bool) -> tuple[int, int, int]:
        """(op, sizes, dtypes) codes of a block as one launch; a partial block's sizes and dtypes unknown."""
        name = block_op(self.op_names[marker_op], [self.op_names[o] for o in ops])
        size_text = "" if partial else block_texts([self.size_texts[c] for c in sizes])
        dtype_text = "" if partial else block_texts([self.dtype_texts[c] for c in dtypes])
        return self._op_code(name), _code(self.size_texts, size_text), _code(self.dtype_texts, dtype_text)

    def _op_code(self, name: str) -> int:
        """`name`'s op code, a new op (a block's name) added with its p2p direction."""
        if name not in self.op_names:
            self.op_names.append(name)
            self.op_is_send = np.r_[self.op_is_send, name.endswith("send")]
            self.op_is_recv = np.r_[self.op_is_recv, name.endswith("recv")]
        return self.op_names.index(name)

    def _trim_wrapped(self, ents: Entries) -> None:
        """keep: False for completed collectives older than what every member of their group still holds."""
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
        """p2p sequence numbers, counted over the kept sends and receives only (-1 for any other p2p entry:
        a block's marker, which a 2-rank group would give a peer, must not count as a receive)."""
        self.p2p_seq = np.full(ents.n, -1, np.int64)
        i = self.p2p_idx
        i = i[(self.op_is_send[self.op[i]] | self.op_is_recv[self.op[i]]) & self.keep[i]]
        if len(i):
            s, k = p2p_sequences(ents.rank[i], ents.record_id[i], self.op_is_send[self.op[i]], self.peer[i],
                                 self.completed[i], self.end_ns[i], ents.created[i], self.wrapped,
                                 self.first_created, self.warnings)
            self.p2p_seq[i] = s
            self.keep[i] &= k
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
                     "coll", "pair_code", "p2p_idx", "size_code", "dtype_code", "nbytes"):
            self.__dict__.pop(name, None)


def _with_outputs(ins: np.ndarray, outs: np.ndarray, in_texts: list[str], out_texts: list[str],
                  always: np.ndarray) -> tuple[np.ndarray, list[str]]:
    """(code per entry, texts) of `with_output(input, output, always)`, worked out once per distinct
    (input, output, always): one hash pass over the entries (pd.factorize), no sort."""
    n_out = len(out_texts) + 1
    key = (ins.astype(np.int64) * n_out + outs) * 2 + always
    pair, uniq = pd.factorize(key)
    texts = [with_output(in_texts[k // 2 // n_out], out_texts[k // 2 % n_out], bool(k % 2)) for k in uniq.tolist()]
    code, distinct = factorize_texts(texts)
    return code[pair], distinct


def _code(table: list[str], text: str) -> int:
    """`text`'s index in `table`, appended where it is new (a table has few entries: a linear search)."""
    try:
        return table.index(text)
    except ValueError:
        table.append(text)
        return len(table) - 1
