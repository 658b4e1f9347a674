"""Flight Recorder fix-ups: what a dump does not say directly.

- group members where pg_config lists none (gloo writes an empty one);
- the global peer of a p2p entry from its profiling name ("send 0->1" names
  group-local ranks);
- completion of gloo collectives, whose state never leaves `scheduled`
  (`infer_gloo`);
- the sender of a receive from any source ("recv 1<-?"), which names none
  (`any_source_peers`);
- p2p sequence numbers aligned between the two sides of a pair when a ring
  buffer wrapped (`p2p_sequences`).

Coalesced blocks are `fr_coalesced`'s.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from ncclscope.load.foreign.fr_read import field_int
from ncclscope.load.foreign.vocab import normalize_op, parse_ranks


# --------------------------------------------------------------------------
# Groups
# --------------------------------------------------------------------------
def group_members(pair_rank: list[int], pair_pg: list[str], pair_desc: list[str], dumps: dict[int, dict[str, Any]],
                   world: int, warnings: list[str], widths: dict[str, int] | None = None) -> list[tuple[int, ...]]:
    """Members of each distinct (rank, pg_name): from pg_config where it lists them
    (this rank's view, else the view most ranks wrote), else rebuilt from the
    entries (default_pg = the world, any other group = the ranks that used it, completed from the mesh
    (`complete_groups`) or, where its all_gather shapes give its size (`widths`, fr_world.group_widths) or
    the other groups of its DeviceMesh dimension do (one description "mesh_<dim>", one size), and exactly
    that many ranks of the world left no dump, with those ranks)."""
    config: dict[tuple[int, str], tuple[int, ...]] = {}
    votes: dict[str, dict[tuple[int, ...], int]] = {}
    for rank, dump in dumps.items():
        cfg = dump.get("pg_config")
        if not isinstance(cfg, dict):
            continue
        for pg_name, info in cfg.items():
            members = parse_ranks(info.get("ranks")) if isinstance(info, dict) else None
            if members is None:
                continue
            config[(rank, str(pg_name))] = members
            votes.setdefault(str(pg_name), {}).setdefault(members, 0)
            votes[str(pg_name)][members] += 1
    users: dict[str, set[int]] = {}
    desc_of: dict[str, str] = {}
    for rank, pg, desc in zip(pair_rank, pair_pg, pair_desc):
        users.setdefault(pg, set()).add(rank)
        desc_of.setdefault(pg, desc)
    rebuilt = {pg: u for pg, u in users.items() if pg not in votes
               and not (desc_of[pg] == "default_pg" or (pg == "0" and desc_of[pg] in ("", "undefined")))}
    completed = complete_groups(rebuilt, set(dumps), world)
    absent = set(range(world)) - set(dumps)
    # the groups of one DeviceMesh dimension (its description "mesh_<dim>") all have that dimension's size
    dim_size: dict[str, int] = {}
    for pg, u in users.items():
        if desc_of[pg].startswith("mesh_"):
            dim_size[desc_of[pg]] = max(dim_size.get(desc_of[pg], 0), len(u))
    for pg, u in rebuilt.items():
        if pg in completed or not absent:
            continue
        w = (widths or {}).get(pg, 0) or dim_size.get(desc_of[pg], 0)
        # its known size lacks exactly the ranks that left no dump; or, size unknown, every rank that dumped
        # used it: a group of the whole world (a 1-d mesh built with new_group), the dumpless ranks in it too
        # (seed 20261213 #59: rank 1 exits, its peers wait on it in a broadcast of that group); in a world of
        # two with one dump, a group of more than one rank can only be both (seed 20261214 #37)
        if w - len(u) == len(absent) or (not w and u == set(dumps) and (len(u) >= 2 or world == 2)):
            completed[pg] = tuple(sorted(u | absent))
    world = max([world] + [max(m) + 1 for m in completed.values()])
    out: list[tuple[int, ...]] = []
    reconstructed = set()
    for rank, pg_name in zip(pair_rank, pair_pg):
        members = config.get((rank, pg_name))
        if members is None and pg_name in votes:        # another rank's view of the same group
            members = max(votes[pg_name].items(), key=lambda kv: kv[1])[0]
        if members is None:
            desc = desc_of[pg_name]
            if desc == "default_pg" or (pg_name == "0" and desc in ("", "undefined")):
                members = tuple(range(world))
            else:
                members = completed.get(pg_name) or tuple(sorted(users[pg_name]))
            reconstructed.add(pg_name)
        out.append(members)
    if reconstructed:
        names = sorted(reconstructed, key=lambda n: (len(n), n))
        warnings.append(
            f"pg_config lists no members for group(s) {', '.join(names[:8])}"
            f"{' ...' if len(names) > 8 else ''}: members rebuilt from the entries (default_pg = all "
            f"{world} ranks; other groups = the ranks that recorded an op on them)")
    return out


def complete_groups(users: dict[str, set[int]], present: set[int], world: int = 0) -> dict[str, tuple[int, ...]]:
    """Rebuilt groups that lack a rank with no dump, completed from the mesh's structure.

    A group rebuilt from the entries holds only ranks that left a dump. On a mesh, the
    groups of one dimension have one shape (size and spacing: tp {0,1},{2,3}; dp {0,2},{1,3})
    and are disjoint. A smaller group that fits exactly one placement of one such shape,
    where every added rank left no dump and is in no group of that shape, is that shape's
    group with its dead member(s) put back ({2} next to tp {0,1} and dp {0,2} is {2,3});
    of several placements, the one that puts back ranks below `world` (a missing dump between
    others), else the fewest ranks, if it is the only one. A shape only one group has is
    no mesh on its own: it puts back only ranks below `world` ({0} next to {1,3} where rank 2's
    dump is missing between others is {0,2}, seed 20261214 #366).
    Anything less certain is left as it is."""
    if not users:
        return {}
    full: dict[tuple[int, ...], list[set[int]]] = {}
    for m in users.values():
        if len(m) >= 2:
            r = sorted(m)
            full.setdefault(tuple(b - a for a, b in zip(r, r[1:])), []).append(set(m))
    shapes = {}
    for gaps, groups in full.items():
        taken: set[int] = set()
        if not any(taken & g or taken.update(g) for g in groups):
            shapes[gaps] = (taken, len(groups))       # a family: disjoint groups of one shape
    # one lone group is no mesh to complete from, unless the ranks it would put back are known to be
    # missing (a higher rank's dump exists): then nothing is guessed about ranks the dumps do not show
    lone = len(shapes) < 2 and not any(n >= 2 for _, n in shapes.values())
    out: dict[str, tuple[int, ...]] = {}
    family: dict[str, int] = {}                      # the chosen completion's shape: how many groups have it
    for name, m in users.items():
        fits: dict[tuple[int, ...], int] = {}
        for gaps, (taken, n) in shapes.items():
            if len(m) > len(gaps) or m & taken:
                continue
            offsets = [0] + list(np.cumsum(gaps))
            for anchor in m:
                for off in offsets:
                    start = anchor - int(off)
                    cand = tuple(start + int(o) for o in offsets)
                    extra = set(cand) - m
                    if start >= 0 and m <= set(cand) and extra and not extra & (present | taken):
                        fits[cand] = max(fits.get(cand, 0), n)
        known = [c for c in fits if max(c) < world]     # ranks the dumps' names show missing come first
        pool = known if lone else (known or list(fits))
        fewest = [c for c in pool if len(c) == min(map(len, pool))]    # then the fewest ranks put back
        if len(fewest) == 1:
            out[name], family[name] = fewest[0], fits[fewest[0]]
    return _drop_invented(out, family, users, world)


def _drop_invented(out: dict[str, tuple[int, ...]], family: dict[str, int], users: dict[str, set[int]],
                   world: int) -> dict[str, tuple[int, ...]]:
    """The completions that put back a rank past the dumps' names only where the mesh says it exists: the
    shape is one several groups share (a mesh dimension), or the rank is put back into two groups or more
    (the one rank that completes both a tp and a dp group). A lone shape's look-alike is no such evidence:
    {3,4} next to {0,1,2} is a second, smaller subgroup (new_subgroups_by_enumeration, a healthy job), not
    {3,4,5} with an invented rank 5; and groups whose names the ranks number in different orders give
    one-user groups that no one rank completes twice."""
    uses: dict[int, int] = {}
    for name, cand in out.items():
        for r in set(cand) - users[name]:
            uses[r] = uses.get(r, 0) + 1
    return {name: cand for name, cand in out.items()
            if family[name] >= 2 or all(uses[r] >= 2 for r in set(cand) - users[name] if r >= world)}


def parse_profiling_name(name: str) -> tuple[str, str, str]:
    """"nccl:send 0->1" -> ("nccl", "send", "0->1")."""
    backend, _, body = name.partition(":") if ":" in name else ("", "", name)
    return backend, normalize_op(body), body.partition(" ")[2]


def peer_of(meta: str, direction: str, rank: int, members: tuple[int, ...]) -> int:
    """Global peer rank of a p2p entry: "send 0->1" / "recv 1<-0" name group-local ranks."""
    local = -1
    if "->" in meta:                                  # src->dst
        a, b = meta.split("->", 1)
        local = field_int(b.strip()) if direction == "send" else field_int(a.strip())
    elif "<-" in meta:                                # dst<-src
        a, b = meta.split("<-", 1)
        local = field_int(b.strip()) if direction == "recv" else field_int(a.strip())
    if local >= 0:
        ordered = sorted(members)
        return ordered[local] if local < len(ordered) else local
    if len(members) == 2 and rank in members:         # no peer written: a 2-rank group has one other
        return members[0] if members[1] == rank else members[1]
    return -1


def any_source_peers(todo: np.ndarray, rank: np.ndarray, label: np.ndarray, created: np.ndarray,
                     record: np.ndarray, is_send: np.ndarray, is_recv: np.ndarray, peer: np.ndarray) -> np.ndarray:
    """The sender of each receive from any source (`todo`: entry positions; the other arrays per entry).

    Such a receive names no peer; the backend hands it the first message that arrives. It takes, on its
    group, a sender with a send to this rank that no receive of this rank claims (receives that name their
    source claim the oldest sends of that source first), the sender whose next unclaimed send is the
    oldest, in the order the rank posted its receives. -1 where no sender has one to spare. Work per
    (receiving rank, group) and per any-source receive times the senders to it: receives from any source
    are rare, and their senders few."""
    out = np.full(len(todo), -1, np.int64)
    if not len(todo):
        return out
    sends = np.flatnonzero(is_send & (peer >= 0))
    named = np.flatnonzero(is_recv & (peer >= 0))
    order = np.lexsort((record[todo], rank[todo], label[todo]))
    for key in np.unique(rank[todo] * (int(label.max()) + 1) + label[todo]).tolist():
        r, lab = divmod(key, int(label.max()) + 1)
        mine = order[(rank[todo][order] == r) & (label[todo][order] == lab)]
        to_me = sends[(peer[sends] == r) & (label[sends] == lab)]
        if not len(to_me):
            continue
        claimed = named[(rank[named] == r) & (label[named] == lab)]
        queue = {}                    # sender -> its sends' times, oldest first, and how many are claimed
        for src in np.unique(rank[to_me]).tolist():
            times = np.sort(created[to_me[rank[to_me] == src]])
            queue[src] = [times, int((peer[claimed] == src).sum())]
        for j in mine.tolist():
            open_ = [(q[0][q[1]], s) for s, q in queue.items() if q[1] < len(q[0])]
            if not open_:
                break
            src = min(open_)[1]
            queue[src][1] += 1
            out[j] = src
    return out


# --------------------------------------------------------------------------
# Completion on gloo
# --------------------------------------------------------------------------
def infer_gloo(rank: np.ndarray, thread: np.ndarray, record: np.ndarray, created: np.ndarray, label: np.ndarray,
                seq: np.ndarray, op: np.ndarray, members: list[tuple[int, ...]], present: set[int],
                first_seq: dict[tuple[int, int], int], wrapped: set[int]) -> tuple[np.ndarray, np.ndarray]:
    """(completed, end_ns) for gloo collective entries, whose state never leaves `scheduled`.
    `label` indexes `members`; `op` is an op-name code.

    Two facts a gloo dump does support:
    (a) every member of a group recorded instance #k with the same op: all of
        them arrived, so it could complete (gloo pairs ranks by the per-group
        sequence number); one member missing it means it cannot have completed;
    (b) a rank recorded a later op on the same thread: its (blocking) call of
        #k returned.
    (a) decides whenever every member's dump exists and still holds #k;
    otherwise (b) decides. End time: the last member's arrival for (a), the
    next op's creation for (b). pg_status is no help: gloo reports every
    enqueued collective as completed.
    """
    n = len(rank)
    if n == 0:
        return np.zeros(0, bool), np.zeros(0, np.int64)
    order = np.lexsort((record, thread, rank))
    r_o, th_o, cr_o = rank[order], thread[order], created[order]
    same_next = np.zeros(n, bool)
    same_next[:-1] = (r_o[1:] == r_o[:-1]) & (th_o[1:] == th_o[:-1])
    next_created = np.full(n, -1, np.int64)
    next_created[:-1] = cr_o[1:]
    later = np.empty(n, bool)
    later[order] = same_next
    later_t = np.empty(n, np.int64)
    later_t[order] = np.where(same_next, next_created, -1)

    inst = pd.DataFrame({"g": label, "s": seq, "r": rank, "o": op, "t": created}).groupby(["g", "s"], sort=False)
    n_rec = inst["r"].transform("nunique").to_numpy()
    n_ops = inst["o"].transform("nunique").to_numpy()
    last_arrival = inst["t"].transform("max").to_numpy()
    n_members = np.array([len(m) for m in members], dtype=np.int64)[label]
    decidable = np.ones(n, bool)
    for g in np.unique(label):
        mem = members[g]
        mask = label == g
        if not mem or any(r not in present for r in mem):
            decidable[mask] = False
            continue
        for r in mem:
            if r in wrapped:
                first = first_seq.get((r, int(g)))
                if first is None:
                    decidable[mask] = False
                else:
                    decidable[mask & (seq < first)] = False
    all_in = (n_rec >= n_members) & (n_ops == 1)
    completed = np.where(decidable, all_in, later)
    end = np.where(decidable, last_arrival, later_t)
    return completed, end.astype(np.int64)


# --------------------------------------------------------------------------
# p2p sequence numbers
# --------------------------------------------------------------------------
def _score(t_send: np.ndarray, t_recv: np.ndarray, s: int) -> tuple[float, int, float] | None:
    """How well send i pairs with recv i - s: dispersion of the completion-time
    differences (a clock offset shifts them all alike), then overlap, then offset."""
    ns, nr = len(t_send), len(t_recv)
    i0, j0 = max(0, s), max(0, -s)
    m = min(ns - i0, nr - j0)
    if m <= 0:
        return None
    d = t_send[i0:i0 + m] - t_recv[j0:j0 + m]
    d = d[~np.isnan(d)]
    if not len(d):
        return None
    med = float(np.median(d))
    return (float(np.median(np.abs(d - med))) if len(d) > 1 else float("inf"), -len(d), abs(med))


def _best_shift(t_send: np.ndarray, t_recv: np.ndarray) -> int | None:
    """Shift s such that send i pairs with recv i - s (completion times, NaN where
    not completed). Candidates come from nearest-in-time neighbours (O(n log n));
    the few most common are scored by `_score`. None when nothing overlaps."""
    ok_s, ok_r = ~np.isnan(t_send), ~np.isnan(t_recv)
    if not ok_s.any() or not ok_r.any():
        return None
    i_s, i_r = np.flatnonzero(ok_s), np.flatnonzero(ok_r)
    ts = t_send[i_s]
    order = np.argsort(ts, kind="stable")
    pos = np.clip(np.searchsorted(ts[order], t_recv[i_r]), 0, len(ts) - 1)
    left = np.clip(pos - 1, 0, len(ts) - 1)
    nearer = np.where(np.abs(ts[order][left] - t_recv[i_r]) < np.abs(ts[order][pos] - t_recv[i_r]), left, pos)
    cand = i_s[order][nearer] - i_r
    values, counts = np.unique(cand, return_counts=True)
    top = values[np.argsort(-counts, kind="stable")][:3]
    shifts = sorted({int(c) + k for c in top for k in (-2, -1, 0, 1, 2)})
    scored = [(sc, s) for s in shifts if (sc := _score(t_send, t_recv, s)) is not None]
    return min(scored)[1] if scored else None


def p2p_sequences(rank: np.ndarray, record: np.ndarray, is_send: np.ndarray, peer: np.ndarray, ended: np.ndarray,
                   end_ns: np.ndarray, created: np.ndarray, wrapped: set[int], first_created: dict[int, int],
                   warnings: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """(p2p_seq_id, keep) for p2p entries: the k-th op of a rank in a direction
    with a peer, counted in record order (how our runtime and analysis/p2p.py
    count). When a side's ring buffer wrapped, its count does not start at the
    true first op; the two sides of the pair are then aligned by their
    completion times (`_best_shift`), and completed ops on the other side
    older than anything the wrapped side still holds are dropped (in-flight
    ones are always kept)."""
    n = len(rank)
    seq = np.full(n, -1, np.int64)
    keep = np.ones(n, bool)
    valid = peer >= 0
    if not valid.any():
        return seq, keep
    order = np.lexsort((record, rank))
    order = order[valid[order]]
    k = pd.DataFrame({"r": rank[order], "d": is_send[order], "p": peer[order]}).groupby(
        ["r", "d", "p"], sort=False).cumcount().to_numpy() + 1
    seq[order] = k
    src, dst = np.where(is_send, rank, peer), np.where(is_send, peer, rank)
    wr = np.array(sorted(wrapped), dtype=np.int64)
    touched = valid & (np.isin(src, wr) | np.isin(dst, wr))
    if not touched.any():
        return seq, keep
    end_f = end_ns.astype(np.float64)
    pos_all = np.flatnonzero(touched)
    pairs = pd.DataFrame({"a": src[pos_all], "b": dst[pos_all], "i": pos_all}).groupby(["a", "b"], sort=False)["i"]
    for (a, b), idx in pairs:
        idx = np.sort(idx.to_numpy())
        s_pos = idx[is_send[idx] & (rank[idx] == a)]
        r_pos = idx[~is_send[idx] & (rank[idx] == b)]
        s_pos = s_pos[np.argsort(seq[s_pos], kind="stable")]
        r_pos = r_pos[np.argsort(seq[r_pos], kind="stable")]
        if len(s_pos) and len(r_pos):
            shift = _best_shift(np.where(ended[s_pos], end_f[s_pos], np.nan), np.where(ended[r_pos], end_f[r_pos], np.nan))
            if shift is None:
                warnings.append(f"p2p {a}->{b}: a ring buffer wrapped and no completed ops overlap; "
                                "send/recv counted from the oldest op each side still holds (may not line up)")
                shift = 0
            seq[s_pos] += max(0, -shift)
            seq[r_pos] += max(0, shift)
            if b in wrapped:
                keep[s_pos[(seq[s_pos] < seq[r_pos].min()) & ended[s_pos]]] = False
            if a in wrapped:
                keep[r_pos[(seq[r_pos] < seq[s_pos].min()) & ended[r_pos]]] = False
        else:   # one side holds nothing of this pair: drop what the other did before its window
            if len(s_pos) and b in wrapped:
                keep[s_pos[(created[s_pos] < first_created.get(int(b), 0)) & ended[s_pos]]] = False
            if len(r_pos) and a in wrapped:
                keep[r_pos[(created[r_pos] < first_created.get(int(a), 0)) & ended[r_pos]]] = False
    return seq, keep

