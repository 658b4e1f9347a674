"""A two-stage pipeline with torch.distributed.pipelining (1F1B schedule), plain PyTorch: nothing of ncclscope in it.

    torchrun --standalone --nproc-per-node 2 examples/pipeline_1f1b.py --steps 2
    ncclscope run --nproc 2 -- examples/pipeline_1f1b.py --steps 2
    ncclscope run --nproc 2 -- examples/pipeline_1f1b.py --bug skip-last-batch --timeout 5

Each rank holds one stage (half of the layers); the schedule exchanges
activations and gradients with isend/irecv (batch_isend_irecv), which the
tracer sees as p2p rows with per-pair sequence numbers.
--bug skip-last-batch: the last stage's data loader drops the last batch (an
uneven shard), so it never posts the recvs of the first stage's last step:
the first stage's sends are never matched.
"""
import argparse
import datetime

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--backend", default="nccl" if torch.cuda.is_available() else "gloo")
    p.add_argument("--timeout", type=float, default=60.0, help="process group timeout, seconds")
    p.add_argument("--bug", default="none", choices=["none", "skip-last-batch"])
    args = p.parse_args()

    torch.set_num_threads(1)
    dist.init_process_group(args.backend, timeout=datetime.timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % max(torch.cuda.device_count(), 1)) if args.backend == "nccl" else torch.device("cpu")
    torch.manual_seed(0)
    layers = [nn.Sequential(nn.Linear(16, 16), nn.ReLU()) for _ in range(2 * world)]
    stage_module = nn.Sequential(*layers[2 * rank:2 * rank + 2]).to(device)
    n_micro = args.microbatches
    mb = torch.empty(args.batch // args.microbatches, 16, device=device)   # one microbatch's activation shape
    stage = PipelineStage(stage_module, rank, world, device, input_args=(mb,), output_args=mb)
    loss_fn = lambda out, target: nn.functional.mse_loss(out, target)  # noqa: E731
    schedule = Schedule1F1B(stage, n_microbatches=n_micro, loss_fn=loss_fn if rank == world - 1 else None)
    opt = torch.optim.SGD(stage_module.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(0)
    for step in range(args.steps):
        x = torch.randn(args.batch, 16, generator=gen).to(device)
        y = torch.randn(args.batch, 16, generator=gen).to(device)
        if args.bug == "skip-last-batch" and rank == world - 1 and step == args.steps - 1:
            continue                          # BUG: this rank's loader drops the last batch
        if rank == 0:
            schedule.step(x)
        elif rank == world - 1:
            losses = []
            schedule.step(target=y, losses=losses)
        else:
            schedule.step()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    if rank == world - 1:
        print(f"pipeline_1f1b: {args.steps} steps on {world} stages, last loss {sum(losses).item() / len(losses):.4f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
