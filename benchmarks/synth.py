"""Synthetic run directory at scale: N ranks on a pp x dp x tp mesh, ~10 M event rows.

    python benchmarks/synth.py /tmp/synth --ranks 1024 --events 10000000 [--no-hang] [--seed 0]

Why: the analyzer must stay fast and bounded at 1,024 ranks, and real runs
that big do not fit on a laptop. This writes exactly what the runtime
writes (rank-NNNNN/events.arrows, metrics.arrows, samples.arrows, rank.json, groups.json,
run.json; groups named and ordered as runtime/mesh.py plans them; local
clocks with per-rank offsets) so `ncclscope.load.trace.load` reads it unchanged.
groups.json is the runtime's format 2 (runtime/mesh.py `group_file`): each
rank's own groups and its plan's fingerprint; rank 0's also holds the whole
plan. So a 16,384-rank directory's metadata is a few KB per rank, not 2 MB.

What is in it: 1F1B pipeline steps (forward/backward per microbatch with
stage and microbatch set, isend/irecv between neighbouring stages with
per-peer sequence numbers, two tensor-parallel all_reduces after every
forward and backward, one data-parallel all_reduce and the optimizer per
step), heartbeats every second, NVML-style samples every 100 ms, metrics
per step (MoE expert load included). The last stage is 25% slower, so the
bubble analysis has imbalance to find.

Hang (default): in the last step, rank `hang_rank` skips the data-parallel
all_reduce (as `--inject skip:rank=R,step=S,op=all_reduce` does): its dp
peers stay inside that all_reduce (begin row, no end row), it goes on to the
optimizer and the final world barrier; every other rank finishes the step
and waits in the world barrier. Heartbeats go on until the launcher's
deadline. run.json["synthetic"] records the ground truth for tests.

Vectorised: one small Python simulation of the pipeline template per step
(p * 2m actions), then numpy expands it to every rank.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc

from ncclscope import schema as S

MS = 1_000_000
T0 = 1_750_000_000 * 1_000_000_000
NAMES = ["forward", "backward", "optimizer", "all_reduce", "isend", "irecv", "all_gather_into_tensor", "barrier",
         S.HEARTBEAT]
KIND_OF = {"forward": S.KIND_COMPUTE, "backward": S.KIND_COMPUTE, "optimizer": S.KIND_COMPUTE,
           "all_reduce": S.KIND_COLLECTIVE, "all_gather_into_tensor": S.KIND_COLLECTIVE, "barrier": S.KIND_COLLECTIVE,
           "isend": S.KIND_P2P, "irecv": S.KIND_P2P, S.HEARTBEAT: S.KIND_MARKER}
G_NONE, G_TP, G_DP, G_PP, G_WORLD = 0, 1, 2, 3, 4


def mesh_for(ranks: int, tp: int | None = None, pp: int | None = None) -> tuple[int, int, int]:
    """(tp, pp, dp): tp 8 and pp 8 when the world is big enough, else 2s."""
    tp = tp or next(t for t in (8, 4, 2, 1) if ranks % t == 0 and ranks // t >= 4 or t == 1)
    rest = ranks // tp
    pp = pp or next(p for p in (8, 4, 2, 1) if rest % p == 0 and rest // p >= 2 or p == 1)
    if ranks % (tp * pp):
        raise ValueError(f"tp*pp = {tp}*{pp} does not divide {ranks} ranks")
    return tp, pp, ranks // (tp * pp)


def one_f_one_b(p: int, m: int, s: int) -> list[tuple[str, int]]:
    warm = min(p - s - 1, m)
    acts = [("F", i) for i in range(warm)]
    for i in range(m - warm):
        acts += [("F", warm + i), ("B", i)]
    acts += [("B", i) for i in range(m - warm, m)]
    return acts


def template(p: int, m: int, steps: int, fwd_ms: float = 4.0, tp_ms: float = 0.3, p2p_ms: float = 0.5,
             dp_ms: float = 20.0, opt_ms: float = 5.0) -> list[list[tuple]]:
    """Per stage: ops (step, name, group, peer_delta, mb, start, end) of a 1F1B pipeline, in ns from 0."""
    ops: list[list[tuple]] = [[] for _ in range(p)]
    free = [0.0] * p
    for step in range(steps):
        order = [one_f_one_b(p, m, s) for s in range(p)]
        pos = [0] * p
        ready: dict[tuple[str, int, int], float] = {}   # (F|B, stage, mb) -> time its output arrives downstream
        left = sum(len(o) for o in order)
        while left:
            moved = False
            for s in range(p):
                if pos[s] >= len(order[s]):
                    continue
                kind, mb = order[s][pos[s]]
                dep = ("F", s - 1, mb) if kind == "F" else (("B", s + 1, mb) if s < p - 1 else ("F", s, mb))
                needs_recv = (kind == "F" and s > 0) or (kind == "B" and s < p - 1)
                if (kind == "F" and s == 0) or dep in ready:
                    t = free[s]
                    arrive = ready.get(dep, t) if needs_recv else t
                    if needs_recv:
                        ops[s].append((step, "irecv", G_PP, -1 if kind == "F" else 1, mb, t, max(arrive, t + 0.02)))
                        t = max(arrive, t + 0.02)
                    dur = fwd_ms * (1.25 if s == p - 1 else 1.0) * (1 if kind == "F" else 2)
                    ops[s].append((step, "forward" if kind == "F" else "backward", G_NONE, 0, mb, t, t + dur))
                    t += dur
                    for _ in range(2):
                        ops[s].append((step, "all_reduce", G_TP, 0, mb, t, t + tp_ms))
                        t += tp_ms
                    sends = (kind == "F" and s < p - 1) or (kind == "B" and s > 0)
                    if sends:
                        ops[s].append((step, "isend", G_PP, 1 if kind == "F" else -1, mb, t, t + p2p_ms))
                        t += p2p_ms
                    ready[(kind, s, mb)] = t
                    free[s] = t
                    pos[s] += 1
                    left -= 1
                    moved = True
            if not moved:
                raise RuntimeError("template schedule deadlocked")
        for s in range(p):
            t = free[s]
            ops[s].append((step, "all_reduce", G_DP, 0, -1, t, t + dp_ms))
            ops[s].append((step, "optimizer", G_NONE, 0, -1, t + dp_ms, t + dp_ms + opt_ms))
            free[s] = t + dp_ms + opt_ms
        top = max(free)
        free = [top + 1.0] * p
    return [[(o[0], o[1], o[2], o[3], o[4], int(o[5] * MS), int(o[6] * MS)) for o in st] for st in ops]


def _strings(codes: np.ndarray, values: list[str]) -> pa.Array:
    return pa.DictionaryArray.from_arrays(pa.array(codes.astype("int32")), pa.array(values)).cast(pa.string())


def _write_stream(path: Path, table: pa.Table) -> None:
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=4096)


def generate(out_dir: str | Path, ranks: int = 1024, events: int = 10_000_000, hang: bool = True, seed: int = 0,
             tp: int | None = None, pp: int | None = None, microbatches: int = 8) -> Path:
    """Write the run directory and return its path (see module docstring)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tp, pp, dp = mesh_for(ranks, tp, pp)
    m = microbatches
    per_step = 2 * (2 * m * 3 + 4 * m * (pp - 1) / pp + 2) + 1
    steps = max(2, int(round(events / (ranks * per_step))))
    tmpl = template(pp, m, steps)
    run_ns = max(st[-1][6] for st in tmpl)
    hang_rank = int(rng.integers(ranks)) if hang else -1
    h_tp, h_dp, h_pp = hang_rank % tp, (hang_rank // tp) % dp, hang_rank // (tp * dp)
    end_ns = run_ns + (30_000 * MS if hang else 2 * MS)
    offsets = rng.integers(-200_000, 200_000, ranks)          # local clock = aligned - offset
    names_idx = {n: i for i, n in enumerate(NAMES)}
    groups = _group_plan(tp, dp, pp)
    group_names = [g["name"] for g in groups]
    gidx = {n: i for i, n in enumerate(group_names)}
    encoded = [{**g, "ranks": _encode(g["ranks"])} for g in groups]
    head = {"format": 2, "fingerprint": f"{_fingerprint(groups):016x}", "n_groups": len(groups)}
    n_written = 0
    for s in range(pp):
        t = tmpl[s]
        n = len(t)
        step = np.array([o[0] for o in t])
        name = np.array([names_idx[o[1]] for o in t])
        gk = np.array([o[2] for o in t])
        pdelta = np.array([o[3] for o in t])
        mb = np.array([o[4] for o in t])
        t_start = np.array([o[5] for o in t], dtype=np.int64)
        t_end = np.array([o[6] for o in t], dtype=np.int64)
        # per-group sequence numbers (the same on every rank of the stage)
        cseq = np.full(n, -1, dtype=np.int64)
        for g in (G_TP, G_DP):
            sel = gk == g
            cseq[sel] = np.arange(1, sel.sum() + 1)
        pseq = np.full(n, -1, dtype=np.int64)
        for nm in ("isend", "irecv"):
            for d in (-1, 1):
                sel = (name == names_idx[nm]) & (pdelta == d)
                pseq[sel] = np.arange(1, sel.sum() + 1)
        # ranks of this stage: (dp, tp) grid; rank = (s*dp + d)*tp + t
        r_grid = (s * dp + np.arange(dp)[:, None]) * tp + np.arange(tp)[None, :]          # [dp, tp]
        jit = rng.integers(0, 30_000, (dp, tp, n))
        start = t_start[None, None, :] + jit                                               # [dp, tp, n]
        dur = t_end - t_start
        end = start + (dur[None, None, :] * (1 - rng.random((dp, tp, n)) * 0.02)).astype(np.int64)
        is_tp, is_dp = gk == G_TP, gk == G_DP
        end[:, :, is_tp] = start[:, :, is_tp].max(axis=1, keepdims=True) + dur[is_tp]
        end[:, :, is_dp] = start[:, :, is_dp].max(axis=0, keepdims=True) + dur[is_dp]
        keep_begin = np.ones((dp, tp, n), dtype=bool)
        keep_end = np.ones((dp, tp, n), dtype=bool)
        last_dp = np.flatnonzero(is_dp)[-1]
        if hang and s == h_pp:
            stuck = np.zeros((dp, tp), dtype=bool)
            stuck[:, h_tp] = True
            stuck[h_dp, h_tp] = False
            keep_end[stuck, last_dp] = False
            keep_begin[stuck, last_dp + 1:] = False
            keep_end[stuck, last_dp + 1:] = False
            keep_begin[h_dp, h_tp, last_dp] = keep_end[h_dp, h_tp, last_dp] = False
        # the world collectives around training: seq 1 at start, the final barrier last
        extra = _world_ops(dp, tp, t_start[0], t_end[-1], hang, rng)
        for d in range(dp):
            for k in range(tp):
                r = int(r_grid[d, k])
                stuck_here = hang and s == h_pp and k == h_tp and d != h_dp
                cols = _rank_rows(r, s, tp, dp, pp, step, name, gk, pdelta, mb, cseq, pseq, start[d, k], end[d, k],
                                  keep_begin[d, k], keep_end[d, k], extra, stuck_here, hang, end_ns, gidx, names_idx)
                cols["time_ns"] = cols["time_ns"] - offsets[r]
                table = _events_table(cols, group_names)
                n_written += table.num_rows
                d_out = out / S.rank_dir_name(r)
                d_out.mkdir(exist_ok=True)
                _write_stream(d_out / S.EVENTS_FILE, table)
                done_steps = steps - 1 if stuck_here else steps
                _write_stream(d_out / S.METRICS_FILE, _metrics(r, s, k, pp, done_steps, start[d, k], end[d, k],
                                                               name, step, names_idx, offsets[r], rng))
                _write_stream(d_out / S.SAMPLES_FILE, _samples(r, t_start, t_end, name, names_idx, end_ns,
                                                               offsets[r], rng))
                meta = {"schema": S.SCHEMA_VERSION, "rank": r, "world_size": ranks, "host": f"node{r // 8:04d}",
                        "pid": 10_000 + r, "device": f"cuda:{r % 8}", "clock_offset_ns": int(offsets[r]),
                        "clock_uncertainty_ns": 20_000, "started_ns": int(T0 - offsets[r]),
                        "coords": {"tp": k, "cp": 0, "dp": d, "pp": s, "ep": 0}, "groups_file": S.GROUPS_JSON}
                if not hang:
                    meta["end"] = {"status": "ok", "message": "", "time_ns": int(T0 + end_ns - offsets[r])}
                (d_out / S.RANK_JSON).write_text(json.dumps(meta))
                # as runtime/mesh.py group_file + recorder.write_meta write it: own groups, plan on rank 0
                own = [encoded[0], encoded[gidx[f"tp{s * dp + d}"]], encoded[gidx[f"cp{r}"]],
                       encoded[gidx[f"dp{s * tp + k}"]], encoded[gidx[f"pp{d * tp + k}"]]]
                own.sort(key=lambda g: g["creation_order"])
                gfile = {**head, "groups": own, **({"plan": encoded} if r == 0 else {})}
                (d_out / S.GROUPS_JSON).write_text(json.dumps(gfile, separators=(",", ":")))
    _run_json(out, ranks, tp, pp, dp, m, steps, hang, hang_rank, h_dp, h_tp, h_pp, end_ns, n_written)
    return out


def _group_plan(tp: int, dp: int, pp: int) -> list[dict[str, Any]]:
    """world + tp/cp/dp/pp groups named and ordered as runtime/mesh.py plans them (cp = 1)."""
    def rank(t: int, d: int, p: int) -> int:
        return (p * dp + d) * tp + t
    plan = [("tp", [[rank(t, d, p) for t in range(tp)] for p in range(pp) for d in range(dp)]),
            ("cp", [[rank(t, d, p)] for p in range(pp) for d in range(dp) for t in range(tp)]),
            ("dp", [[rank(t, d, p) for d in range(dp)] for p in range(pp) for t in range(tp)]),
            ("pp", [[rank(t, d, p) for p in range(pp)] for d in range(dp) for t in range(tp)])]
    out = [{"name": "world", "kind": "world", "ranks": list(range(tp * dp * pp)), "creation_order": 0,
            "backend": "nccl"}]
    for kind, lists in plan:
        for i, members in enumerate(lists):
            out.append({"name": f"{kind}{i}", "kind": kind, "ranks": members, "creation_order": len(out),
                        "backend": "nccl" if len(members) > 1 else ""})
    return out


def _encode(members: list[int]) -> list[int] | dict[str, list[int]]:
    """As runtime/mesh.py encode_members: an arithmetic progression of >= 3 ranks as {"range": [a, b, step]}."""
    if len(members) >= 3:
        step = members[1] - members[0]
        if step > 0 and members == list(range(members[0], members[-1] + 1, step)):
            return {"range": [members[0], members[-1] + step, step]}
    return list(members)


def _fingerprint(groups: list[dict[str, Any]]) -> int:
    """As runtime/mesh.py fingerprint(plan): the plan is every group but world, as (name, kind, members)."""
    plan = [(g["name"], g["kind"], g["ranks"]) for g in groups if g["name"] != "world"]
    return int.from_bytes(hashlib.blake2b(json.dumps(plan).encode(), digest_size=8).digest(), "big") >> 1


def _world_ops(dp: int, tp: int, first: int, last: int, hang: bool, rng: np.random.Generator) -> dict[str, int]:
    return {"gather_start": first - 50 * MS, "gather_end": first - 48 * MS, "barrier_start": last + MS,
            "barrier_end": -1 if hang else last + 2 * MS}


def _rank_rows(r: int, s: int, tp: int, dp: int, pp: int, step: np.ndarray, name: np.ndarray, gk: np.ndarray,
               pdelta: np.ndarray, mb: np.ndarray, cseq: np.ndarray, pseq: np.ndarray, start: np.ndarray,
               end: np.ndarray, keep_b: np.ndarray, keep_e: np.ndarray, world: dict[str, int], stuck: bool,
               hang: bool, end_ns: int, gidx: dict[str, int], names_idx: dict[str, int]) -> dict[str, np.ndarray]:
    """Begin/end rows of one rank (aligned times) as column arrays."""
    t_i, d_i = r % tp, (r // tp) % dp
    gname = np.select([gk == G_TP, gk == G_DP, gk == G_PP],
                      [gidx[f"tp{s * dp + d_i}"], gidx[f"dp{s * tp + t_i}"], gidx[f"pp{d_i * tp + t_i}"]], -1)
    peer = np.where(gk == G_PP, r + pdelta * tp * dp, -1)
    n = len(step)
    op_id = np.arange(1, n + 1)
    # world ops: all_gather #1 before, barrier #2 after (a stuck rank never reaches it)
    w_name = np.array([names_idx["all_gather_into_tensor"], names_idx["barrier"]])
    w_keep_b = np.array([True, not stuck])
    w_keep_e = np.array([True, not stuck and world["barrier_end"] >= 0])
    hb_t = np.arange(0, end_ns, 1_000 * MS) + (r * 7919) % (1_000 * MS)
    parts = []

    def rows(phase: str, mask: np.ndarray, t: np.ndarray, **cols: np.ndarray) -> None:
        parts.append({"phase": np.full(mask.sum(), phase, dtype=object), "time_ns": t[mask],
                      **{k: (v[mask] if np.ndim(v) else np.full(mask.sum(), v)) for k, v in cols.items()}})

    nbytes = np.select([gk == G_TP, gk == G_DP, gk == G_PP], [8 << 20, 256 << 20, 2 << 20], -1)
    common = dict(op_id=op_id, name=name, group=gname, cseq=cseq, pseq=pseq, peer=peer, step=step, mb=mb,
                  stage=np.where(mb >= 0, s, -1), nbytes=nbytes)
    rows("begin", keep_b, start, **common, status=0)
    rows("end", keep_e, end, **common, status=1)
    wcommon = dict(op_id=np.array([0, n + 1]), name=w_name, group=gidx["world"], cseq=np.array([1, 2]), pseq=-1,
                   peer=-1, step=-1, mb=-1, stage=-1, nbytes=np.array([8, 0]))
    rows("begin", w_keep_b, np.array([world["gather_start"], world["barrier_start"]]), **wcommon, status=0)
    rows("end", w_keep_e, np.array([world["gather_end"], world["barrier_end"]]), **wcommon, status=1)
    hb = np.ones(len(hb_t), dtype=bool)
    rows("instant", hb, hb_t, op_id=-1, name=names_idx[S.HEARTBEAT], group=-1, cseq=-1, pseq=-1, peer=-1,
         step=np.minimum(np.searchsorted(start[name == names_idx["optimizer"]], hb_t), step.max()), mb=-1,
         stage=-1, status=0, nbytes=-1)
    cols = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    order = np.argsort(cols["time_ns"], kind="stable")
    cols = {k: v[order] for k, v in cols.items()}
    cols["time_ns"] = cols["time_ns"] + T0
    cols["rank"] = np.full(len(order), r)
    return cols


def _events_table(c: dict[str, np.ndarray], group_names: list[str]) -> pa.Table:
    n = len(c["rank"])
    name = c["name"]
    kinds = [S.KIND_COMPUTE, S.KIND_COLLECTIVE, S.KIND_P2P, S.KIND_MARKER]
    kind_of = np.array([kinds.index(KIND_OF[x]) for x in NAMES])
    begin = c["phase"] == "begin"
    is_coll = kind_of[name] == 1
    is_p2p = kind_of[name] == 2
    grp = np.where(c["group"] >= 0, c["group"] + 1, 0)
    status = np.where(c["phase"] == "end", 1, 0)
    arrays = {
        "rank": pa.array(c["rank"], pa.int32()), "op_id": pa.array(c["op_id"], pa.int64()),
        "phase": pa.array(c["phase"], pa.string()), "time_ns": pa.array(c["time_ns"], pa.int64()),
        "kind": _strings(kind_of[name], kinds), "op_name": _strings(name, NAMES),
        "process_group": _strings(grp, [""] + group_names),
        "collective_seq_id": pa.array(c["cseq"], pa.int64()), "p2p_seq_id": pa.array(c["pseq"], pa.int64()),
        "peer": pa.array(c["peer"], pa.int32()), "tag": pa.array(np.where(is_p2p, 0, -1), pa.int32()),
        "bytes": pa.array(c["nbytes"], pa.int64()),
        "input_dtypes": _strings(np.where(begin & (is_coll | is_p2p), 1, 0), ["", "bfloat16"]),
        "input_sizes": _strings(np.where(begin & (is_coll | is_p2p), 1, 0), ["", "[[4194304]]"]),
        "reduce_op": _strings(np.where(begin & (name == NAMES.index("all_reduce")), 1, 0), ["", "sum"]),
        "step": pa.array(c["step"], pa.int32()), "microbatch": pa.array(c["mb"], pa.int32()),
        "stage": pa.array(c["stage"], pa.int32()), "chunk": pa.array(np.where(c["stage"] >= 0, 0, -1), pa.int32()),
        "status": _strings(status, ["", S.STATUS_OK]),
        "timeout_ms": pa.array(np.where(begin & (is_coll | is_p2p), 600_000, -1), pa.int64()),
        "call_site": _strings(np.where(begin & ~(kind_of[name] == 3), 1 + kind_of[name], 0),
                              ["", "train.py:120", "parallel/tensor.py:88", "pipeline/executor.py:210"]),
        "message": pa.nulls(n, pa.string()).fill_null(""),
    }
    return pa.Table.from_arrays([arrays[f] for f in S.EVENT_COLUMNS], schema=S.EVENTS_SCHEMA)


def _metrics(r: int, s: int, k: int, pp: int, steps: int, start: np.ndarray, end: np.ndarray, name: np.ndarray,
             step: np.ndarray, names_idx: dict[str, int], offset: int, rng: np.random.Generator) -> pa.Table:
    opt = name == names_idx["optimizer"]
    t_end = end[opt][:steps]
    st = np.arange(steps)
    step_time = np.diff(np.concatenate([[start[0]], t_end])) / 1e9
    loss = 5.5 * np.exp(-st / 40) + 0.01 * rng.standard_normal(steps) if s == pp - 1 else np.full(steps, np.nan)
    gn = 2.0 + 0.5 * np.sin(st)
    cols = {
        "rank": pa.array(np.full(steps, r), pa.int32()), "step": pa.array(st, pa.int32()),
        "time_ns": pa.array(t_end + T0 - offset, pa.int64()), "step_time_s": pa.array(step_time),
        "loss": pa.array(loss), "grad_norm_local": pa.array(gn * (1 + 0.1 * rng.standard_normal(steps))),
        "grad_norm_global": pa.array(gn), "grad_norm_reduced": pa.array(np.full(steps, np.nan)), "param_checksum": pa.array(100.0 + s * 10 + k + st * 0.01),
        "memory_bytes": pa.array((60e9 + 1e8 * np.minimum(st, 5) + s * 1e9).astype(np.int64)),
        "tokens": pa.array(np.full(steps, 8 * 4096), pa.int64()),
        "expert_load": pa.array([list(x) for x in rng.poisson(4096, (steps, 8)) * np.array([3, 1, 1, 1, 1, 1, 1, 1])],
                                pa.list_(pa.int64())),
        "dropped_tokens": pa.array(rng.poisson(20, steps), pa.int64()),
        "extra": pa.array([""] * steps, pa.string()),
    }
    return pa.Table.from_arrays([cols[f] for f in S.METRIC_COLUMNS], schema=S.METRICS_SCHEMA)


def _samples(r: int, t_start: np.ndarray, t_end: np.ndarray, name: np.ndarray, names_idx: dict[str, int],
             end_ns: int, offset: int, rng: np.random.Generator) -> pa.Table:
    t = np.arange(0, end_ns, 100 * MS) + (r * 104729) % (100 * MS)
    comp = np.isin(name, [names_idx["forward"], names_idx["backward"], names_idx["optimizer"]])
    cs, ce = t_start[comp], t_end[comp]
    i = np.searchsorted(cs, t, side="right") - 1
    busy = (i >= 0) & (t < ce[np.clip(i, 0, None)])
    util = np.where(busy, 92.0, 4.0) + rng.random(len(t)) * 4
    n = len(t)
    cols = {"rank": pa.array(np.full(n, r), pa.int32()), "time_ns": pa.array(t + T0 - offset, pa.int64()),
            "source": pa.array(["nvml"] * n, pa.string()), "device": pa.array(np.full(n, r % 8), pa.int32()),
            "gpu_util": pa.array(util), "mem_util": pa.array(util * 0.6),
            "mem_used_bytes": pa.array(np.full(n, 62 << 30), pa.int64()), "power_w": pa.array(util * 6.5),
            "temperature_c": pa.array(np.full(n, 55.0)), "cpu_percent": pa.array(np.full(n, 100.0)),
            "rss_bytes": pa.array(np.full(n, 8 << 30), pa.int64())}
    return pa.Table.from_arrays([cols[f] for f in S.SAMPLE_COLUMNS], schema=S.SAMPLES_SCHEMA)


def _run_json(out: Path, ranks: int, tp: int, pp: int, dp: int, m: int, steps: int, hang: bool, hang_rank: int,
              h_dp: int, h_tp: int, h_pp: int, end_ns: int, rows: int) -> None:
    cfg = {"tp": tp, "pp": pp, "dp": dp, "cp": 1, "ep": 1, "nproc": ranks, "zero": 1, "schedule": "1f1b",
           "microbatches": m, "vpp": 1, "pp_layers": [], "n_layer": 32, "n_head": 32, "n_embd": 4096,
           "block_size": 4096, "vocab_size": 32000, "n_experts": 8, "top_k": 2, "capacity_factor": 1.25,
           "steps": steps, "batch_size": 1024, "dtype": "bfloat16", "timeout_s": 600.0, "deadline_s": 0.0,
           "trace": True, "out": str(out), "inject": [], "backend": "nccl"}
    rank_state = ({"exitcode": None, "signal": "SIGTERM", "pid": 10_000 + r, "stopped_by_launcher": True}
                  if hang else {"exitcode": 0, "signal": None, "pid": 10_000 + r, "stopped_by_launcher": False}
                  for r in range(ranks))
    run = {"schema": S.SCHEMA_VERSION, "launcher": "synthetic", "world_size": ranks, "config": cfg,
           "versions": {"ncclscope": "synthetic"}, "started": "2025-06-15T12:00:00",
           "end_reason": "deadline" if hang else "completed", "duration_s": round(end_ns / 1e9, 3),
           "ranks": {str(r): st for r, st in enumerate(rank_state)},
           "synthetic": {"events": rows, "steps": steps, "hang": hang, "hang_rank": hang_rank,
                         "skipped": {"op": "all_reduce", "group": f"dp{h_pp * tp + h_tp}", "step": steps - 1,
                                     "seq": steps} if hang else None,
                         "stuck_ranks": [(h_pp * dp + d) * tp + h_tp for d in range(dp) if d != h_dp] if hang else []}}
    (out / S.RUN_JSON).write_text(json.dumps(run, indent=1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="run directory to create")
    ap.add_argument("--ranks", type=int, default=1024)
    ap.add_argument("--events", type=int, default=10_000_000)
    ap.add_argument("--no-hang", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args(argv)
    t0 = time.perf_counter()
    path = generate(ns.out, ns.ranks, ns.events, hang=not ns.no_hang, seed=ns.seed)
    info = json.loads((path / S.RUN_JSON).read_text())["synthetic"]
    print(f"{path}: {ns.ranks} ranks, {info['events']:,} event rows, {info['steps']} steps, "
          f"hang rank {info['hang_rank']} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
