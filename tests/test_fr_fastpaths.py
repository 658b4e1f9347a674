"""The Flight Recorder reader's fast paths give what the plain paths give.

- `safe_pickle._Prefetched`: the zero-copy file the restricted unpickler reads (every protocol,
  any bytes-like input, truncated and hostile pickles refused as before);
- `fr_read.DumpBuffer`: one reused read buffer, the same content and errors as `safe_io.read_bytes`;
- `fr_entries._size_texts`: shapes keyed by their marshal bytes, the same texts as `str` of each.
"""
from __future__ import annotations

import collections
import pickle
from pathlib import Path

import pytest

from ncclscope import safe_io
from ncclscope.ingest.errors import TraceError
from ncclscope.ingest.fr_entries import _size_texts
from ncclscope.ingest.fr_read import DumpBuffer, _size_text, read_dump
from ncclscope.ingest.safe_pickle import UnsafePickleError, safe_loads

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
    [_deep(1500), [[1]]],                                                      # str gives up: _size_text
    [[[1, 2]], "not a list", None],                                            # not all lists
])
def test_size_texts_match_str_of_each(sizes: list) -> None:
    want = [_size_text(sz) for sz in sizes]
    assert _size_texts(sizes) == want
