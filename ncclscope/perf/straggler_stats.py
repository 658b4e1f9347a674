"""The significance tests of a straggler (split out of stragglers.py, whose docstring states the rule):
the binomial tail on the steps a rank was last in, the robust spreads of its healthy peers' compute, the
effect size and its z, and the sentences that report them. Pure functions of the per-(rank, step) tables
`stragglers.analyze_stragglers` builds; nothing here reads the trace.
"""
from __future__ import annotations

import math

import numpy as np
import pandas as pd

ALPHA = 0.01             # binomial tail on the steps a rank was last in
MIN_STEP_FRAC = 2 / 3    # steps in which the rank was last at most of its collectives
MIN_RATIO = 1.25         # compute over the healthy peers' median
MIN_Z = 3.0              # robust z of that excess against the healthy peers' spread
NOISE_FLOOR = 0.10       # floor of the spread, in log units (about 10%): z >= 3 needs >= 1.35x
MAD_SIGMA = 1.4826       # MAD -> standard deviation for a normal
MIN_STEPS_ALL = 4        # steps a power-limited rank must have led, all of them
POWER_Z = 2 * MIN_Z      # and the z its compute effect needs then
MEDIAN_SE = 1.2533       # standard error of a median / (sigma / sqrt(n)) for a normal
# The two tests are two views of one slowdown, and on a loaded host either may lack power: who arrives
# last is decided by milliseconds of scheduling, the compute effect by its own spread. A strong effect
# carries a weaker last-arrival record, never no record: p <= ALPHA_STRONG with z >= STRONG_Z. (Healthy
# runs of the accuracy sweep reached z 3.1 at most, and none p <= 0.05.)
ALPHA_STRONG = 0.05
STRONG_Z = 1.5 * MIN_Z
STRONG_RATIO = 1.5
# ... and the other way round: a rank last in (nearly) every step, far beyond chance (p <= ALPHA_RARE),
# carries a compute effect the loaded host's spread blurs (z >= WEAK_Z, still >= STRONG_RATIO).
ALPHA_RARE = ALPHA / 10
WEAK_Z = 2.0
ARRIVAL = "arrival"      # `effect_from` of an effect measured from arrival lateness (straggler_arrival.py)


def binom_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p), exact, in log space (no scipy)."""
    if k <= 0:
        return 1.0
    if k > n or p <= 0:
        return 0.0
    if p >= 1:
        return 1.0
    j = np.arange(k, n + 1, dtype=np.float64)
    logf = np.concatenate([[0.0], np.cumsum(np.log(np.arange(1, n + 1, dtype=np.float64)))])
    ji = j.astype(np.int64)
    logpmf = logf[n] - logf[ji] - logf[n - ji] + j * math.log(p) + (n - j) * math.log1p(-p)
    top = float(logpmf.max())
    return float(min(1.0, math.exp(top) * np.exp(logpmf - top).sum()))


def robust_sigma(x: np.ndarray) -> float:
    """1.4826 * MAD: the standard deviation of a normal sample, unmoved by a few outliers."""
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    if len(x) < 2:
        return float("nan")
    return float(MAD_SIGMA * np.median(np.abs(x - np.median(x))))


def spread_sigma(x: np.ndarray) -> float:
    """Spread of a few values: the larger of 1.4826 * MAD and 1.2533 * mean |x - median| (both estimate a
    normal's standard deviation; the second still sees one outlier among three)."""
    x = np.asarray(x, dtype=np.float64)
    x = x[np.isfinite(x)]
    if len(x) < 2:
        return float("nan")
    dev = np.abs(x - np.median(x))
    return float(max(MAD_SIGMA * np.median(dev), 1.2533 * dev.mean()))


def significance(r: int, led: pd.DataFrame, cstep: pd.DataFrame, counted: np.ndarray,
                 effect: dict | None = None) -> dict:
    """The tests of the module docstring for rank r: binomial on last arrivals, step consistency, effect size.

    `led`: per (rank, step) the last arrivals (stragglers._last_by_step); `cstep`: per (rank, step) compute
    with the peer key; `counted`: the steps the effect size is measured over. `effect`, when given, is the
    effect size measured otherwise (straggler_arrival.arrival_effect, without compute spans)."""
    out: dict = {"p_last": float("nan"), "p_best": float("nan"), "steps_led": 0, "steps_seen": 0, "effect_ratio": float("nan"),
                 "noise": float("nan"), "z": float("nan"), "noise_from": "", "significant": False}
    mine = led[led["rank"] == r] if len(led) else led
    if len(mine):
        out.update(_last_arrival_test(mine))
    if effect is not None:
        out.update(effect)
    elif len(cstep):
        out.update(_effect_size(r, cstep, counted))
    out["power_limited"], out["significant"] = _decide(out)
    return out


def _last_arrival_test(mine: pd.DataFrame) -> dict:
    """steps_led, steps_seen, p_last (binomial tail) and p_best (the rarest outcome) from one rank's rows of
    the last-arrival table."""
    # a step is led when the rank was last where most of the step's waiting was (skew-weighted: a
    # collective posted right after another, with no compute between, is a coin flip that says nothing);
    # by count when nothing has a skew
    timed = mine["w"] > 0
    led = np.where(timed, mine["wk"] * 2 > mine["w"], mine["k"] * 2 > mine["n"])
    steps_led, steps_seen = int(led.sum()), int(len(mine))
    w = float(mine["w"].sum())
    p0 = float(mine["wp0_sum"].sum()) / w if w > 0 else float(mine["p0_sum"].sum()) / max(1, int(mine["n"].sum()))
    return {"steps_led": steps_led, "steps_seen": steps_seen, "p_last": binom_tail(steps_led, steps_seen, p0),
            "p_best": p0 ** steps_seen}


def _effect_size(r: int, cstep: pd.DataFrame, counted: np.ndarray) -> dict:
    """effect_ratio, z, noise and noise_from of rank r's compute against its healthy peers' (same pipeline
    position) over the counted steps; {} when it has no healthy peer to compare with."""
    peer = cstep.loc[cstep["rank"] == r, "peer"]
    if not len(peer):
        return {}
    grp = cstep[(cstep["peer"] == int(peer.iloc[0])) & cstep["step"].isin(counted)]
    piv = grp.pivot_table(index="step", columns="rank", values="compute_ns", aggfunc="sum")
    if r not in piv.columns:
        return {}
    piv = piv[piv[r].notna() & (piv[r] > 0)]
    healthy = [q for q in piv.columns if q != r]
    piv = piv[piv[healthy].notna().all(axis=1)] if healthy else piv
    if not (healthy and len(piv) and (piv[healthy] > 0).all().all()):
        return {}
    # per step, log compute against the healthy peers' median of that step; a rank's effect is its median
    # over the steps (one descheduled step of seconds does not move it)
    logs = np.log(piv.astype("float64"))
    tot = np.log(piv.sum(axis=0))
    if len(healthy) >= 2:
        z, effect, noise, noise_from = _against_peers(r, healthy, logs, tot, len(piv))
    else:
        z, effect, noise, noise_from = _against_one_peer(r, healthy[0], logs, tot, cstep, int(peer.iloc[0]),
                                                         counted, list(piv.index))
    return {"effect_ratio": float(math.exp(effect)), "z": z, "noise": noise, "noise_from": noise_from}


def _against_peers(r: int, healthy: list, logs: pd.DataFrame, tot: pd.Series, n_steps: int
                   ) -> tuple[float, float, float, str]:
    """(z, effect, noise, noise_from) against two or more healthy peers.

    Two estimates of the same effect, each blind in its own case; the larger z counts: totals over the
    steps (a few noisy steps average out) and the median over steps of the per-step log ratio (one step in
    which a peer was descheduled for seconds does not move it); each healthy peer is measured the same way
    against the others."""
    def per_step(q: int, ref: list[int]) -> pd.Series:
        return logs[q] - logs[ref].median(axis=1)
    others = {q: per_step(q, [h for h in healthy if h != q]) for q in healthy}
    # the median of n per-step ratios is only as steady as one step's ratio allows: its standard error
    # from the healthy peers' per-step ratios pooled (a spread of three peers' medians alone says little
    # about how a median of three steps can swing)
    pooled = np.concatenate([v.to_numpy(dtype=np.float64) for v in others.values()])
    se_median = MEDIAN_SE * spread_sigma(pooled) / math.sqrt(n_steps)
    fits = []
    for eff, peers, floor in (
            (float(tot[r] - np.median(tot[healthy])), tot[healthy].to_numpy(dtype=np.float64), 0.0),
            (float(per_step(r, healthy).median()), np.asarray([float(v.median()) for v in others.values()]),
             se_median)):
        sigma = max(spread_sigma(peers), floor)
        fits.append((eff / max(sigma, NOISE_FLOOR), eff, sigma))
    z, effect, noise = max(fits)
    return z, effect, noise, f"spread between {len(healthy)} healthy peers"


def _against_one_peer(r: int, peer: int, logs: pd.DataFrame, tot: pd.Series, cstep: pd.DataFrame, own: int,
                      counted: np.ndarray, steps: list) -> tuple[float, float, float, str]:
    """(z, effect, noise, noise_from) against a single healthy peer: the larger of the step-to-step spread
    of the log ratio and the spread between the healthy ranks of the other pipeline positions (one peer
    cannot show how far two healthy ranks of this run drift apart; the other positions' ranks can, each
    against its own position's others). noise_from is '' when neither can be measured."""
    effect = float(tot[r] - tot[peer])
    noise, noise_from = float("nan"), ""
    if len(steps) >= 3:
        lr = (logs[r] - logs[peer]).to_numpy(dtype=np.float64)
        noise = 1.2533 * robust_sigma(lr) / math.sqrt(len(lr))
        noise_from = f"step-to-step spread over {len(lr)} steps"
    other = _other_positions_spread(cstep, own, counted, steps)
    if np.isfinite(other):
        across = MEDIAN_SE * other / math.sqrt(len(steps))
        if not np.isfinite(noise) or across > noise:
            noise, noise_from = across, "spread between the healthy ranks of the other pipeline positions"
    z = effect / max(noise, NOISE_FLOOR) if np.isfinite(noise) else float("nan")
    return z, effect, noise, noise_from


def _decide(out: dict) -> tuple[bool, bool]:
    """(power_limited, significant) from the test results in `out` (see the module docstring of
    stragglers.py and the constants above)."""
    effect_ok = np.isfinite(out["z"]) and out["z"] >= MIN_Z and out["effect_ratio"] >= MIN_RATIO
    last_ok = (np.isfinite(out["p_last"]) and out["p_last"] <= ALPHA
               and out["steps_seen"] > 0 and out["steps_led"] >= MIN_STEP_FRAC * out["steps_seen"])
    # Power: with two-member groups no outcome of n steps is rarer than 2^-n, so 6 steps can never reach
    # ALPHA. Where even the most extreme outcome cannot, it must be that outcome (last in every step, at
    # least MIN_STEPS_ALL of them) and the compute effect must stand out twice as far from the noise.
    power_limited = bool(np.isfinite(out["p_best"]) and out["p_best"] > ALPHA)
    strong = (effect_ok and out["z"] >= STRONG_Z and out["effect_ratio"] >= STRONG_RATIO
              and np.isfinite(out["p_last"]) and out["p_last"] <= ALPHA_STRONG
              and out["steps_led"] >= MIN_STEP_FRAC * out["steps_seen"] > 0)
    rare = (last_ok and np.isfinite(out["p_last"]) and out["p_last"] <= ALPHA_RARE
            and np.isfinite(out["z"]) and out["z"] >= WEAK_Z and out["effect_ratio"] >= STRONG_RATIO)
    if rare and not effect_ok:
        effect_ok = True
    # A weaker record stands in only where the record could have been strong: on too few steps for any
    # outcome to reach ALPHA (power_limited) the extreme outcome is asked for, a strong effect or not
    # (a healthy 3-step, 4-rank job's dumps: one rank last in all 3 steps by chance, p = 0.016, z 4.6).
    if strong and not last_ok and not power_limited:
        last_ok = True
    elif power_limited and not last_ok:
        # ... and that outcome must itself be as rare as a strong effect's record (p <= ALPHA_STRONG): two
        # ranks last in turn over 4 steps give 1/16 (a healthy 2-rank DDP job on a loaded CI host, the
        # second rank 6 ms late in each of its 4 steps, read as a STRAGGLER warning)
        last_ok = (out["steps_seen"] >= MIN_STEPS_ALL and out["steps_led"] == out["steps_seen"]
                   and np.isfinite(out["p_last"]) and out["p_last"] <= ALPHA_STRONG)
        effect_ok = effect_ok and out["z"] >= POWER_Z
    return power_limited, bool(last_ok and effect_ok)


def _other_positions_spread(cstep: pd.DataFrame, own: int, counted: np.ndarray, steps: list) -> float:
    """Spread (log units) of one step's compute between ranks of the same pipeline position, pooled over
    the positions other than `own` and over `steps`: each rank's log compute minus the median of its
    position's other ranks in that step. NaN when no other position has two ranks."""
    x = cstep[(cstep["peer"] != own) & cstep["step"].isin(counted) & cstep["step"].isin(steps)
              & (cstep["compute_ns"] > 0)]
    vals = []
    for _, grp in x.groupby("peer"):
        piv = np.log(grp.pivot_table(index="step", columns="rank", values="compute_ns", aggfunc="sum")
                     .dropna().astype("float64"))
        if piv.shape[1] < 2 or not len(piv):
            continue
        for q in piv.columns:
            vals.append((piv[q] - piv.drop(columns=q).median(axis=1)).to_numpy(dtype=np.float64))
    return spread_sigma(np.concatenate(vals)) if vals else float("nan")


def stats_text(st: dict) -> str:
    parts = []
    if np.isfinite(st["p_last"]):
        parts.append(f"last in {st['steps_led']} of {st['steps_seen']} steps, binomial p={st['p_last']:.2g}")
    if np.isfinite(st["z"]) and st.get("effect_from") == ARRIVAL:
        parts.append(f"late by a median {st['late_ms']:.1f} ms a step ({st['effect_ratio'] - 1:.0%} of a step), "
                     f"z={st['z']:.1f} against its peers' lateness noise ({st['noise']:.0%} of a step)")
    elif np.isfinite(st["z"]):
        parts.append(f"compute {st['effect_ratio']:.2f}x its healthy peers, z={st['z']:.1f} against their "
                     f"noise {max(st['noise'], NOISE_FLOOR):.0%}")
    return "; ".join(parts) or "no arrival or compute statistics"


def shortfall_text(st: dict) -> str:
    need = []
    if not (np.isfinite(st["p_last"]) and st["p_last"] <= ALPHA):
        need.append(f"p<={ALPHA:g}")
    if not (st["steps_seen"] and st["steps_led"] >= MIN_STEP_FRAC * st["steps_seen"]):
        need.append(f"last in >={MIN_STEP_FRAC:.0%} of steps")
    if not (np.isfinite(st["z"]) and st["z"] >= MIN_Z):
        need.append(f"z>={MIN_Z:g}")
    if not (np.isfinite(st["effect_ratio"]) and st["effect_ratio"] >= MIN_RATIO):
        need.append(f"lateness >={MIN_RATIO - 1:.0%} of a step" if st.get("effect_from") == ARRIVAL
                    else f"compute >={MIN_RATIO:g}x")
    return "a straggler needs " + ", ".join(need)
