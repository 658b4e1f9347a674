"""PyTorch profiler traces (Chrome trace JSON, optionally gzipped) -> Trace.

    ncclscope analyze ./profiles/      # one <name>.pt.trace.json[.gz] per rank

What is read from each rank's trace (everything else is skipped unparsed):
- communication ops: on GPU traces the NCCL kernels (`ncclKernel_*`,
  `ncclDevKernel_*`, cat "kernel"), whose args carry "Collective name",
  "Process Group Name/Description/Ranks", "In msg nelems", "dtype",
  "Src Rank"/"Dst Rank" for p2p; on CPU traces (gloo) the `gloo:*`
  user annotations, with "Input Dims"/"Input type" when record_shapes was on,
  and the peer of a send/recv from the `c10d::send` / `c10d::recv_` op that
  issued it. Where a GPU trace has no kernels, `record_param_comms` CPU ops
  stand in;
- steps: `ProfilerStep#N` spans (schedule + `prof.step()`) -> `step` on every
  row inside, and one metrics row per step with its duration;
- microbatches: `torch.distributed.pipelining` annotations (`PP:1F3`,
  `Forward 3`, `Backward 3`) and names like `forward_mb3` / `bwd 3` -> compute
  rows with step, microbatch and stage, the shape the bubble analysis needs.

The rank comes from `distributedInfo.rank`, else from the file name
(`rank3`, `rank_3`, `...3.pt.trace.json`). Times: `baseTimeNanoseconds` +
ts (µs) is the wall clock, comparable across ranks on one host (on several
hosts, as good as their NTP). Profiler traces hold finished ops only.

Speed: kineto writes one event per indented block, so the reader finds the
interesting events with one regex pass over the text and json-parses only
those (usually well under 1% of a trace); any other layout falls back to a
full `json.loads`.
"""
from __future__ import annotations

import functools
import gzip
import json
import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pandas as pd
import pyarrow as pa

from .. import schema as S
from ..trace import RankInfo, Trace, TraceError, assemble
from . import GroupNamer, P2P_OPS, dtype_itemsize, events_table, group_kind, normalize_dtype, normalize_op, parse_ranks

SNIFF_BYTES = 65536
UNKNOWN_GROUP = "unknown"

# Which events matter, decided from (cat, name) before anything is parsed.
_C10D_P2P = {"c10d::send": "send", "c10d::recv_": "recv", "c10d::recv_any_source_": "recv"}
_STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
_MB_RES: list[tuple[re.Pattern[str], str]] = [
    (re.compile(r"^PP:(?P<stage>\d+)(?P<kind>[FBIW])(?P<mb>\d+)$"), "pp"),
    (re.compile(r"^(?P<kind>Forward|Backward) (?P<mb>\d+)$"), "gpipe"),
    (re.compile(r"(?i)^(?:.*[^a-z])?(?P<kind>forward|backward|fwd|bwd)[ _\-]?"
                r"(?:mb|microbatch|micro_batch|micro-batch)?[ _\-#]?(?P<mb>\d+)$"), "generic"),
]
_PP_KIND = {"F": "forward", "B": "backward", "I": "backward_input", "W": "backward_weight"}
_KINETO_LAYOUT = re.compile(rb'\[\s*\n  \{\n    "ph": "')


def _microbatch(name: str) -> tuple[str, int, int] | None:
    """(compute op name, microbatch, stage) from an annotation name, else None."""
    for rx, style in _MB_RES:
        m = rx.match(name)
        if m:
            kind = m.group("kind")
            if style == "pp":
                return _PP_KIND[kind], int(m.group("mb")), int(m.group("stage"))
            k = kind.lower()
            return ("forward" if k in ("forward", "fwd") else "backward"), int(m.group("mb")), -1
    return None


def _interesting(cat: str, name: str) -> bool:
    if cat == "kernel":
        return name.startswith("nccl")
    if cat == "cpu_op":
        return name in _C10D_P2P or name == "record_param_comms"
    return (name.startswith(("gloo:", "ProfilerStep#", "nccl:")) or _microbatch(name) is not None)


# --------------------------------------------------------------------------
# Files
# --------------------------------------------------------------------------
def _head(path: Path) -> bytes:
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as fh:
                return fh.read(SNIFF_BYTES)
        with open(path, "rb") as fh:
            return fh.read(SNIFF_BYTES)
    except (OSError, EOFError, gzip.BadGzipFile):
        return b""


def sniff(path: Path) -> bool:
    """True when the file looks like a Chrome trace from torch.profiler."""
    if not (path.name.endswith(".json") or path.name.endswith(".json.gz")):
        return False
    head = _head(path)
    return head.lstrip().startswith(b"{") and (b'"traceEvents"' in head or b'"schemaVersion"' in head
                                               or b'"distributedInfo"' in head)


def trace_files(directory: Path) -> list[Path]:
    return [p for p in sorted(directory.iterdir()) if p.is_file() and not p.name.startswith(".") and sniff(p)]


def _read_bytes(path: Path) -> bytes:
    try:
        return gzip.open(path, "rb").read() if path.name.endswith(".gz") else path.read_bytes()
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise TraceError(f"{path}: unreadable ({exc})") from None


_RANK_NAME_RES = [re.compile(r"(?i)rank[_\-]?(\d+)"), re.compile(r"(?:^|[^0-9])(\d{1,5})$")]


def rank_from_name(name: str) -> int | None:
    stem = name
    for suffix in (".gz", ".json", ".trace", ".pt"):
        if stem.endswith(suffix):
            stem = stem[: -len(suffix)]
    for rx in _RANK_NAME_RES:
        m = rx.search(stem)
        if m:
            return int(m.group(1))
    return None


# --------------------------------------------------------------------------
# Event selection
# --------------------------------------------------------------------------
def _header_and_events(text: bytes, path: Path) -> tuple[dict[str, Any], Iterator[dict[str, Any]]]:
    """(top-level fields except traceEvents, the interesting X events)."""
    start = text.find(b'"traceEvents"')
    if start >= 0 and _KINETO_LAYOUT.search(text, start, start + 256):
        header = _fast_header(text, start)
        if header is not None:
            return header, _fast_events(text, start)
    try:
        doc = json.loads(text)
    except ValueError as exc:
        # A profiler killed mid-write leaves an unterminated array: keep what is complete.
        if start >= 0:
            header = _fast_header(text, start) or {}
            return header, _fast_events(text, start)
        raise TraceError(f"{path}: not valid JSON ({str(exc)[:120]})") from None
    if not isinstance(doc, dict):
        doc = {"traceEvents": doc} if isinstance(doc, list) else {}
    events = doc.pop("traceEvents", []) or []
    return doc, (e for e in events if isinstance(e, dict) and e.get("ph") == "X"
                 and _interesting(str(e.get("cat", "")), str(e.get("name", ""))))


def _fast_header(text: bytes, start: int) -> dict[str, Any] | None:
    """Top-level fields: the text before "traceEvents", closed into an object."""
    head = text[:start].rstrip().rstrip(b",") + b"}"
    try:
        header = json.loads(head)
    except ValueError:
        header = {}
        decoded = head.decode("utf-8", errors="replace")
        for key in ("distributedInfo", "baseTimeNanoseconds", "deviceProperties", "host_name"):
            m = re.search(r'"%s":\s*' % key, decoded)
            if m:
                try:
                    header[key] = json.JSONDecoder().raw_decode(decoded, m.end())[0]
                except ValueError:
                    pass
    return header if isinstance(header, dict) else None


# Kineto writes every event as "\n  {\n    ...\n  }" with "cat" just before "name", so
# the few events we need are found by plain substring search (C speed), and only they
# are parsed. Each needle is followed by the check of (cat, name) on the parsed event.
_NEEDLES = (b'"cat": "user_annotation"', b'"cat": "gpu_user_annotation"', b'"name": "nccl',
            b'"name": "record_param_comms"', b'"name": "c10d::')


def _fast_events(text: bytes, start: int) -> Iterator[dict[str, Any]]:
    starts: set[int] = set()
    for needle in _NEEDLES:
        find = text.find
        i = find(needle, start)
        while i >= 0:
            b = text.rfind(b"\n  {", start, i)
            if b >= 0:
                starts.add(b)
            i = find(needle, i + len(needle))
    for b in sorted(starts):
        e = text.find(b"\n  }", b + 4)
        if e < 0:
            continue
        try:
            ev = json.loads(text[b + 1:e + 4].decode("utf-8", errors="replace"))
        except ValueError:
            continue
        if isinstance(ev, dict) and ev.get("ph") == "X" and _interesting(str(ev.get("cat", "")), str(ev.get("name", ""))):
            yield ev


# --------------------------------------------------------------------------
# One rank
# --------------------------------------------------------------------------
_KERNEL_RE = re.compile(r"^nccl(?:Dev)?Kernel_([A-Za-z]+?)(?:_|\(|$)(.*)")
_KERNEL_OPS = {"AllReduce": "all_reduce", "AllGather": "all_gather", "ReduceScatter": "reduce_scatter",
               "Broadcast": "broadcast", "Reduce": "reduce", "SendRecv": "sendrecv", "Send": "send",
               "Recv": "recv", "AllToAll": "all_to_all", "Generic": "nccl_generic"}
_REDOPS = {"sum": "sum", "prod": "product", "max": "max", "min": "min", "avg": "avg", "premulsum": "premul_sum",
           "sumpostdiv": "sum"}


@functools.lru_cache(maxsize=4096)
def _kernel_info(name: str) -> tuple[str, str, str]:
    """(op, reduce_op, dtype) from an NCCL kernel name, e.g.
    ncclDevKernel_AllReduce_Sum_f32_RING_LL -> all_reduce, sum, float32."""
    m = _KERNEL_RE.match(name)
    if not m:
        return "nccl_kernel", "", ""
    op = _KERNEL_OPS.get(m.group(1), normalize_op(m.group(1)))
    redop, dtype = "", ""
    for tok in re.split(r"[_(<,]", m.group(2)):
        low = tok.lower()
        if not redop and low in _REDOPS:
            redop = _REDOPS[low]
        elif not dtype and normalize_dtype(low) != low:
            dtype = normalize_dtype(low)
    return op, redop, dtype


def _num(v: Any, default: float = -1.0) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return default


def _dims_bytes(dims: Any, types: Any) -> tuple[str, str, int]:
    """(input_sizes JSON, dtype, bytes) from the profiler's "Input Dims"/"Input type"."""
    shapes = [d for d in dims if isinstance(d, list) and all(isinstance(x, int) for x in d)] if isinstance(dims, list) else []
    tys = [normalize_dtype(t) for t in types if isinstance(t, str) and t] if isinstance(types, list) else []
    tys = [t for t in tys if dtype_itemsize(t)]
    total = 0
    for i, shp in enumerate(shapes):
        n = 1
        for x in shp:
            n *= x
        total += n * dtype_itemsize(tys[min(i, len(tys) - 1)]) if tys else 0
    return json.dumps(shapes), ",".join(dict.fromkeys(tys)), total


def _rank_rows(header: dict[str, Any], events: Iterator[dict[str, Any]], base_ns: int) -> dict[str, Any]:
    """Pull the rows of one rank's trace out of its interesting events."""
    comm: list[dict[str, Any]] = []
    steps: list[tuple[int, int, int, bool]] = []          # (start_ns, end_ns, step, on_gpu)
    mbs: list[tuple[int, int, str, int, int, bool]] = []  # (start, end, op, microbatch, stage, on_gpu)
    p2p_calls: list[tuple[Any, int, str, int, int]] = []  # (tid, ts_ns, direction, peer, tag)
    param_comms: list[dict[str, Any]] = []
    kernels = 0
    pid: Any = None

    def ns(ts: Any) -> int:
        return base_ns + int(round(_num(ts, 0.0) * 1000.0))

    for ev in events:
        cat, name = str(ev.get("cat", "")), str(ev.get("name", ""))
        args = ev.get("args") if isinstance(ev.get("args"), dict) else {}
        t0 = ns(ev.get("ts"))
        t1 = t0 + int(round(max(_num(ev.get("dur"), 0.0), 0.0) * 1000.0))
        if cat == "kernel":
            kernels += 1
            comm.append({"src": "kernel", "name": name, "args": args, "start": t0, "end": t1,
                         "tid": ev.get("tid")})
            continue
        if cat == "cpu_op":
            if name == "record_param_comms":
                param_comms.append({"src": "param", "name": name, "args": args, "start": t0, "end": t1,
                                    "tid": ev.get("tid")})
            else:
                conc = args.get("Concrete Inputs") if isinstance(args.get("Concrete Inputs"), list) else []
                peer = int(_num(conc[2], -1)) if len(conc) > 2 else -1
                tag = int(_num(conc[3], 0)) if len(conc) > 3 else 0
                p2p_calls.append((ev.get("tid"), t0, _C10D_P2P[name], peer, tag))
                pid = pid if pid is not None else ev.get("pid")
            continue
        gpu = cat == "gpu_user_annotation"
        m = _STEP_RE.match(name)
        if m:
            steps.append((t0, t1, int(m.group(1)), gpu))
            if not gpu:
                pid = pid if pid is not None else ev.get("pid")
            continue
        if name.startswith(("gloo:", "nccl:")):
            if name.startswith("gloo:") and not gpu:
                comm.append({"src": "gloo", "name": name, "args": args, "start": t0, "end": t1, "tid": ev.get("tid")})
            continue
        mb = _microbatch(name)
        if mb is not None:
            mbs.append((t0, t1, mb[0], mb[1], mb[2], gpu))
    if kernels == 0 and param_comms:
        comm.extend(param_comms)
    elif kernels:
        comm = [c for c in comm if c["src"] == "kernel"]
    return {"comm": comm, "steps": steps, "mbs": mbs, "p2p_calls": p2p_calls, "pid": pid}


def _containing(starts: np.ndarray, spans: list[tuple[int, int, Any]]) -> np.ndarray:
    """Index into `spans` (sorted, non-overlapping start/end/...) of the span holding each start, or -1."""
    if not spans or not len(starts):
        return np.full(len(starts), -1, np.int64)
    s0 = np.array([s[0] for s in spans], np.int64)
    s1 = np.array([s[1] for s in spans], np.int64)
    i = np.searchsorted(s0, starts, side="right") - 1
    ok = (i >= 0) & (starts < s1[np.clip(i, 0, None)])
    return np.where(ok, i, -1)


# --------------------------------------------------------------------------
# Loader
# --------------------------------------------------------------------------
def load_profiler(path: str | Path) -> Trace:
    """Load a directory of per-rank profiler traces (or one trace file)."""
    root = Path(path)
    if root.is_dir():
        files = trace_files(root)
        if not files:
            raise TraceError(f"{root}: no PyTorch profiler traces (*.json / *.json.gz with traceEvents)")
    elif root.is_file():
        files = [root]
    else:
        raise TraceError(f"{root}: no such file or directory")
    warnings: list[str] = []
    parsed: dict[int, tuple[Path, dict[str, Any], dict[str, Any], int]] = {}
    pending: list[tuple[Path, dict[str, Any], dict[str, Any], int]] = []
    for f in files:
        text = _read_bytes(f)
        header, events = _header_and_events(text, f)
        base_ns = int(_num(header.get("baseTimeNanoseconds"), 0))
        rows = _rank_rows(header, events, base_ns)
        del text
        info = header.get("distributedInfo") if isinstance(header.get("distributedInfo"), dict) else {}
        rank = int(_num(info.get("rank"), -1)) if info else -1
        if rank < 0:
            r = rank_from_name(f.name)
            rank = r if r is not None else -1
        if rank < 0 or rank in parsed:
            if rank in parsed:
                warnings.append(f"{f}: rank {rank} already read from {parsed[rank][0].name}; assigned a free rank")
            pending.append((f, header, rows, base_ns))
            continue
        parsed[rank] = (f, header, rows, base_ns)
    for f, header, rows, base_ns in pending:
        rank = next(r for r in range(len(parsed) + len(pending) + 1) if r not in parsed)
        warnings.append(f"{f}: no distributedInfo and no rank in the file name; read as rank {rank}")
        parsed[rank] = (f, header, rows, base_ns)
    if not parsed:
        raise TraceError(f"{root}: no readable profiler trace")

    world = max(parsed) + 1
    for _, header, _, _ in parsed.values():
        info = header.get("distributedInfo") if isinstance(header.get("distributedInfo"), dict) else {}
        world = max(world, int(_num(info.get("world_size"), 0)))
    missing_base = [r for r, v in parsed.items() if v[3] == 0]
    if missing_base and len(parsed) > 1:
        warnings.append(f"ranks {missing_base[:8]}: trace has no baseTimeNanoseconds; times taken as absolute µs")

    # groups: distributedInfo pg_config (+ what NCCL kernel args name) -----------------------------
    group_views: dict[int, list[tuple[str, str, tuple[int, ...] | None, str]]] = {}
    for r, (_, header, rows, _) in parsed.items():
        info = header.get("distributedInfo") if isinstance(header.get("distributedInfo"), dict) else {}
        backend = str(info.get("backend", ""))
        views = []
        for pg in info.get("pg_config", []) if isinstance(info.get("pg_config"), list) else []:
            if isinstance(pg, dict):
                members = parse_ranks(pg.get("ranks"))
                views.append((str(pg.get("pg_name", "")), str(pg.get("pg_desc", "")), members, backend))
        group_views[r] = views
    namer_items = {(g, d, m) for views in group_views.values() for g, d, m, _ in views}
    for r, (_, _, rows, _) in parsed.items():
        for c in rows["comm"]:
            a = c["args"]
            if "Process Group Name" in a:
                namer_items.add((str(a.get("Process Group Name", "")), str(a.get("Process Group Description", "")),
                                 parse_ranks(a.get("Process Group Ranks"))))
    namer = GroupNamer(namer_items)

    tables, metric_tables, group_rows = [], [], []
    ranks: dict[int, RankInfo] = {}
    multi_pg_gloo = False
    for r, (f, header, rows, base_ns) in sorted(parsed.items()):
        views = group_views.get(r, [])
        default = next(((g, d, m) for g, d, m, _ in views if d == "default_pg"), None)
        only = (views[0][0], views[0][1], views[0][2]) if len(views) == 1 else None
        gloo_group = only or (None if len(views) > 1 else default)
        if rows["comm"] and any(c["src"] == "gloo" for c in rows["comm"]) and len(views) > 1:
            multi_pg_gloo = True
        table = _comm_table(r, rows, namer, gloo_group, world, views)
        tables.append(table)
        metric_tables.append(_metrics_table(r, rows["steps"]))
        dev = header.get("deviceProperties")
        device = str(dev[0].get("name", "")) if isinstance(dev, list) and dev and isinstance(dev[0], dict) else "cpu"
        ranks[r] = RankInfo(rank=r, present=True, host=str(header.get("host_name", "")),
                            pid=int(_num(rows["pid"], -1)) if isinstance(rows["pid"], (int, float, str)) else -1,
                            device=device, end_status="ok")
        for order, (g, d, m, backend) in enumerate(views):
            if m is None:
                continue
            label = namer(g, d, m)
            group_rows.append({"rank": r, "process_group": label, "group_kind": group_kind(d, g),
                               "ranks": [int(x) for x in m], "creation_order": order, "backend": backend})
        if not rows["comm"]:
            warnings.append(f"{f}: no communication ops found (no NCCL kernels, gloo:* annotations or "
                            "record_param_comms)")
    if multi_pg_gloo:
        warnings.append("gloo profiler traces do not say which process group a collective ran on; with "
                        f"several groups they are all attributed to '{UNKNOWN_GROUP}' and numbered per rank "
                        "in start order, so per-group alignment may be off")
    _pipeline_from_annotations(parsed, ranks, group_rows, warnings)
    for r in range(world):
        if r not in ranks:
            ranks[r] = RankInfo(rank=r, present=False)
            warnings.append(f"rank {r}: no profiler trace; analyzing the other ranks")
    run = {"source": "torch_profiler", "world_size": world, "files": {str(r): str(v[0]) for r, v in parsed.items()},
           "backend": ",".join(sorted({b for views in group_views.values() for *_, b in views if b}))}
    return assemble(root, run, world, ranks, tables, metric_tables, None, group_rows, None, warnings)


def _pipeline_from_annotations(parsed: dict[int, Any], ranks: dict[int, RankInfo], group_rows: list[dict[str, Any]],
                               warnings: list[str]) -> None:
    """torch.distributed.pipelining names its actions "PP:<stage><F|B|I|W><mb>": the
    stage each rank runs is then known even when no process group is tagged as the
    pipeline one. Record it as the rank's pp coordinate and, when the trace names no
    pp group, add one (members in stage order) so the bubble analysis can run."""
    stage_of: dict[int, int] = {}
    for r, (_, _, rows, _) in parsed.items():
        stages = [m[4] for m in rows["mbs"] if m[4] >= 0]
        if stages:
            stage_of[r] = min(stages)
            ranks[r].coords["pp"] = min(stages)
    if len(stage_of) < 2 or any(g["group_kind"] == "pp" for g in group_rows):
        return
    members = sorted(stage_of, key=lambda r: (stage_of[r], r))
    order = 1 + max((g["creation_order"] for g in group_rows), default=-1)
    for r in members:
        group_rows.append({"rank": r, "process_group": "pp", "group_kind": "pp", "ranks": members,
                           "creation_order": order, "backend": ""})
    warnings.append(f"pipeline stages taken from PP:<stage>... annotations: pp group {members} (no process group "
                    "in the traces is tagged as the pipeline one)")


def _comm_table(rank: int, rows: dict[str, Any], namer: GroupNamer, gloo_group: Any, world: int,
                views: list[tuple[str, str, tuple[int, ...] | None, str]]) -> pa.Table:
    comm = rows["comm"]
    n = len(comm)
    cols: dict[str, list[Any]] = {k: [] for k in ("kind", "op_name", "process_group", "peer", "tag",
                                                  "bytes", "input_dtypes", "input_sizes", "reduce_op", "start", "end",
                                                  "gpu", "explicit_seq")}
    calls = sorted(rows["p2p_calls"], key=lambda c: c[1])
    call_t = np.array([c[1] for c in calls], np.int64)
    gloo_label = namer(*gloo_group) if gloo_group is not None else UNKNOWN_GROUP
    labels: dict[tuple[str, str, str], str] = {}
    members_of_gloo = sorted(gloo_group[2]) if gloo_group is not None and gloo_group[2] else None
    for c in comm:
        a = c["args"]
        if c["src"] == "gloo":
            op = normalize_op(c["name"])
            sizes, dtype, nbytes = _dims_bytes(a.get("Input Dims"), a.get("Input type"))
            group, redop, seq, peer, tag = gloo_label, "", -1, -1, -1
            if op in P2P_OPS:
                tag = 0
                i = int(np.searchsorted(call_t, c["start"], side="right")) - 1
                # the c10d call that issued it, on the same thread, just before
                while i >= 0 and calls[i][0] != c["tid"]:
                    i -= 1
                if i >= 0 and calls[i][2] == ("send" if op.endswith("send") else "recv"):
                    peer, tag = calls[i][3], calls[i][4]
                    if members_of_gloo and 0 <= peer < len(members_of_gloo):
                        peer = members_of_gloo[peer]
                if peer < 0 and world == 2:
                    peer = 1 - rank
            gpu = False
        else:
            k_op, redop, k_dtype = _kernel_info(c["name"]) if c["src"] == "kernel" else ("", "", "")
            op = normalize_op(a.get("Collective name")) if a.get("Collective name") else k_op
            dtype = normalize_dtype(a.get("dtype")) if a.get("dtype") else k_dtype
            nel = _num(a.get("In msg nelems"), -1)
            nbytes = int(nel * dtype_itemsize(dtype)) if nel >= 0 else 0
            sizes = json.dumps([[int(nel)]]) if nel >= 0 else "[]"
            if "Process Group Name" in a:
                key = (str(a.get("Process Group Name", "")), str(a.get("Process Group Description", "")),
                       str(a.get("Process Group Ranks")))
                group = labels.get(key)
                if group is None:
                    group = labels[key] = namer(key[0], key[1], parse_ranks(a.get("Process Group Ranks")))
            elif len(views) == 1:
                group = namer(views[0][0], views[0][1], views[0][2])
            else:
                group = UNKNOWN_GROUP
            seq = int(_num(a.get("Seq"), -1))
            members = parse_ranks(a.get("Process Group Ranks"))
            peer, tag = -1, -1
            if op in P2P_OPS:
                tag = 0
                raw = a.get("Dst Rank") if op.endswith("send") else a.get("Src Rank")
                peer = int(_num(raw, -1))
                if members and 0 <= peer < len(members) and rank in members and members != tuple(range(len(members))):
                    peer = members[peer]
                if peer < 0 and members and len(members) == 2 and rank in members:
                    peer = members[0] if members[1] == rank else members[1]
            gpu = c["src"] == "kernel"
        cols["kind"].append(S.KIND_P2P if op in P2P_OPS else S.KIND_COLLECTIVE)
        cols["op_name"].append(op)
        cols["process_group"].append(group)
        cols["explicit_seq"].append(seq)
        cols["peer"].append(peer)
        cols["tag"].append(tag)
        cols["bytes"].append(nbytes)
        cols["input_dtypes"].append(dtype)
        cols["input_sizes"].append(sizes)
        cols["reduce_op"].append(redop)
        cols["start"].append(c["start"])
        cols["end"].append(c["end"])
        cols["gpu"].append(gpu)

    # compute rows from microbatch annotations (CPU ones; GPU copies only if there are no CPU ones)
    mbs = [m for m in rows["mbs"] if not m[5]] or [m for m in rows["mbs"] if m[5]]
    for t0, t1, op, mb, stage, gpu in mbs:
        cols["kind"].append(S.KIND_COMPUTE)
        cols["op_name"].append(op)
        cols["process_group"].append("")
        cols["explicit_seq"].append(-1)
        cols["peer"].append(-1)
        cols["tag"].append(-1)
        cols["bytes"].append(0)
        cols["input_dtypes"].append("")
        cols["input_sizes"].append("")
        cols["reduce_op"].append("")
        cols["start"].append(t0)
        cols["end"].append(t1)
        cols["gpu"].append(gpu)
    df = pd.DataFrame(cols)
    n = len(df)
    if n == 0:
        return S.EVENTS_SCHEMA.empty_table()
    df = df.sort_values(["start", "end"], kind="stable").reset_index(drop=True)
    df["op_id"] = np.arange(1, n + 1)

    # sequence numbers: per group in start order where the trace gives none
    is_coll = (df["kind"] == S.KIND_COLLECTIVE).to_numpy()
    seq = df["explicit_seq"].to_numpy().copy()
    counted = df[is_coll].groupby("process_group", sort=False).cumcount().to_numpy() + 1
    coll_seq = np.where(seq[is_coll] >= 0, seq[is_coll], counted)
    cseq = np.full(n, -1, np.int64)
    cseq[is_coll] = coll_seq
    is_p2p = (df["kind"] == S.KIND_P2P).to_numpy()
    pseq = np.full(n, -1, np.int64)
    if is_p2p.any():
        sub = df[is_p2p]
        direction = np.where(sub["op_name"].str.endswith("send"), "send", "recv")
        pseq[is_p2p] = sub.assign(_d=direction).groupby(["_d", "peer"], sort=False).cumcount().to_numpy() + 1

    # step / microbatch / stage by containment
    starts = df["start"].to_numpy()
    gpu = df["gpu"].to_numpy()
    step = np.full(n, -1, np.int64)
    cpu_steps = sorted((s for s in rows["steps"] if not s[3]), key=lambda s: s[0])
    gpu_steps = sorted((s for s in rows["steps"] if s[3]), key=lambda s: s[0]) or cpu_steps
    for spans, mask in ((cpu_steps, ~gpu), (gpu_steps, gpu)):
        idx = _containing(starts[mask], spans)
        step[mask] = np.where(idx >= 0, np.array([s[2] for s in spans] or [-1])[np.clip(idx, 0, None)], -1)
    microbatch = np.full(n, -1, np.int64)
    stage = np.full(n, -1, np.int64)
    is_comp = (df["kind"] == S.KIND_COMPUTE).to_numpy()
    spans_mb = sorted(((m[0], m[1], m[3], m[4]) for m in mbs), key=lambda s: s[0])
    if spans_mb:
        idx = _containing(starts, spans_mb)
        mb_arr = np.array([s[2] for s in spans_mb])
        st_arr = np.array([s[3] for s in spans_mb])
        microbatch = np.where(idx >= 0, mb_arr[np.clip(idx, 0, None)], -1)
        stage = np.where(idx >= 0, st_arr[np.clip(idx, 0, None)], -1)
    cols_out = {
        "rank": rank, "op_id": df["op_id"].to_numpy(), "kind": df["kind"].to_numpy(object),
        "op_name": df["op_name"].to_numpy(object), "process_group": df["process_group"].to_numpy(object),
        "collective_seq_id": cseq, "p2p_seq_id": pseq, "peer": df["peer"].to_numpy(), "tag": df["tag"].to_numpy(),
        "bytes": df["bytes"].to_numpy(), "input_dtypes": df["input_dtypes"].to_numpy(object),
        "input_sizes": df["input_sizes"].to_numpy(object), "reduce_op": df["reduce_op"].to_numpy(object),
        "step": step, "microbatch": microbatch, "stage": stage,
    }
    del is_comp
    begin = events_table({**cols_out, "phase": S.PHASE_BEGIN, "time_ns": starts}, n)
    end = events_table({**cols_out, "phase": S.PHASE_END, "time_ns": df["end"].to_numpy(), "status": S.STATUS_OK}, n)
    return pa.concat_tables([begin, end])


def _metrics_table(rank: int, steps: list[tuple[int, int, int, bool]]) -> pa.Table:
    cpu = sorted((s for s in steps if not s[3]), key=lambda s: s[0]) or sorted(steps, key=lambda s: s[0])
    n = len(cpu)
    if n == 0:
        return S.METRICS_SCHEMA.empty_table()
    nan = np.full(n, np.nan)
    cols = {
        "rank": pa.array(np.full(n, rank, np.int32)), "step": pa.array(np.array([s[2] for s in cpu], np.int32)),
        "time_ns": pa.array(np.array([s[0] for s in cpu], np.int64)),
        "step_time_s": pa.array(np.array([(s[1] - s[0]) / 1e9 for s in cpu], np.float64)),
        "loss": pa.array(nan), "grad_norm_local": pa.array(nan), "grad_norm_global": pa.array(nan),
        "param_checksum": pa.array(nan), "memory_bytes": pa.array(np.full(n, -1, np.int64)),
        "tokens": pa.array(np.full(n, -1, np.int64)), "expert_load": pa.array([[]] * n, pa.list_(pa.int64())),
        "dropped_tokens": pa.array(np.full(n, -1, np.int64)), "extra": pa.array(['{"source": "ProfilerStep"}'] * n),
    }
    return pa.Table.from_arrays([cols[name] for name in S.METRIC_COLUMNS], schema=S.METRICS_SCHEMA)
