"""Jacobi heat diffusion on a 2 x 3 process grid with a halo exchange by `batch_isend_irecv`.
Each rank owns a 12 x 12 tile of the plate and swaps its edge rows/columns with its north, south, west
and east neighbours (non-periodic: the plate's border is held at fixed temperatures), then the ranks
all-reduce the residual. The neighbour helper was adapted from a 1-D slab version, and the east bound
still checks the world (`rank + 1 < world`) instead of the column, so rank 2, at the end of the first
row, takes rank 3 (the start of the second row) as its east neighbour: it sends a column nobody
receives and waits for one rank 3 never sends, while its real neighbours go on to the residual
all_reduce and wait for it there. 6 ranks.
Truth: rank 2 (wrong peer: its east neighbour is rank 3), line: the east bound check in `neighbours`."""
import datetime
import sys

import torch
import torch.distributed as dist


def _init(timeout_s=10.0):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return dist.get_rank(), dist.get_world_size()


ROWS, COLS, TILE = 2, 3, 12
BORDER = {"north": 1.0, "south": 0.0, "west": 0.5, "east": 0.0}  # fixed plate-border temperatures


def neighbours(rank, world):
    row, col = divmod(rank, COLS)
    nbrs = {}
    if row > 0:
        nbrs["north"] = rank - COLS
    if row < ROWS - 1:
        nbrs["south"] = rank + COLS
    if col > 0:
        nbrs["west"] = rank - 1
    if rank + 1 < world:  # <BUG>
        nbrs["east"] = rank + 1  # <ALT>
    return nbrs


def edge(tile, side):
    if side == "north":
        return tile[0].clone()
    if side == "south":
        return tile[-1].clone()
    if side == "west":
        return tile[:, 0].clone()
    return tile[:, -1].clone()


def exchange_halos(tile, nbrs):
    ops, halos = [], {}
    for side, peer in nbrs.items():
        halos[side] = torch.empty(TILE)
        ops.append(dist.P2POp(dist.isend, edge(tile, side), peer))  # <ALT>
        ops.append(dist.P2POp(dist.irecv, halos[side], peer))  # <ALT>
    for req in dist.batch_isend_irecv(ops):  # <ALT>
        req.wait()
    for side in BORDER:
        if side not in halos:
            halos[side] = torch.full((TILE,), BORDER[side])
    return halos


def jacobi_step(tile, halos):
    padded = torch.zeros(TILE + 2, TILE + 2)
    padded[1:-1, 1:-1] = tile
    padded[0, 1:-1], padded[-1, 1:-1] = halos["north"], halos["south"]
    padded[1:-1, 0], padded[1:-1, -1] = halos["west"], halos["east"]
    return 0.25 * (padded[:-2, 1:-1] + padded[2:, 1:-1] + padded[1:-1, :-2] + padded[1:-1, 2:])


torch.set_num_threads(1)
rank, world = _init()
assert world == ROWS * COLS, f"launch with {ROWS * COLS} ranks"
nbrs = neighbours(rank, world)  # <ALT>
gen = torch.Generator().manual_seed(rank)
tile = torch.rand(TILE, TILE, generator=gen)
for it in range(20):
    halos = exchange_halos(tile, nbrs)  # <ALT>
    new = jacobi_step(tile, halos)
    residual = (new - tile).square().sum().reshape(1)
    tile = new
    dist.all_reduce(residual)
    if rank == 0 and it % 5 == 0:
        print(f"iter {it:2d} residual {residual.sqrt().item():.5f}", flush=True)
dist.destroy_process_group()
