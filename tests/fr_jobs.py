"""Plain-PyTorch gloo jobs that leave Flight Recorder dumps with a known culprit.

    from fr_jobs import make_dumps
    out = make_dumps("wrong_group", world=4, culprit=1, out=tmp_path)   # -> directory of nccl_trace_rank_N

No ncclscope code runs in these jobs: they are what a user's script does (a
tp x dp mesh of `new_group`s, a gradient all-reduce on the dp group and an
activation all-reduce on the tp group per step), broken the way users break
them, and each rank writes `torch._C._distributed_c10d._dump_fr_trace()` the
way the NCCL watchdog would on a timeout (gloo writes none by itself:
platform-notes.md). Scenarios (culprit = the rank that deviates):

    healthy      nothing wrong
    skip         the culprit skips its dp all_reduce at step 2
    wrong_group  the culprit issues the tp call site's all_reduce on its dp group at step 2
    size / dtype / type   the culprit's dp all_reduce at step 2 has another size / dtype / is a broadcast
    dead         the culprit exits at step 2 (no dump, as a killed process leaves none)
    extra        the culprit, alone, all-reduces a scalar (its loss, for logging) on the world group at
                 step 2, behind an `if` on its rank: an op no peer ever posts
    stuck        the culprit sleeps in "compute" at step 2 past its peers' timeout (on a dump this
                 reads as a rank that never posted the op: a hang rooted at the culprit)
    group_order  the culprit creates the dp groups before the tp groups; every rank then fails inside
                 new_group. gloo's pg_config is empty, so each rank's dump gets the pg_config an NCCL
                 job would have written (group name -> members, in its own creation order): the
                 same names with different members on the culprit

Each job has a hard deadline; every child is reaped.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import socket
import threading
import time
from pathlib import Path

SCENARIOS = ("healthy", "skip", "wrong_group", "size", "dtype", "type", "dead", "stuck", "group_order", "extra")
STEPS = 4
BAD_STEP = 2
OP_TIMEOUT_S = 3.0
WARM_TIMEOUT_S = 60.0   # steps before BAD_STEP: a loaded machine connects a new group's pairs slowly
# the kind of headline each scenario must produce (what the analyzer should say)
EXPECTED_KIND = {"skip": "hang", "wrong_group": "wrong_group", "size": "collective_mismatch",
                 "dtype": "collective_mismatch", "type": "collective_mismatch", "dead": "dead_rank",
                 "stuck": "hang", "extra": "hang", "group_order": "group_mismatch", "healthy": None}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _plan(world: int, swap: bool) -> list[list[int]]:
    """tp groups {2k, 2k+1} then dp groups {j, j+2, ...}; `swap` creates dp first."""
    tp = [[2 * k, 2 * k + 1] for k in range(world // 2)]
    dp = [list(range(j, world, 2)) for j in range(2)]
    return dp + tp if swap else tp + dp


_STARTED_NS = [0]   # when this forked rank started (set in _rank)


def _dump(out: Path, rank: int, pg_config: dict | None = None) -> None:
    """This rank's Flight Recorder buffer, without the entries a fork inherited: forked from a test
    process that ran collectives of its own (the tracer's unit tests do), the buffer holds those
    too, with their groups and stack frames, and the verdicts were about them."""
    import torch
    d = pickle.loads(torch._C._distributed_c10d._dump_fr_trace())
    d["entries"] = [e for e in d.get("entries", []) if int(e.get("time_created_ns", 0) or 0) >= _STARTED_NS[0]]
    if pg_config is not None:      # emulate the pg_config an NCCL job writes (gloo leaves it empty)
        d["pg_config"] = pg_config
    data = pickle.dumps(d)
    tmp = out / f".tmp{rank}"
    tmp.write_bytes(data)
    os.replace(tmp, out / f"nccl_trace_rank_{rank}")


def _wait(work, out: Path, rank: int, pg_config: dict | None = None, timeout_s: float = OP_TIMEOUT_S) -> bool:
    """Dump with the op in flight (what a watchdog's dump on timeout holds), then wait for it
    with a timeout; False when it timed out or failed. Re-dumping after every issue keeps a
    dump even when gloo aborts the process inside the op."""
    _dump(out, rank, pg_config)
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        return True
    except RuntimeError:
        return False


def _tp_sync(x, group):                        # the activation all-reduce a TP layer does
    import torch.distributed as dist
    return dist.all_reduce(x, group=group, async_op=True)


def _grad_sync(g, group):                      # the gradient all-reduce a DP wrapper does
    import torch.distributed as dist
    return dist.all_reduce(g, group=group, async_op=True)


def _rank(scenario: str, rank: int, world: int, culprit: int, port: int, out: str) -> None:  # forked child
    _STARTED_NS[0] = time.time_ns()
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    outp = Path(out)
    dist.init_process_group("gloo", rank=rank, world_size=world, init_method=f"tcp://127.0.0.1:{port}",
                            timeout=datetime.timedelta(seconds=OP_TIMEOUT_S + 2))
    seed = torch.zeros(4)
    dist.broadcast(seed, 0)                       # broadcast #1 on default_pg
    plan = _plan(world, swap=scenario == "group_order" and rank == culprit)
    if scenario == "group_order":
        cfg = {str(i + 1): {"name": str(i + 1), "desc": "undefined", "ranks": str(m)} for i, m in enumerate(plan)}
        cfg["0"] = {"name": "0", "desc": "default_pg", "ranks": str(list(range(world)))}
        _dump(outp, rank, cfg)          # gloo may abort the process inside new_group: keep what we know
        threading.Timer(OP_TIMEOUT_S + 3, os._exit, (0,)).start()   # a hung new_group: the watchdog's end
        try:
            groups = [dist.new_group(m) for m in plan]
            x = torch.ones(8)
            for g, m in zip(groups, plan):
                if rank in m:
                    _wait(dist.all_reduce(x, group=g, async_op=True), outp, rank, cfg)
        except Exception:
            pass
        _dump(outp, rank, cfg)
        os._exit(0)
    groups = [dist.new_group(m) for m in plan]
    tp = next(g for g, m in zip(groups, plan) if len(m) == 2 and rank in m and m[1] - m[0] == 1)
    dp = next(g for g, m in zip(groups, plan) if rank in m and (len(m) != 2 or m[1] - m[0] != 1))
    x, grad = torch.ones(16), torch.ones(16)
    ok = True
    for step in range(STEPS):
        bad = rank == culprit and step == BAD_STEP
        tmo = OP_TIMEOUT_S if step >= BAD_STEP else WARM_TIMEOUT_S   # the watchdog's deadline matters from there
        if bad and scenario == "dead":     # a killed process leaves no dump
            (outp / f"nccl_trace_rank_{rank}").unlink(missing_ok=True)
            os._exit(1)
        if bad and scenario == "stuck":
            time.sleep(OP_TIMEOUT_S + 4)
            _dump(outp, rank)
            os._exit(0)
        ok = _wait(_tp_sync(x, dp if bad and scenario == "wrong_group" else tp), outp, rank, timeout_s=tmo)
        if not ok:
            break
        if bad and scenario == "skip":
            break
        if bad and scenario == "extra":
            ok = _wait(dist.all_reduce(torch.ones(1), async_op=True), outp, rank, timeout_s=tmo)
            if not ok:
                break
        g = grad
        if bad and scenario == "size":
            g = torch.ones(24)
        elif bad and scenario == "dtype":
            g = torch.ones(16, dtype=torch.float64)
        if bad and scenario == "type":
            ok = _wait(dist.broadcast(g, src=dist.get_global_rank(dp, 0), group=dp, async_op=True), outp, rank,
                       timeout_s=tmo)
        else:
            ok = _wait(_grad_sync(g, dp), outp, rank, timeout_s=tmo)
        if not ok:
            break
    _dump(outp, rank)
    os._exit(0)


def clean_context() -> mp.context.BaseContext:
    """Where the ranks start: forks of a fork server that imported torch once, not of this process.
    Flight Recorder's buffer is one per process, and a fork of this one would carry into every rank's
    dump the entries of whatever it ran before (a test that initialised gloo in-process); spawned ranks
    would each import torch again."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed"])
    return ctx


def make_dumps(scenario: str, world: int, culprit: int, out: Path, deadline_s: float = 90.0) -> Path:
    """Run the scenario on `world` gloo ranks; return the directory holding their dumps."""
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario {scenario!r} (one of {', '.join(SCENARIOS)})")
    out = Path(out) / f"{scenario}-w{world}-c{culprit}"
    out.mkdir(parents=True, exist_ok=False)
    ctx = clean_context()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(scenario, r, world, culprit, port, str(out)), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    end = time.monotonic() + deadline_s
    try:
        for p in procs:
            p.join(max(0.1, end - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
    return out


def _is_tp(members: list[int]) -> bool:
    return len(members) == 2 and members[1] - members[0] == 1


def reorder_groups(src: Path, dst: Path, culprit: int, world: int, descs: bool = False,
                   keep_pg_config: bool = False) -> Path:
    """A healthy job's dumps (`make_dumps("healthy", ...)`) rewritten as the culprit would have
    recorded them had it created the dp groups before the tp groups (group names are a creation
    counter, so its groups carry the other ranks' names for other member sets) and the job had
    run on anyway: every collective pairs with someone and completes, nothing hangs. gloo's
    pg_config is empty, so only the entries tell (unless `keep_pg_config`). `descs` gives each
    group a description the way DeviceMesh does ("mesh_tp" / "mesh_dp"), in each rank's own view.
    No process runs: what the rewritten rank recorded follows from the names alone."""
    normal, swapped = _plan(world, swap=False), _plan(world, swap=True)
    dst = Path(dst)
    dst.mkdir(parents=True, exist_ok=False)
    for f in sorted(Path(src).glob("nccl_trace_rank_*")):
        rank = int(f.name.rsplit("_", 1)[1])
        d = pickle.loads(f.read_bytes())
        plan = swapped if rank == culprit else normal
        for e in d["entries"]:
            name, desc = e["process_group"]
            if not str(name).isdigit() or name == "0":
                continue
            members = normal[int(name) - 1]                  # what this op was for (its call site's group)
            new = str(plan.index(members) + 1)
            e["process_group"] = (new, ("mesh_tp" if _is_tp(members) else "mesh_dp") if descs else desc)
        if keep_pg_config:
            cfg = {str(i + 1): {"name": str(i + 1), "desc": "undefined", "ranks": str(m)} for i, m in enumerate(plan)}
            cfg["0"] = {"name": "0", "desc": "default_pg", "ranks": str(list(range(world)))}
            d["pg_config"] = cfg
        (dst / f.name).write_bytes(pickle.dumps(d))
        st = f.stat()                # the dump's time is its file's mtime: keep the job's, not the rewrite's
        os.utime(dst / f.name, ns=(st.st_atime_ns, st.st_mtime_ns))
    return dst
