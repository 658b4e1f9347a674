"""Which member of a tied replica set moved: the evidence that breaks a tie of the replica norms.

Two replicas have no majority, and tensor or pipeline partners mix into the
global norm, so "who diverged" needs evidence beyond a vote: the rank whose
gradient after the reduction is its own (`kept_own_gradient`), the norms that
fit one rank keeping its own gradient (`skip_signature`), the job-wide split
of the global norm when no replica set can compare (`world_norm_split`,
`world_rows`), and the tied set whose checksums moved apart decisively
(`decisive_set`). `divergence.py` asks these in that order.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ncclscope.load.trace import Trace

REL_TOL = 1e-6
DECISIVE = 5.0      # a position's checksum spread over every other's, to break a tie of the norms

def replica_of(trace: Trace) -> dict[int, tuple]:
    """rank -> its model replica: every coordinate but tp and pp (the ranks that share one global grad norm)."""
    return {r: tuple(v for k, v in sorted(info.coords.items()) if k not in ("tp", "pp"))
            for r, info in trace.ranks.items()}


def kept_own_gradient(m: pd.DataFrame, step: int, candidates: list[int]) -> int | None:
    """The one candidate whose gradient after the data-parallel reduction is its own gradient before it
    (`grad_norm_reduced` == `grad_norm_local`, to the last bits) while some rank's is not: it kept its own
    gradient. Direct where the replica norms cannot say it: tensor and pipeline partners mix into the
    global norm, and two replicas have no majority. None without the metric (older traces, ZeRO-2)."""
    if "grad_norm_reduced" not in m.columns or not candidates:
        return None
    x = m[m["step"] == step][["rank", "grad_norm_local", "grad_norm_reduced"]]
    x = x[np.isfinite(x["grad_norm_local"]) & np.isfinite(x["grad_norm_reduced"])]
    if len(x) < 2:
        return None
    same = (x["grad_norm_reduced"] - x["grad_norm_local"]).abs() <= 1e-12 * np.maximum(x["grad_norm_local"].abs(), 1e-30)
    if same.all():
        return None                      # every rank's reduction left its gradient as it was: no evidence
    kept = [int(r) for r in x.loc[same, "rank"] if int(r) in set(candidates)]
    return kept[0] if len(kept) == 1 else None


def skip_signature(trace: Trace, m: pd.DataFrame, step: int, candidates: list[int]) -> int | None:
    """The one candidate whose norms fit "this rank kept its local gradient" at `step`, or None.

    Per model replica d and position s (tp, pp), l[s, d] is the local grad norm
    before the reduction and G[d] the replica's global norm after it. Healthy
    replicas reduced position s to the same r[s], with |mean| bounds
    lo[s] = max(0, (2 max_d l - sum_d l) / n) <= r[s] <= hi[s] = sum_d l / n.
    If rank (s*, d*) skipped: G[d*]^2 - G[o]^2 = l[s*, d*]^2 - r[s*]^2, so
    r[s*]^2 follows; it must lie in [lo^2, hi^2], and G[o]^2 - r[s*]^2 (the other
    positions' share) in [sum lo^2, sum hi^2]. A candidate whose replica's
    global norm did not move cannot have skipped. Exactly one feasible
    candidate is the answer; none or several say nothing. Only without cp and
    ep (their reductions span other groups). When several fit, the one at the
    position whose parameter checksums moved apart most, by DECISIVE (5x) over
    every other position, is kept (its partners moved only through the clip
    coefficient)."""
    kept = kept_own_gradient(m, step, candidates)
    if kept is not None:
        return kept
    ranks = trace.ranks
    if not candidates or any(not ranks[r].coords for r in ranks if ranks[r].present):
        return None
    if any(info.coords.get("cp", 0) or info.coords.get("ep", 0) for info in ranks.values()):
        return None
    x = m[(m["step"] == step)][["rank", "grad_norm_local", "grad_norm_global"]]
    x = x[np.isfinite(x["grad_norm_local"]) & np.isfinite(x["grad_norm_global"])]
    if not len(x):
        return None
    rep = {r: str(v) for r, v in replica_of(trace).items()}     # string keys: plain index labels
    pos = {r: f"tp{info.coords.get('tp', 0)}/pp{info.coords.get('pp', 0)}" for r, info in ranks.items()}
    x = x.assign(rep=[rep.get(int(r)) for r in x["rank"]], pos=[pos.get(int(r)) for r in x["rank"]])
    reps = sorted(x["rep"].unique())
    positions = sorted(x["pos"].unique())
    if len(reps) < 2 or len(x) != len(reps) * len(positions):
        return None
    l = x.set_index(["pos", "rep"])["grad_norm_local"]
    G = x.groupby("rep")["grad_norm_global"]
    if (G.max() - G.min()).max() > 1e-6 * max(float(G.max().max()), 1e-12):
        return None                                         # one replica, one global norm
    G = G.median()
    n = len(reps)
    lo = {s: max(0.0, (2 * l.loc[s].max() - l.loc[s].sum()) / n) for s in positions}
    hi = {s: l.loc[s].sum() / n for s in positions}
    fits = []
    for r in candidates:
        if r not in rep or rep[r] not in G.index or (pos[r], rep[r]) not in l.index:
            continue
        s_, d_ = pos[r], rep[r]
        others = G.drop(d_)
        g_o = float(others.median())
        tol = 1e-5 * max(g_o * g_o, 1e-12)
        if (others - g_o).abs().max() ** 2 > tol or abs(G[d_] ** 2 - g_o ** 2) <= tol:
            continue
        r2 = float(l.loc[(s_, d_)]) ** 2 - (float(G[d_]) ** 2 - g_o ** 2)
        rest = g_o ** 2 - r2
        if lo[s_] ** 2 - tol <= r2 <= hi[s_] ** 2 + tol and \
                sum(lo[t] ** 2 for t in positions if t != s_) - tol <= rest <= sum(hi[t] ** 2 for t in positions if t != s_) + tol:
            fits.append(r)
    if len(fits) > 1 and "param_checksum" in m.columns:
        # several fit the norms: the position whose own parameters moved most, if decisively (5x the others)
        ck = m[m["step"] == step][["rank", "param_checksum"]].dropna()
        ck = ck.assign(pos=[pos.get(int(r)) for r in ck["rank"]])
        g = ck.groupby("pos")["param_checksum"]
        rel = ((g.max() - g.min()) / g.median().abs().clip(lower=1e-12)).sort_values(ascending=False)
        if len(rel) >= 2 and rel.iloc[0] > 0 and rel.iloc[0] >= DECISIVE * rel.iloc[1]:
            fits = [r for r in fits if pos[r] == rel.index[0]]
    return fits[0] if len(fits) == 1 else None


def world_norm_split(m: pd.DataFrame) -> tuple[int, set[int], bool] | None:
    """(step, ranks off, decided) for the first step at which the ranks disagree on the global grad norm,
    when it was one number for the whole job at every earlier step (at least one): then it is one number
    by construction (it spans every parallel dimension), and its job-wide majority says which ranks moved.
    `decided`: one value is held by more ranks than any other (else the split is a tie and `off` holds
    the ranks of every value but the lowest-ranked one's). None without such a history."""
    g = m[["rank", "step", "grad_norm_global"]].dropna()
    g = g[np.isfinite(g["grad_norm_global"])]
    if not len(g) or g["rank"].nunique() < 2:
        return None
    by = g.groupby("step")["grad_norm_global"]
    spread = (by.max() - by.min()) > REL_TOL * np.maximum(by.median().abs(), 1e-12)
    if not spread.any():
        return None
    step = int(spread[spread].index.min())
    if not (spread.index < step).any():
        return None                               # no earlier step shows it was one number
    at = g[g["step"] == step]
    vals = at["grad_norm_global"].to_numpy()
    key = np.round(vals / max(float(np.abs(vals).max()), 1e-12), 9)
    counts = pd.Series(key).value_counts()
    decided = len(counts) > 1 and counts.iloc[0] > counts.iloc[1]
    ref = counts.index[0] if decided else key[np.argmin(at["rank"].to_numpy())]
    return step, {int(r) for r, k in zip(at["rank"], key) if k != ref}, bool(decided)


def world_rows(m: pd.DataFrame, step: int, off: set[int], decided: bool) -> pd.DataFrame:
    """Deviation rows of the global norm against the job-wide vote, for traces whose replica sets cannot
    compare (each a single rank: experts carved out of dp hold different parameters on every dp rank)."""
    at = m[(m["step"] == step) & m["rank"].isin(off)]
    ref = m[(m["step"] == step) & ~m["rank"].isin(off)]["grad_norm_global"].median()
    return pd.DataFrame({"rank": at["rank"].to_numpy(), "step": step, "replica_set": -1, "dp": at["dp"].to_numpy(),
                         "value": at["grad_norm_global"].to_numpy(), "grad_norm_local": at["grad_norm_local"].to_numpy(),
                         "reference": ref, "n": len(m[m["step"] == step]), "total": np.nan, "tie": False,
                         "same_local": False, "metric": "grad_norm_global", "guess_world": not decided})


def decisive_set(m: pd.DataFrame, tied: pd.DataFrame, step: int, chosen: pd.Series) -> set[int]:
    """Ranks chosen in tied replica sets other than the one whose parameter checksums moved apart most, by
    DECISIVE over every other tied set at `step`: they moved with it (through the global norm, the tokens
    they exchange), their own parameters did not diverge. Empty when no set stands out that far."""
    sets = sorted(int(x) for x in tied["replica_set"].unique())
    if len(sets) < 2:
        return set()
    ck = m[m["step"] == step][["rank", "replica_set", "param_checksum"]].dropna()
    ck = ck[ck["replica_set"].isin(sets)]
    g = ck.groupby("replica_set")["param_checksum"]
    rel = ((g.max() - g.min()) / g.median().abs().clip(lower=1e-12)).sort_values(ascending=False)
    if len(rel) < 2 or not rel.iloc[0] > 0 or rel.iloc[0] < DECISIVE * rel.iloc[1]:
        return set()
    return {int(chosen[s]) for s in rel.index[1:] if s in chosen.index}
