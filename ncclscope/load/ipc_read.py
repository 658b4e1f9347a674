"""Reading one rank's append-only Arrow IPC stream, torn tail and all.

Split out of trace.py (the loader), which calls it three times per rank: at 16,384 ranks that is
49,152 files, so the per-file work here is kept to what the result needs. Nothing is ever written.
"""
from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc

from ncclscope.load import safe_io
from ncclscope import schema as S
from ncclscope.load.columns import conform_table, missing_only

# errnos for which pathlib's Path.exists() says False instead of raising (what the loader asked before)
_ABSENT = (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ELOOP)


def read_stream(path: Path, schema: pa.Schema, warnings: list[str]) -> pa.Table:
    """Read an append-only Arrow IPC stream, keeping every complete batch.

    A writer killed mid-batch leaves a torn tail: the batches before it are
    returned and the tail is reported once. Every batch is validated in full
    (offsets, UTF-8) before it is used; a batch that fails is treated like a
    torn one, so a flipped byte costs the batches from there on, never the
    process. Only a regular file is opened (a named pipe or a device would
    block or never end). Columns missing from an older file are filled with
    nulls; unknown extra columns are dropped.
    """
    table, _ = read_stream_lazy(path, schema, warnings, lazy=False)
    return table


def read_stream_lazy(path: Path | str, schema: pa.Schema, warnings: list[str],
                     lazy: bool = True) -> tuple[pa.Table, bool]:
    """(`read_stream`'s table, whether the file is absent as Path.exists() would say).

    With `lazy`, a table whose only difference from `schema` is missing columns comes back as it is
    (`missing_only`): the column engine fills those once per batch of ranks, not once per file (at
    16,384 ranks the per-file conforming of metrics.arrows alone took 4 s). Warnings, kept batches
    and every other outcome are `read_stream`'s."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return schema.empty_table(), True
    except (OSError, ValueError) as exc:
        warnings.append(f"{path}: unreadable ({safe_io.short(exc)}); skipped")
        return schema.empty_table(), isinstance(exc, OSError) and exc.errno in _ABSENT
    if not stat.S_ISREG(st.st_mode):
        warnings.append(f"{path}: {safe_io.file_kind(st.st_mode)}, not a regular file; skipped")
        return schema.empty_table(), False
    if st.st_size == 0:
        warnings.append(f"{path}: empty file (the rank died before its first flush)")
        return schema.empty_table(), False
    batches: list[pa.RecordBatch] = []
    try:
        # Read into Arrow's memory pool rather than memory-mapping: then the
        # conversion to pandas can free each buffer as soon as it is copied.
        source = pa.OSFile(str(path), "r")
        reader = pa.ipc.open_stream(source)
        file_version = (reader.schema.metadata or {}).get(b"ncclscope_schema", b"").decode(errors="replace")
    except (pa.ArrowException, OSError, ValueError, MemoryError) as exc:
        warnings.append(f"{path}: not a readable Arrow stream ({safe_io.short(exc)}); skipped")
        return schema.empty_table(), False
    if file_version and S.major(file_version) != S.major(S.SCHEMA_VERSION):
        warnings.append(f"{path}: schema version {file_version[:40]}, this reader understands {S.SCHEMA_VERSION}; skipped")
        return schema.empty_table(), False
    while True:
        try:
            batch = reader.read_next_batch()
            batch.validate(full=True)
            batches.append(batch)
        except StopIteration:
            break
        except (pa.ArrowException, OSError, ValueError, MemoryError, IndexError, KeyError) as exc:
            warnings.append(f"{path}: torn batch after {len(batches)} complete ones ({safe_io.short(exc)}); kept those")
            break
    try:
        table = pa.Table.from_batches(batches, schema=reader.schema) if batches else reader.schema.empty_table()
    except (pa.ArrowException, ValueError) as exc:
        warnings.append(f"{path}: batches disagree with the stream's schema ({safe_io.short(exc)}); skipped")
        return schema.empty_table(), False
    same = table.replace_schema_metadata(schema.metadata)      # already in this schema: nothing to conform
    if same.schema.equals(schema, check_metadata=True):
        return same, False
    if lazy and missing_only(same.schema, schema):
        return same, False
    return conform_table(table, schema, Path(path), warnings), False
