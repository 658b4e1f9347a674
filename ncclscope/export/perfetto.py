"""Perfetto / Chrome trace-event JSON export (see the package docstring for the layout)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from ncclscope import schema as S
from ncclscope.load.trace import Trace

INFLIGHT_NOTE = "never completed (still in flight when the trace ends)"
_CHUNK = 200_000

# (samples column, counter name, scale)
_SAMPLE_COUNTERS = [("gpu_util", "GPU util %", 1.0), ("mem_util", "GPU memory util %", 1.0),
                    ("mem_used_bytes", "GPU memory used GiB", 1 / 2**30), ("power_w", "power W", 1.0),
                    ("temperature_c", "temperature C", 1.0), ("cpu_percent", "CPU %", 1.0),
                    ("rss_bytes", "RSS GiB", 1 / 2**30)]
_METRIC_COUNTERS = [("loss", "loss"), ("step_time_s", "step time s"), ("grad_norm_global", "grad norm"),
                    ("memory_bytes", "memory bytes")]


# --------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------
def _plain(s: pd.Series) -> pd.Series:
    """A string-ish column as plain Python strings ("" for missing)."""
    if isinstance(s.dtype, pd.CategoricalDtype):
        cats = np.append(s.cat.categories.astype(str).to_numpy(dtype=object), "")
        return pd.Series(cats.take(s.cat.codes.to_numpy()), index=s.index, dtype=object)
    return s.astype(object).where(s.notna(), "").astype(str).astype(object)


def _jstr(s: pd.Series) -> pd.Series:
    """JSON string literals for a column, escaping each distinct value once."""
    plain = _plain(s)
    uniq = pd.unique(plain.to_numpy())
    lut = {u: json.dumps(u) for u in uniq}
    return plain.map(lut)


def _jnum(values: np.ndarray, decimals: int = 3) -> pd.Series:
    """Numbers as JSON text (finite floats rounded, ints as ints)."""
    arr = np.asarray(values)
    if np.issubdtype(arr.dtype, np.integer):
        return pd.Series(arr.astype(str), dtype=object)
    arr = np.round(arr.astype(np.float64), decimals)
    arr = np.where(np.isfinite(arr), arr, 0.0)
    return pd.Series(arr.astype(str), dtype=object)


def _lanes(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Lane per slice (0, 1, ...) so that slices in one lane never overlap; inputs sorted by start."""
    n = len(start)
    lanes = np.zeros(n, np.int64)
    if n < 2:
        return lanes
    run_max = np.maximum.accumulate(end)
    if not (start[1:] < run_max[:-1]).any():
        return lanes
    lane_end: list[int] = []
    for i in range(n):                      # only for tracks that do overlap (async p2p)
        for k, e in enumerate(lane_end):
            if e <= start[i]:
                lanes[i] = k
                lane_end[k] = end[i]
                break
        else:
            lanes[i] = len(lane_end)
            lane_end.append(end[i])
    return lanes


# --------------------------------------------------------------------------
# Perfetto
# --------------------------------------------------------------------------
def export_perfetto(trace: Trace, out_path: str | os.PathLike[str]) -> dict[str, Any]:
    """Write the trace as Chrome trace-event JSON for the Perfetto UI; returns counts."""
    out = Path(out_path)
    ops = trace.ops
    events = trace.events
    instants = events[events["phase"] == S.PHASE_INSTANT] if len(events) else events
    t0, t_end = _time_range(trace, instants)
    chunks: list[str] = []
    stats = {"path": str(out), "slices": 0, "inflight": 0, "flows": 0, "counters": 0, "instants": 0,
             "processes": 0, "tracks": 0}
    track_rows: list[tuple[int, int, str]] = []        # (pid, tid, name)
    if len(ops):
        tids, track_rows, n_inflight = _tracks(ops, t_end)
        chunks.extend(_slice_chunks(ops, t0, t_end, tids))
        stats["slices"] = int(len(ops))
        stats["inflight"] = n_inflight
        send_side, recv_side = _p2p_pairs(ops, tids, t0, t_end)
        if len(send_side):
            chunks.extend(_flow_chunks(send_side, recv_side))
            stats["flows"] = int(len(send_side))
    # instants: markers, not heartbeats
    marks = instants[_plain(instants["op_name"]) != S.HEARTBEAT] if len(instants) else instants
    if len(marks):
        chunks.append(_instant_chunk(marks, track_rows, t0))
        stats["instants"] = int(len(marks))
    counters, stats["counters"] = _counter_chunks(trace, t0)
    chunks.extend(counters)
    meta = _metadata(trace, track_rows)
    stats["processes"] = len(trace.ranks)
    stats["tracks"] = len(track_rows)
    other = {"generator": "ncclscope", "ncclscope_schema": S.SCHEMA_VERSION, "t0_ns": int(t0),
             "source": trace.run.source or "ncclscope", "path": str(trace.path)}
    _write(out, other, meta, chunks)
    stats["events"] = len(meta) + stats["slices"] + 2 * stats["flows"] + stats["instants"] + stats["counters"]
    stats["bytes"] = out.stat().st_size
    return stats


def _time_range(trace: Trace, instants: pd.DataFrame) -> tuple[int, int]:
    """(t0, t_end): the earliest time of any op, sample, metric or instant; the trace's end (or the last op
    end, if later). Slices still in flight are drawn to t_end."""
    ops = trace.ops
    times = [int(ops["start_ns"].min())] if len(ops) else []
    if len(trace.samples):
        times.append(int(trace.samples["time_ns"].min()))
    if len(trace.metrics):
        times.append(int(trace.metrics["time_ns"].min()))
    if len(instants):
        times.append(int(instants["t_ns"].min()))
    t0 = min(times) if times else 0
    t_end = max(trace.end_ns, t0)
    if len(ops):
        t_end = max(t_end, int(ops["end_ns"].max()))
    return t0, t_end


def _tracks(ops: pd.DataFrame, t_end: int) -> tuple[np.ndarray, list[tuple[int, int, str]], int]:
    """(tid per row of `ops`, the (pid, tid, name) of every track, slices in flight). A rank's tracks:
    compute, then one per collective group, then p2p; slices that overlap in a track (async p2p) get lanes,
    each lane a track of its own."""
    df = pd.DataFrame({
        "rank": ops["rank"].to_numpy(np.int64), "kind": _plain(ops["kind"]).to_numpy(),
        "group": _plain(ops["process_group"]).to_numpy(), "start": ops["start_ns"].to_numpy(np.int64),
        "end": ops["end_ns"].to_numpy(np.int64), "_pos": np.arange(len(ops)),
    })
    inflight = df["end"].to_numpy() < 0
    df["end"] = np.maximum(np.where(inflight, t_end, df["end"]), df["start"])
    kind = df["kind"]
    df["track"] = np.where(kind == S.KIND_COMPUTE, "compute",
                           np.where(df["group"] != "", kind + " " + df["group"], kind))
    df = df.sort_values(["rank", "track", "start"], kind="stable").reset_index(drop=True)
    lane = np.zeros(len(df), np.int64)
    for idx in df.groupby(["rank", "track"], sort=False).indices.values():
        lane[idx] = _lanes(df["start"].to_numpy()[idx], df["end"].to_numpy()[idx])
    df["lane"] = lane
    tracks = df[["rank", "track", "lane"]].drop_duplicates()
    order = {"compute": 0, "collective": 1, "p2p": 2}
    tracks = tracks.assign(_o=tracks["track"].map(lambda t: order.get(t.split(" ", 1)[0], 3)))
    tracks = tracks.sort_values(["rank", "_o", "track", "lane"])
    tracks["tid"] = tracks.groupby("rank").cumcount() + 1
    df = df.merge(tracks[["rank", "track", "lane", "tid"]], on=["rank", "track", "lane"], how="left")
    track_rows = [(int(r), int(tid), tr + (f" ({ln + 1})" if ln else ""))
                  for r, tr, ln, tid in tracks[["rank", "track", "lane", "tid"]].itertuples(index=False)]
    return _tid_lookup(ops, df), track_rows, int(inflight.sum())


def _flow_chunks(send_side: pd.DataFrame, recv_side: pd.DataFrame) -> list[str]:
    """The flow arrows from each send to its matched recv: one start ("s") and one finish ("f") per pair."""
    ids = np.arange(1, len(send_side) + 1)
    s = ('{"ph":"s","cat":"p2p","name":"send->recv","id":' + pd.Series(ids.astype(str), dtype=object)
         + ',"pid":' + pd.Series(send_side["rank"].astype(str).to_numpy(), dtype=object)
         + ',"tid":' + pd.Series(send_side["tid"].astype(str).to_numpy(), dtype=object)
         + ',"ts":' + _jnum(send_side["ts"].to_numpy()) + '}')
    f = ('{"ph":"f","bp":"e","cat":"p2p","name":"send->recv","id":' + pd.Series(ids.astype(str), dtype=object)
         + ',"pid":' + pd.Series(recv_side["rank"].astype(str).to_numpy(), dtype=object)
         + ',"tid":' + pd.Series(recv_side["tid"].astype(str).to_numpy(), dtype=object)
         + ',"ts":' + _jnum(recv_side["ts"].to_numpy()) + '}')
    return [",\n".join(s.tolist()), ",\n".join(f.tolist())]


def _instant_chunk(marks: pd.DataFrame, track_rows: list[tuple[int, int, str]], t0: int) -> str:
    """The markers as instant events, on a "markers" track per rank (appended to `track_rows`)."""
    marker_tid = {}
    for r in sorted(set(marks["rank"].astype(int))):
        tid = 1 + max([t for (p, t, _) in track_rows if p == r], default=0)
        marker_tid[r] = tid
        track_rows.append((r, tid, "markers"))
    tids = marks["rank"].astype(int).map(marker_tid).astype(int)
    line = ('{"ph":"i","s":"t","pid":' + pd.Series(marks["rank"].astype(int).astype(str).to_numpy(), dtype=object)
            + ',"tid":' + pd.Series(tids.astype(str).to_numpy(), dtype=object)
            + ',"ts":' + _jnum((marks["t_ns"].to_numpy(np.int64) - t0) / 1000.0)
            + ',"name":' + _jstr(marks["op_name"]).reset_index(drop=True)
            + ',"args":{"message":' + _jstr(marks["message"]).reset_index(drop=True)
            + ',"step":' + pd.Series(marks["step"].astype(int).astype(str).to_numpy(), dtype=object) + '}}')
    return ",\n".join(line.tolist())


def _counter_chunks(trace: Trace, t0: int) -> tuple[list[str], int]:
    """(counter tracks of the samples and metrics, one chunk per column; how many values)."""
    chunks: list[str] = []
    count = 0
    for table, specs in ((trace.samples, [(c, n, k) for c, n, k in _SAMPLE_COUNTERS]),
                         (trace.metrics, [(c, n, 1.0) for c, n in _METRIC_COUNTERS])):
        if not len(table):
            continue
        for col, name, scale in specs:
            if col not in table.columns:
                continue
            vals = pd.to_numeric(table[col], errors="coerce").to_numpy(np.float64)
            ok = np.isfinite(vals)
            if col.endswith("_bytes"):
                ok &= vals >= 0
            if not ok.any():
                continue
            sub = table[ok]
            line = ('{"ph":"C","name":' + json.dumps(name) + ',"pid":'
                    + pd.Series(sub["rank"].astype(int).astype(str).to_numpy(), dtype=object)
                    + ',"ts":' + _jnum((sub["time_ns"].to_numpy(np.int64) - t0) / 1000.0)
                    + ',"args":{"value":' + _jnum(vals[ok] * scale, 6) + '}}')
            chunks.append(",\n".join(line.tolist()))
            count += int(ok.sum())
    return chunks, count


def _metadata(trace: Trace, track_rows: list[tuple[int, int, str]]) -> list[dict[str, Any]]:
    """Process (rank) and thread (track) names and sort order."""
    meta = []
    for r, info in sorted(trace.ranks.items()):
        label = f"rank {r}" + (f" @ {info.host}" if info.host else "") + ("" if info.present else " (no trace)")
        meta.append({"ph": "M", "name": "process_name", "pid": int(r), "tid": 0, "args": {"name": label}})
        meta.append({"ph": "M", "name": "process_sort_index", "pid": int(r), "tid": 0, "args": {"sort_index": int(r)}})
    for pid, tid, name in track_rows:
        meta.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}})
        meta.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid, "args": {"sort_index": tid}})
    return meta


def _write(out: Path, other: dict[str, Any], meta: list[dict[str, Any]], chunks: list[str]) -> None:
    """The JSON file, written to a temporary name and renamed (a reader never sees half a file)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as fh:
        fh.write('{"displayTimeUnit":"ns","otherData":' + json.dumps(other) + ',"traceEvents":[\n')
        fh.write(",\n".join(json.dumps(m, separators=(",", ":")) for m in meta))
        for c in chunks:
            if c:
                fh.write(",\n")
                fh.write(c)
        fh.write("\n]}\n")
    os.replace(tmp, out)


def _tid_lookup(ops: pd.DataFrame, df: pd.DataFrame) -> np.ndarray:
    """tid per row of `ops` (df holds the same rows in another order; `_pos` is the row in ops)."""
    tid = np.zeros(len(ops), np.int64)
    tid[df["_pos"].to_numpy()] = df["tid"].to_numpy()
    return tid


def _slice_chunks(ops: pd.DataFrame, t0: int, t_end: int, df_tids: np.ndarray) -> list[str]:
    out = []
    for lo in range(0, len(ops), _CHUNK):
        sub = ops.iloc[lo:lo + _CHUNK]
        tid = df_tids[lo:lo + _CHUNK]
        start = sub["start_ns"].to_numpy(np.int64)
        end = sub["end_ns"].to_numpy(np.int64)
        inflight = end < 0
        end = np.maximum(np.where(inflight, t_end, end), start)
        cseq = sub["collective_seq_id"].to_numpy(np.int64)
        pseq = sub["p2p_seq_id"].to_numpy(np.int64)
        seq = np.where(cseq >= 0, cseq, pseq)
        name = _plain(sub["op_name"]).reset_index(drop=True)
        name = name.where(seq < 0, name + " #" + pd.Series(seq.astype(str), dtype=object))
        status = _plain(sub["status"]).reset_index(drop=True)
        note = pd.Series(np.where(inflight, ',"note":' + json.dumps(INFLIGHT_NOTE), ""), dtype=object)
        msg = _plain(sub["message"]).reset_index(drop=True) if "message" in sub else pd.Series([""] * len(sub))
        msg_j = pd.Series(np.where(msg.to_numpy() != "", ',"message":' + _jstr(msg).to_numpy().astype(object), ""),
                          dtype=object)

        def col(c: str) -> pd.Series:
            return pd.Series(sub[c].to_numpy(np.int64).astype(str), dtype=object)

        line = ('{"ph":"X","pid":' + col("rank") + ',"tid":' + pd.Series(tid.astype(str), dtype=object)
                + ',"ts":' + _jnum((start - t0) / 1000.0) + ',"dur":' + _jnum((end - start) / 1000.0)
                + ',"name":' + name.map(json.dumps) + ',"cat":' + _jstr(sub["kind"]).reset_index(drop=True)
                + ',"args":{"op_id":' + col("op_id")
                + ',"process_group":' + _jstr(sub["process_group"]).reset_index(drop=True)
                + ',"collective_seq_id":' + col("collective_seq_id") + ',"p2p_seq_id":' + col("p2p_seq_id")
                + ',"peer":' + col("peer") + ',"tag":' + col("tag") + ',"bytes":' + col("bytes")
                + ',"input_dtypes":' + _jstr(sub["input_dtypes"]).reset_index(drop=True)
                + ',"input_sizes":' + _jstr(sub["input_sizes"]).reset_index(drop=True)
                + ',"step":' + col("step") + ',"microbatch":' + col("microbatch") + ',"stage":' + col("stage")
                + ',"status":' + _jstr(status) + note + msg_j
                + ',"call_site":' + _jstr(sub["call_site"]).reset_index(drop=True) + '}}')
        out.append(",\n".join(line.tolist()))
    return out


def _p2p_pairs(ops: pd.DataFrame, tids: np.ndarray, t0: int, t_end: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Matched (send, recv) rows with pid/tid/ts for flow events, keyed as analysis/p2p.py keys them."""
    kind = _plain(ops["kind"]).to_numpy()
    name = _plain(ops["op_name"]).str.lower().to_numpy()
    peer = ops["peer"].to_numpy(np.int64)
    mask = (kind == S.KIND_P2P) & (peer >= 0)
    if not mask.any():
        empty = pd.DataFrame(columns=["rank", "tid", "ts"])
        return empty, empty
    rank = ops["rank"].to_numpy(np.int64)
    start = ops["start_ns"].to_numpy(np.int64)
    end = ops["end_ns"].to_numpy(np.int64)
    end = np.maximum(np.where(end < 0, t_end, end), start)
    d = pd.DataFrame({"rank": rank, "peer": peer, "tag": ops["tag"].to_numpy(np.int64),
                      "seq": ops["p2p_seq_id"].to_numpy(np.int64), "tid": tids, "start": start, "end": end,
                      "send": np.char.endswith(name.astype(str), "send"),
                      "recv": np.char.endswith(name.astype(str), "recv")})[mask]
    sends = d[d["send"]].rename(columns={"rank": "src", "peer": "dst"})
    recvs = d[d["recv"]].rename(columns={"rank": "dst", "peer": "src"})
    m = sends.merge(recvs, on=["src", "dst", "tag", "seq"], suffixes=("_s", "_r"))
    m = m.drop_duplicates(["src", "dst", "tag", "seq"])
    send_side = pd.DataFrame({"rank": m["src"].to_numpy(), "tid": m["tid_s"].to_numpy(),
                              "ts": (m["start_s"].to_numpy() - t0) / 1000.0})
    f_ns = m["start_r"].to_numpy() + (m["end_r"].to_numpy() - m["start_r"].to_numpy()) * 0.999
    recv_side = pd.DataFrame({"rank": m["dst"].to_numpy(), "tid": m["tid_r"].to_numpy(), "ts": (f_ns - t0) / 1000.0})
    return send_side, recv_side
