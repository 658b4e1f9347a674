"""The world's size from the shapes a Flight Recorder dump recorded, where no dump lists the members.

Why: gloo's dumps leave `pg_config` empty, so the world was the highest rank with a dump + 1. A rank that
died without dumping (os._exit, a kill, a crash before the dump) is then simply not there when it is the
highest: two ranks, rank 1 exits, rank 0's dump alone reads as a healthy world of one, and the analysis
said OK. But an all_gather on the default group records its output next to its input, and the output holds
one input per member: the shapes say how many ranks the world has, whoever dumped.

Rules (the same as hang/shape_rules.py applies per op, here read the other way): one input shape S; an
output of W shapes equal to S, or one shape [W] + S (stacked), or one flat shape whose first dimension is
W times S's (all_gather_into_tensor). Only the default group's entries (pg name "0" or description
default_pg) count, every distinct (op, input, output) once, and the answer must be one W for all of them.

A lower bound says less but is as sure (`group_floors`): an all_to_all_single that received another
number of rows than it sent had at least one other member (a group of one sends itself what it receives),
and no group is larger than the world, so the world has at least 2 ranks, and rank 1 is one of them.

A mesh says it too (`family_floor`): torch names groups by creation ("1", "2", ...), and a mesh's dimension is
created as one run of groups of one size that share no rank. A run of consecutively created groups of one
width W (by their shapes) whose users share no rank is such a dimension: its k groups hold k x W distinct
ranks, whoever dumped (seed 20261216 #28: groups 1 {0,2} and 2 {1}, both of width 2, on a world read as 3
ranks: rank 3, the highest, died without a dump, and rank 1 waiting on it read OK).
"""
from __future__ import annotations

import json
from typing import Any

import numpy as np

from ncclscope.load.foreign.fr_entries import Entries

_GATHERS = ("all_gather", "allgather", "_allgather_base", "all_gather_into_tensor")
_ALL_TO_ALLS = ("all_to_all", "alltoall", "all_to_all_single", "alltoall_base")


def _shapes(text: str) -> list[list[int]] | None:
    try:
        v = json.loads(text)
    except (ValueError, TypeError):
        return None
    if not isinstance(v, list) or not all(isinstance(s, list) and all(isinstance(d, int) for d in s) for s in v):
        return None
    return v


def gathered_width(inp: list[list[int]], out: list[list[int]]) -> int | None:
    """W, the number of members an all_gather's shapes imply (module docstring), or None."""
    if len(inp) != 1:
        return None
    s = inp[0]
    if len(out) > 1 and all(o == s for o in out):
        return len(out)
    if len(out) == 1:
        o = out[0]
        if len(o) == len(s) + 1 and o[1:] == s:
            return o[0]
        if s and len(o) == len(s) and o[1:] == s[1:] and s[0] > 0 and o[0] % s[0] == 0:
            return o[0] // s[0]
    return None


def _shape_pairs(ents: Entries, ops: tuple[str, ...]) -> list[tuple[int, Any, Any]]:
    """(pg code, input shapes, output shapes) of every distinct entry of the ops `ops` (the name after the
    backend prefix); a shape text that is no list of int lists reads as None."""
    if not getattr(ents, "n", 0) or not hasattr(ents, "out_size_code"):
        return []
    codes = [i for i, p in enumerate(ents.pnames) if str(p).rsplit(":", 1)[-1].lower() in ops]
    if not codes:
        return []
    sel = np.isin(ents.pn_code, codes)
    combos = set(zip(ents.pg_code[sel].tolist(), ents.size_code[sel].tolist(), ents.out_size_code[sel].tolist()))
    return [(pg, _shapes(ents.size_texts[si]), _shapes(ents.out_size_texts[oi])) for pg, si, oi in combos]


def group_widths(ents: Entries, cap: int) -> dict[str, int]:
    """pg name -> its size by its all_gather shapes, for each group whose shapes agree on one value in
    [2, cap] (module docstring): the default group's gives the world (world_from_shapes); another group
    rebuilt from its users takes back the ranks that left no dump when exactly that many are missing from it
    (fr_fixups.group_members), so gloo's inferred completion (a collective every member entered) no longer
    counts a collective the dead member never entered as done."""
    widths: dict[int, set[int]] = {}
    for pg, inp, out in _shape_pairs(ents, _GATHERS):
        w = gathered_width(inp, out) if inp is not None and out is not None else None
        if w is not None:
            widths.setdefault(pg, set()).add(w)
    return {str(ents.pg_names[pg]): next(iter(ws)) for pg, ws in widths.items()
            if len(ws) == 1 and 2 <= next(iter(ws)) <= cap}


def group_floors(ents: Entries) -> dict[str, int]:
    """pg name -> 2 for each group one of whose all_to_alls received another number of rows than it sent
    (module docstring): it had another member, whoever dumped."""
    out: dict[str, int] = {}
    for pg, inp, res in _shape_pairs(ents, _ALL_TO_ALLS):
        if inp and res and len(inp) == 1 and len(res) == 1 and inp[0] and res[0] and inp[0][0] != res[0][0]:
            out[str(ents.pg_names[pg])] = 2
    return out


def family_floor(ents: Entries, widths: dict[str, int]) -> int:
    """The most ranks one mesh dimension's groups imply (module docstring): over every run of two or more
    consecutively created groups ("1", "2", ...; not the default group "0") of one width whose users are
    disjoint, the run's length x that width; 0 where there is none. A group's width is its shapes' (`widths`),
    else, for a DeviceMesh dimension's group (description "mesh_<dim>"), the one number of users that every
    group of that description with two users or more has (none where they differ: two meshes may name a
    dimension alike): a dimension's groups are of one size, so one rank of a pair dumping while its partner
    left none still makes a group of two (seed 20261221 #151: mesh_inner groups "3" {0,1} and "4" {2}, a
    world read as 3 ranks; rank 3 aborted without a dump and the dumps read OK). A run of fallback widths
    keeps to one description, so two dimensions of one size are not read as one."""
    if not getattr(ents, "n", 0):
        return 0
    n_pg = max(len(ents.pg_names), 1)
    pairs = ents.rank_pg_pairs()[0]                 # one (rank, group) per use
    users: dict[str, set[int]] = {}
    for r, pg in zip((pairs // n_pg).tolist(), (pairs % n_pg).tolist()):
        users.setdefault(str(ents.pg_names[pg]), set()).add(int(r))
    descs = {name: str(d) for name, d in zip(map(str, ents.pg_names), _descs_of(ents))}
    sizes: dict[str, set[int]] = {}
    for name, u in users.items():
        if descs.get(name, "").startswith("mesh_") and len(u) >= 2:
            sizes.setdefault(descs[name], set()).add(len(u))
    # one size among the groups with two users or more, else the description is not one dimension's
    mesh_w = {d: next(iter(n)) for d, n in sizes.items() if len(n) == 1}
    kin = {n: ("" if n in widths else descs.get(n, "")) for n in users}     # "": its own shapes' width
    width_of = {n: widths.get(n) or mesh_w.get(kin[n], 0) for n in users}
    named = sorted((int(n), n) for n in users if n.isdigit() and n != "0" and width_of[n] >= 2)
    best, run, taken, prev, width, family = 0, 0, set(), -2, 0, ""
    for num, name in named:
        w, u = width_of[name], users[name]
        if len(u) > w:                      # more users than its shapes allow: no mesh to read
            run, taken = 0, set()
        elif run and num == prev + 1 and w == width and kin[name] == family and not u & taken:
            run += 1
            taken |= u
        else:
            run, taken, width, family = 1, set(u), w, kin[name]
        prev = num
        if run >= 2:
            best = max(best, run * width)
    return best


def world_from_shapes(ents: Entries, widths: dict[str, int]) -> int | None:
    """The default group's size by its all_gather shapes (pg name "0" or description default_pg, its width in
    `widths`, group_widths), or None."""
    if not widths:
        return None
    descs = dict(zip(map(str, ents.pg_names), _descs_of(ents)))
    found = {w for name, w in widths.items()
             if descs.get(name) == "default_pg" or (name == "0" and descs.get(name) in ("", "undefined"))}
    return found.pop() if len(found) == 1 else None


def _descs_of(ents: Entries) -> list[Any]:
    """Each pg name's description (its first entry's), aligned with ents.pg_names."""
    out: list[Any] = [""] * len(ents.pg_names)
    codes, first = np.unique(ents.pg_code, return_index=True)
    for pg, i in zip(codes.tolist(), first.tolist()):
        out[pg] = ents.descs[int(ents.desc_code[i])]
    return out
