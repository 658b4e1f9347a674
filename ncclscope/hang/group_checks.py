"""Process-group checks: do the ranks agree on the groups, and did each use the right one?

A hang often starts before the first collective, in the group table. If
rank 3 built dp0 as [0,1,3] while everyone else built [0,1,2], every later
dp0 collective pairs the wrong processes; if one rank created groups in a
different order, NCCL/gloo communicators are cross-wired. And a rank that
calls `all_reduce(group=world)` where its peers call `all_reduce(group=dp0)`
from the same line of code waits forever in a group nobody else entered.
These are cheap to detect from the recorded data:

- `check_group_views`   `group_mismatch`: ranks' views of a group's members or
                        creation order disagree (majority vote names the odd ones).
- `check_orthogonality` `group_mismatch`: groups of one kind overlap (error) or
                        do not cover the world (warning): the mesh is not a set
                        of orthogonal slices.
- `find_wrong_group`    `wrong_group`: a rank missing from a collective instance
                        called the same op from the same call site and step on
                        another group instead; `with_partner_deaths` adds the
                        dead members of either group alive at the wrong call
                        (gloo aborts the one it pairs the wrong call with).

Membership, kinds and the missing participants come from the index
(membership.py, instances.py); labels from labels.py.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Callable

import numpy as np
import pandas as pd

from ncclscope import schema as S
from ncclscope.findings import Cause, Evidence, Finding, InstanceRef, WaitSummary, WrongCall
from ncclscope.index.views import IndexLike, TraceIndex, as_index
from ncclscope.hang.group_order import creation_order_findings
from ncclscope.index.instances import near_instances
from ncclscope.index.labels import created_at, group_label, kind_of, majority_vote, rank_label
from ncclscope.index.membership import INFERRED_PREFIX
from ncclscope.hang.wording import duration, wait_seconds, wait_since
from ncclscope.hang.wrong_site import WRONG_GROUP_LAYOUT, find_wrong_group_by_site

if TYPE_CHECKING:
    from ncclscope.load.trace import Trace

NOT_ORTHOGONAL_KINDS = ("custom", "world")  # kinds that need not partition the world


@dataclass
class GroupReport:
    findings: list[Finding] = field(default_factory=list)
    view_deviations: pd.DataFrame = field(default_factory=pd.DataFrame)



def analyze_groups(source: IndexLike) -> GroupReport:
    """All group checks, on a trace or its index."""
    ix = as_index(source)
    view_findings, table = check_group_views(ix)
    findings = view_findings + check_orthogonality(ix)
    findings += [f for f in creation_order_findings(ix) if not any(set(f.ranks) & set(v.ranks) for v in view_findings)]
    wrong = find_wrong_group(ix)
    named = {int(r) for f in wrong for r in f.ranks}
    findings += wrong + [f for f in find_wrong_group_by_site(ix) if not set(f.ranks) & named]
    findings = [with_partner_deaths(ix, f) if f.kind == "wrong_group" else f for f in findings]
    return GroupReport(findings=findings, view_deviations=table)


DEATH_SLACK_NS = 1_500_000_000   # a rank's last record may precede its death by a heartbeat interval and a flush


def with_partner_deaths(ix: TraceIndex, f: Finding) -> Finding:
    """`f` with `cause.partner_deaths`: the dead members (culprit aside) of the group the wrong call went
    to or of the group it was meant for, that were still alive when the wrong call was posted.

    gloo pairs the wrong call with whatever its new partners post on that group (or leaves the intended
    group's members waiting): a size mismatch there SIGABRTs one of them, an innocent member. A death
    among those members at or after the wrong call is its consequence (diagnose.explains). "Alive at the
    call": the rank's last record (event or heartbeat) is at most DEATH_SLACK_NS before it, since a rank
    blocked in a collective writes nothing until it dies; a rank with no record at all counts only when
    it died of SIGABRT (gloo's abort), or, with no file of its own (a rank that left no Flight Recorder dump),
    where its peers' records say when it was last alive (`_alive_with_peers`)."""
    wrong = f.cause.wrong
    t = wrong.ns if wrong is not None else None
    if t is None or t < 0:
        return f
    meant = f.instance.group if f.instance is not None else str(f.data.get("process_group", ""))
    ms = set(ix.members.get(wrong.group, [])) | set(ix.members.get(meant, []))
    st = ix.rank_states
    cand = sorted(r for r in ms - set(f.ranks) if r in st.index and bool(st.at[r, "dead"]))
    deaths = []
    for r in cand:
        last = max(int(st.at[r, "last_event_ns"]), int(st.at[r, "last_hb_ns"]) if pd.notna(st.at[r, "last_hb_ns"])
                   else -1)
        if last < 0 and str(st.at[r, "state"]) == "missing":
            last = _alive_with_peers(ix, int(r))
        if (last >= 0 and last + DEATH_SLACK_NS >= t) or (last < 0 and str(st.at[r, "signal"]) == "SIGABRT"):
            deaths.append(int(r))
    if not deaths:
        return f
    return replace(f, cause=replace(f.cause, partner_deaths=tuple(deaths)))


def _alive_with_peers(ix: TraceIndex, rank: int) -> int:
    """When a rank with no records of its own was last alive, by its peers' records: the latest start of a
    collective its peers completed on a group it belongs to (no member returns from a collective its other
    members did not enter); -1 where none."""
    coll = ix.coll
    groups = [g for g, ms in ix.members.items() if rank in ms]
    done = coll[coll["process_group"].isin(groups).to_numpy() & (coll["rank"] != rank).to_numpy()
                & (coll["status"].astype(str) == S.STATUS_OK).to_numpy()]
    return int(done["start_ns"].max()) if len(done) else -1


def check_group_views(source: IndexLike, max_findings: int = 16) -> tuple[list[Finding], pd.DataFrame]:
    """`group_mismatch` where ranks disagree on a group's members or creation order.

    Ranks whose disagreements cover the same groups share one finding (a rank
    that built the whole mesh in another order is one problem, not 12).
    """
    ix = as_index(source)
    trace, views = ix.trace, ix.view_table
    findings: list[Finding] = []
    frames = []
    for attr in ("members", "creation_order"):
        dev = _ties_to_known_deviants(majority_vote(views, ["process_group"], attr), views, attr)
        if not len(dev):
            continue
        frames.append(dev.assign(attribute=attr))
        per_rank = dev.sort_values("process_group").groupby("rank")["process_group"].agg(tuple)
        clusters = per_rank.reset_index().groupby("process_group", sort=False)["rank"].agg(list)
        for n, (names, ranks) in enumerate(sorted(clusters.items(), key=lambda kv: min(kv[1]))):
            if n >= max_findings:
                break
            sub = dev[dev["rank"].isin(ranks) & dev["process_group"].isin(names)]
            findings.append(_view_finding(trace, attr, sorted(int(r) for r in ranks), list(names), sub, views))
    table = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    return findings, table


def _ties_to_known_deviants(dev: pd.DataFrame, views: pd.DataFrame, attr: str) -> pd.DataFrame:
    """A tied group (two voters, two views) whose voters include exactly one rank the vote already named
    on other groups: that rank's view is the odd one here too (a rank that built the mesh in another
    order pairs its groups with the wrong members, and every group it shares with one peer ties)."""
    if not len(dev) or not bool(dev["tie"].any()):
        return dev
    firm = set(dev.loc[~dev["tie"].astype(bool), "rank"].astype(int))
    keep, add = [], []
    for g, rows in dev.groupby("process_group", sort=False):
        if not bool(rows["tie"].any()):
            keep.append(rows)
            continue
        voters = views[views["process_group"] == g]
        known = sorted(set(voters["rank"].astype(int)) & firm)
        if len(known) != 1 or voters[attr].nunique() != 2:
            keep.append(rows)
            continue
        mine = voters[voters["rank"] == known[0]]
        other = voters.loc[voters[attr] != mine[attr].iloc[0], attr].iloc[0]
        add.append(mine.assign(majority=other, n_majority=int((voters[attr] == other).sum()),
                               n_voters=len(voters), tie=False))
    out = pd.concat(keep + add, ignore_index=True) if keep or add else dev.iloc[0:0]
    return out[list(dev.columns)]


def _view_finding(trace: Trace, attr: str, odd: list[int], names: list[str], sub: pd.DataFrame,
                  views: pd.DataFrame) -> Finding:
    what = "members" if attr == "members" else "creation order"
    shown = (lambda v: f"[{v}]") if attr == "members" else str
    first = sub[sub["process_group"] == names[0]]
    tie = bool(sub["tie"].any())
    who = rank_label(trace, odd)
    verb = "disagrees" if len(odd) == 1 else "disagree"
    if len(names) == 1:
        name, majority = names[0], first["majority"].iloc[0]
        agree = views[(views["process_group"] == name) & (views[attr] == majority)]["rank"]
        odd_vals = "; ".join(f"rank {int(r)} sees {shown(v)}" for r, v in
                             first.sort_values("rank")[["rank", attr]].head(4).itertuples(index=False))
        title = (f"{who} {verb} on the {what} of group {name}: {odd_vals} where {len(agree)} "
                 f"rank{'s' if len(agree) != 1 else ''} see{'s' if len(agree) == 1 else ''} {shown(majority)}")
    else:
        r0 = sub[sub["rank"] == odd[0]].sort_values("process_group")
        diffs = ", ".join(f"{g} {shown(v)} vs {shown(m)}" for g, v, m in
                          r0[["process_group", attr, "majority"]].head(3).itertuples(index=False))
        more = ", ..." if len(r0) > 3 else ""
        if attr == "creation_order":
            title = (f"{who} created the process groups in a different order than the other ranks: "
                     f"{len(names)} groups differ ({diffs}{more})")
        else:
            title = f"{who} {verb} on the members of {len(names)} groups ({diffs}{more})"
    if tie:
        title = f"ambiguous (tie), naming the lowest rank: {title}"
    title += created_at(trace, odd[:1], names[0])
    ev = [Evidence(rank=int(r), note=f"view of {g} {what}: {shown(v)} (majority {shown(m)})", process_group=str(g))
          for r, g, v, m in sub.sort_values(["rank", "process_group"])[["rank", "process_group", attr, "majority"]]
          .head(24).itertuples(index=False)]
    return Finding(kind="group_mismatch", severity="error", title=title, ranks=odd[:1] if tie else odd,
                   evidence=ev, data={"process_group": names[0], "groups": names, "attribute": attr,
                                      "majority": str(first["majority"].iloc[0])},
                   cause=Cause(ambiguous=tie, deviant_ranks=tuple(odd)))


def _dimension(name: str, kind: str) -> str:
    """The mesh dimension a group is a slice of: its kind, and its name without the instance number
    ("dp0" -> dp, "mesh_dp:1" -> mesh_dp). Two dimensions may share a kind (HSDP's mesh_dp and mesh_fsdp,
    torchtitan's dp_replicate and dp_shard: both data parallel) and overlap by design."""
    base = re.sub(r"[:_\-]?\d+$", "", name.split("[", 1)[0]).rstrip(":_-")
    return f"{kind}/{base}" if base and not base.isdigit() else kind


def check_orthogonality(source: IndexLike) -> list[Finding]:
    """Groups of one mesh dimension must be disjoint slices that together cover the world."""
    ix = as_index(source)
    if not ix.recorded:
        return []
    trace, members, kinds = ix.trace, ix.recorded_members, ix.kinds
    names = list(members)
    sizes = np.fromiter((len(members[n]) for n in names), dtype=np.int64, count=len(names))
    flat = np.fromiter((r for n in names for r in members[n]), dtype=np.int64, count=int(sizes.sum()))
    kind_of = [str(kinds.get(n, "custom")) for n in names]
    long = pd.DataFrame({"kind": np.repeat(np.array(kind_of, dtype=object), sizes),
                         "dim": np.repeat(np.array([_dimension(n, k) for n, k in zip(names, kind_of)], dtype=object),
                                          sizes),
                         "process_group": np.repeat(np.array(names, dtype=object), sizes), "rank": flat})
    long = long[~long["kind"].isin(NOT_ORTHOGONAL_KINDS) & ~long["kind"].str.startswith(INFERRED_PREFIX)]
    findings: list[Finding] = []
    # a rank that left no trace or dump says nothing of its groups: "in no group" is only said of ranks seen
    world = set(trace.present_ranks) or set(range(trace.world_size))
    count = long.groupby(["kind", "dim", "rank"])["process_group"].nunique()
    overl = count[count > 1].reset_index()
    for (kind, dim), sub in overl.groupby(["kind", "dim"], sort=True):
        ranks = sorted(int(r) for r in sub["rank"])
        gs = long[(long["dim"] == dim) & long["rank"].isin(ranks)]["process_group"].unique()
        labels = ", ".join(group_label(str(g), members[str(g)]) for g in sorted(gs)[:4])
        ev = [Evidence(rank=r, note=f"member of more than one {kind} group", process_group=str(gs[0]))
              for r in ranks[:16]]
        findings.append(Finding(
            kind="group_mismatch", severity="error",
            title=f"{rank_label(trace, ranks)} belong{'s' if len(ranks) == 1 else ''} to more than one "
                  f"{kind} group ({labels}): {kind} groups must be disjoint slices of the mesh",
            ranks=ranks, evidence=ev, data={"group_kind": str(kind), "check": "overlap"}))
    for (kind, _), sub in long.groupby(["kind", "dim"], sort=True):
        missing = sorted(world - set(sub["rank"].astype(int)))
        if not missing or len(missing) == len(world):
            continue
        ev = [Evidence(rank=r, note=f"in no {kind} group") for r in missing[:16]]
        findings.append(Finding(
            kind="group_mismatch", severity="warning",
            title=f"{kind} groups do not cover the world: {rank_label(trace, missing)} "
                  f"{'is' if len(missing) == 1 else 'are'} in no {kind} group",
            ranks=missing, evidence=ev, data={"group_kind": str(kind), "check": "coverage"}))
    return findings


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


def _match_key(df: pd.DataFrame) -> pd.Series:
    """How two ranks' ops correspond: the call site, or the shapes when no call site was recorded."""
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
    ranks in (g, k) used there, b used the wrong group: h instead of g.
    """
    ix = as_index(source)
    coll, missing, members = ix.coll, ix.missing, ix.members
    if not len(missing) or not len(coll):
        return []
    miss = missing.head(max_findings * 8)[["process_group", "seq", "rank", "n_began", "n_members"]]
    inst = near_instances(coll, miss["process_group"], miss["seq"]).merge(
        miss[["process_group", "seq"]].drop_duplicates(),
        left_on=["process_group", "collective_seq_id"], right_on=["process_group", "seq"])
    if not len(inst):
        return []
    inst = inst.assign(key=_match_key(inst))
    ref = inst.sort_values("rank").drop_duplicates(["process_group", "seq"])
    ref = ref[["process_group", "seq", "op_name", "key", "step", "call_site"]].rename(
        columns={"call_site": "ref_call_site"})
    m = miss.merge(ref, on=["process_group", "seq"])
    cand = coll[coll["rank"].isin(m["rank"].unique())]     # only the absent ranks' ops from here on
    last_g = cand.groupby(["process_group", "rank"], sort=False)["start_ns"].max().rename("last_g").reset_index()
    m = m.merge(last_g, on=["process_group", "rank"], how="left")
    m["last_g"] = m["last_g"].fillna(-1).astype("int64")

    cand = cand.assign(key=_match_key(cand))[["rank", "process_group", "collective_seq_id", "op_name", "key",
                                              "step", "start_ns", "op_id", "status"]]
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
    used = used.assign(key=_match_key(used), wrong_kind=kind(used["process_group"]))
    used = used[["rank", "wrong_kind", "op_name", "key", "step"]].rename(columns={"rank": "user"}).drop_duplicates()
    legit = c.merge(users, on=["process_group", "seq"]).merge(
        used, on=["user", "wrong_kind", "op_name", "key", "step"])[["process_group", "seq", "rank", "wrong_group"]]
    c = c.merge(legit.drop_duplicates().assign(legit=True), on=["process_group", "seq", "rank", "wrong_group"],
                how="left")
    c = c[c["legit"].isna()]
    if len(c):
        c = _less_supported(c, coll, members, kind)
    c = c.sort_values("start_ns").drop_duplicates(["process_group", "seq", "rank"])
    findings = []
    for (g, k), sub in c.groupby(["process_group", "seq"], sort=True):
        findings.append(_wrong_group_finding(ix, str(g), int(k), sub, inst))
        if len(findings) >= max_findings:
            break
    return findings


def _less_supported(c: pd.DataFrame, coll: pd.DataFrame, members: dict[str, list[int]],
                    kind: Callable[[pd.Series], pd.Series]) -> pd.DataFrame:
    """The candidates whose group h is less supported than the group g they skipped."""
    # The group b chose must be less supported than the one it skipped: in the case above 2 of 3
    # dp0 members entered dp0 #3 but only b entered its world instance, never the other way round.
    # Support for h's instance: members that issued the same call there (a member that is in
    # (h, seq) from another call site was doing its own thing, not joining b).
    cand_inst = c[["wrong_group", "wrong_seq", "key"]].drop_duplicates()
    h_rows = near_instances(coll, cand_inst["wrong_group"], cand_inst["wrong_seq"]).merge(
        cand_inst[["wrong_group", "wrong_seq"]].drop_duplicates(),
        left_on=["process_group", "collective_seq_id"], right_on=["wrong_group", "wrong_seq"])
    h_rows = h_rows.assign(key=_match_key(h_rows)).merge(cand_inst, on=["wrong_group", "wrong_seq", "key"])
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
                   data={"process_group": g, "seq": k, "call_site": str(row["ref_call_site"]), "step": step},
                   cause=Cause(wrong=WrongCall(h, int(row["wrong_seq"]), int(sub["start_ns"].min()))),
                   layout=WRONG_GROUP_LAYOUT)

