"""The recorder's append-only Arrow IPC streams: a flat row-major list filled by the hot
path, drained by the flusher as one record batch per interval (see recorder.py for why rows
are kept this way and what each conversion costs).
"""
from __future__ import annotations

import array
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa

_WRITE_BUFFER_BYTES = 1 << 20   # a batch larger than this is written through, unbuffered


def column_converter(typ: pa.DataType) -> Any:
    """The fastest conversion of one column (a Python list) to an Arrow array of `typ`
    (public: tests/test_recorder.py checks it against `pa.array` on random columns).

    For the values the schema means (int, str, float, None) the array is the
    one `pa.array(col, type=typ)` makes. Integer columns go through the
    stdlib's `array.array` (a C loop over the list, about 2/3 of np.fromiter's
    time), and what it refuses through numpy, which also accepts what pa.array
    refuses: a bool, a float or a numeric string in an integer field is
    written as numpy converts it (True -> 1, 2.7 -> 2), where pa.array raised
    and the flusher stopped. Floats stay with pa.array (numpy would write None
    as NaN, not null). A column is tested for one value in the whole batch
    only when its last value is its first (most columns of a batch alternate
    begin and end rows: their `count` was a wasted pass over the column)."""
    np_type = {pa.int32(): np.int32, pa.int64(): np.int64}.get(typ)
    code = {pa.int32(): "i", pa.int64(): "q"}.get(typ)
    if code is not None and array.array(code).itemsize != np.dtype(np_type).itemsize:
        code = None                      # a platform whose C int sizes differ: numpy only

    def convert(col: list[Any], n: int) -> pa.Array:
        first = col[0]
        if col[n - 1] is first or col[n - 1] == first:
            if col.count(first) == n:    # C-level; one value for the whole batch
                try:
                    return pa.repeat(pa.scalar(first, type=typ), n)
                except (pa.ArrowException, TypeError, ValueError, OverflowError):
                    pass
        if np_type is not None:
            if code is not None:
                try:
                    return pa.Array.from_buffers(typ, n, [None, pa.py_buffer(array.array(code, col))])
                except (TypeError, ValueError, OverflowError):
                    pass                 # not all ints (None, a float, a str) or out of range: numpy
            try:
                return pa.array(np.fromiter(col, np_type, n))
            except (TypeError, ValueError, OverflowError):
                pass                     # None (null) or a bad value: pa.array decides, as before
        elif is_string:
            try:
                return _strings(col, n)
            except (TypeError, ValueError):
                pass                     # None (null), not a str, a NUL inside, a lone surrogate
        return pa.array(col, type=typ)
    is_string = typ == pa.string()
    return convert


def _strings(col: list[Any], n: int) -> pa.Array:
    """`pa.array(col, type=pa.string())` for a list of str without NUL characters,
    in half its time: the values are one `"".join`, the offsets are where the
    NUL separators fall in a `"\\0".join` (numpy finds them). Raises TypeError or
    ValueError for anything else, and the caller falls back to pa.array."""
    data = "".join(col).encode()         # TypeError if a value is not a str
    if len(data) >= 2**31 - 1:
        raise ValueError("too long for 32-bit offsets")
    offsets = np.empty(n + 1, np.int32)
    offsets[0] = 0
    if n > 1:
        seps = np.flatnonzero(np.frombuffer("\0".join(col).encode(), np.uint8) == 0)
        if len(seps) != n - 1:
            raise ValueError("a value contains NUL")
        # value i+1 starts where the i-th separator is, less the i separators before it
        np.subtract(seps, np.arange(n - 1), out=offsets[1:n], casting="unsafe")
    offsets[n] = len(data)
    return pa.StringArray.from_buffers(n, pa.py_buffer(offsets), pa.py_buffer(data))


class _RowsView:
    """`stream.rows`: the queued rows as tuples (a snapshot), and `append(row)`."""

    __slots__ = ("_stream",)

    def __init__(self, stream: "IpcStream") -> None:
        self._stream = stream

    def append(self, row: tuple[Any, ...]) -> None:
        if len(row) != self._stream.width:   # one short row would skew every later one
            raise ValueError(f"{self._stream.path.name}: a row has {len(row)} values, "
                             f"the schema {self._stream.width}")
        self._stream.buf.extend(row)

    def _snapshot(self) -> list[tuple[Any, ...]]:
        flat, w = self._stream.buf[:], self._stream.width
        return [tuple(flat[i:i + w]) for i in range(0, len(flat) - len(flat) % w, w)]

    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        return iter(self._snapshot())

    def __len__(self) -> int:
        return len(self._stream.buf) // self._stream.width


class IpcStream:
    """One append-only Arrow IPC stream file fed from a flat, row-major list.

    Writers append a whole row with one `buf.extend(row_tuple)` (atomic under
    the GIL); `drain` converts and then removes exactly the rows it found, so
    rows appended meanwhile stay queued for the next batch. Public: the
    Recorder (recorder.py) owns one per file (events, metrics, samples)."""

    def __init__(self, path: Path, schema: pa.Schema) -> None:
        self.path = path
        self.schema = schema
        self.width = len(schema)
        self.buf: list[Any] = []
        self.append_row = self.buf.extend    # the hot path's one call per row
        self.rows = _RowsView(self)
        self._convert = [column_converter(f.type) for f in schema]
        # A native file behind Arrow's own buffer: a batch is gathered in memory
        # and handed to the OS in one write by flush() (written buffer by
        # buffer, a batch costs a system call per column buffer), without
        # going back to Python for each. After flush() the bytes are in the
        # page cache: what survives SIGKILL of this process.
        self._raw = pa.OSFile(str(path), "wb")
        self._file = pa.BufferedOutputStream(self._raw, _WRITE_BUFFER_BYTES)
        self._writer = pa.ipc.new_stream(self._file, schema)
        self._file.flush()  # the schema message on disk at once: an empty but valid stream
        self.written = 0

    def drain(self) -> int:
        """Write whatever rows are queued as one record batch; return the count."""
        buf = self.buf
        n = len(buf)
        if n == 0:
            return 0
        w = self.width
        rows = n // w
        # Rows appended meanwhile land after n: the slices and the del see the
        # same first n values. A batch that cannot be converted is dropped, as
        # it always was: kept, it would fail every later flush too.
        try:
            arrays = [conv(buf[j:n:w], rows) for j, conv in enumerate(self._convert)]
        finally:
            del buf[:n]
        self._writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=self.schema))
        self._file.flush()  # into the OS page cache: survives SIGKILL of this process
        self.written += rows
        return rows

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self._writer.close()   # the end-of-stream marker
            self._file.close()     # flushes the buffer, closes the OS file
            if not self._raw.closed:
                self._raw.close()
