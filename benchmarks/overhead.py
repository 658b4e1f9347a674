"""What does tracing cost? Prints two ratios measured in one run on this machine.

    python benchmarks/overhead.py [--ops 3000] [--steps 40]

(a) wrapper cost per op: `Comm.all_reduce` (timeout, begin/end rows, sequence
    numbers, call site) minus a raw `torch.distributed.all_reduce` of the same
    tiny tensor on the same 2-rank gloo group, alternating op by op so both see
    the same machine load (median of the paired differences), and the
    wrapper's CPU time alone with the communication replaced by a completed
    handle. Target: <= 20 us per op.
(b) training step time with tracing on vs off (`--no-trace`: NullRecorder),
    2 DP ranks, same process group, alternating blocks of steps. Target <= 1.03x.

Absolute times on a shared 2-core machine are noise; the differences and
ratios measured side by side are what this prints.

Rank 0 sends its figures back over a Pipe (a plain `send` is written before it
returns; a Queue's feeder thread can lose the result if the child `os._exit`s
first), and the parent waits a bounded time for it, then reaps both ranks.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time


RESULT_WAIT_S = 900.0


def _rank(rank: int, world: int, init: str, run_dir: str, n_ops: int, steps: int, conn) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    from ncclscope.runtime.comm import Comm
    from ncclscope.runtime.config import RunConfig
    from ncclscope.runtime.faults import FaultPlan
    from ncclscope.runtime.mesh import build_mesh
    from ncclscope.runtime.null_recorder import NullRecorder
    from ncclscope.runtime.recorder import Recorder
    from ncclscope.runtime.train import train_dp

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    rec = Recorder(run_dir, rank, world)
    comm = Comm(rec, rank, world, timeout_s=60)
    world_g = comm.register_world()
    t = torch.zeros(4)

    # (a) per-op cost: raw and wrapped calls alternate op by op, so both see the
    # same machine load; the paired differences' median is the wrapper's cost.
    raw_us, wrapped_us, diff_us = [], [], []
    for _ in range(20):  # warm-up
        dist.all_reduce(t)
        comm.all_reduce(t, world_g)
    dist.barrier()
    for _ in range(n_ops):
        t0 = time.perf_counter_ns()
        dist.all_reduce(t)
        t1 = time.perf_counter_ns()
        comm.all_reduce(t, world_g)
        t2 = time.perf_counter_ns()
        raw_us.append((t1 - t0) / 1e3)
        wrapped_us.append((t2 - t1) / 1e3)
        diff_us.append(((t2 - t1) - (t1 - t0)) / 1e3)
    # the wrapper's own CPU cost, with the communication replaced by a done handle
    class _Done:
        def wait(self, timeout=None):
            return True
    done = _Done()
    # The public path (`Comm.all_reduce`: group-of-one check, hooks, begin row,
    # issue, end row) with torch.distributed swapped, in the comm module only,
    # for a stand-in whose all_reduce returns the done handle: the same
    # measurement for any version of the wrapper.
    import types

    import ncclscope.runtime.comm as comm_mod
    real_dist = comm_mod.dist
    comm_mod.dist = types.SimpleNamespace(all_reduce=lambda *a, **k: done)

    def wrapped_alone() -> None:
        comm.all_reduce(t, world_g)
    # CPU time of this thread (not wall time: a 2-core machine shared with other
    # jobs deschedules us), per op, in blocks of 100; the median block is the figure
    block, blocks = 100, max(10, n_ops // 100)
    per_block = []
    for _ in range(blocks):
        t0 = time.thread_time_ns()
        for _ in range(block):
            wrapped_alone()
        per_block.append((time.thread_time_ns() - t0) / block / 1e3)
    cpu_us = statistics.median(per_block)
    comm_mod.dist = real_dist

    # (b) training steps traced vs untraced on the same mesh
    cfg = RunConfig(dp=world, steps=5, out=run_dir).validate()
    mesh = build_mesh(cfg, comm)
    null = NullRecorder(rank, world)
    comm_off = Comm(null, rank, world, timeout_s=60)
    comm_off.groups = comm.groups
    traced, plain = [], []
    for i in range(max(2, steps // cfg.steps)):
        for which in ((0, 1) if i % 2 == 0 else (1, 0)):
            c, r, sink = (comm, rec, traced) if which == 0 else (comm_off, null, plain)
            dist.barrier()
            t0 = time.perf_counter()
            train_dp(cfg, c, mesh, r, FaultPlan([], rank, r))
            sink.append((time.perf_counter() - t0) / cfg.steps)
    rec.close()
    if rank == 0:
        conn.send_bytes(json.dumps({"raw_us": raw_us, "wrapped_us": wrapped_us, "diff_us": diff_us,
                                    "cpu_us": cpu_us, "traced_s": traced, "plain_s": plain}).encode())
    conn.close()
    dist.barrier()
    os._exit(0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", type=int, default=5000)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--wait-s", type=float, default=RESULT_WAIT_S, help="give up on the ranks after this long")
    args = p.parse_args()
    from ncclscope.runtime.train import warm_imports
    warm_imports()
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    res = None
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/store"
        procs = [ctx.Process(target=_rank, args=(r, 2, init, f"{tmp}/run", args.ops, args.steps, send))
                 for r in range(2)]
        for proc in procs:
            proc.start()
        send.close()   # the parent's copy: EOF on recv once both ranks are gone
        deadline = time.monotonic() + args.wait_s
        try:
            while res is None and time.monotonic() < deadline:
                if recv.poll(1.0):
                    res = json.loads(recv.recv_bytes())
                elif all(proc.exitcode is not None for proc in procs):
                    break          # both ranks ended without a result
        except EOFError:
            pass
        for proc in procs:
            proc.join(max(1.0, min(60.0, deadline - time.monotonic())))
            if proc.exitcode is None:
                proc.kill()
                proc.join(5)
    if res is None:
        codes = [proc.exitcode for proc in procs]
        print(f"overhead: no result from rank 0 within {args.wait_s:g} s (rank exit codes {codes})", file=sys.stderr)
        return 1
    raw, wrapped = statistics.median(res["raw_us"]), statistics.median(res["wrapped_us"])
    traced, plain = statistics.median(res["traced_s"]), statistics.median(res["plain_s"])
    print("ncclscope overhead (2 gloo ranks on this machine, medians of interleaved blocks)")
    diff = statistics.median(res["diff_us"])
    print(f"  all_reduce of 4 floats: raw {raw:8.1f} us/op   wrapped {wrapped:8.1f} us/op   "
          f"wrapper cost {diff:+6.1f} us/op (median of {len(res['diff_us'])} paired ops; target <= 20)")
    print(f"  wrapper CPU time alone (begin/end rows, sequence, call site, timeout; no communication): "
          f"{res['cpu_us']:.1f} us/op (thread CPU time, median of blocks of 100 ops)")
    print(f"  DP training step:       plain {plain * 1e3:7.2f} ms    traced  {traced * 1e3:7.2f} ms    "
          f"ratio {traced / plain:.3f}x   (target <= 1.03x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
