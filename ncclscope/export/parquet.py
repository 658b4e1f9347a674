"""Parquet export: one hive-partitioned dataset per table plus ncclscope_dataset.json,
and `load_parquet`, which rebuilds the Trace from it (read like any other input:
through safe_io, every failure one TraceError line)."""
from __future__ import annotations

import gc
import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from ncclscope.load import safe_io
from ncclscope import schema as S
from ncclscope.load.trace import RankInfo, RunInfo, Tables, Trace, TraceError, assemble

DATASET_MARKER = "ncclscope_dataset.json"
PARQUET_TABLES = ("events", "ops", "metrics", "samples", "groups")


# --------------------------------------------------------------------------
# Parquet
# --------------------------------------------------------------------------
def _arrow(df: pd.DataFrame) -> pa.Table:
    """pandas -> Arrow with categoricals decoded to plain strings (every reader takes those)."""
    table = pa.Table.from_pandas(df, preserve_index=False)
    cols, fields = [], []
    for fld, col in zip(table.schema, table.columns):
        if pa.types.is_dictionary(fld.type):
            col = pa.chunked_array([c.dictionary_decode() for c in col.chunks], type=fld.type.value_type)
            fld = pa.field(fld.name, fld.type.value_type)
        if pa.types.is_large_string(fld.type):
            col = col.cast(pa.string())
            fld = pa.field(fld.name, pa.string())
        if fld.name == "rank":
            col = col.cast(pa.int32())
            fld = pa.field("rank", pa.int32())
        cols.append(col)
        fields.append(fld)
    return pa.Table.from_arrays(cols, schema=pa.schema(fields))


def export_parquet(trace: Trace, out_dir: str | os.PathLike[str]) -> dict[str, Any]:
    """Write events, ops, metrics, samples and groups as Parquet datasets
    partitioned by rank (hive layout) under out_dir; returns row counts."""
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise TraceError(f"{out}: exists and is not a directory")
    if out.exists() and any(out.iterdir()) and not (out / DATASET_MARKER).exists():
        raise TraceError(f"{out}: exists, is not empty and is not an ncclscope dataset; refusing to write into it")
    out.mkdir(parents=True, exist_ok=True)
    part = ds.partitioning(pa.schema([("rank", pa.int32())]), flavor="hive")
    stats: dict[str, Any] = {"path": str(out)}
    tables = {"events": trace.events, "ops": trace.ops, "metrics": trace.metrics, "samples": trace.samples,
              "groups": trace.groups}
    for name, df in tables.items():
        target = out / name
        if target.exists():
            shutil.rmtree(target)
        table = _arrow(df.reset_index(drop=True))
        if len(table):
            ds.write_dataset(table, target, format="parquet", partitioning=part,
                             basename_template="part-{i}.parquet", existing_data_behavior="overwrite_or_ignore")
        else:
            target.mkdir(parents=True)
            pq.write_table(table, target / "part-0.parquet")
        stats[name] = int(len(table))
        del table
    # The dataset writer's Python objects are dropped here, while Arrow is alive: left to the interpreter's
    # final collection, their threads can outlive Arrow's pools and abort the process at exit ("terminate
    # called without an active exception", apache/arrow#36980; seen once in this suite after a clean export).
    gc.collect()
    meta = {
        "ncclscope_schema": S.SCHEMA_VERSION, "tables": {k: stats[k] for k in PARQUET_TABLES},
        "partitioning": "hive, by rank", "source_path": str(trace.path), "world_size": trace.world_size,
        "run": trace.run.raw, "ranks": [asdict(info) for info in trace.ranks.values()],
        "warnings": list(trace.warnings), "stacks": {str(r): s for r, s in trace.stacks.items()},
    }
    (out / DATASET_MARKER).write_text(json.dumps(meta, indent=1, default=str))
    return stats


def _read_table(path: Path) -> pa.Table:
    try:
        files = sorted(p for p in path.rglob("*.parquet") if safe_io.is_regular(p))
    except OSError as exc:
        raise TraceError(f"{path}: cannot list ({safe_io.short(exc)})") from None
    if not files:
        raise TraceError(f"{path}: no Parquet files")
    parts = []
    for f in files:
        try:
            t = pq.read_table(f)
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise TraceError(f"{f}: not a readable Parquet file ({safe_io.short(exc)})") from None
        if "rank" not in t.column_names:
            rank = next((safe_io.to_int(p.split("=", 1)[1], -1, 0, safe_io.MAX_RANK)
                         for p in f.relative_to(path).parts if p.startswith("rank=")), -1)
            t = t.append_column("rank", pa.array(np.full(len(t), rank, np.int32)))
        parts.append(t)
    return pa.concat_tables(parts, promote_options="default")


def load_parquet(path: str | os.PathLike[str]) -> Trace:
    """Rebuild a Trace from a dataset written by `export_parquet`; TraceError
    (one line) for anything that is not one."""
    try:
        return _load_parquet(Path(path))
    except TraceError:
        raise
    except (pa.ArrowException, OSError, ValueError, TypeError, KeyError, AttributeError) as exc:
        raise TraceError(f"{path}: not a readable ncclscope Parquet dataset "
                         f"({type(exc).__name__}: {safe_io.short(exc)})") from None


def _load_parquet(root: Path) -> Trace:
    marker = root / DATASET_MARKER
    if not marker.exists():
        raise TraceError(f"{root}: no {DATASET_MARKER} (not a dataset written by `ncclscope export --parquet`)")
    try:
        meta = safe_io.read_json(marker)
    except safe_io.InputError as exc:
        raise TraceError(str(exc)) from None
    if not isinstance(meta, dict):
        raise TraceError(f"{marker}: not a JSON object")
    if S.major(str(meta.get("ncclscope_schema", "0"))) != S.major(S.SCHEMA_VERSION):
        raise TraceError(f"{root}: schema {str(meta.get('ncclscope_schema'))[:40]}, this reader understands "
                         f"{S.SCHEMA_VERSION}")
    ranks = {}
    items = meta.get("ranks") if isinstance(meta.get("ranks"), list) else []
    for item in items[:safe_io.MAX_RANK]:
        if not isinstance(item, dict):
            continue
        fields = {k: v for k, v in item.items() if k in RankInfo.__dataclass_fields__}
        info = RankInfo(**fields)
        info.rank = safe_io.to_int(info.rank, -1, 0, safe_io.MAX_RANK)
        info.clock_offset_ns = safe_io.to_int(info.clock_offset_ns, 0, -(2**53), 2**53)
        if info.rank >= 0:
            ranks[info.rank] = info
    offsets = {r: info.clock_offset_ns for r, info in ranks.items()}

    def conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
        cols = [table.column(f.name).cast(f.type) if f.name in table.column_names else pa.nulls(len(table), f.type)
                for f in schema]
        return pa.Table.from_arrays(cols, schema=schema)

    def unalign(table: pa.Table) -> pa.Table:
        """metrics/samples were written with aligned times; assemble aligns again."""
        if not len(table) or not any(offsets.values()):
            return table
        r = table.column("rank").to_numpy()
        off = np.array([offsets.get(int(x), 0) for x in r], np.int64)
        idx = table.schema.get_field_index("time_ns")
        return table.set_column(idx, "time_ns", pa.array(table.column("time_ns").to_numpy() - off))

    events = conform(_read_table(root / "events"), S.EVENTS_SCHEMA)
    metrics = unalign(conform(_read_table(root / "metrics"), S.METRICS_SCHEMA))
    samples = unalign(conform(_read_table(root / "samples"), S.SAMPLES_SCHEMA))
    groups = _read_table(root / "groups").to_pandas()
    group_rows = [{"rank": int(g["rank"]), "process_group": str(g["process_group"]),
                   "group_kind": str(g["group_kind"]), "ranks": [int(x) for x in g["ranks"]],
                   "creation_order": int(g["creation_order"]), "backend": str(g["backend"])}
                  for g in groups.to_dict("records")] if len(groups) else []
    raw_stacks = meta.get("stacks") if isinstance(meta.get("stacks"), dict) else {}
    stacks = {safe_io.to_int(k): str(v) for k, v in raw_stacks.items()}
    world = safe_io.to_int(meta.get("world_size"), len(ranks), 0)
    highest = max(ranks, default=-1)
    world = min(world, safe_io.plausible_world(world, len(ranks), highest))
    for r in range(world):
        ranks.setdefault(r, RankInfo(rank=r, present=False))
    run = RunInfo.from_dict(meta.get("run") if isinstance(meta.get("run"), dict) else {})
    warnings = meta.get("warnings") if isinstance(meta.get("warnings"), list) else []
    return assemble(root, run, max(world, highest + 1), ranks, Tables(
        events=[events], metrics=[metrics], samples=[samples], group_rows=group_rows, stacks=stacks,
        warnings=[str(w) for w in warnings]))
