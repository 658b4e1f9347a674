"""Accuracy on hand-written plain-PyTorch programs (benchmarks/hand_programs/), judged like the random ones.

    OMP_NUM_THREADS=1 python benchmarks/hand_programs.py --out /tmp/hand            # all 101, ~45 min on 2 cores
    OMP_NUM_THREADS=1 python benchmarks/hand_programs.py --out /tmp/hand --only grad_accum,early_stop
    python benchmarks/hand_programs.py --rejudge /tmp/hand                          # kept runs, this code

Each program is a script a user might write (DDP with gradient accumulation, FSDP2, DTensor, a DeviceMesh,
torch.distributed.pipelining, object collectives, a hand-written pipeline, an MoE token exchange...), with
one bug of a random-program class (`randprog/catalogue.py`) or none, and its truth here (`CASES`: class,
culprit ranks, world). Its lines carry `# <BUG>` (the line the verdict should name) and `# <ALT>` (other
acceptable lines: the caller, the `if` that skips, the loop left); the marks are stripped before it runs.
Each runs under `ncclscope run` with the random programs' own runner (hard deadline, the job's process
group reaped, the Flight Recorder dumps a plain-torchrun user would have extracted), and both evidence
sources are scored by their scorer (root, cause, line; healthy: no error and exit 0). A program whose bug
did not make its job fail is SILENT, not scored. Exit 0 when every scored source is right.
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))

from randprog.catalogue import CATALOGUE, HEALTHY  # noqa: E402
from randprog.generator import Program, Truth  # noqa: E402
from randprog.runner import analyze, run_job  # noqa: E402
import random_programs as rp  # noqa: E402

PROGRAMS = ROOT / "hand_programs"
# name -> (bug class, culprit ranks, world size)
CASES: dict[str, tuple[str, list[int], int]] = {
    "ckpt_rank0": ("extra", [0], 4), "early_stop": ("uneven_loop", [3], 4), "metric_dtype": ("dtype", [1], 4),
    "grad_accum": ("extra", [2], 4), "gather_object_misuse": ("op_type", [2], 4),
    "pipe_microbatches": ("uneven_loop", [3], 4), "fsdp2_shape": ("size", [1], 4), "a2a_counts": ("skip", [0], 4),
    "dtensor_skip": ("skip", [3], 4), "eval_rank0": ("extra", [0], 4), "ring_wrong_src": ("wrong_peer", [2], 4),
    "slow_loader": ("slow", [2], 4), "fsdp2_skip_backward": ("skip", [0], 4),
    "dmesh_wrong_dim": ("wrong_group", [1], 4), "uneven_loader": ("uneven_loop", [1], 4),
    "swallowed_error": ("skip", [2], 4),
    "healthy_accum": (HEALTHY, [], 4), "healthy_pipe": (HEALTHY, [], 4), "healthy_objects": (HEALTHY, [], 4),
    "healthy_subgroups": (HEALTHY, [], 4), "healthy_pipelining": (HEALTHY, [], 2),
    "barrier_rank0": ("extra", [0], 4), "nested_token_budget": ("uneven_loop", [2], 4),
    "zero_shard_align": ("size", [1], 4), "collate_bad_label": ("exception", [1], 2),
    "missing_val_shard": ("exit", [3], 4), "shard_poll_hang": ("hang_compute", [2], 4),
    "sched_bcast_dtype": ("dtype", [0], 4), "lazy_group_order": ("group_order", [3], 4),
    "healthy_join": (HEALTHY, [], 3), "healthy_rotating_root": (HEALTHY, [], 4),
    "healthy_gather_scatter": (HEALTHY, [], 4), "healthy_moe_splits": (HEALTHY, [], 4),
    "tp_mlp_skip_reduce": ("skip", [2], 4), "moe_stale_splits": ("size", [1], 3),
    "ring_spare_irecv": ("wrong_peer", [0], 5), "ckpt_barrier_continue": ("skip", [1], 3),
    "resume_objlist_short": ("short_objlist", [1], 2), "eval_view_raise": ("exception", [5], 6),
    "halo_local_parity": ("swap_order", [3], 6), "prefetch_thread_hang": ("hang_compute", [1], 2),
    "preempt_exit": ("exit", [3], 4), "healthy_uneven_work": (HEALTHY, [], 5),
    "healthy_alt_subgroups": (HEALTHY, [], 6), "healthy_batch_pipe3": (HEALTHY, [], 3),
    "clip_norm_logger": ("extra", [7], 8), "mesh3d_fallback_group": ("wrong_group", [6], 8),
    "async_bucket_unused": ("skip", [1], 4), "stop_flag_preempt": ("op_type", [2], 5),
    "val_after_train_uneven": ("uneven_loop", [5], 6), "pipe_label_offbyone": ("exception", [2], 3),
    "cache_lock_deadlock": ("hang_compute", [2], 4), "a2a_list_capacity": ("size", [3], 6),
    "nan_stuck_sensor": ("nan", [1], 2), "healthy_zero2_async": (HEALTHY, [], 4),
    "healthy_mesh_stop_flag": (HEALTHY, [], 6), "healthy_moe_capacity": (HEALTHY, [], 8),
    "tracker_empty_val": ("skip", [5], 6), "rollback_bcast_rank0": ("extra", [0], 5),
    "ps_vocab_growth": ("size", [4], 6), "early_stop_vote_bool": ("dtype", [3], 5),
    "reduce_logger_ckpt_rank": ("op_type", [6], 7), "stream_epoch_short_file": ("uneven_loop", [2], 6),
    "ckpt_lambda_pickle": ("exception", [5], 8), "balanced_resample_retry": ("hang_compute", [1], 3),
    "masked_mean_all_pad": ("nan", [2], 4), "healthy_ring_attention": (HEALTHY, [], 5),
    "healthy_hier_subgroups": (HEALTHY, [], 8), "healthy_pipe_config_vote": (HEALTHY, [], 4),
    "fsdp2_host_bf16_reduce": ("dtype", [2], 3), "ddp_packed_dedup_short": ("uneven_loop", [3], 5),
    "plateau_main_allreduce": ("op_type", [0], 6), "pipe1f1b_spike_abort": ("exit", [3], 4),
    "healthy_tp_replica_eval": (HEALTHY, [], 6), "healthy_multitask_fp16_hook": (HEALTHY, [], 3),
    "grid_halo_east_bound": ("wrong_peer", [2], 6), "gossip_resume_parity": ("swap_order", [3], 4),
    "eval_sidecar_group_order": ("group_order", [4], 5), "seqpar_tail_chunk": ("size", [2], 3),
    "healthy_ps_partial_push": (HEALTHY, [], 4), "healthy_uneven_nodes_tree": (HEALTHY, [], 5),
    "curriculum_stage_count": ("short_objlist", [2], 3), "val_recall_rare_class": ("exception", [2], 4),
    "resume_sampler_resync": ("extra", [4], 6), "bucket_rows_cached_vote": ("skip", [3], 5),
    "healthy_pretrain_finetune_tasks": (HEALTHY, [], 8), "healthy_vocab_ring_preempt": (HEALTHY, [], 7),
    "zero3_unchanged_shard_cache": ("skip", [3], 4), "tp_dp_clip_metrics_default_group": ("wrong_group", [0], 6),
    "moe_ep_dp_expert_monitor": ("exception", [4], 8), "zero1_async_ckpt_join_under_lock": ("hang_compute", [0], 3),
    "healthy_ddp_actckpt_length_buckets": (HEALTHY, [], 5), "healthy_pipe3_dp2_uneven_accum": (HEALTHY, [], 6),
    "ps_unlabeled_push_skip": ("wrong_peer", [3], 4), "topk_adaptive_density": ("size", [2], 4),
    "hier_allreduce_stale_hostfile": ("wrong_group", [2], 4), "warmup_bcast_stale_resume": ("skip", [3], 4),
    "shampoo_owner_cholesky": ("exception", [2], 4), "adaptive_clip_bisect_spin": ("hang_compute", [1], 4),
    "healthy_hook_overlap_tied": (HEALTHY, [], 4), "healthy_hash_dedup_shuffle": (HEALTHY, [], 4),
}
# a p2p pipeline whose last stage leaves its loop early also leaves a send unmatched
KINDS_EXTRA = {"pipe_microbatches": ["unmatched_p2p"]}
# a pair deadlock both of whose ranks send first: the pair is as right as the culprit (catalogue: swap_order)
# (as the random programs score it; halo_local_parity was scored on rank 3 alone before stop 47)
ROOTS_EXTRA = {"gossip_resume_parity": [[2, 3]], "halo_local_parity": [[2, 3]]}
MARK = re.compile(r"  # <(BUG|ALT)>$")


def program(name: str) -> Program:
    """The program with its marks stripped, and its truth (lines from the marks: BUG first)."""
    bug, culprits, world = CASES[name]
    text = (PROGRAMS / f"{name}.py").read_text()
    src, lines, texts = [], [], []
    for i, line in enumerate(text.split("\n"), 1):
        m = MARK.search(line)
        if m:
            line = line[:m.start()]
            at = 0 if m.group(1) == "BUG" else len(lines)
            lines.insert(at, i)
            texts.insert(at, line.strip())
        src.append(line)
    judged = bug != HEALTHY and CATALOGUE[bug].line_judged
    kinds = list(CATALOGUE[bug].kinds) + KINDS_EXTRA.get(name, []) if bug != HEALTHY else []
    truth = Truth(name=f"hand_{name}", seed=0, index=0, bug=bug, world=world, culprits=culprits,
                  accept_roots=[culprits] + ROOTS_EXTRA.get(name, []) if culprits else [], accept_kinds=kinds,
                  lines=lines if judged else [], line_texts=texts if judged else [], step=None,
                  detail=text.split('"""')[1].split("\n")[0][:90], mesh_shape=[world], mesh_dims=["world"],
                  mesh_mode="none", steps=0, pg_timeout_s=10.0,
                  # a culprit whose process ends by itself writes no dump a plain torchrun user would have
                  dies=list(culprits) if bug != HEALTHY and CATALOGUE[bug].kills_culprit else [])
    return Program(source="\n".join(src), truth=truth, filename=f"hand_{name}.py")


def judge_sources(row: dict, prog: Program, work: Path, fresh: bool) -> dict:
    """Score both evidence sources of one kept job into `row` (the dumps as the random programs score them
    where there are none to analyze: `random_programs.unjudged_dumps`)."""
    t = prog.truth
    for s in rp.SOURCES:
        unjudged = rp.unjudged_dumps(t.bug, bool(row.get("all_clean")), row["fr_ranks"]) if s == "fr" else None
        if unjudged is not None:
            row[s] = unjudged
            continue
        rc, rep = analyze(work / s, work / f"{'analyze' if fresh else 'rejudged'}_{s}.json")
        row[s] = rp.score(t, prog.filename, rc, rep, s, row["fr_left_out"])
    row["miss"] = rp.is_miss(row)
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="", help="keep every job's directory and results.jsonl here")
    ap.add_argument("--only", default="", help="comma-separated program names")
    ap.add_argument("--timeout-s", type=float, default=240.0, help="hard limit per job")
    ap.add_argument("--rejudge", default="", metavar="OUT", help="analyze the kept jobs under OUT again")
    ns = ap.parse_args(argv)
    if ns.rejudge:
        out = Path(ns.rejudge).resolve()
        rows = [json.loads(line) for line in open(out / "results.jsonl")]
    else:
        import tempfile
        out = Path(ns.out or tempfile.mkdtemp(prefix="ncclscope-hand-")).resolve()
        out.mkdir(parents=True, exist_ok=True)
        rows = [{"name": f"hand_{n}"} for n in CASES if not ns.only or n in ns.only.split(",")]
    results = []
    for row in rows:
        prog = program(row["name"][len("hand_"):])
        t, work = prog.truth, out / row["name"]
        if not ns.rejudge:
            job = run_job(prog, work, ns.timeout_s)
            row = {"name": t.name, "bug": t.bug, "world": t.world, "culprits": t.culprits, "detail": t.detail,
                   "lines": t.lines, "took_s": round(job.took_s, 1), "stopped": job.stopped, "exits": job.exits,
                   "fr_ranks": job.fr_ranks, "fr_left_out": job.fr_left_out, "all_clean": job.all_clean,
                   "silent": t.bug != HEALTHY and CATALOGUE[t.bug].hangs and job.all_clean,
                   "healthy_job_failed": t.bug == HEALTHY and not job.all_clean}
        row = judge_sources(row, prog, work, fresh=not ns.rejudge)
        results.append(row)
        print(rp.row_line(row), flush=True)
    if not ns.rejudge:
        with open(out / "results.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in results)
    scored = [r for r in results if not r["silent"] and not r["healthy_job_failed"]]
    for s in rp.SOURCES:
        judged = [r[s] for r in scored if not r[s].get("na")]
        faulty = [r[s] for r in scored if not r[s].get("na") and r["bug"] != HEALTHY]
        lines = [x["line"] for x in faulty if x.get("line") is not None]
        print(f"{s}: right {sum(x['right'] for x in judged)}/{len(judged)}, root {sum(x['root'] for x in faulty)}/"
              f"{len(faulty)}, cause {sum(x['cause'] for x in faulty)}/{len(faulty)}, "
              f"line {sum(lines)}/{len(lines)}")
    print(f"not scored: {sum(r['silent'] for r in results)} silent, "
          f"{sum(r['healthy_job_failed'] for r in results)} healthy jobs that failed; under {out}")
    return 0 if all(r[s]["right"] for r in scored for s in rp.SOURCES) else 1


if __name__ == "__main__":
    sys.exit(main())
