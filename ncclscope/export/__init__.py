"""Export a Trace to the tools people already use: Perfetto and Parquet.

    ncclscope export RUN --perfetto run.json     # open in https://ui.perfetto.dev
    ncclscope export RUN --parquet run_parquet/  # pandas, DuckDB, Polars, Spark

RUN is anything `load.foreign.load_any` reads (our run directory, Flight Recorder
dumps, profiler traces, or a dataset this module wrote).

Perfetto (Chrome trace-event JSON, `{"traceEvents": [...], "displayTimeUnit": "ns"}`):
- one process per rank ("rank 3 @ host"), one track (thread) per kind of
  activity: "compute", "collective <group>", "p2p <group>", "markers";
  ops that overlap on one track (async isend/irecv) are spread over extra
  lanes, because trace viewers draw only properly nested slices;
- every op is an "X" slice (ts/dur in µs from the trace's first event, the
  absolute start in otherData.t0_ns) whose args carry group, sequence number,
  peer, bytes, dtype, step, microbatch, status and call site; an op that never
  ended is drawn to the end of the trace with status "inflight" and
  note "never completed";
- a flow arrow ("s" -> "f", bp "e") from each send to the recv it pairs with,
  matched by (src, dst, tag, p2p_seq_id) as in hang/p2p.py;
- "C" counters for NVML/host samples and per-step metrics, "i" instants for
  markers (heartbeats are left out: they would bury everything else).
The JSON is assembled column-wise (strings escaped once per distinct value),
not one dict per event, so exporting millions of ops takes seconds.

Parquet: one dataset per table (events, ops, metrics, samples, groups), each
partitioned by rank in hive layout (`ops/rank=3/part-0.parquet`), plus
`ncclscope_dataset.json` (schema version, run info, ranks, warnings, stacks)
from which `load_parquet` rebuilds the Trace, so the export round-trips.

Modules: `perfetto.py` (trace-event JSON), `parquet.py` (datasets, and reading them back).
"""
from __future__ import annotations

from ncclscope.export.parquet import DATASET_MARKER, PARQUET_TABLES, export_parquet, load_parquet
from ncclscope.export.perfetto import INFLIGHT_NOTE, export_perfetto

__all__ = ["DATASET_MARKER", "PARQUET_TABLES", "INFLIGHT_NOTE", "export_perfetto", "export_parquet", "load_parquet"]
