"""Arrow schemas of the trace: the contract between the runtime and the analyzer.

Everything ncclscope reads or writes about a run goes through these schemas, so
this module is deliberately tiny and imports nothing but pyarrow: the runtime
(which imports torch) and the analyzer (which never does) both depend on it.

Field names follow PyTorch's Flight Recorder where the meaning is the same
(`process_group`, `collective_seq_id`, `p2p_seq_id`, `input_sizes`,
`input_dtypes`, `timeout_ms`), so one loader and one set of analyses serve both
our own traces and Flight Recorder dumps.

Bump SCHEMA_VERSION on any change a reader would notice; the reader accepts the
same major version and warns on a newer minor one.
"""
from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = "1.0"

# File names inside a run directory (see docs/trace-format.md).
RUN_JSON = "run.json"
RANK_DIR_FMT = "rank-{:05d}"
RANK_JSON = "rank.json"
GROUPS_JSON = "groups.json"     # this rank's view of the process groups (may be absent in old traces)
EVENTS_FILE = "events.arrows"
METRICS_FILE = "metrics.arrows"
SAMPLES_FILE = "samples.arrows"
STACKS_FILE = "stacks.txt"

# Values of the `phase` column. An op writes a `begin` row before it starts and
# an `end` row after it finished (or failed): an op with no end row is the
# evidence of a hang. `instant` rows are markers (heartbeats, step boundaries).
PHASE_BEGIN = "begin"
PHASE_END = "end"
PHASE_INSTANT = "instant"

# Values of the `kind` column.
KIND_COLLECTIVE = "collective"
KIND_P2P = "p2p"
KIND_COMPUTE = "compute"
KIND_MARKER = "marker"

# Values of the `status` column on end rows (begin rows carry "").
STATUS_OK = "ok"
STATUS_TIMEOUT = "timeout"
STATUS_ERROR = "error"
STATUS_SUSPECT = "suspect"  # instant row from the watchdog: op far over its own history
# rank.json `end.message` of a rank that did not end on its own: the tracer's SIGTERM path (the
# launcher, torchrun's agent or a scheduler stopped the job), and the SIGABRT handler's
END_TERMINATED = "terminated by SIGTERM"
END_ABORTED = "aborted (SIGABRT)"
STATUS_NOT_MEMBER = "not_member"  # instant row: a collective called on a group this rank is not in (a no-op)

# The channel of a group's monitored barriers: gloo's group counter does not number them (it runs each as
# tagged sends and receives), so the run tracer numbers them on their own, under "<group>/barriers", a name
# that shares the group's members (index/views.py), never an instance with the group's collective of one number.
BARRIER_CHANNEL = "/barriers"


def barrier_group(name: str) -> str:
    """The group whose barrier channel `name` is ("world" for "world/barriers"), "" for any other name."""
    return name[:-len(BARRIER_CHANNEL)] if name.endswith(BARRIER_CHANNEL) else ""

HEARTBEAT = "heartbeat"

# One row per begin/end/instant. Integers that do not apply are -1, strings "".
EVENT_FIELDS: list[tuple[str, pa.DataType]] = [
    ("rank", pa.int32()),              # global rank that wrote the row
    ("op_id", pa.int64()),             # per-rank id shared by an op's begin and end rows
    ("phase", pa.string()),            # begin | end | instant
    ("time_ns", pa.int64()),           # rank-local wall clock (time.time_ns); align with rank.json offset
    ("kind", pa.string()),             # collective | p2p | compute | marker
    ("op_name", pa.string()),          # all_reduce, isend, forward, heartbeat, ...
    ("process_group", pa.string()),    # group name from the group table ("" for compute)
    ("collective_seq_id", pa.int64()), # per-group collective sequence number, from 1
    ("p2p_seq_id", pa.int64()),        # per (group, src, dst, tag) sequence number, from 1
    ("peer", pa.int32()),              # global rank of the p2p peer / broadcast root
    ("tag", pa.int32()),               # p2p tag
    ("bytes", pa.int64()),             # payload bytes this rank sends or reduces
    ("input_dtypes", pa.string()),     # e.g. "float64"
    ("input_sizes", pa.string()),      # shape(s) as JSON, e.g. "[[4,16]]"
    ("reduce_op", pa.string()),        # sum, max, avg, ... ("" if none)
    ("step", pa.int32()),
    ("microbatch", pa.int32()),
    ("stage", pa.int32()),             # pipeline stage (virtual stage for interleaved)
    ("chunk", pa.int32()),             # model chunk on this rank (interleaved)
    ("status", pa.string()),           # "" on begin; ok | timeout | error on end; suspect
    ("timeout_ms", pa.int64()),
    ("call_site", pa.string()),        # file:line of the caller outside comm.py
    ("message", pa.string()),          # error text, marker payload
]
EVENTS_SCHEMA = pa.schema(EVENT_FIELDS, metadata={"ncclscope_schema": SCHEMA_VERSION, "table": "events"})
EVENT_COLUMNS = [name for name, _ in EVENT_FIELDS]

# One row per optimizer step per rank. NaN where a value does not apply
# (for example loss on a non-last pipeline stage).
METRIC_FIELDS: list[tuple[str, pa.DataType]] = [
    ("rank", pa.int32()),
    ("step", pa.int32()),
    ("time_ns", pa.int64()),
    ("step_time_s", pa.float64()),
    ("loss", pa.float64()),
    ("grad_norm_local", pa.float64()),   # this rank's gradient before any reduction
    ("grad_norm_global", pa.float64()),  # norm of the full reduced gradient (all dims)
    ("grad_norm_reduced", pa.float64()),  # this rank's own gradient after the data-parallel reduction
    ("param_checksum", pa.float64()),    # sum over this rank's parameters; replicas must agree
    ("memory_bytes", pa.int64()),        # CUDA allocated, else process RSS
    ("tokens", pa.int64()),
    ("expert_load", pa.list_(pa.int64())),  # tokens routed to each local expert (MoE)
    ("dropped_tokens", pa.int64()),
    ("extra", pa.string()),              # JSON object for anything else
]
METRICS_SCHEMA = pa.schema(METRIC_FIELDS, metadata={"ncclscope_schema": SCHEMA_VERSION, "table": "metrics"})
METRIC_COLUMNS = [name for name, _ in METRIC_FIELDS]

# NVML samples, or host samples where NVML is absent (source says which).
SAMPLE_FIELDS: list[tuple[str, pa.DataType]] = [
    ("rank", pa.int32()),
    ("time_ns", pa.int64()),
    ("source", pa.string()),             # nvml | host
    ("device", pa.int32()),              # GPU index, -1 for host
    ("gpu_util", pa.float64()),          # percent
    ("mem_util", pa.float64()),          # percent
    ("mem_used_bytes", pa.int64()),
    ("power_w", pa.float64()),
    ("temperature_c", pa.float64()),
    ("cpu_percent", pa.float64()),       # host: this process
    ("rss_bytes", pa.int64()),
]
SAMPLES_SCHEMA = pa.schema(SAMPLE_FIELDS, metadata={"ncclscope_schema": SCHEMA_VERSION, "table": "samples"})
SAMPLE_COLUMNS = [name for name, _ in SAMPLE_FIELDS]

# Process groups as each rank saw them (stored in rank.json, loaded as a table).
GROUP_FIELDS: list[tuple[str, pa.DataType]] = [
    ("rank", pa.int32()),                # whose view this is
    ("process_group", pa.string()),      # name, e.g. "dp1"
    ("group_kind", pa.string()),         # tp | cp | dp | pp | ep | edp | dp_cp | world | custom
    ("ranks", pa.list_(pa.int32())),     # member global ranks
    ("creation_order", pa.int32()),
    ("backend", pa.string()),
]
GROUPS_SCHEMA = pa.schema(GROUP_FIELDS, metadata={"ncclscope_schema": SCHEMA_VERSION, "table": "groups"})
GROUP_COLUMNS = [name for name, _ in GROUP_FIELDS]

GROUP_KINDS = ("world", "tp", "cp", "dp", "pp", "ep", "edp", "dp_cp", "custom")

TABLE_SCHEMAS = {
    EVENTS_FILE: EVENTS_SCHEMA,
    METRICS_FILE: METRICS_SCHEMA,
    SAMPLES_FILE: SAMPLES_SCHEMA,
}


def rank_dir_name(rank: int) -> str:
    """Directory name of one rank inside a run directory (zero-padded so it sorts)."""
    return RANK_DIR_FMT.format(rank)


def major(version: str) -> str:
    """The major part of a schema version ("1.0" -> "1")."""
    return str(version).split(".", 1)[0]
