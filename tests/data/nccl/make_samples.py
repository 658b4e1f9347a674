"""Write NCCL Inspector / RAS / torch debug server samples, field for field as the writers in
NVIDIA/nccl (plugins/profiler/inspector/inspector_json.cc, src/ras/client_support.cc) and
pytorch/pytorch (torch/distributed/debug/_frontend.py, _debug_handlers.py) print them.

    python tests/data/nccl/make_samples.py                 # rewrites the small files next to this script
    python tests/data/nccl/make_samples.py --sample DIR    # writes the Inspector+RAS sample (sample_traces/nccl-ras-inspector)

Seeded: the same bytes every time. No NCCL or GPU is needed, which is the point: the tests write
what they need into a temporary folder with these functions, and only a few small files are kept
here (`main`).
"""
from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
T0_US = 1_765_000_000_000_000          # 2025-12-06, gettimeofday microseconds
COMM, COMM_NAME = "0x5f3a2c1b9e8d77", "DP Group 0"
RAS_HASH = 0x5F3A2C1B9E8D7731          # the same communicator as RAS prints it ("0x%lx": Inspector keeps 14 digits)


# --------------------------------------------------------------------------
# NCCL Inspector (JSON, v4.0-4.2 per-record lines or v4.3 dump_stats markers)
# --------------------------------------------------------------------------
def header(rank: int, n: int, name: str = COMM_NAME, comm: str = COMM) -> dict:
    return {"id": comm, "comm_name": name, "rank": rank, "n_ranks": n, "nnodes": 1}


def metadata(host: str, pid: int, dump_us: int, version: str = "v4.0") -> dict:
    return {"inspector_output_format_version": version, "git_rev": "", "rec_mechanism": "nccl_profiler_interface",
            "dump_timestamp_us": dump_us, "hostname": host, "pid": pid}


def coll_perf(func: str, sn: int, size: int, exec_us: int, n: int, verbose_ts: tuple[int, int] | None) -> dict:
    """One completed collective as inspectorCompletedColl writes it (busbw as nccl-tests defines it)."""
    algobw = size / exec_us / 1e3 if exec_us else 0.0
    factor = 2 * (n - 1) / n if func == "AllReduce" else (n - 1) / n
    perf = {"coll": func, "coll_sn": sn, "coll_msg_size_bytes": size, "coll_exec_time_us": exec_us,
            "coll_timing_source": "kernel_gpu", "coll_algobw_gbs": round(algobw, 6),
            "coll_busbw_gbs": round(algobw * factor, 6)}
    if verbose_ts is not None:
        start, kstart = verbose_ts
        perf["event_trace_sn"] = {"coll_start_sn": 1, "coll_stop_sn": 2, "kernel_events": [
            {"channel_id": 0, "kernel_start_sn": 3, "kernel_stop_sn": 40, "kernel_record_sn": 39}]}
        perf["event_trace_ts"] = {"coll_start_ts": start, "coll_stop_ts": start + 5, "kernel_events": [
            {"channel_id": 0, "kernel_start_ts": kstart, "kernel_stop_ts": kstart + exec_us,
             "kernel_record_ts": kstart + exec_us}]}
    return perf


def compact(obj: dict) -> str:
    return json.dumps(obj, separators=(",", ":"))


def straggler_job(out: Path, world: int = 4, slow: int = 2, steps: int = 12, verbose: bool = False,
                  hosts: tuple[str, ...] = ("gpu-node-01",), skew_us: int = 0, late_us: int = 9000,
                  version: str = "v4.0", comm_name: str = COMM_NAME, arrivals: list | None = None) -> Path:
    """A data-parallel job: per step one 64 MiB all-reduce and one 16 MiB all-gather on one communicator;
    rank `slow` reaches every collective `late_us` after its peers (late_us 0: a healthy job), so the
    peers sit in the kernel waiting for it: their coll_exec_time_us is longer, the straggler's the
    shortest. The second host's clock runs `skew_us` ahead (what the reader must align). v4.3 writes
    one dump_stats marker per rank and step, then bare op lines. `arrivals`, when given, receives
    (function, {rank: arrival us}, end us) per collective: the same job's Flight Recorder dumps (`fr_dumps`)."""
    rng = random.Random(7 + world + slow)
    out.mkdir(parents=True, exist_ok=True)
    lines: dict[int, list[str]] = {r: [] for r in range(world)}
    t = T0_US
    for step in range(steps):
        batch: dict[int, list[dict]] = {r: [] for r in range(world)}
        for func, size, work in (("AllReduce", 64 << 20, 2400), ("AllGather", 16 << 20, 700)):
            arrive = {r: t + rng.randint(0, 300) + (late_us if r == slow else 0) for r in range(world)}
            done = max(arrive.values()) + work
            if arrivals is not None:
                arrivals.append((func, arrive, done))
            for r in range(world):
                skew = skew_us if r % len(hosts) == 1 else 0
                ts = (arrive[r] - 40 + skew, arrive[r] + skew) if verbose else None
                batch[r].append({"coll_perf": coll_perf(func, step, size, done - arrive[r], world, ts),
                                 "dump_us": done + 800 + skew})
            t = done + 3000
        t += 20000
        for r in range(world):
            host, pid = hosts[r % len(hosts)], 41000 + r
            if version == "v4.3":
                stats = {"coll_records": len(batch[r]), "coll_dropped_total": 0, "coll_dropped_since_last_dump": 0,
                         "p2p_records": 0, "p2p_dropped_total": 0, "p2p_dropped_since_last_dump": 0}
                lines[r].append(compact({"header": header(r, world, comm_name), "metadata": metadata(
                    host, pid, batch[r][-1]["dump_us"], version), "dump_stats": stats}))
                lines[r] += [compact({"coll_perf": b["coll_perf"]}) for b in batch[r]]
            else:
                lines[r] += [compact({"header": header(r, world, comm_name), "metadata": metadata(
                    host, pid, b["dump_us"], version), "coll_perf": b["coll_perf"]}) for b in batch[r]]
    for r in range(world):
        (out / f"{hosts[r % len(hosts)]}-pid{41000 + r}.log").write_text("\n".join(lines[r]) + "\n")
    return out


# --------------------------------------------------------------------------
# NCCL RAS (ncclras -f json, the text mode, monitor events)
# --------------------------------------------------------------------------
FUNCS = ("Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce")


def ras_rank(rank: int, host: str, pid: int, counts: dict[str, int], async_error: int = 0, abort: bool = False) -> str:
    """jsonWriteRankData, line for line."""
    lines = ["        {", f'          "rank": {rank},', f'          "host": "{host}",', f'          "pid": {pid},',
             f'          "cuda_dev": {rank},', f'          "nvml_dev": {rank},', '          "status": {',
             '            "init_state": 0,', f'            "async_error": {async_error},',
             '            "finalize_called": false,', '            "destroy_flag": false,',
             f'            "abort_flag": {"true" if abort else "false"}', "          },",
             '          "collective_counts": {']
    lines += [f'            "{f}": {counts.get(f, 0)}' + ("," if i < len(FUNCS) - 1 else "") for i, f in enumerate(FUNCS)]
    return "\n".join(lines + ["          }", "        }"])


def ras_missing(rank: int, host: str, pid: int, unresponsive: bool, dead: bool) -> str:
    """jsonWriteMissingRank, line for line."""
    return "\n".join(["        {", f'          "rank": {rank},', f'          "host": "{host}",', f'          "pid": {pid},',
                      f'          "cuda_dev": {rank},', f'          "nvml_dev": {rank},', '          "status": {',
                      f'            "unresponsive": {"true" if unresponsive else "false"},',
                      f'            "considered_dead": {"true" if dead else "false"}', "          }", "        }"])


def ras_json(world: int = 4, counts: dict[int, dict[str, int]] | None = None, missing: dict[int, str] | None = None,
             comm_hash: int = RAS_HASH, async_errors: dict[int, int] | None = None,
             when: str = "2025-12-06 10:15:00") -> str:
    """`ncclras -f json`: one communicator of `world` ranks (IP 10.0.0.<1 + rank // 2>, pid 41000 + rank);
    `counts` per rank (default 42 AllReduce, 41 AllGather each); `missing`: rank -> "dead" | "unresponsive"."""
    counts = counts or {}
    missing = missing or {}
    ranks = [ras_rank(r, f"10.0.0.{1 + r // 2}", 41000 + r, counts.get(r, {"AllReduce": 42, "AllGather": 41}),
                      (async_errors or {}).get(r, 0)) for r in range(world) if r not in missing]
    gone = [ras_missing(r, f"10.0.0.{1 + r // 2}", 41000 + r, True, why == "dead") for r, why in sorted(missing.items())]
    comm = "\n".join(["    {", f'      "hash": "0x{comm_hash:x}",', '      "secondary_hash": "0x1a2b:0x3c4d",',
                      f'      "size": {world},', f'      "ranks_count": {len(ranks)},',
                      f'      "missing_ranks_count": {len(gone)},', '      "ranks": [', ",\n".join(ranks), "      ],",
                      '      "missing_ranks": [', ",\n".join(gone), "      ]", "    }"])
    return "\n".join(["{", '  "nccl_version": "2.29.2",', '  "cuda_runtime_version": 12090,',
                      '  "cuda_driver_version": 13000,', f'  "timestamp": "{when}",',
                      '  "communicators_count": 1,', '  "communicators": [', comm, "  ],", '  "ras": {',
                      '    "collection_time_sec": 0.012,', '    "timeouts_count": 0', "  }", "}"]) + "\n"


def ras_text(world: int = 4, behind: int = 3, launched: int = 41, peers: int = 42, comm_hash: int = RAS_HASH) -> str:
    """The text mode's summary and its MISMATCH section: rank `behind` launched fewer AllReduce."""
    n_peers = world - 1
    return (f"Job summary\n===========\n\n  Nodes  Processes      GPUs  Processes     GPUs\n(total)   per node  per "
            f"process    (total)  (total)\n      2          2          1          {world}        {world}\n\n"
            f"Communicators... (0.00s)\n=============\n\n"
            "Group     Comms     Nodes     Ranks     Ranks     Ranks    Status  Errors\n"
            "    #  in group  per comm  per node  per comm  in group\n"
            f"    0         1         2         2         {world}         {world}   RUNNING  MISMATCH\n\n"
            "Errors\n======\n\nWarnings\n========\n\n"
            f"#0-0 ({comm_hash:016x}) MISMATCH\n"
            "  Communicator ranks have different AllReduce operation counts\n"
            f"  {n_peers} ranks have launched up to operation {peers}\n"
            f"  Rank {behind} has launched up to operation {launched} -- GPU {behind} managed by process "
            f"{41000 + behind} on node 10.0.0.{1 + behind // 2}\n\n")


def ras_peer_dead(rank: int) -> str:
    """One monitor-mode (`ncclras -m -f json`) PEER_DEAD event, as rasClientsNotifyEvent prints it."""
    return ("{\n" '  "timestamp": "2025-12-06 10:16:00",\n' '  "group": "LIFECYCLE",\n' '  "event": "PEER_DEAD",\n'
            '  "peer": {\n' f'    "host": "10.0.0.{1 + rank // 2}",\n' f'    "pid": {41000 + rank},\n'
            f'    "cuda_devs": [{rank}],\n' f'    "nvml_devs": [{rank}]\n' "  },\n"
            '  "details": "peer declared dead"\n' "}\n")


# --------------------------------------------------------------------------
# Flight Recorder dumps (JSON, as torch writes them) and torch debug server dumps
# --------------------------------------------------------------------------
def fr_dumps(out: Path, world: int = 4, done: int = 5, stuck: int | None = 3, absent: tuple[int, ...] = (),
             arrivals: list | None = None, cpu_ahead: bool = False) -> Path:
    """Per rank a JSON dump of `done` completed all-reduces on default_pg, one every 0.1 s, then #done+1
    in flight on every rank but `stuck` (which never issued it; None: a healthy job, nothing in flight);
    ranks in `absent` write no dump. `arrivals` (from `straggler_job`): that job's collectives instead,
    each created 40 us before its kernel started on the rank and completed with the collective;
    `cpu_ahead`: every rank's CPU created it at the same time, ahead of its GPU (a GPU straggler the
    dumps cannot show: only NCCL Inspector's kernel times can)."""
    out.mkdir(parents=True, exist_ok=True)
    for r in range(world):
        if r in absent:
            continue
        entries = []
        plan = [(f"nccl:{_FR_NAMES[f]}", (min(a.values()) if cpu_ahead else a[r]) * 1000 - 40_000 + r,
                 -1 if cpu_ahead else a[r] * 1000, e * 1000) for f, a, e in arrivals] \
            if arrivals else [("nccl:all_reduce", t + r * 1000, t + 5000, t + 9000)
                              for t in (1_765_000_000_000_000_000 + i * 10**8 for i in range(done + 1))]
        n = len(plan) if arrivals else done + (stuck is not None and r != stuck)
        for i in range(n):
            end, (name, t, started, ended) = arrivals is not None or i < done, plan[i]
            entries.append({"record_id": i, "pg_id": 0, "process_group": ["0", "default_pg"],
                            "collective_seq_id": i + 1, "p2p_seq_id": 0, "op_id": i + 1,
                            "profiling_name": name, "time_created_ns": t,
                            "input_sizes": [[1024]], "input_dtypes": ["Float"],
                            "output_sizes": [[1024 * (world if "allgather" in name else 1)]],
                            "output_dtypes": ["Float"], "state": "completed" if end else "started",
                            "time_discovered_started_ns": started if started >= 0 else None,
                            "time_discovered_completed_ns": ended if end else None,
                            "retired": end, "timeout_ms": 600000, "is_p2p": False, "frames": []})
        dump = {"version": "2.10", "comm_lib_version": "2.27.5", "pg_config": {"0": {
            "name": "0", "desc": "default_pg", "ranks": str(list(range(world)))}}, "pg_status": {}, "entries": entries}
        (out / f"nccl_trace_rank_{r}.json").write_text(json.dumps(dump))
    return out


_FR_NAMES = {"AllReduce": "all_reduce", "AllGather": "_allgather_base"}
FAULTHANDLER = ('Thread 0x00007f0000001000 (most recent call first):\n'
                '  File "/usr/lib/python3.12/threading.py", line 359 in wait\n'
                '  File "/usr/lib/python3.12/threading.py", line 1010 in _bootstrap\n\n'
                'Current thread 0x00007f0000000000 (most recent call first):\n'
                '  File "/opt/torch/distributed/distributed_c10d.py", line 2806 in all_reduce\n'
                '  File "/job/train.py", line {line} in train_step\n'
                '  File "/job/train.py", line 120 in <module>\n')


def debug_dumps(out: Path, world: int = 4, silent: int | None = None, stamp: str = "20251206_101500") -> Path:
    """The debug server's periodic stacks file (and an fr_trace tables file) for `world` ranks; rank
    `silent` did not answer (HTTP 408)."""
    out.mkdir(parents=True, exist_ok=True)
    parts = []
    if silent is not None:
        parts += [f"PARTIAL DATA: {world - 1}/{world} workers responded", f"  Rank {silent}: Timeout: read timed out", ""]
    for r in range(world):
        parts.append(f"=== Rank {r}: http://gpu-node-0{1 + r // 2}:4{r}123/handler/dump_traceback? ===")
        parts.append("Error: 408" if r == silent else FAULTHANDLER.format(line=88 if r != 3 else 64))
    (out / f"stacks_{stamp}.txt").write_text("\n".join(parts))
    (out / f"fr_trace_{stamp}.txt").write_text("=== FR Trace ===\n--- Groups ---\nid    desc        size\n"
                                               f"0     default_pg  {world}\n")
    return out


# --------------------------------------------------------------------------
def inspector_ras_sample(out: Path) -> Path:
    """The sample_traces/ sample: a healthy 4-rank Inspector record of 12 steps, then two RAS snapshots
    a minute apart of the hang that followed: ranks 0-2 launched the 13th all-reduce, rank 3 did not,
    and nobody moved."""
    straggler_job(out / "nccl-inspector-4242", late_us=0, steps=12)
    counts = {r: {"AllReduce": 13, "AllGather": 12} for r in range(3)}
    counts[3] = {"AllReduce": 12, "AllGather": 12}
    for when in ("10:15:00", "10:16:00"):
        (out / f"ncclras-{when.replace(':', '')}.json").write_text(ras_json(counts=counts, when=f"2025-12-06 {when}"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sample", type=Path, help="write the Inspector+RAS sample into this folder instead")
    ns = ap.parse_args()
    if ns.sample:
        inspector_ras_sample(ns.sample)
        return
    (HERE / "ras_laggard.json").write_text(ras_json(counts={**{r: {"AllReduce": 42, "AllGather": 41} for r in range(3)},
                                                             3: {"AllReduce": 41, "AllGather": 41}}))
    (HERE / "ras_laggard.txt").write_text(ras_text())
    (HERE / "ras_peer_dead.json").write_text(ras_peer_dead(2))


if __name__ == "__main__":
    main()
