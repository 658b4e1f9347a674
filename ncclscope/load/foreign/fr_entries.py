"""Flight Recorder entries -> columns, one dump at a time.

`Entries.add(rank, entries)` transposes one dump's entry dicts into columns
with C-level passes (one itemgetter over the entries, (input_sizes, input_dtypes)
pairs keyed by their `marshal` bytes and one `str` per distinct pair, dict-based
coding of the string fields into one table per field), so no per-entry Python
code runs on a dump as torch writes it. Anything else (a missing key, a hostile field type) takes the
tolerant per-entry path of `fr_read`'s helpers, which gives the same columns.
Every field is coerced to the type it should have, and a dump that fails
part-way adds nothing (all or nothing).
"""
from __future__ import annotations

import marshal
from itertools import repeat
from typing import Any

import numpy as np
import pandas as pd

from ncclscope.load import safe_io
from ncclscope.load.foreign.fr_fields import KEYS, fields
from ncclscope.load.foreign.fr_read import dtype_and_bytes, field_ints, object_array, size_text, field_text, call_site

__all__ = ["Entries", "KEYS", "fields"]

_CODED = ("pg_name", "pg_desc", "pname", "state", "thread", "thread_name", "site", "size_text", "dtype_text",
          "out_size", "out_dtype")
_INTS = ("rank", "record_id", "cseq", "p2pseq", "created", "started", "completed_ns", "timeout_ms", "nbytes")


_PLAIN = frozenset({str, int, type(None)})


def _distinct_texts(values: Any) -> tuple[Any, dict[Any, None]]:
    """(the values, their distinct values in order of first appearance): the values as they are when
    they are str / int / None (hashable, and what the tables hold), else each coerced to a str. One
    hashing pass over the entries when they are plain, as torch writes them (the coding reuses it)."""
    try:
        uniq = dict.fromkeys(values)
        if set(map(type, uniq)) <= _PLAIN:
            return values, uniq
    except TypeError:          # unhashable: a list or dict where a name should be
        pass
    values = [field_text(v) if not isinstance(v, (str, int)) or isinstance(v, bool) else v for v in values]
    return values, dict.fromkeys(values)


def _size_texts(sizes: list[Any]) -> list[str]:
    """`size_text` of each (str of a list, when they are all lists). A dump has few distinct shapes, and
    `str` of a nested list is slow (~0.7 us): each list is keyed by its `marshal` bytes (one C pass, 3x
    faster; equal bytes mean the same types and values, so the same text) and only one list per
    distinct key is turned into text. Where marshal refuses a value, `str` of every list, as before."""
    if values_are_lists(sizes):
        try:
            keys = list(map(marshal.dumps, sizes, repeat(2)))     # version 2: no back-references
        except ValueError:             # unmarshallable (an OrderedDict), or nested too deep
            keys = None
        try:
            if keys is None:
                return list(map(str, sizes))
            by_key = dict(zip(keys, sizes))
            if any(map(_holds_set, by_key.values())):   # marshal sorts a set, str does not: str of each
                return list(map(str, sizes))
            text = {k: str(sz) for k, sz in by_key.items()}
            return list(map(text.__getitem__, keys))
        except (RecursionError, ValueError):
            pass
    return [size_text(sz) for sz in sizes]


def values_are_lists(values: list[Any]) -> bool:
    return bool(values) and set(map(type, values)) == {list}


_SETS = (set, frozenset)


def _holds_set(value: Any, limit: int = 10_000) -> bool:
    """Whether `value` holds a set or frozenset anywhere (or is too big or deep to tell: True).
    Equal marshal bytes mean equal types and values in the same order, except that marshal writes a
    set's elements sorted: two sets alike but for their iteration order (hence their `str`) give
    equal bytes. A value without sets is safe to key by its marshal bytes."""
    stack = [value]
    seen = 0
    while stack:
        v = stack.pop()
        seen += 1
        if seen > limit:
            return True
        t = type(v)
        if t in _SETS:
            return True
        if t is list or t is tuple:
            stack.extend(v)
        elif t is dict:
            stack.extend(v.keys())
            stack.extend(v.values())
    return False


def _call_site_keys(all_frames: list[Any]) -> tuple[list[int], dict[int, str]]:
    """(id of each entry's frames object, call site per distinct id): one walk per distinct
    frames object (a dump that shares one stack list between entries costs one walk)."""
    ids = list(map(id, all_frames))
    obj = dict(zip(ids, all_frames))
    return ids, {k: call_site(f) for k, f in obj.items()}


class _Table:
    """Codes for one string field: distinct values in order of first appearance over all dumps."""

    __slots__ = ("index",)

    def __init__(self) -> None:
        self.index: dict[Any, int] = {}

    def codes(self, values: Any, distinct: dict[Any, None] | None = None) -> tuple[np.ndarray, dict[Any, int]]:
        """Codes of `values` into this table as it will be once `commit` adds their new values
        (nothing is added yet: a dump that fails later must leave the table as it was).
        Work per dump: its distinct values (`distinct`, when the caller has them), not the table."""
        index = self.index
        lut: dict[Any, int] = {}
        new: dict[Any, int] = {}
        nxt = len(index)
        for u in (dict.fromkeys(values) if distinct is None else distinct):
            code = index.get(u)
            if code is None:
                code = new[u] = nxt
                nxt += 1
            lut[u] = code
        if len(lut) == 1:          # one value throughout (a thread id, a state): no second pass over them
            return np.full(len(values), code, np.int64), new
        return np.fromiter(map(lut.__getitem__, values), np.int64, len(values)), new

    def commit(self, new: dict[Any, int]) -> None:
        self.index.update(new)

    def texts(self) -> list[str]:
        return ["" if u is None else safe_io.clean_text(u) for u in self.index]


class Entries:
    """All entries of all ranks as columns: numbers as int64 arrays, strings as
    codes into small tables (a job has few distinct group names, op names,
    states, threads, call sites, shapes), no pandas string columns.

    Dumps are added one at a time (`add`) and reduced right away, the stack
    frames kept only for entries that had not completed (the stacks a person
    reads), so peak memory is one unpickled dump plus compact arrays. Per rank,
    `rank_stats` keeps (min record_id, min created, max created, max timeout_ms,
    max record_id) over its entries."""

    def __init__(self) -> None:
        self._parts: dict[str, list[np.ndarray]] = {k: [] for k in _INTS + ("is_p2p",) + _CODED}
        self.frames: dict[tuple[int, int], Any] = {}     # (rank, record_id) -> frames, unfinished entries only
        self.rank_stats: dict[int, tuple[int, int, int, int, int]] = {}
        # (rank, pg name code) -> the entries' pg_id: the group's number in the order its recording process
        # built its groups (torch's per-process backend counter; hang/group_ids.py reads it)
        self.group_ids: dict[tuple[int, int], int] = {}
        self._bytes_cache: dict[tuple[str, str], tuple[str, int]] = {}
        self._tables: dict[str, _Table] = {k: _Table() for k in _CODED}

    def add(self, rank: int, entries: list[Any], fast: bool = True) -> None:
        """Reduce one rank's entries. All or nothing: a dump that fails part-way
        (an exception from a hostile field) adds no row, so the columns of the
        other ranks stay aligned; the caller reports it. `fast=False` forces the
        tolerant per-entry paths (the tests compare the two)."""
        c = fields(entries, fast)
        n = len(c["record_id"])
        if not n:
            return
        pgs = c["process_group"]
        try:
            pg_name, pg_desc = zip(*pgs)
            if len(pg_name) != n:
                raise ValueError
        except (TypeError, ValueError):
            fixed = [pg if isinstance(pg, (list, tuple)) and len(pg) >= 2 else (field_text(pg), "") for pg in pgs]
            pg_name, pg_desc = tuple(p[0] for p in fixed), tuple(p[1] for p in fixed)
        ints = {"rank": np.full(n, rank, np.int64), "record_id": field_ints(c["record_id"], -1),
                "cseq": field_ints(c["collective_seq_id"], -1), "p2pseq": field_ints(c["p2p_seq_id"], -1),
                "created": field_ints(c["time_created_ns"], -1),        # -1: no time (the analyses then say none)
                "started": field_ints(c["time_discovered_started_ns"], 0),
                "completed_ns": field_ints(c["time_discovered_completed_ns"], 0), "timeout_ms": field_ints(c["timeout_ms"], -1)}
        flags = c["is_p2p"]
        try:
            plain = set(map(type, set(flags))) <= {bool, type(None)}      # as torch writes it
        except TypeError:                                                # an unhashable flag
            plain = False
        is_p2p = object_array(flags).astype(bool) if plain else np.array([bool(v) for v in flags], dtype=bool)
        tables = self._tables
        coded: dict[str, tuple[np.ndarray, dict[Any, int]]] = {}
        for key, vals in (("pg_name", pg_name), ("pg_desc", pg_desc), ("pname", c["profiling_name"]),
                          ("state", c["state"]), ("thread", c["thread_id"]), ("thread_name", c["thread_name"])):
            coded[key] = tables[key].codes(*_distinct_texts(vals))
        coded["site"] = self._sites(c["frames"]) if fast else tables["site"].codes(_plain_sites(c["frames"]))
        coded["size_text"], coded["dtype_text"], ints["nbytes"] = self._texts(c["input_sizes"], c["input_dtypes"],
                                                                              ("size_text", "dtype_text"), fast)
        coded["out_size"], coded["out_dtype"], _ = self._texts(c["output_sizes"], c["output_dtypes"],
                                                               ("out_size", "out_dtype"), fast)
        frames = {}
        record = ints["record_id"]
        all_frames = c["frames"]
        state_codes, new_states = coded["state"]
        done = tables["state"].index.get("completed", new_states.get("completed", -1))
        unfinished = self._unfinished(state_codes != done, coded, ints, is_p2p)
        for i in np.flatnonzero(unfinished).tolist():   # frames kept: unfinished entries only
            fr = all_frames[i]
            if fr:
                frames[(rank, int(record[i]))] = fr
        stats = (int(record.min()), int(ints["created"].min()), int(ints["created"].max()),
                 int(ints["timeout_ms"].max()), int(record.max()))
        ids = _group_ids(rank, coded["pg_name"][0], field_ints(c["pg_id"], -1))
        # nothing failed: commit
        for key, arr in ints.items():
            self._parts[key].append(arr)
        self._parts["is_p2p"].append(is_p2p)
        for key, (codes, new) in coded.items():
            self._tables[key].commit(new)
            self._parts[key].append(codes)
        old = self.rank_stats.get(rank)
        self.rank_stats[rank] = stats if old is None else (
            min(old[0], stats[0]), min(old[1], stats[1]), max(old[2], stats[2]), max(old[3], stats[3]),
            max(old[4], stats[4]))
        self.frames.update(frames)
        for key, gid in ids.items():
            self.group_ids.setdefault(key, gid)

    def _unfinished(self, pending: np.ndarray, coded: dict[str, Any], ints: dict[str, np.ndarray],
                    is_p2p: np.ndarray) -> np.ndarray:
        """`pending` (not completed) less the members of a coalesced block whose marker completed: they never
        leave `scheduled` (fr_coalesced) and finish with their marker, so their stacks are not kept (a job
        that batches its sends and receives would keep nearly every stack). A member shares its marker's
        (group, p2p or not, sequence id); the marker's profiling name ends in "coalesced"."""
        pn_codes, new = coded["pname"]
        markers = [c for name, c in (*self._tables["pname"].index.items(), *new.items())
                   if isinstance(name, str) and name.endswith("coalesced")]
        if not markers or not pending.any():
            return pending
        seq = np.where(is_p2p, ints["p2pseq"], ints["cseq"])
        key = pd.MultiIndex.from_arrays([coded["pg_name"][0], is_p2p, seq])
        closed = np.isin(pn_codes, markers) & ~pending
        return pending & ~key.isin(key[closed])

    def _sites(self, all_frames: list[Any]) -> tuple[np.ndarray, dict[Any, int]]:
        """`_Table.codes` of each entry's call site, coded once per distinct frames object (the sites
        in order of their first entry, so the table numbers them as coding the per-entry list would)."""
        ids, site_of = _call_site_keys(all_frames)
        codes, new = self._tables["site"].codes(list(site_of.values()))
        if len(site_of) == 1:            # one stack object throughout
            return np.full(len(ids), codes[0] if len(codes) else 0, np.int64), new
        code = dict(zip(site_of, codes.tolist()))
        return np.fromiter(map(code.__getitem__, ids), np.int64, len(ids)), new

    def _texts(self, sizes: Any, dts: Any, tables: tuple[str, str], fast: bool) -> tuple[Any, Any, np.ndarray]:
        """(size text codes, dtype text codes, bytes) of each entry's (sizes, dtypes) into `tables`: the inputs,
        or the outputs (a dump without outputs: "null" and "" throughout)."""
        shapes = self._shapes(sizes, dts, tables) if fast else None
        if shapes is not None:
            return shapes
        texts = _size_texts(sizes) if fast else [size_text(sz) for sz in sizes]
        size_codes = self._tables[tables[0]].codes(texts)
        dtype_codes, nbytes = self._dtypes_and_bytes(texts, size_codes[0], sizes, dts, fast, tables[1])
        return size_codes, dtype_codes, nbytes

    def _shapes(self, sizes: Any, dts: Any,
                tables: tuple[str, str] = ("size_text", "dtype_text")) -> tuple[Any, Any, np.ndarray] | None:
        """(size text codes, dtype text codes, payload bytes) of each entry, each worked out once per
        distinct (input_sizes, input_dtypes) pair, the pairs keyed by their marshal bytes (one C pass:
        equal bytes mean equal types and values, so equal texts and bytes; `_holds_set` covers the one
        exception). What `_dtypes_and_bytes` gives from the per-entry texts, in ~1/3 of the time (no
        per-entry str, tuple or sort). None where marshal refuses a value, or a pair holds a set: the
        caller then takes the per-text path."""
        n = len(sizes)
        try:
            keys = list(map(marshal.dumps, zip(sizes, dts), repeat(2)))   # version 2: no back-references
        except ValueError:             # unmarshallable (an OrderedDict), or nested too deep
            return None
        if len(keys) != n:
            return None
        last = dict(zip(keys, range(n)))     # distinct pairs in order of first appearance, one entry each
        size_texts, names, nbytes = [], [], []
        cache = self._bytes_cache
        for i in last.values():
            sz, dt = sizes[i], dts[i]
            if _holds_set(sz) or _holds_set(dt):
                return None
            text = size_text(sz)
            key = (text, field_text(dt) if not isinstance(dt, (list, tuple)) else size_text(dt))
            hit = cache.get(key)
            if hit is None:
                hit = cache[key] = dtype_and_bytes(sz, tuple(dt) if isinstance(dt, (list, tuple)) else (dt,))
            size_texts.append(text)
            names.append(hit[0])
            nbytes.append(hit[1])
        code = dict(zip(last, range(len(last))))
        of_entry = np.fromiter(map(code.__getitem__, keys), np.int64, n)
        # the tables number texts in order of first appearance over the entries: the pairs are in that order
        size_codes, new_sizes = self._tables[tables[0]].codes(size_texts)
        name_codes, new_names = self._tables[tables[1]].codes(names)
        return ((size_codes[of_entry], new_sizes), (name_codes[of_entry], new_names),
                np.array(nbytes, np.int64)[of_entry])

    def _dtypes_and_bytes(self, texts: list[str], size_code: np.ndarray, sizes: Any, dts: Any, fast: bool,
                          table: str = "dtype_text") -> tuple[tuple[np.ndarray, dict[Any, int]], np.ndarray]:
        """dtype text codes (`_Table.codes` of the per-entry texts) and payload bytes per entry, worked out
        once per distinct (shape text, dtypes); `size_code`: a code per distinct shape text."""
        n = len(texts)
        if fast and values_are_lists(dts):
            dkeys: list[Any] = list(map(tuple, dts))     # what the per-entry path makes of them, in one C pass
        else:
            dkeys = [tuple(dt) if type(dt) is list else dt for dt in dts]
        try:
            d_index = {k: i for i, k in enumerate(dict.fromkeys(dkeys))}
            d_code = np.fromiter(map(d_index.__getitem__, dkeys), np.int64, n)
            _, first, pair_code = np.unique(size_code * len(d_index) + d_code, return_index=True, return_inverse=True)
            pair_code = pair_code.reshape(-1)
            n_pairs = len(first)
        except TypeError:            # an unhashable dtype field: one key per entry
            pair_code, n_pairs = np.arange(n), n
        firsts = np.full(n_pairs, -1, np.int64)
        firsts[pair_code[::-1]] = np.arange(n - 1, -1, -1)          # first entry of each distinct pair
        cache = self._bytes_cache
        hits = []
        for i in firsts.tolist():
            text, sz, dt = texts[i], sizes[i], dts[i]
            key = (text, field_text(dt) if not isinstance(dt, (list, tuple)) else size_text(dt))
            hit = cache.get(key)
            if hit is None:
                hit = cache[key] = dtype_and_bytes(sz, tuple(dt) if isinstance(dt, (list, tuple)) else (dt,))
            hits.append(hit)
        # the names coded per pair, the pairs taken in order of their first entry: the table then numbers the
        # names in order of first appearance over the entries, as coding the per-entry list would
        order = np.argsort(firsts, kind="stable")
        pair_names, new = self._tables[table].codes([hits[i][0] for i in order.tolist()])
        of_pair = np.empty(n_pairs, np.int64)
        of_pair[order] = pair_names
        return (of_pair[pair_code], new), np.array([h[1] for h in hits], np.int64)[pair_code]

    def absorb(self, other: "Entries") -> None:
        """Add the dumps `other` reduced (on an engine worker, engine/dump_chunks.py) as if `add` had read them
        here after this one's: string codes remapped into these tables, which register `other`'s values in
        the order `other` met them, so the tables grow as one reader's would."""
        for key in _INTS + ("is_p2p",):
            self._parts[key].extend(other._parts[key])
        for key in _CODED:
            theirs = list(other._tables[key].index)
            lut, new = self._tables[key].codes(theirs)
            self._tables[key].commit(new)
            self._parts[key].extend(lut[p] if len(lut) else p for p in other._parts[key])
        for rank, stats in other.rank_stats.items():
            old = self.rank_stats.get(rank)
            self.rank_stats[rank] = stats if old is None else (
                min(old[0], stats[0]), min(old[1], stats[1]), max(old[2], stats[2]), max(old[3], stats[3]),
                max(old[4], stats[4]))
        self.frames.update(other.frames)
        pg_lut = self._tables["pg_name"].index
        theirs_pg = list(other._tables["pg_name"].index)
        for (rank, code), gid in other.group_ids.items():
            self.group_ids.setdefault((rank, pg_lut[theirs_pg[code]]), gid)

    def finish(self) -> "Entries":
        """Concatenate the per-dump pieces, one column at a time (each column's pieces are
        dropped as it is done, so the peak is the columns plus one column's pieces)."""
        parts = self._parts
        self.n = sum(len(a) for a in parts["rank"])

        def cat(key: str, dtype: Any) -> np.ndarray:
            pieces = parts.pop(key)
            out = np.concatenate(pieces) if pieces else np.zeros(0, dtype)
            pieces.clear()
            return out

        self.rank, self.record_id, self.cseq = cat("rank", np.int64), cat("record_id", np.int64), cat("cseq", np.int64)
        self.p2pseq = cat("p2pseq", np.int64)
        self.created, self.started = cat("created", np.int64), cat("started", np.int64)
        self.completed_ns, self.timeout_ms = cat("completed_ns", np.int64), cat("timeout_ms", np.int64)
        self.is_p2p, self.nbytes = cat("is_p2p", bool), cat("nbytes", np.int64)

        def codes(key: str) -> tuple[np.ndarray, list[str]]:
            return cat(key, np.int64), self._tables[key].texts()

        self.pg_code, self.pg_names = codes("pg_name")
        self.desc_code, self.descs = codes("pg_desc")
        self.pn_code, self.pnames = codes("pname")
        self.state_code, self.states = codes("state")
        self.thread_code, self.threads = codes("thread")
        self.thread_name_code, self.thread_names = codes("thread_name")
        self.site_code, self.sites = codes("site")
        self.size_code, self.size_texts = codes("size_text")
        self.dtype_code, self.dtype_texts = codes("dtype_text")
        self.out_size_code, self.out_size_texts = codes("out_size")      # "null": no outputs recorded
        self.out_dtype_code, self.out_dtype_texts = codes("out_dtype")
        self._tables = {}
        self._parts = {}
        self._bytes_cache = {}
        self._pairs: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        return self

    def rank_pg_pairs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The distinct (rank, pg name code) pairs of the entries, keyed rank * len(pg_names) + pg code, sorted;
        with the first entry of each and each entry's pair (np.unique's index and inverse). Computed once: the
        world's mesh floor (fr_world.family_floor) and the group fix-ups (fr_fixup_stage) both read it, and
        at 32,768 ranks x 2,000 entries it is a sort of 65 M keys."""
        if self._pairs is None:
            n_pg = max(len(self.pg_names), 1)
            self._pairs = np.unique(self.rank * n_pg + self.pg_code, return_index=True, return_inverse=True)
        return self._pairs


def _group_ids(rank: int, pg_code: np.ndarray, pg_id: np.ndarray) -> dict[tuple[int, int], int]:
    """(rank, pg name code) -> pg_id for one dump's entries that carry one (the first where a name has several)."""
    have = pg_id >= 0
    if not have.any():
        return {}
    codes, first = np.unique(pg_code[have], return_index=True)
    return {(rank, int(c)): int(g) for c, g in zip(codes.tolist(), pg_id[have][first].tolist())}


def _plain_sites(all_frames: list[Any]) -> list[str]:
    """call_site of each entry's frames, once per frames object (the per-entry path)."""
    seen: dict[int, str] = {}
    out = []
    for f in all_frames:
        k = id(f)
        site = seen.get(k)
        if site is None:
            site = seen[k] = call_site(f)
        out.append(site)
    return out
