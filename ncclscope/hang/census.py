"""Step census: a skipped (or extra) collective earlier in the run, found by counting per step.

gloo and NCCL pair collectives by per-group sequence number, so a rank that
skips one all_reduce does not hang there: its next all_reduce pairs with the
others' skipped one (one instance off) and the job hangs later, elsewhere,
often in a 2-member group where "3 of 4 members entered" cannot point at
anyone. The step each op was issued in still can: per (group, step, call
site) every member that finished the step must have issued the same number
of ops. The wait-for graph asks this module which cycle member deviated first;
skips.py finds a skip in a dead or stuck rank's own record.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ncclscope.index.instances import member_table
from ncclscope.index.labels import majority_vote, take_str

CENSUS_COLUMNS = ["process_group", "step", "call_site", "rank", "count", "expected", "direction", "basis",
                  "op_name", "ref_seq", "ref_ranks", "n_members"]



def passed_steps(coll: pd.DataFrame) -> pd.Series:
    """rank -> the highest training step it certainly finished: the one before its last step, or its
    last step when it went on to post-training ops (a step -1 op after its last training op).

    Grouped on the view's own columns (no frame copy of the 2 M collective rows at 10 M events: inside
    the hang analysis, on top of the index's views, that copy was its peak)."""
    if not len(coll):
        return pd.Series(dtype="int64")
    rank = pd.Series(coll["rank"].to_numpy(np.int64), name="rank", copy=False)
    step = coll["step"].to_numpy()
    start = pd.Series(coll["start_ns"].to_numpy(np.int64), copy=False)
    train = step >= 0
    if not train.any():
        return pd.Series(dtype="int64")
    mx = pd.Series(step.astype(np.int64, copy=False), copy=False)[train].groupby(rank[train]).max()
    last_train = start[train].groupby(rank[train]).max()
    after = start[~train].groupby(rank[~train]).max().reindex(mx.index)
    finished = (after > last_train).fillna(False).astype(np.int64)
    return (mx - 1 + finished).astype(np.int64).rename(None)


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
    full = _member_counts(coll, members, groups)
    if full is None:
        return empty
    spread = full.groupby(_CELL, sort=False)["count"].agg(["min", "max", "size"])
    bad = spread[(spread["min"] != spread["max"]) & (spread["size"] >= 2)].reset_index()[_CELL]
    if not len(bad):
        return empty
    f = full.merge(bad, on=_CELL)
    dev = majority_vote(f, _CELL, "count")
    frames = []
    strict = dev[~dev["tie"].astype(bool)]
    if len(strict):
        frames.append(strict.assign(expected=strict["majority"].astype(np.int64), basis="majority"))
    tied = dev.loc[dev["tie"].astype(bool), _CELL].drop_duplicates()
    reg = _by_regularity(f, full, tied) if len(tied) else None
    if reg is not None and len(reg):
        frames.append(reg.assign(expected=reg["usual"].astype(np.int64), basis="regularity"))
    if not frames:
        return empty
    out = pd.concat(frames, ignore_index=True)
    out["direction"] = np.where(out["count"] < out["expected"], "skipped", "extra")
    out = out[out["finished"].astype(bool) | (out["direction"] == "extra")]
    # an extra call is one more than the others issued in the whole step: only where the members holding the
    # expected count finished it (inside the step, a member ahead of the others is not an extra one)
    held = f.merge(out[_CELL + ["expected"]].drop_duplicates(), on=_CELL)
    held = held[held["count"] == held["expected"]]
    open_cells = held.loc[~held["finished"].astype(bool), _CELL].drop_duplicates().assign(open=True)
    out = out.merge(open_cells, on=_CELL, how="left")
    out = out[~((out["direction"] == "extra") & out["open"].fillna(False).astype(bool))].drop(columns="open")
    if not len(out):
        return empty
    return _with_references(out, f, members)


_CELL = ["process_group", "step", "call_site"]      # one census cell: a group's calls from one site in one step


def _member_counts(coll: pd.DataFrame, members: dict[str, list[int]], groups: list[str] | None) -> pd.DataFrame | None:
    """Per cell and member of its group: how many collectives it issued there (0: none), its first seq and op
    name, and whether it finished the step; None where no collective has a step and a call site."""
    if not len(coll):
        return None
    want = set(members) if groups is None else set(groups) & set(members)
    # Select on the int group codes first: the collective table may hold millions of rows.
    gid = coll["gid"].to_numpy() if "gid" in coll else pd.factorize(coll["process_group"])[0]
    first = ~pd.Series(gid).duplicated().to_numpy()
    codes = [int(k) for k, n in zip(gid[first], take_str(coll["process_group"], first)) if n in want]
    mask = np.isin(gid, codes) & (coll["step"].to_numpy() >= 0)
    c = coll.loc[mask, ["rank", "op_id", "process_group", "collective_seq_id", "op_name", "call_site", "step"]]
    c = c[(c["call_site"] != "").to_numpy()]
    if not len(c):
        return None
    cnt = c.groupby(_CELL + ["rank"], sort=False).agg(
        count=("op_id", "size"), first_seq=("collective_seq_id", "min"), op_name=("op_name", "first")).reset_index()
    cnt["op_name"] = cnt["op_name"].astype("str")    # one row per cell and rank: plain strings again (filled below)
    cells = cnt[_CELL].drop_duplicates()
    mt = member_table({g: members[g] for g in cells["process_group"].unique()}).rename(columns={"member": "rank"})
    full = cells.merge(mt, on="process_group")
    passed = passed_steps(coll)
    full = full.merge(cnt, on=_CELL + ["rank"], how="left")
    full["count"] = full["count"].fillna(0).astype(np.int64)
    # A member still inside the step counts from below: what it began there it issued. It can show that a
    # member who finished the step issued fewer (a 2-member group whose other member is stuck in the very
    # call the finished one left out), never that it skipped something itself (dropped below).
    done = full["rank"].map(passed).fillna(-1).to_numpy() >= full["step"].to_numpy()
    keep = done | (full["count"].to_numpy() > 0)
    return full[keep].assign(finished=done[keep])


def _by_regularity(f: pd.DataFrame, full: pd.DataFrame, tied: pd.DataFrame) -> pd.DataFrame:
    """The odd members of tied cells, by regularity: a member whose count there differs from the count it
    usually issues from that call site in its other steps (column `usual`), where every member's usual
    count is known and not all of them are odd."""
    t = f.merge(tied, on=_CELL)
    hist = full.merge(t[["process_group", "call_site", "rank"]].drop_duplicates(),
                      on=["process_group", "call_site", "rank"])
    h = hist.groupby(["process_group", "call_site", "rank", "count"]).size().rename("n").reset_index()
    tt = t[_CELL + ["rank", "count"]].merge(h.rename(columns={"count": "usual"}),
                                           on=["process_group", "call_site", "rank"])
    tt["n"] = tt["n"] - (tt["usual"] == tt["count"]).astype(np.int64)     # its other steps only
    tt = tt[tt["n"] > 0]
    top = tt.groupby(_CELL + ["rank"])["n"].transform("max")
    best = tt[tt["n"] == top]
    best = best[best.groupby(_CELL + ["rank"])["usual"].transform("size") == 1]
    t2 = t.merge(best[_CELL + ["rank", "usual"]], on=_CELL + ["rank"])
    odd = t2[t2["count"] != t2["usual"]]
    n_odd = odd.groupby(_CELL).size().rename("n_odd")
    n_all = t.groupby(_CELL).size().rename("n_all")
    n_known = t2.groupby(_CELL).size().rename("n_known")
    ok = pd.concat([n_odd, n_all, n_known], axis=1).fillna(0)
    ok = ok[(ok["n_odd"] >= 1) & (ok["n_odd"] < ok["n_all"]) & (ok["n_known"] == ok["n_all"])]
    return odd.merge(ok.reset_index()[_CELL], on=_CELL)


def _with_references(out: pd.DataFrame, f: pd.DataFrame, members: dict[str, list[int]]) -> pd.DataFrame:
    """The deviations `out` with what the others issued in their cell (their first seq and op name, and
    who they are), in CENSUS_COLUMNS, sorted by step, group and rank."""
    devs = out[_CELL + ["rank"]].assign(is_dev=True)
    others = f.merge(devs, on=_CELL + ["rank"], how="left")
    others = others[others["is_dev"].isna() & others["first_seq"].notna()]
    ref = others.groupby(_CELL, sort=False).agg(
        ref_seq=("first_seq", "min"), ref_op=("op_name", "first"),
        ref_ranks=("rank", lambda r: sorted(int(x) for x in r))).reset_index()
    out = out.drop(columns=["op_name"]).merge(f[_CELL + ["rank", "op_name"]], on=_CELL + ["rank"], how="left")
    out = out.merge(ref, on=_CELL, how="left")
    out["op_name"] = out["ref_op"].where(out["ref_op"].notna(), out["op_name"]).fillna("collective")
    out["ref_seq"] = out["ref_seq"].fillna(-1).astype(np.int64)
    out["ref_ranks"] = out["ref_ranks"].map(lambda v: v if isinstance(v, list) else [])
    out["n_members"] = out["process_group"].map(lambda g: len(members.get(g, [])))
    return out[CENSUS_COLUMNS].sort_values(["step", "process_group", "rank"], kind="stable").reset_index(drop=True)



# --------------------------------------------------------------------------
# The first deviation before a death
# --------------------------------------------------------------------------
