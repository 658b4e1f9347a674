"""The vocabulary both foreign-format readers share.

dtype and op names as PyTorch, NCCL and gloo spell them, mapped onto the names
our own runtime writes; process-group labels and kinds; member lists as
pg_config and profiler args write them (bounded: a hostile "[0, ..., 10**11]"
is not expanded); and a builder that turns a dict of columns into an Arrow
table in `schema.EVENTS_SCHEMA`.
"""
from __future__ import annotations

import functools
import re
from typing import Any, Iterable, Mapping

import numpy as np
import pyarrow as pa

from ncclscope import schema as S
from ncclscope.load.safe_io import MAX_RANK, to_int

__all__ = ["normalize_dtype", "dtype_itemsize", "normalize_op", "group_kind", "GroupNamer", "events_table", "coded",
           "parse_ranks", "P2P_OPS", "NCCL_KERNEL_TYPES", "REDUCING_OPS"]


# --------------------------------------------------------------------------
# dtypes
# --------------------------------------------------------------------------
# Flight Recorder writes c10 ScalarType names ("Float"), the profiler's
# "Input type" writes C++ type names ("float", "c10::BFloat16"), NCCL kernel
# names abbreviate ("f32", "bf16"). Our runtime writes torch names ("float32").
_DTYPES = {
    "float": "float32", "float32": "float32", "f32": "float32", "ncclfloat32": "float32", "ncclfloat": "float32",
    "double": "float64", "float64": "float64", "f64": "float64", "ncclfloat64": "float64", "nccldouble": "float64",
    "half": "float16", "float16": "float16", "f16": "float16", "c10::half": "float16", "ncclfloat16": "float16",
    "ncclhalf": "float16",
    "bfloat16": "bfloat16", "bf16": "bfloat16", "c10::bfloat16": "bfloat16", "ncclbfloat16": "bfloat16",
    "long": "int64", "int64": "int64", "long int": "int64", "i64": "int64", "int64_t": "int64", "ncclint64": "int64",
    "int": "int32", "int32": "int32", "i32": "int32", "ncclint32": "int32", "ncclint": "int32",
    "short": "int16", "int16": "int16", "short int": "int16",
    "char": "int8", "int8": "int8", "signed char": "int8", "i8": "int8", "ncclint8": "int8", "ncclchar": "int8",
    "byte": "uint8", "uint8": "uint8", "unsigned char": "uint8", "u8": "uint8",
    "nccluint8": "uint8", "u32": "uint32", "nccluint32": "uint32", "u64": "uint64", "nccluint64": "uint64",
    "bool": "bool",
    "complexfloat": "complex64", "c10::complex<float>": "complex64", "complex64": "complex64",
    "complexdouble": "complex128", "c10::complex<double>": "complex128", "complex128": "complex128",
    "float8_e4m3fn": "float8_e4m3fn", "f8e4m3": "float8_e4m3fn", "c10::float8_e4m3fn": "float8_e4m3fn",
    "float8_e5m2": "float8_e5m2", "f8e5m2": "float8_e5m2", "c10::float8_e5m2": "float8_e5m2",
}
# The type token of an NCCL kernel's name, and only that (a demangled name's parameter list,
# "(ncclDevComm*, unsigned long, ncclWork*)", is no dtype). NCCL <= 2.18 names kernels
# ncclKernel_<coll>_<algo>_<proto>_<redop>_<C type>, NCCL >= 2.19 ncclDevKernel_<coll>_<redop>_<abbrev>_<algo>_<proto>.
NCCL_KERNEL_TYPES = {
    "int8_t": "int8", "uint8_t": "uint8", "int32_t": "int32", "uint32_t": "uint32", "int64_t": "int64",
    "uint64_t": "uint64", "half": "float16", "float": "float32", "double": "float64", "__nv_bfloat16": "bfloat16",
    "__nv_fp8_e4m3": "float8_e4m3fn", "__nv_fp8_e5m2": "float8_e5m2",
    "i8": "int8", "u8": "uint8", "i32": "int32", "u32": "uint32", "i64": "int64", "u64": "uint64",
    "f16": "float16", "f32": "float32", "f64": "float64", "bf16": "bfloat16", "f8e4m3": "float8_e4m3fn",
    "f8e5m2": "float8_e5m2",
}
_ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
             "int8": 1, "uint8": 1, "uint32": 4, "uint64": 8, "bool": 1, "complex64": 8, "complex128": 16,
             "float8_e4m3fn": 1, "float8_e5m2": 1}


def normalize_dtype(name: Any) -> str:
    """"Float" / "float" / "f32" / "c10::BFloat16" -> "float32" / "bfloat16"; unknown names pass through."""
    return _normalize_dtype(name if isinstance(name, str) else str(name or ""))


@functools.lru_cache(maxsize=4096)
def _normalize_dtype(name: str) -> str:
    text = name.strip()
    return _DTYPES.get(text.lower(), text)


def dtype_itemsize(name: str) -> int:
    """Bytes per element of a normalized dtype (0 when unknown)."""
    return _ITEMSIZE.get(name, 0)


# --------------------------------------------------------------------------
# op names
# --------------------------------------------------------------------------
_OPS = {
    "allreduce": "all_reduce", "all_reduce": "all_reduce", "allreduce_coalesced": "all_reduce_coalesced",
    "all_reduce_barrier": "barrier", "barrier": "barrier", "monitored_barrier": "monitored_barrier",
    "allgather": "all_gather", "all_gather": "all_gather", "_allgather_base": "all_gather_into_tensor",
    "allgather_base": "all_gather_into_tensor", "all_gather_into_tensor": "all_gather_into_tensor",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "all_gather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
    "allgather_coalesced": "all_gather_coalesced", "all_gather_base": "all_gather_into_tensor",
    "all_gather_single": "all_gather_into_tensor", "all_gather_v": "all_gather_v",
    "reduce_scatter_single": "reduce_scatter_tensor", "reduce_scatter_v": "reduce_scatter_v",
    "broadcast_oop": "broadcast", "reduce_oop": "reduce", "all_to_all_v_single": "all_to_all_single",
    "reducescatter": "reduce_scatter", "reduce_scatter": "reduce_scatter",
    "_reduce_scatter_base": "reduce_scatter_tensor", "reduce_scatter_base": "reduce_scatter_tensor",
    "reduce_scatter_tensor": "reduce_scatter_tensor",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced",
    "alltoall": "all_to_all", "all_to_all": "all_to_all", "alltoall_base": "all_to_all_single",
    "all_to_all_single": "all_to_all_single", "all_to_allv": "all_to_all_single", "alltoallv": "all_to_all_single",
    "broadcast": "broadcast", "bcast": "broadcast", "reduce": "reduce", "gather": "gather", "scatter": "scatter",
    "send": "send", "recv": "recv", "isend": "isend", "irecv": "irecv", "recv_any_source": "recv",
    "sendrecv": "sendrecv", "coalesced": "coalesced",
}
P2P_OPS = frozenset({"send", "recv", "isend", "irecv", "sendrecv"})
# Ops whose NCCL kernel is compiled per dtype: the others (all_gather, broadcast, sendrecv) move bytes, and the
# int8_t in their old kernel names is no tensor's dtype.
REDUCING_OPS = frozenset({"all_reduce", "reduce_scatter", "reduce"})


def normalize_op(name: Any) -> str:
    """NCCL/gloo/c10d spellings -> the torch API name our runtime writes ("_allgather_base" ->
    "all_gather_into_tensor", "allreduce" -> "all_reduce"); unknown names are lower-cased."""
    return _normalize_op(name if isinstance(name, str) else str(name or ""))


@functools.lru_cache(maxsize=4096)
def _normalize_op(name: str) -> str:
    text = name.strip()
    if ":" in text:                       # "nccl:all_reduce", "c10d::allreduce_"
        text = text.rsplit(":", 1)[1]
    text = text.split(" ", 1)[0].strip().lower()
    if text.endswith("_") and not text.startswith("_"):
        text = text[:-1]                  # c10d in-place names: allreduce_ -> allreduce
    return _OPS.get(text, _OPS.get(text.lstrip("_"), text))


# --------------------------------------------------------------------------
# process groups
# --------------------------------------------------------------------------
_KIND_RULES: list[tuple[str, str]] = [
    (r"default_pg|^world$|mesh_world", "world"),
    (r"expert.*data|edp|expert_dp", "edp"),
    (r"data.*(context|with_cp|_cp)|dp_cp", "dp_cp"),
    (r"expert|(^|[^a-z])ep([^a-z]|$)", "ep"),
    (r"tensor|(^|[^a-z])tp([^a-z]|$)", "tp"),
    (r"pipeline|(^|[^a-z])pp([^a-z]|$)", "pp"),
    (r"context|(^|[^a-z])cp([^a-z]|$)", "cp"),
    (r"data|(^|[^a-z])dp|fsdp|ddp", "dp"),
]


def group_kind(desc: str, name: str = "") -> str:
    """A schema group kind guessed from a group's description (Megatron's
    "TENSOR_MODEL_PARALLEL_GROUP", torchtitan's "mesh_tp", "default_pg")."""
    text = f"{desc} {name}".lower()
    for pattern, kind in _KIND_RULES:
        if re.search(pattern, text):
            return kind
    return "custom"


def _uninformative(desc: str) -> bool:
    return desc.strip().lower() in ("", "undefined", "none", "unnamed")


class GroupNamer:
    """Readable, unique labels for process groups known by (pg name, members).

    A group's label is its description ("default_pg", "mesh_tp") when that
    description belongs to one group only; otherwise "desc:name" ("tp:3"),
    and, where one pg name covers different member sets (split_group), the
    members are appended ("tp:3[0,1]"). Groups with no description keep their
    pg name ("0", "1"), as Flight Recorder spells them.
    """

    def __init__(self, groups: Iterable[tuple[str, str, tuple[int, ...] | None]]) -> None:
        items = sorted(set(groups), key=lambda g: (_pg_sort_key(g[0]), g[1], g[2] or ()))
        by_desc: dict[str, set[tuple[str, tuple[int, ...] | None]]] = {}
        by_name: dict[str, set[tuple[int, ...] | None]] = {}
        for name, desc, members in items:
            by_desc.setdefault(desc, set()).add((name, members))
            by_name.setdefault(name, set()).add(members)
        self.labels: dict[tuple[str, str, tuple[int, ...] | None], str] = {}
        for name, desc, members in items:
            if not _uninformative(desc) and len(by_desc[desc]) == 1:
                label = desc
            elif not _uninformative(desc):
                label = f"{desc}:{name}"
            else:
                label = name or "?"
            if len(by_name[name]) > 1 and members is not None:
                label += "[" + ",".join(str(r) for r in members) + "]"
            self.labels[(name, desc, members)] = label

    def __call__(self, name: str, desc: str, members: tuple[int, ...] | None) -> str:
        return self.labels[(name, desc, members)]


def _pg_sort_key(name: str) -> tuple[int, int | str]:
    return (0, int(name)) if str(name).isdigit() else (1, str(name))


def parse_ranks(value: Any) -> tuple[int, ...] | None:
    """Member ranks as pg_config / profiler args write them ("[0, 1, 2]", a
    list, or a truncated "[0, 1, ..., 63]" which is expanded when it is a
    stride); None when empty or unreadable."""
    if isinstance(value, str):
        return _parse_ranks_text(value)
    return _parse_ranks(value)


@functools.lru_cache(maxsize=4096)
def _parse_ranks_text(value: str) -> tuple[int, ...] | None:
    return _parse_ranks(value)


def _parse_ranks(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, (list, tuple)):
        items = list(value)
    else:
        text = str(value or "").strip()
        if not text or text in ("[]", "()"):
            return None
        parts = [p.strip() for p in text.strip("[]()").split(",") if p.strip()]
        if "..." in parts:
            i = parts.index("...")
            head = [to_int(p, -1) for p in parts[:i]]
            tail = [to_int(p, -1) for p in parts[i + 1:]]
            if min(head + tail, default=0) < 0:
                return None
            if len(head) >= 2 and tail:
                step = head[1] - head[0]
                if (step > 0 and (tail[-1] - head[0]) % step == 0 and 0 <= head[0]
                        and tail[-1] <= MAX_RANK and (tail[-1] - head[0]) // step < MAX_RANK):
                    return tuple(range(head[0], tail[-1] + 1, step))
            return None
        items = parts
    if len(items) > MAX_RANK:
        return None
    out = tuple(to_int(x, -1, 0, MAX_RANK) for x in items)
    if not out or min(out) < 0:      # junk, or a rank no job has: the list is unreadable
        return None
    return out


# --------------------------------------------------------------------------
# events table
# --------------------------------------------------------------------------
def coded(codes: np.ndarray, table: list[str] | np.ndarray, decode: bool = True) -> pa.Array:
    """A string column from integer codes into a small table of distinct values,
    expanded by Arrow (C++) instead of through a Python object array; with
    decode=False the dictionary array itself (for `events_table(..., dictionary=True)`)."""
    dictionary = pa.array(list(table), type=pa.string())
    arr = pa.DictionaryArray.from_arrays(pa.array(np.asarray(codes, dtype=np.int32)), dictionary)
    return arr.dictionary_decode() if decode else arr


def events_table(columns: Mapping[str, Any], n: int, dictionary: bool = False) -> pa.Table:
    """An Arrow table in EVENTS_SCHEMA with `n` rows from the given columns
    (arrays, lists, scalars, or Arrow arrays such as `coded(...)`); missing
    columns get -1 / "".

    dictionary=True: string columns given as dictionary arrays (`coded(..., decode=False)`)
    and the constant ones stay dictionary-encoded (the table's schema says so). Only
    for tables that go straight to `trace.assemble`, whose column engine reads the
    codes as they are: a million-entry Flight Recorder load then never writes out, and
    hashes back, millions of repeated strings."""
    arrays = []
    for name, dtype in S.EVENT_FIELDS:
        value = columns.get(name)
        if isinstance(value, (pa.Array, pa.ChunkedArray)):
            if dictionary and pa.types.is_dictionary(value.type) and pa.types.is_string(dtype):
                arrays.append(value)
            else:
                arrays.append(value.cast(dtype) if value.type != dtype else value)
        elif dictionary and pa.types.is_string(dtype) and (value is None or np.ndim(value) == 0):
            arrays.append(pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, dtype=np.int32)),
                                                         pa.array(["" if value is None else str(value)])))
        elif pa.types.is_integer(dtype):
            narrow = dtype == pa.int32()      # a hostile peer / step / stage must not fail the cast: clipped
            if value is None or np.ndim(value) == 0:
                v = -1 if value is None else int(value)
                if narrow:
                    v = min(max(v, -(2**31)), 2**31 - 1)
                arr = np.full(n, v, dtype=np.int32 if narrow else np.int64)
            else:
                arr = np.asarray(value, dtype=np.int64)
                if narrow:
                    arr = np.clip(arr, -(2**31), 2**31 - 1).astype(np.int32)
            arrays.append(pa.array(arr, type=pa.int32() if narrow else pa.int64()).cast(dtype))
        else:
            if value is None:
                arr = pa.array(np.full(n, "", dtype=object), type=pa.string())
            elif np.ndim(value) == 0:
                arr = pa.array(np.full(n, str(value), dtype=object), type=pa.string())
            else:
                arr = pa.array(np.asarray(value, dtype=object), type=pa.string())
            arrays.append(arr)
    if dictionary:
        fields = [pa.field(name, a.type) for (name, _), a in zip(S.EVENT_FIELDS, arrays)]
        return pa.Table.from_arrays(arrays, schema=pa.schema(fields, metadata=S.EVENTS_SCHEMA.metadata))
    return pa.Table.from_arrays(arrays, schema=S.EVENTS_SCHEMA)
