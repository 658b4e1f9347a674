"""Step census: a skipped (or extra) collective earlier in the run, found by counting per step.

gloo and NCCL pair collectives by per-group sequence number, so a rank that
skips one all_reduce does not hang there: its next all_reduce pairs with the
others' skipped one (one instance off) and the job hangs later, elsewhere,
often in a 2-member group where "3 of 4 members entered" cannot point at
anyone. The step each op was issued in still can: per (group, step, call
site) every member that finished the step must have issued the same number
of ops. The wait-for graph asks this module which cycle member deviated first.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from .instances import member_table
from .labels import majority_vote, take_str

CENSUS_COLUMNS = ["process_group", "step", "call_site", "rank", "count", "expected", "direction", "basis",
                  "op_name", "ref_seq", "ref_ranks", "n_members"]



def passed_steps(coll: pd.DataFrame) -> pd.Series:
    """rank -> the highest training step it certainly finished: the one before its last step, or its
    last step when it went on to post-training ops (a step -1 op after its last training op)."""
    if not len(coll):
        return pd.Series(dtype="int64")
    df = pd.DataFrame({"rank": coll["rank"].to_numpy(np.int64), "step": coll["step"].to_numpy(np.int64),
                       "start": coll["start_ns"].to_numpy(np.int64)})
    pos = df[df["step"] >= 0]
    if not len(pos):
        return pd.Series(dtype="int64")
    mx = pos.groupby("rank")["step"].max()
    last_train = pos.groupby("rank")["start"].max()
    after = df[df["step"] < 0].groupby("rank")["start"].max().reindex(mx.index)
    finished = (after > last_train).fillna(False).astype(np.int64)
    return (mx - 1 + finished).astype(np.int64)


def step_census_deviations(coll: pd.DataFrame, members: dict[str, list[int]],
                           groups: list[str] | None = None) -> pd.DataFrame:
    """Members of a group that issued fewer (skipped) or more (extra) collectives on it from one
    call site in one training step than the group's other members.

    gloo and NCCL pair collectives by per-group sequence number, so a rank that
    skips one all_reduce does not hang there: its next all_reduce pairs with
    the others' skipped one, and the job hangs later, one instance off, often
    in a 2-member group where "3 of 4 members entered" cannot point at anyone.
    The step each op was issued in still can: per (group, step, call site),
    every member that finished the step must have issued the same number of
    ops. The odd member is found by majority; in a tie (two members), by
    regularity: the member whose count at that step differs from its own
    count at that call site in its other steps.
    """
    empty = pd.DataFrame(columns=CENSUS_COLUMNS)
    if not len(coll):
        return empty
    want = set(members) if groups is None else set(groups) & set(members)
    # Select on the int group codes first: the collective table may hold millions of rows.
    gid = coll["gid"].to_numpy() if "gid" in coll else pd.factorize(coll["process_group"])[0]
    first = ~pd.Series(gid).duplicated().to_numpy()
    codes = [int(k) for k, n in zip(gid[first], take_str(coll["process_group"], first)) if n in want]
    mask = np.isin(gid, codes) & (coll["step"].to_numpy() >= 0)
    c = coll.loc[mask, ["rank", "op_id", "process_group", "collective_seq_id", "op_name", "call_site", "step"]]
    c = c[(c["call_site"] != "").to_numpy()]
    if not len(c):
        return empty
    cell = ["process_group", "step", "call_site"]
    cnt = c.groupby(cell + ["rank"], sort=False).agg(
        count=("op_id", "size"), first_seq=("collective_seq_id", "min"), op_name=("op_name", "first")).reset_index()
    cells = cnt[cell].drop_duplicates()
    mt = member_table({g: members[g] for g in cells["process_group"].unique()}).rename(columns={"member": "rank"})
    full = cells.merge(mt, on="process_group")
    passed = passed_steps(coll)
    full = full[full["rank"].map(passed).fillna(-1).to_numpy() >= full["step"].to_numpy()]
    full = full.merge(cnt, on=cell + ["rank"], how="left")
    full["count"] = full["count"].fillna(0).astype(np.int64)
    spread = full.groupby(cell, sort=False)["count"].agg(["min", "max", "size"])
    bad = spread[(spread["min"] != spread["max"]) & (spread["size"] >= 2)].reset_index()[cell]
    if not len(bad):
        return empty
    f = full.merge(bad, on=cell)
    dev = majority_vote(f, cell, "count")
    frames = []
    strict = dev[~dev["tie"].astype(bool)]
    if len(strict):
        frames.append(strict.assign(expected=strict["majority"].astype(np.int64), basis="majority"))
    tied = dev.loc[dev["tie"].astype(bool), cell].drop_duplicates()
    if len(tied):
        t = f.merge(tied, on=cell)
        hist = full.merge(t[["process_group", "call_site", "rank"]].drop_duplicates(),
                          on=["process_group", "call_site", "rank"])
        h = hist.groupby(["process_group", "call_site", "rank", "count"]).size().rename("n").reset_index()
        tt = t[cell + ["rank", "count"]].merge(h.rename(columns={"count": "usual"}),
                                              on=["process_group", "call_site", "rank"])
        tt["n"] = tt["n"] - (tt["usual"] == tt["count"]).astype(np.int64)     # its other steps only
        tt = tt[tt["n"] > 0]
        top = tt.groupby(cell + ["rank"])["n"].transform("max")
        best = tt[tt["n"] == top]
        best = best[best.groupby(cell + ["rank"])["usual"].transform("size") == 1]
        t2 = t.merge(best[cell + ["rank", "usual"]], on=cell + ["rank"])
        odd = t2[t2["count"] != t2["usual"]]
        n_odd = odd.groupby(cell).size().rename("n_odd")
        n_all = t.groupby(cell).size().rename("n_all")
        n_known = t2.groupby(cell).size().rename("n_known")
        ok = pd.concat([n_odd, n_all, n_known], axis=1).fillna(0)
        ok = ok[(ok["n_odd"] >= 1) & (ok["n_odd"] < ok["n_all"]) & (ok["n_known"] == ok["n_all"])]
        reg = odd.merge(ok.reset_index()[cell], on=cell)
        if len(reg):
            frames.append(reg.assign(expected=reg["usual"].astype(np.int64), basis="regularity"))
    if not frames:
        return empty
    out = pd.concat(frames, ignore_index=True)
    out["direction"] = np.where(out["count"] < out["expected"], "skipped", "extra")
    # What the others issued there: their first seq and op name, and who they are.
    devs = out[cell + ["rank"]].assign(is_dev=True)
    others = f.merge(devs, on=cell + ["rank"], how="left")
    others = others[others["is_dev"].isna() & others["first_seq"].notna()]
    ref = others.groupby(cell, sort=False).agg(
        ref_seq=("first_seq", "min"), ref_op=("op_name", "first"),
        ref_ranks=("rank", lambda r: sorted(int(x) for x in r))).reset_index()
    out = out.drop(columns=["op_name"]).merge(f[cell + ["rank", "op_name"]], on=cell + ["rank"], how="left")
    out = out.merge(ref, on=cell, how="left")
    out["op_name"] = out["ref_op"].where(out["ref_op"].notna(), out["op_name"]).fillna("collective")
    out["ref_seq"] = out["ref_seq"].fillna(-1).astype(np.int64)
    out["ref_ranks"] = out["ref_ranks"].map(lambda v: v if isinstance(v, list) else [])
    out["n_members"] = out["process_group"].map(lambda g: len(members.get(g, [])))
    return out[CENSUS_COLUMNS].sort_values(["step", "process_group", "rank"], kind="stable").reset_index(drop=True)

