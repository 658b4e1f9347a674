"""The zero-communication replay of a pipeline step: the makespan of the step's
observed action order when every message is free (a critical-path computation
over the F/B dependency graph, vectorised by level). `bubbles.py` replays each
step three times (measured, uniform, slowest stage fixed) to split idle time
into warm-up/cool-down, imbalance and communication stall.
"""
from __future__ import annotations

import numpy as np
import pandas as pd


def replay_makespans(nodes: pd.DataFrame, durations: np.ndarray, n_stages: int) -> np.ndarray:
    """Zero-communication makespan of each replay (`sim`) for each duration column.

    nodes: one row per action, sorted by (sim, rank, observed start), with
    sim, rank, stage (virtual), is_b, microbatch. An action starts when the
    previous action on its rank and its data dependency have finished:
    F(s, mb) needs F(s-1, mb); B(s, mb) needs B(s+1, mb), or F(s, mb) on the
    last stage. Nodes are levelled once (longest chain, integer relaxation),
    then one vectorised pass per level computes the times: O(nodes) work.
    A replay whose observed order has a cycle gets NaN."""
    n = len(nodes)
    sim = nodes["sim"].to_numpy()
    stage = nodes["stage"].to_numpy().astype(np.int64)
    is_b = nodes["is_b"].to_numpy().astype(bool)
    mb = nodes["microbatch"].to_numpy().astype(np.int64)
    n_mb = int(mb.max()) + 1
    def key(st: np.ndarray, b: np.ndarray) -> np.ndarray:
        return ((sim * n_stages + st) * 2 + b) * n_mb + mb
    index = pd.Index(key(stage, is_b.astype(np.int64)))
    last = stage == n_stages - 1
    dep_stage = np.where(is_b, np.where(last, stage, stage + 1), stage - 1)
    dep_b = (is_b & ~last).astype(np.int64)
    dep = np.where(~is_b & (stage == 0), -1, index.get_indexer(key(dep_stage, dep_b)))
    rank = nodes["rank"].to_numpy()
    pred = np.arange(n) - 1
    same = np.zeros(n, dtype=bool)
    same[1:] = (sim[1:] == sim[:-1]) & (rank[1:] == rank[:-1])
    pred[~same] = -1
    level = np.zeros(n, dtype=np.int64)
    cap = int(np.bincount(sim).max()) + 1 if n else 0
    for _ in range(cap + 1):
        new = np.maximum(np.where(pred >= 0, level[pred] + 1, 0), np.where(dep >= 0, level[dep] + 1, 0))
        if np.array_equal(new, level):
            break
        level = new
    cyclic = level > cap
    finish = np.zeros_like(durations, dtype=np.float64)
    order = np.argsort(level, kind="stable")
    bounds = np.searchsorted(level[order], np.arange(level.max() + 2 if n else 1))
    for lv in range(len(bounds) - 1):
        idx = order[bounds[lv]:bounds[lv + 1]]
        if not len(idx):
            continue
        st = np.zeros((len(idx), durations.shape[1]))
        p_, d_ = pred[idx], dep[idx]
        hp, hd = p_ >= 0, d_ >= 0
        st[hp] = finish[p_[hp]]
        st[hd] = np.maximum(st[hd], finish[d_[hd]])
        finish[idx] = st + durations[idx]
    del order, bounds, level, pred, dep, index
    return _per_sim_max(finish, cyclic, sim)


def _per_sim_max(finish: np.ndarray, cyclic: np.ndarray, sim: np.ndarray) -> np.ndarray:
    """Per replay (sorted `sim`): the column maxima of `finish` skipping NaN, NaN where a node is cyclic.

    One segment reduction (`fmax` skips NaN as pandas' group max does) instead of a grouped copy of the
    n x 3 finish times (the bubble analysis' peak at 10 M events). Nodes come sorted by sim; any that do
    not are sorted first (a max does not depend on the order within a replay)."""
    if not len(sim):
        return np.zeros((0, finish.shape[1]))
    if not (sim[1:] >= sim[:-1]).all():
        order = np.argsort(sim, kind="stable")
        finish, cyclic, sim = finish[order], cyclic[order], sim[order]
    first = np.flatnonzero(np.r_[True, sim[1:] != sim[:-1]])
    out = np.fmax.reduceat(finish, first, axis=0)
    out[np.logical_or.reduceat(cyclic, first)] = np.nan
    return out
