"""Group creation order from each process's own numbering of its groups (Flight Recorder `pg_id`).

    from ncclscope.hang.group_ids import by_group_ids
    by_group_ids(ix, use)      # [] unless ranks stopped alone in groups their own numbers tell apart

torch numbers the process groups a process builds in the order it builds
them (the `pg_id` of every Flight Recorder entry; a rank that is not a member
of a group builds nothing and does not count it). A rank that creates the
mesh's groups in another order than its peers gives the group it uses at a
call site another number than its peers give theirs: where they use their
2nd group, it uses its 1st. Its collective lands in a group whose other
members posted theirs under another name, so it waits there alone, and so
does the peer it should have met there. gloo's dumps list no group members
(`pg_config` is empty) and a job that hangs at the first use of its groups
crosses no two call sites, so neither the description nor the call-site rule
of group_order.py sees it; the numbers do.

The rule, all of it required:
- at one call site, every rank's first op on a non-world group votes with
  that group's number on the rank; a strict majority of at least three voters
  agrees on one number;
- each rank outside it stopped there: that op is its last recorded one and no
  other rank recorded that instance of its group as the same call (it waits
  alone; another rank whose own order gave another group that name may have
  recorded another call there);
- some rank of the majority also waits alone at that site (the peer the
  odd one should have met went to the group the names gave it).
A healthy job raises nothing (no rank waits alone); a layout whose ranks
number the groups of one call site differently by design (pipeline pair
groups: the first stage is a member of one, the others of two) only meets
the rule where a job hung there with a lone rank of each kind, which the
third condition asks for.
"""
from __future__ import annotations

from collections import Counter

import pandas as pd

from ncclscope.findings import Cause, CauseBasis, Evidence, Finding, InstanceRef
from ncclscope.index.labels import created_at, rank_label
from ncclscope.index.views import TraceIndex

MIN_VOTERS = 3
# The JSON order of the finding's `data`, as group_order.py's findings write theirs.
IDS_LAYOUT = ("attribute", "basis", "process_group", "groups", "deviant_ranks", "ambiguous", "call_site",
              "group_ids", "majority_id")


def by_group_ids(ix: TraceIndex, use: pd.DataFrame) -> list[Finding]:
    """`group_mismatch` (attribute creation_order, basis group_id) per call site where the ranks that
    stopped alone in a group number it unlike the majority; `use` is the collective rows on non-world
    groups (group_order.USE_COLUMNS)."""
    ids = {int(r): info.group_ids for r, info in ix.trace.ranks.items() if info.group_ids}
    if len(ids) < MIN_VOTERS or not len(use):
        return []
    sited = use[use["call_site"].astype(str) != ""]
    if not len(sited):
        return []
    first = sited.sort_values(["rank", "op_id"], kind="stable").drop_duplicates(["rank", "call_site"])
    gid = [ids.get(int(r), {}).get(str(g), -1) for r, g in zip(first["rank"], first["process_group"])]
    first = first.assign(group_id=gid)
    first = first[first["group_id"] >= 0]
    if not len(first):
        return []
    alone = _alone(use, first)
    last = _last_op_ids(ix)
    first = first.assign(alone=alone, last=[last.get(int(r)) == int(o) for r, o in zip(first["rank"], first["op_id"])])
    out = []
    named: set[int] = set()
    for site, votes in first.groupby("call_site", sort=True, observed=True):
        if len(votes) < MIN_VOTERS:
            continue
        count = Counter(int(v) for v in votes["group_id"])
        major, n_major = count.most_common(1)[0]
        if 2 * n_major <= len(votes):
            continue
        odd = votes[votes["group_id"] != major]
        stuck = odd[odd["alone"] & odd["last"]]
        if not len(stuck) or len(stuck) != len(odd):
            continue
        peers_alone = votes[(votes["group_id"] == major) & votes["alone"] & votes["last"]]
        if not len(peers_alone):
            continue
        ranks = sorted(int(r) for r in stuck["rank"] if int(r) not in named)
        if not ranks:
            continue
        named |= set(ranks)
        out.append(_finding(ix, str(site), major, votes, stuck, peers_alone, ranks))
    return out


def _alone(use: pd.DataFrame, rows: pd.DataFrame) -> list[bool]:
    """Whether each row's instance (group, sequence number) was recorded by its rank only, as the same call:
    another rank that recorded it as another op from another call site made another call, under a group
    its own creation order gave the same name (seed 20261213 #161: rank 0's 3rd group is its data-parallel
    pair, rank 1's 3rd its tensor-parallel pair; rank 0's all_reduce and rank 1's all_gather both sit in
    "#1 on 3")."""
    key = ["process_group", "collective_seq_id", "op_name", "call_site"]
    n = use.astype({"op_name": str, "call_site": str}).groupby(key, observed=True)["rank"].nunique()
    return [int(n.get((g, s, str(o), str(c)), 0)) == 1
            for g, s, o, c in zip(rows["process_group"], rows["collective_seq_id"], rows["op_name"], rows["call_site"])]


def _last_op_ids(ix: TraceIndex) -> dict[int, int]:
    """Each rank's last recorded op (the highest op id among its collectives and p2p ops)."""
    parts = [t[["rank", "op_id"]] for t in (ix.coll, ix.p2p) if len(t)]
    if not parts:
        return {}
    both = pd.concat(parts, ignore_index=True)
    return {int(r): int(o) for r, o in both.groupby("rank")["op_id"].max().items()}


def _finding(ix: TraceIndex, site: str, major: int, votes: pd.DataFrame, stuck: pd.DataFrame,
             peers_alone: pd.DataFrame, ranks: list[int]) -> Finding:
    trace = ix.trace
    agree = sorted(int(r) for r in votes.loc[votes["group_id"] == major, "rank"])
    mine = stuck.sort_values("rank").iloc[0]
    who = rank_label(trace, ranks)
    verb = "uses" if len(ranks) == 1 else "use"
    title = (f"{who} created {'its' if len(ranks) == 1 else 'their'} process groups in a different order than the "
             f"other ranks: at {site} {verb} {_nth(int(mine['group_id']))} group {'it' if len(ranks) == 1 else 'they'}"
             f" built ({ix.label(str(mine['process_group']))}, {mine['op_name']} #{int(mine['collective_seq_id'])}) "
             f"where {rank_label(trace, agree)} use the {_nth(major)} each built, and "
             f"{'waits' if len(ranks) == 1 else 'wait'} there alone, as "
             f"{rank_label(trace, sorted(int(r) for r in peers_alone['rank']))} "
             f"{'does' if len(peers_alone) == 1 else 'do'} in {'its' if len(peers_alone) == 1 else 'theirs'}: "
             f"the same group names pair other processes on {'it' if len(ranks) == 1 else 'them'}")
    title += created_at(trace, ranks[:1], str(mine["process_group"]))
    ev = []
    for row in pd.concat([stuck, peers_alone, votes]).drop_duplicates("rank").head(8).itertuples(index=False):
        lone = " and waits there alone (its last op)" if row.alone and row.last else ""
        ev.append(Evidence(rank=int(row.rank), note=f"at {site}: its {_nth(int(row.group_id))} group "
                           f"{ix.label(str(row.process_group))}{lone}", op_name=str(row.op_name),
                           process_group=str(row.process_group), seq=int(row.collective_seq_id),
                           op_id=int(row.op_id), time_ns=int(row.start_ns)))
    groups = [str(g) for g in stuck.sort_values("rank")["process_group"]]
    involved = sorted(set(ranks) | {int(r) for r in peers_alone["rank"]})
    return Finding(kind="group_mismatch", severity="error", title=title, ranks=ranks, evidence=ev,
                   instance=InstanceRef(str(mine["process_group"]), int(mine["collective_seq_id"])),
                   involved=involved,
                   data={"attribute": "creation_order", "process_group": groups[0], "groups": groups,
                         "call_site": site, "group_ids": {str(int(r)): int(g) for r, g in
                                                          zip(votes["rank"], votes["group_id"])},
                         "majority_id": int(major)},
                   cause=Cause(basis=CauseBasis.GROUP_ID, deviant_ranks=tuple(ranks), ambiguous=False),
                   layout=IDS_LAYOUT)


def _nth(i: int) -> str:
    """1 -> "1st", 2 -> "2nd", ... (torch numbers the default group 0, a process's first new group 1)."""
    suffix = "th" if 10 <= i % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(i % 10, "th")
    return f"{i}{suffix}"
