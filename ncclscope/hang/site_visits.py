"""Which of a rank's earlier calls from one call site are the same call as this one.

One line of a user's program may issue several collectives each time it runs: `broadcast_object_list`
broadcasts the objects' sizes (int64) and then their bytes (uint8), a loop over buckets calls all_reduce
at one line once per bucket. Those calls differ from each other by design, so the call before this one from
the very line says nothing about what this one should have been. What does is the call at the same place
in an earlier run of that line: a *visit* is a maximal run of a rank's consecutive collectives from one
call site (in the order it issued them, across its groups), and a call is compared with the calls at its
own position in earlier visits.

A site whose visits are all one call long (the common case: one collective per line per iteration) keeps
every earlier call as its history, as before.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd


def same_call_history(coll: pd.DataFrame, row: Any, same: pd.DataFrame) -> pd.DataFrame:
    """`same` (the rank's earlier calls from `row`'s call site) cut to the calls at `row`'s position in
    earlier visits of that site, where the site issues more than one call per visit; else `same`."""
    if not len(same):
        return same
    mine = coll[(coll["rank"] == row.rank).to_numpy()]
    order = np.lexsort((mine["collective_seq_id"].to_numpy(), mine["start_ns"].to_numpy()))
    mine = mine.iloc[order]
    site = mine["call_site"].astype(str).to_numpy()
    starts = np.r_[True, site[1:] != site[:-1]] if len(site) else np.zeros(0, dtype=bool)
    visit = np.cumsum(starts)
    first = np.flatnonzero(starts)
    pos = np.arange(len(site)) - first[visit - 1]
    where = np.flatnonzero((mine["process_group"].astype(str).to_numpy() == str(row.process_group))
                           & (mine["collective_seq_id"].to_numpy() == row.collective_seq_id))
    if not len(where):
        return same
    at = int(where[0])
    here = site == str(row.call_site)
    upto = here & (np.arange(len(site)) <= at)
    if not _longer_visits(visit[upto], visit):
        return same                               # one call per visit: every earlier call is history
    keep = here & (visit < visit[at]) & (pos == pos[at])
    ids = set(zip(mine["process_group"].astype(str).to_numpy()[keep], mine["collective_seq_id"].to_numpy()[keep]))
    pick = [(str(g), k) in ids for g, k in zip(same["process_group"].astype(str), same["collective_seq_id"])]
    return same[np.asarray(pick, dtype=bool)]


def _longer_visits(mine: np.ndarray, visit: np.ndarray) -> bool:
    """Whether any of the visits in `mine` holds more than one call (counted over every call of `visit`)."""
    if not len(mine):
        return False
    counts = np.bincount(visit)
    return bool((counts[np.unique(mine)] > 1).any())
