"""Which of the ranks that all stopped outside collectives stopped first.

Flight Recorder dumps of gloo record no send/recv, so a job that deadlocked in one shows every rank stopped
after its last collective, nothing in flight (`stopped.stopped_roots`). Where the ranks stopped at different
points, the points say who stopped first: a rank whose last collective other ranks also completed and then
went past (they recorded later collectives) was left behind by them. Those others were still running after
it had stopped; whatever they wait on now, they were not waiting when it stopped. In a program every rank
runs the same way (SPMD), the ranks left behind are where the job stopped first (seed 20261216 #38: ranks 0
and 1 deadlocked in a send/recv after all_reduce #8 on the world; ranks 2 and 3 went on to a broadcast on
their own group and then waited in a send/recv on them).

Only where the split is clean: every rank that went on went past some left-behind rank's last collective, and
every one of their last collectives began after every left-behind rank's last one. Anything else (a rank
neither left behind nor past anyone) says nothing, and every rank stays named.
"""
from __future__ import annotations

import numpy as np
import pandas as pd


def left_behind(coll: pd.DataFrame, present: list[int]) -> tuple[list[int], list[int]]:
    """(ranks left behind, ranks that went past them), or ([], []) where the stops say no order (module
    docstring). `coll`: the collective rows (rank, process_group, collective_seq_id, start_ns)."""
    mine = coll[coll["rank"].isin(present).to_numpy()] if len(coll) else coll
    if not len(mine) or len(set(mine["rank"].astype(int))) != len(present):
        return [], []
    mine = mine.assign(process_group=mine["process_group"].astype(str))
    last = mine.sort_values(["rank", "start_ns"], kind="stable").drop_duplicates("rank", keep="last")
    last_t = pd.Series(last["start_ns"].to_numpy(), index=last["rank"].astype(int).to_numpy())
    keys = last[["process_group", "collective_seq_id"]].drop_duplicates()
    rec = mine.merge(keys, on=["process_group", "collective_seq_id"])
    past = rec["start_ns"].to_numpy() < last_t.reindex(rec["rank"].astype(int).to_numpy()).to_numpy()
    rec = rec.assign(past=past)
    passed = rec.groupby(["process_group", "collective_seq_id"])["past"].any()
    behind_mask = np.array([bool(passed.get((g, k), False)) for g, k in
                            zip(last["process_group"], last["collective_seq_id"])])
    behind = sorted(int(r) for r in last["rank"].to_numpy()[behind_mask])
    ahead = sorted(set(present) - set(behind))
    if not behind or not ahead:
        return [], []
    # every rank that went on went past a left-behind rank's last collective
    stopped_keys = set(zip(last.loc[behind_mask, "process_group"], last.loc[behind_mask, "collective_seq_id"]))
    went = {int(r) for r, g, k, p in zip(rec["rank"], rec["process_group"], rec["collective_seq_id"], rec["past"])
            if p and (g, k) in stopped_keys}
    if not set(ahead) <= went:
        return [], []
    if int(last_t.loc[ahead].min()) <= int(last_t.loc[behind].max()):
        return [], []
    return behind, ahead
