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
- `find_wrong_group`    `wrong_group` (wrong_call.py): a rank missing from a collective
                        instance called the same op from the same call site and step on
                        another group instead; `with_partner_deaths` adds the
                        dead members of either group alive at the wrong call
                        (gloo aborts the one it pairs the wrong call with).

Membership, kinds and the missing participants come from the index
(membership.py, instances.py); labels from labels.py.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd

from ncclscope import schema as S
from ncclscope.findings import Cause, Evidence, Finding
from ncclscope.index.views import IndexLike, TraceIndex, as_index
from ncclscope.hang.group_order import creation_order_findings
from ncclscope.index.labels import created_at, group_label, majority_vote, rank_label
from ncclscope.index.membership import INFERRED_PREFIX
from ncclscope.hang.wrong_call import find_wrong_group
from ncclscope.hang.wrong_site import find_wrong_group_by_site

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
