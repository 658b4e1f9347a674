"""All process groups cut from one rank grid, and recorded on every rank.

Order follows Megatron-LM: tp varies fastest, then cp, then dp, then pp;
expert parallelism (ep) is carved out of dp (contiguous chunks of each dp
group), with `edp` the groups that reduce expert gradients across chunks.
`dp_cp` is the group that reduces dense gradients when cp > 1.

Why fingerprints: torch requires every rank to create every group in the same
order; a rank that disagrees does not get an error, it gets a hang (or, worse,
silently mismatched groups). So before creating anything the ranks all-gather
a hash of their planned group list and refuse to continue if they differ,
naming the ranks whose plan is in the minority.

Why each rank writes only its own groups: a 16,384-rank mesh has 20,545
groups (2 MB of JSON); written by every rank that was 32 GB of identical
copies. Each rank's groups.json now holds the groups it belongs to plus the
fingerprint of its whole ordered plan; the whole plan is written by rank 0
and by the lowest rank of every other fingerprint (a disagreeing view is
evidence, so it is kept, once). Members that form an arithmetic progression
(every mesh slice: world, tp, dp, pp, ep, edp, dp_cp) are written as
{"range": [start, stop, step]}. See docs/trace-format.md.

    mesh = build_mesh(cfg, comm)   # comm: runtime.comm.Comm
    mesh.group("dp")               # this rank's dp Group
"""
from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from itertools import product
from typing import Any

import torch

from ncclscope.runtime.comm import Comm, Group
from ncclscope.runtime.config import RunConfig

AXES = ("tp", "cp", "dp", "pp")  # fastest first


class MeshError(RuntimeError):
    """The ranks disagree about the process groups (would otherwise hang)."""


@dataclass
class Grid:
    """The rank grid: shape and rank <-> coordinate maps (pure, no torch)."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    pp: int = 1
    ep: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.dp * self.pp

    def rank_of(self, tp: int = 0, cp: int = 0, dp: int = 0, pp: int = 0) -> int:
        return ((pp * self.dp + dp) * self.cp + cp) * self.tp + tp

    def coords(self, rank: int) -> dict[str, int]:
        tp = rank % self.tp
        cp = (rank // self.tp) % self.cp
        dp = (rank // (self.tp * self.cp)) % self.dp
        pp = rank // (self.tp * self.cp * self.dp)
        return {"tp": tp, "cp": cp, "dp": dp, "pp": pp, "ep": dp % self.ep}

    def _groups_along(self, axes: tuple[str, ...]) -> list[list[int]]:
        """Groups whose members vary along `axes` and agree on all other axes."""
        sizes = {"tp": self.tp, "cp": self.cp, "dp": self.dp, "pp": self.pp}
        fixed = [a for a in reversed(AXES) if a not in axes]
        out = []
        for fixed_vals in product(*(range(sizes[a]) for a in fixed)):
            base = dict(zip(fixed, fixed_vals))
            members = []
            for var_vals in product(*(range(sizes[a]) for a in reversed(axes))):
                c = {**base, **dict(zip(reversed(axes), var_vals))}
                members.append(self.rank_of(**c))
            out.append(sorted(members))
        return out

    def plan(self) -> list[tuple[str, str, list[int]]]:
        """Every group to create, in creation order: (name, kind, members)."""
        plan: list[tuple[str, str, list[int]]] = []
        for kind, axes in (("tp", ("tp",)), ("cp", ("cp",)), ("dp", ("dp",)), ("pp", ("pp",))):
            for i, members in enumerate(self._groups_along(axes)):
                plan.append((f"{kind}{i}", kind, members))
        if self.cp > 1:
            for i, members in enumerate(self._groups_along(("dp", "cp"))):
                plan.append((f"dp_cp{i}", "dp_cp", members))
        if self.ep > 1:
            ep_i = edp_i = 0
            for dp_members in self._groups_along(("dp",)):
                for c in range(0, self.dp, self.ep):
                    plan.append((f"ep{ep_i}", "ep", dp_members[c:c + self.ep]))
                    ep_i += 1
                for j in range(self.ep):
                    plan.append((f"edp{edp_i}", "edp", dp_members[j::self.ep]))
                    edp_i += 1
        return plan


def fingerprint(plan: list[tuple[str, str, list[int]]]) -> int:
    """A signed 63-bit hash of the plan (fits an int64 tensor)."""
    digest = hashlib.blake2b(json.dumps(plan).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 1


GROUPS_FORMAT = 2   # groups.json as an object {format, fingerprint, n_groups, groups[, plan]}; 1 was a list


def encode_members(members: list[int] | tuple[int, ...]) -> list[int] | dict[str, list[int]]:
    """[0, 8, 16, ..., 2040] -> {"range": [0, 2048, 8]}; other lists (and short ones) as they are."""
    ms = list(members)
    if len(ms) >= 3:
        step = ms[1] - ms[0]
        if step > 0 and ms == list(range(ms[0], ms[-1] + 1, step)):
            return {"range": [ms[0], ms[-1] + step, step]}
    return ms


def writes_whole_plan(rank: int, fps: list[int]) -> bool:
    """Whether this rank writes the whole plan: rank 0, and the lowest rank of every other fingerprint.

    So each distinct view is on disk exactly once, whoever disagrees (even
    when rank 0 is the odd one: then rank 1 writes the majority's plan)."""
    mine = fps[rank]
    return rank == 0 or (mine != fps[0] and fps.index(mine) == rank)


def group_file(rank: int, view: list[dict[str, Any]], fp: int, full: bool) -> dict[str, Any]:
    """The groups.json object of one rank: its own groups, the plan's fingerprint, the whole plan if `full`.

    `view` is every group this rank plans or created, in creation order
    (world first), as `Group.describe()` dicts; `fp` is `fingerprint(plan)`,
    the value this rank all-gathers before creating groups."""
    def enc(g: dict[str, Any]) -> dict[str, Any]:
        return {**g, "ranks": encode_members(g["ranks"])}
    out: dict[str, Any] = {"format": GROUPS_FORMAT, "fingerprint": f"{fp:016x}", "n_groups": len(view),
                           "groups": [enc(g) for g in view if rank in g["ranks"]]}
    if full:
        out["plan"] = [enc(g) for g in view]
    return out


@dataclass
class Mesh:
    grid: Grid
    rank: int
    groups: dict[str, Group] = field(default_factory=dict)   # by name, all groups in the world
    mine: dict[str, Group] = field(default_factory=dict)     # by kind, this rank's groups

    def group(self, kind: str) -> Group:
        """This rank's group of that kind ("tp", "dp", ...); a size-1 group if the axis is 1."""
        return self.mine[kind]

    @property
    def coords(self) -> dict[str, int]:
        return self.grid.coords(self.rank)

    def describe(self) -> list[dict[str, Any]]:
        return [g.describe() for g in sorted(self.groups.values(), key=lambda g: g.creation_order)]


def build_mesh(cfg: RunConfig, comm: Comm, reorder: bool = False) -> Mesh:
    """Create all groups on this rank, after checking that every rank plans the same.

    `reorder` (the `group_order` drill) makes this rank plan its groups in
    reverse order, which the fingerprint check must catch.
    """
    grid = Grid(tp=cfg.tp, cp=cfg.cp, dp=cfg.dp, pp=cfg.pp, ep=cfg.ep)
    world = comm.groups.get("world") or comm.register_world()
    plan = grid.plan()
    if reorder:
        plan = list(reversed(plan))
    mine_fp = fingerprint(plan)
    mesh = Mesh(grid=grid, rank=comm.rank)
    mesh.groups["world"] = world
    # record the planned view first, so a refused mesh still leaves evidence
    planned = [world.describe()] + [{"name": n, "kind": k, "ranks": m, "creation_order": i + 1,
                                     "backend": cfg.backend} for i, (n, k, m) in enumerate(plan)]
    comm.rec.write_meta(coords=grid.coords(comm.rank), groups=group_file(comm.rank, planned, mine_fp,
                                                                         full=comm.rank == 0))
    writes_plan = comm.rank == 0
    if comm.world_size > 1:
        fps = torch.zeros(comm.world_size, dtype=torch.int64)
        comm.all_gather_into_tensor(fps, torch.tensor([mine_fp], dtype=torch.int64), world)
        values = fps.tolist()
        writes_plan = writes_whole_plan(comm.rank, values)
        if writes_plan and comm.rank != 0:
            comm.rec.write_meta(groups=group_file(comm.rank, planned, mine_fp, full=True))
        counts = Counter(values)
        if len(counts) > 1:
            majority = counts.most_common(1)[0][0]
            odd = [r for r, v in enumerate(values) if v != majority]
            raise MeshError(f"ranks {','.join(map(str, odd))} planned different process groups than the other "
                            f"{comm.world_size - len(odd)} ranks (membership or creation order); refusing to "
                            f"create groups that would hang")
    for name, kind, members in plan:
        # Always a new torch group, even when its members equal the world's:
        # gloo pairs ops by per-group order, and sharing one torch group between
        # two of our names would make their sequence numbers lie.
        if len(members) == 1:   # nothing to communicate: no torch group needed
            g = Group(name, kind, tuple(members), None, len(comm.groups), 0 if comm.rank in members else -1)
            comm.groups[name] = g
        else:
            g = comm.new_group(name, kind, members)
        mesh.groups[name] = g
        if comm.rank in members:
            mesh.mine[kind] = g
    for kind in ("tp", "cp", "dp", "pp", "dp_cp", "ep", "edp"):
        if kind not in mesh.mine:   # axis of size 1 (or ep off): a trivial group
            mesh.mine[kind] = Group(f"{kind}-self{comm.rank}", kind, (comm.rank,), None, -1, 0)
    mesh.mine["world"] = world
    comm.rec.write_meta(coords=grid.coords(comm.rank),
                        groups=group_file(comm.rank, mesh.describe(), mine_fp, full=writes_plan))
    return mesh
