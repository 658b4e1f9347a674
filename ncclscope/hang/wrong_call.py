"""`wrong_group` from a missing participant's own calls (split out of group_checks.py): a rank absent from an
unfinished instance (g, k) that made the call its peers made there on another group h instead.

`find_wrong_group` matches the absent rank's later calls with the peers' call at (g, k) by call site (the
shapes where no call site was recorded). Where that finds nothing, it matches by the site's callers and the
shapes: the same call of the user's loop issued from another line of the same function, a branch that passes
another group (seen: a "contribute zeros" fallback that all-reduced the dp gradient over tp; gloo paired it
with the tp partner's own tp call, whose size check aborted the partner, and the Flight Recorder dumps named
the dead partner). `group_checks.analyze_groups` runs it, then `with_partner_deaths`.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import pandas as pd

from ncclscope.findings import Cause, Evidence, Finding, InstanceRef, WaitSummary, WrongCall
from ncclscope.hang.wording import duration, wait_seconds, wait_since
from ncclscope.hang.wrong_site import WRONG_GROUP_LAYOUT
from ncclscope.index.instances import near_instances
from ncclscope.index.labels import created_at, kind_of, rank_label
from ncclscope.index.views import IndexLike, TraceIndex, as_index


def _per_text(col: pd.Series, fn: Callable[[str], str] = str) -> np.ndarray:
    """`fn` of each value's text (`astype(str)`: missing is "nan"), as an object array, computed once per
    distinct text: a categorical through its categories, anything else through its unique values (the
    collective rows of 16,384 ranks are millions, their call sites and groups a handful)."""
    if isinstance(col.dtype, pd.CategoricalDtype):
        cats = np.array([fn(str(c)) for c in col.cat.categories] + [fn("nan")], dtype=object)
        return cats[col.cat.codes.to_numpy()]          # code -1 (missing) -> the last entry
    texts = col.astype(str).to_numpy(dtype=object)
    if fn is str:
        return texts
    uniq, inverse = np.unique(texts, return_inverse=True)
    return np.array([fn(t) for t in uniq], dtype=object)[inverse.reshape(-1)]


def _callers(site: str) -> str:
    """A call site's callers (its innermost frame left out); a site without callers stands for itself."""
    return site.split(" < ", 1)[1] if " < " in site else "\x00" + site


def _match_key(df: pd.DataFrame, outer: bool = False) -> pd.Series:
    """How two ranks' ops correspond: the call site, or the shapes when no call site was recorded; with
    `outer`, the site's callers and the shapes (module docstring)."""
    if outer:
        key = _per_text(df["call_site"], _callers) + "\x1f" + _per_text(df["input_sizes"])
        return pd.Series(key, index=df.index, dtype=object)
    key = _per_text(df["call_site"])
    empty = np.flatnonzero(key == "")
    if len(empty):
        key = key.copy()
        key[empty] = ["sizes:" + t for t in _per_text(df["input_sizes"].iloc[empty])]
    return pd.Series(key, index=df.index, dtype=object)


def find_wrong_group(source: IndexLike, max_findings: int = 16) -> list[Finding]:
    """`wrong_group`: who skipped instance (g, k) because it called the same op elsewhere.

    For each missing participant b of an unfinished instance (g, k) (from
    `TraceIndex.missing`), take the op the others issued there
    (op name, call site, step). If b, after its last op on g, issued that same
    op from the same call site and step on another group h that none of the
    ranks in (g, k) used there, b used the wrong group: h instead of g. Where no
    call matches by its site, the same question by the site's callers and the
    shapes (module docstring).
    """
    ix = as_index(source)
    if not len(ix.missing) or not len(ix.coll):
        return []
    return _find(ix, False, max_findings) or _find(ix, True, max_findings)


def _find(ix: TraceIndex, outer: bool, max_findings: int) -> list[Finding]:
    """find_wrong_group with one way of matching calls (`_match_key`)."""
    coll, missing, members = ix.coll, ix.missing, ix.members
    miss = missing.head(max_findings * 8)[["process_group", "seq", "rank", "n_began", "n_members"]]
    inst = near_instances(coll, miss["process_group"], miss["seq"]).merge(
        miss[["process_group", "seq"]].drop_duplicates(),
        left_on=["process_group", "collective_seq_id"], right_on=["process_group", "seq"])
    if not len(inst):
        return []
    inst = inst.assign(key=_match_key(inst, outer))
    ref = inst.sort_values("rank").drop_duplicates(["process_group", "seq"])
    ref = ref[["process_group", "seq", "op_name", "key", "step", "call_site"]].rename(
        columns={"call_site": "ref_call_site"})
    m = miss.merge(ref, on=["process_group", "seq"])
    cand = coll[coll["rank"].isin(m["rank"].unique())]     # only the absent ranks' ops from here on
    last_g = cand.groupby(["process_group", "rank"], sort=False)["start_ns"].max().rename("last_g").reset_index()
    m = m.merge(last_g, on=["process_group", "rank"], how="left")
    m["last_g"] = m["last_g"].fillna(-1).astype("int64")

    cand = cand.assign(key=_match_key(cand, outer))[["rank", "process_group", "collective_seq_id", "op_name", "key",
                                                     "step", "start_ns", "op_id", "status", "call_site"]]
    cand = cand.rename(columns={"process_group": "wrong_group", "collective_seq_id": "wrong_seq"})
    c = m.merge(cand, on=["rank", "op_name", "key", "step"])
    c = c[(c["wrong_group"] != c["process_group"]) & (c["start_ns"] > c["last_g"])]
    if not len(c):
        return []
    # Legit when the ranks that entered (g, k) also called a group of h's kind there (each rank
    # all-reduces over its own tp group, or a loop over groups): b did the same, not a substitute.
    kinds = ix.kinds
    def kind(s: pd.Series) -> pd.Series:
        return pd.Series(_per_text(s, lambda n: kind_of(n, kinds)), index=s.index, dtype=object)
    c = c.assign(wrong_kind=kind(c["wrong_group"]))
    users = inst[["process_group", "seq", "rank"]].rename(columns={"rank": "user"})
    used = coll[coll["rank"].isin(users["user"].unique()) & coll["step"].isin(c["step"].unique())]
    used = used.assign(key=_match_key(used, outer), wrong_kind=kind(used["process_group"]))
    used = used[["rank", "wrong_kind", "op_name", "key", "step"]].rename(columns={"rank": "user"}).drop_duplicates()
    legit = c.merge(users, on=["process_group", "seq"]).merge(
        used, on=["user", "wrong_kind", "op_name", "key", "step"])[["process_group", "seq", "rank", "wrong_group"]]
    c = c.merge(legit.drop_duplicates().assign(legit=True), on=["process_group", "seq", "rank", "wrong_group"],
                how="left")
    c = c[c["legit"].isna()]
    if len(c):
        c = _less_supported(c, coll, members, kind, outer)
    c = c.sort_values("start_ns").drop_duplicates(["process_group", "seq", "rank"])
    findings = []
    for (g, k), sub in c.groupby(["process_group", "seq"], sort=True):
        findings.append(_wrong_group_finding(ix, str(g), int(k), sub, inst))
        if len(findings) >= max_findings:
            break
    return findings


def _less_supported(c: pd.DataFrame, coll: pd.DataFrame, members: dict[str, list[int]],
                    kind: Callable[[pd.Series], pd.Series], outer: bool) -> pd.DataFrame:
    """The candidates whose group h is less supported than the group g they skipped."""
    # The group b chose must be less supported than the one it skipped: in the case above 2 of 3
    # dp0 members entered dp0 #3 but only b entered its world instance, never the other way round.
    # Support for h's instance: members that issued the same call there (a member that is in
    # (h, seq) from another call site was doing its own thing, not joining b).
    cand_inst = c[["wrong_group", "wrong_seq", "key"]].drop_duplicates()
    h_rows = near_instances(coll, cand_inst["wrong_group"], cand_inst["wrong_seq"]).merge(
        cand_inst[["wrong_group", "wrong_seq"]].drop_duplicates(),
        left_on=["process_group", "collective_seq_id"], right_on=["wrong_group", "wrong_seq"])
    h_rows = h_rows.assign(key=_match_key(h_rows, outer)).merge(cand_inst, on=["wrong_group", "wrong_seq", "key"])
    counts = h_rows.groupby(["wrong_group", "wrong_seq", "key"]).size()
    c = c.merge(counts.rename("h_began").reset_index(), on=["wrong_group", "wrong_seq", "key"], how="left")
    h_members = c["wrong_group"].map(lambda n: len(members.get(str(n), [])) or 1)
    g_frac = c["n_began"] / c["n_members"].clip(lower=1)
    h_frac = c["h_began"].fillna(1) / h_members
    # A tie (1 of 2 entered each: two-member groups, or the partner's rows died with it) is
    # decided by what that call site uses everywhere else: the group kind of every other
    # call from it, on every rank and step. b's call is the odd one when the site's kind is g's.
    site_kind = _site_kinds(coll, c, kind)
    g_kind = kind(c["process_group"])
    tie_ok = (h_frac == g_frac) & (c["ref_call_site"] != "") \
        & (c["ref_call_site"].astype("str").map(site_kind) == g_kind) & (c["wrong_kind"] != g_kind)
    return c[(h_frac < g_frac) | tie_ok]


def _site_kinds(coll: pd.DataFrame, c: pd.DataFrame, kind) -> dict[str, str]:
    """Call site -> the group kind most of its calls use (candidates' own calls excluded)."""
    sites = c["ref_call_site"].unique()
    use = coll[coll["call_site"].isin(sites).to_numpy()]
    mine = pd.MultiIndex.from_arrays([c["rank"].astype("int64"), c["op_id"].astype("int64")])
    use = use[~pd.MultiIndex.from_arrays([use["rank"].astype("int64"), use["op_id"].astype("int64")]).isin(mine)]
    if not len(use):
        return {}
    k = use.assign(site_kind=kind(use["process_group"]))
    top = k.groupby(["call_site", "site_kind"]).size().rename("n").reset_index()
    top = top.sort_values("n", ascending=False, kind="stable")
    n_top = top.groupby("call_site")["n"].transform("max")
    unique_top = top[top["n"] == n_top].groupby("call_site")["site_kind"].transform("size") == 1
    top = top[(top["n"] == n_top) & unique_top]
    return dict(zip(top["call_site"], top["site_kind"]))


def _wrong_group_finding(ix: TraceIndex, g: str, k: int, sub: pd.DataFrame, inst: pd.DataFrame) -> Finding:
    trace = ix.trace
    deviants = sorted(int(r) for r in sub["rank"])
    row = sub.iloc[0]
    h = str(row["wrong_group"])
    began = inst[(inst["process_group"] == g) & (inst["seq"] == k)].sort_values("rank")
    waiting = began[began["status"].astype(str) != "ok"]
    site = str(row["ref_call_site"]) or "the same call site"
    own = str(row["call_site"])
    if own and own != str(row["ref_call_site"]):       # matched by its callers: the line that differs is its own
        site, own_site = f"{own} (its peers' call: {site})", own
    else:
        own_site = str(row["ref_call_site"])
    step = int(row["step"])
    title = (f"{rank_label(trace, deviants)} called {row['op_name']} on {ix.label(h)} "
             f"instead of {ix.label(g)} (#{k}) at {site}"
             + (f" (step {step})" if step >= 0 else "") + created_at(trace, deviants, h))
    since = wait_since(ix.end_ns, waiting["start_ns"])
    if len(waiting):
        title += (f"; {rank_label(trace, waiting['rank'])} waiting in {row['op_name']} #{k} on {g}"
                  + (f" since {duration(since)}" if duration(since) else ""))
    ev = [Evidence(rank=int(r.rank), note=f"called it on {h} (#{int(r.wrong_seq)}) instead of {g}; "
                                           f"status {r.status}", op_name=str(r.op_name), process_group=h,
                   seq=int(r.wrong_seq), op_id=int(r.op_id), time_ns=int(r.start_ns))
          for r in sub.itertuples(index=False)]
    ev += [Evidence(rank=int(r.rank), note=f"in {g} #{k}: {r.status}"
                    + (f", waiting since {duration(wait_since(ix.end_ns, pd.Series([r.start_ns])))}"
                       if str(r.status) != "ok" and duration(wait_since(ix.end_ns, pd.Series([r.start_ns]))) else ""),
                    op_name=str(r.op_name), process_group=g, seq=k, op_id=int(r.op_id), time_ns=int(r.start_ns))
           for r in began.head(16).itertuples(index=False)]
    wait_s = wait_seconds(ix.end_ns, waiting["start_ns"].min()) if len(waiting) else None
    return Finding(kind="wrong_group", severity="error", title=title, ranks=deviants, evidence=ev,
                   instance=InstanceRef(g, k), wait=WaitSummary(waiting_ranks=tuple(int(r) for r in waiting["rank"]),
                                                                wait_s=wait_s),
                   data={"process_group": g, "seq": k, "call_site": own_site, "step": step},
                   cause=Cause(wrong=WrongCall(h, int(row["wrong_seq"]), int(sub["start_ns"].min()))),
                   layout=WRONG_GROUP_LAYOUT)

