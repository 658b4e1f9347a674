"""The Flight Recorder reader's fast paths give what the plain paths give.

- `safe_pickle._Prefetched`: the zero-copy file the restricted unpickler reads (every protocol,
  any bytes-like input, truncated and hostile pickles refused as before);
- `fr_read.DumpBuffer`: one reused read buffer, the same content and errors as `safe_io.read_bytes`;
- `fr_entries._size_texts`: shapes keyed by their marshal bytes, the same texts as `str` of each;
- `fr_entries.Entries._shapes`: (input_sizes, input_dtypes) pairs keyed by their marshal bytes, the same
  codes, texts and bytes as the per-entry path (sets, which marshal sorts, take the per-text path);
- `fr_entries.fields` with the dump's own key objects, and `_Table.codes` of a single value.
"""
from __future__ import annotations

import collections
import pickle
from pathlib import Path

import pytest

from ncclscope.load import safe_io
from ncclscope.load.foreign.errors import TraceError
from ncclscope.load.foreign.fr_entries import Entries, _holds_set, _size_texts, _Table, fields
from ncclscope.load.foreign.fr_read import DumpBuffer, size_text, read_dump
from ncclscope.load.foreign.safe_pickle import UnsafePickleError, safe_loads

DATA = {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
        "entries": [{"record_id": i, "profiling_name": "nccl:all_reduce", "input_sizes": [[1024, 4096]],
                     "blob": b"x" * (300_000 if i == 1 else 3), "s": {1, 2}, "c": 1j, "big": "z" * 200_000 * (i == 2),
                     "o": collections.OrderedDict(a=i), "t": (i, None, True, 2.5)} for i in range(4)]}


@pytest.mark.parametrize("protocol", range(0, pickle.HIGHEST_PROTOCOL + 1))
@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_safe_loads_reads_every_protocol_from_any_buffer(protocol: int, kind: type) -> None:
    blob = pickle.dumps(DATA, protocol=protocol)
    assert safe_loads(kind(blob)) == DATA


@pytest.mark.parametrize("protocol", [0, 2, 4])
def test_truncated_pickles_are_trace_errors(protocol: int) -> None:
    blob = pickle.dumps(DATA, protocol=protocol)
    for cut in (0, 1, 2, len(blob) // 3, len(blob) // 2, len(blob) - 1):
        with pytest.raises(TraceError, match="not a readable pickle"):
            safe_loads(memoryview(blob)[:cut])


def test_refusals_and_wrong_types_read_as_before() -> None:
    with pytest.raises(UnsafePickleError):
        safe_loads(bytearray(b"csubprocess\nPopen\n."))
    with pytest.raises(UnsafePickleError):
        safe_loads(b"P1\n.")
    with pytest.raises(TraceError, match=r"a bytes-like object is required, not 'str'\)"):
        safe_loads("not bytes")      # type: ignore[arg-type]


def test_nothing_unpickled_refers_to_the_reused_buffer(tmp_path: Path) -> None:
    buf = DumpBuffer()
    small, big = tmp_path / "nccl_trace_rank_0", tmp_path / "nccl_trace_rank_1"
    small.write_bytes(pickle.dumps({"entries": [{"a": "small"}], "version": "2.10"}, protocol=2))
    big.write_bytes(pickle.dumps(DATA, protocol=2))
    first = read_dump(big, "pickle", buf)
    second = read_dump(small, "pickle", buf)      # written over the start of the same buffer
    assert first == DATA and second == {"entries": [{"a": "small"}], "version": "2.10"}
    assert read_dump(big, "pickle", buf) == read_dump(big, "pickle") == DATA


def test_dump_buffer_reads_what_read_bytes_reads(tmp_path: Path) -> None:
    buf = DumpBuffer()
    for size in (0, 1, 10, 70_000, 3, 500_000, 499_999, 2):
        f = tmp_path / f"f{size}"
        f.write_bytes(bytes(range(256)) * (size // 256) + b"q" * (size % 256))
        assert bytes(buf.read(f, safe_io.DUMP_LIMIT)) == safe_io.read_bytes(f, safe_io.DUMP_LIMIT)
    with pytest.raises(safe_io.InputError) as ours:
        buf.read(tmp_path / "f500000", 1000)
    with pytest.raises(safe_io.InputError) as plain:
        safe_io.read_bytes(tmp_path / "f500000", 1000)
    assert str(ours.value) == str(plain.value)
    with pytest.raises(safe_io.InputError):
        buf.read(tmp_path, safe_io.DUMP_LIMIT)          # a directory, not a regular file


def _deep(n: int) -> list:
    x: list = []
    for _ in range(n):
        x = [x]
    return x


@pytest.mark.parametrize("sizes", [
    [[[1024, 4096]], [[1024, 4096]], [[8]], [], [[1024, 4096]]],
    [[[1]], [[True]], [[1.0]], [[-0.0]], [[0.0]], [[2**70]], [[1]]],          # equal values, different texts
    [[{1, 2}], [frozenset({3})], [(1, 2)], [None], ["a\udcff"], [b"x"], [1j], [{"k": [1]}]],
    [[collections.OrderedDict(a=1)], [[1]]],                                   # marshal refuses: str of each
    [_deep(1500), [[1]]],                                                      # str gives up: size_text
    [[[1, 2]], "not a list", None],                                            # not all lists
    [[{8, 0}], [{0, 8}], [{8, 0}]],              # equal sets, another order: marshal sorts them, str does not
])
def test_size_texts_match_str_of_each(sizes: list) -> None:
    want = [size_text(sz) for sz in sizes]
    assert _size_texts(sizes) == want


def _entry(i: int, sz, dt) -> dict:
    return {"record_id": i, "process_group": ("0", "default_pg"), "collective_seq_id": i, "p2p_seq_id": 0,
            "profiling_name": "nccl:all_reduce", "input_sizes": sz, "input_dtypes": dt,
            "state": "completed" if i % 3 else "started", "time_created_ns": 10 + i,
            "time_discovered_started_ns": 11 + i, "time_discovered_completed_ns": 12 + i, "timeout_ms": 600000,
            "is_p2p": False, "thread_id": "1", "frames": []}


_PAIRS = [([[1024, 4096]], ["BFloat16"]), ([[1024, 4096]], ["Float"]), ([[1024, 4096]], ("BFloat16",)),
          (((1024, 4096),), ["BFloat16"]), ([[1024, 4096]], ["BFloat16"]), ([[True]], ["Float"]),
          ([[1]], ["Float"]), ([[1.0]], ["Float"]), ([[2**70, 2**70]], ["Float"]), ([], []),
          ([[8], [3, 3]], ["Int", "c10::Half"]), ([[8]], [["nested"]]), ([[8]], "Float"), ([[8]], None),
          ([[4, "x"]], ["Float"]), ([[-3, 5]], ["Float"]), ([[1024, 4096]], ["BFloat16"])]


@pytest.mark.parametrize("extra", [[], [([{8, 0}], ["Float"]), ([{0, 8}], ["Float"])],
                                   [([collections.OrderedDict(a=1)], ["Float"])], [([_deep(1500)], ["Float"])]])
def test_shapes_give_what_the_per_entry_path_gives(extra: list) -> None:
    pairs = _PAIRS + extra
    dumps = [[_entry(i, sz, dt) for i, (sz, dt) in enumerate(pairs[k:] + pairs[:k])] for k in (0, 5, 11)]
    fast, slow = Entries(), Entries()
    for r, entries in enumerate(dumps):
        fast.add(r, entries)
        slow.add(r, entries, fast=False)
    fast.finish(), slow.finish()
    for name in ("size_code", "dtype_code", "nbytes"):
        assert getattr(fast, name).tolist() == getattr(slow, name).tolist(), name
    assert fast.size_texts == slow.size_texts and fast.dtype_texts == slow.dtype_texts
    if not extra:      # plain values: the marshal-keyed path took them
        ents = Entries()
        assert ents._shapes([sz for sz, _ in pairs], [dt for _, dt in pairs]) is not None


def test_shapes_refuse_sets_and_unmarshallable_values() -> None:
    ents = Entries()
    assert ents._shapes([[{1, 2}]], [["Float"]]) is None
    assert ents._shapes([[1]], [frozenset({"Float"})]) is None
    assert ents._shapes([[collections.OrderedDict(a=1)]], [["Float"]]) is None
    assert _holds_set([[1, (2, {"k": [{3}]})]]) and not _holds_set([[1, (2, {"k": [3]})]])
    assert _holds_set(list(range(20_000)))         # too big to tell: the per-text path


def test_fields_with_the_dumps_own_keys_read_what_the_tolerant_path_reads() -> None:
    entries = [_entry(i, [[i]], ["Float"]) for i in range(5)]
    # keys equal to KEYS but other objects (as an unpickled dump has them), then a dict with keys of its own
    entries = [{("".join(list(k)) if type(k) is str else k): v for k, v in e.items()} for e in entries]
    entries.append({**entries[0], "record_id": 99})
    want = fields(entries, fast=False)
    got = fields(entries)
    assert {k: list(v) for k, v in got.items()} == {k: list(v) for k, v in want.items()}
    assert fields([], True) == {k: () for k in want}


def test_codes_of_one_value_are_the_codes_of_each() -> None:
    t = _Table()
    t.commit(t.codes(["a", "b"])[1])
    for values in (["b"] * 4, ["c"] * 3, [None], [1, True, 1]):
        codes, new = t.codes(values)
        lut = {**t.index, **new}
        assert codes.tolist() == [lut[v] for v in values]
