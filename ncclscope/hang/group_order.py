"""Group creation order from the entries alone: a rank that created its process groups in another order.

    from ncclscope.hang.group_order import creation_order_findings
    creation_order_findings(index_of(trace))      # [] on a healthy trace

`torch.distributed.new_group` names a group by a creation counter ("1", "2",
...) that every rank advances on every call, members or not. A rank that
creates the dp groups before the tp groups gives its groups the other ranks'
names for other member sets: its "3" is their "1". Where the dump lists each
rank's groups (an NCCL dump's `pg_config`), `groups.check_group_views` sees
the same name with different members. gloo writes an empty pg_config
(platform-notes.md), and then only the entries tell, in two ways:

- **descriptions** (`process_group` is (name, desc); DeviceMesh writes
  "mesh_tp", "mesh_dp"): the same pg name carries one description on most of
  its users and another on a few. The loader labels those apart ("mesh_tp:1",
  "mesh_dp:1"); the ranks in the minority on every such name are the ones
  that created the groups differently.
- **call sites** (no descriptions): each call site of a training loop goes to
  groups of one kind. The rank whose calls from site A all land on a group
  its other users call only from site B, and whose calls from B land on a
  group the others call only from A, has its groups' names permuted: that is
  a creation order, not one wrong call (`wrong_site.find_wrong_group_by_site`,
  which needs the rest of the rank's calls from A to go to the right kind of
  group). At least two groups must be crossed, every call from those sites
  crossed, and the sites the rank uses there exactly the sites the others use
  there (a permutation).
- **each process's numbers** (neither of the above: a job that hung at the
  first use of its groups crosses nothing): the Flight Recorder `pg_id`
  each rank gave the group it stopped in alone (group_ids.py).

`in_group_creation` answers the question the other way round, for run traces:
which ranks the wait-for graph calls stuck in compute are in fact inside
`new_group` (their last stack dump on a line that created a group), so that a
creation disagreement heads their wait even where its rank is not among those
the wait involves (stopped.fr_roots).

Silent on healthy traces by construction: a name with one description and
groups whose users agree on the call site raise nothing. Every rule reads
the index's collective table once; the loops are over (rank, group) pairs
that are crossed, never over events.
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np
import pandas as pd

from ncclscope.findings import Cause, CauseBasis, Evidence, Finding, FindingKind, InstanceRef
from ncclscope.hang.group_ids import by_group_ids
from ncclscope.index.views import IndexLike, TraceIndex, as_index
from ncclscope.index.labels import created_at, rank_label
from ncclscope.index.stack_excerpts import user_frame

MIN_CROSSED = 2                   # a permutation crosses at least two groups
MAX_FINDINGS = 8
MAX_SHOWN = 3                     # groups spelled out in a title
# The JSON order of the finding's `data` (its cause's claims among them), as earlier releases wrote it.
ORDER_LAYOUT = ("attribute", "basis", "process_group", "groups", "deviant_ranks", "ambiguous", "crossed")
_SKIP_KINDS = ("world",)          # default_pg: one group, nothing to order
_MEMBERS = re.compile(r"\[[^\[\]]*\]$")


def creation_order_findings(source: IndexLike) -> list[Finding]:
    """`group_mismatch` (attribute creation_order, basis "desc" or "call_site") per rank that created its
    groups in another order than the others, from the collective entries alone."""
    ix = as_index(source)
    coll = ix.coll
    if not len(coll):
        return []
    skip = [g for g, k in ix.kinds.items() if k in _SKIP_KINDS]
    keep = ~coll["process_group"].isin(skip).to_numpy()
    if not keep.any():
        return []
    cache: dict[str, pd.DataFrame] = {}

    def full() -> pd.DataFrame:        # every kept row: only the few findings' evidence reads it
        if "use" not in cache:
            cache["use"] = coll.loc[keep, USE_COLUMNS]
        return cache["use"]

    firsts = _first_rows(coll, keep)
    if firsts is None:
        users = sites = full()
    else:
        users, sites = (coll.iloc[p][USE_COLUMNS] for p in firsts)
    found = _by_desc(ix, users, full)
    named = {r for f in found for r in f.ranks}
    found += [f for f in _by_call_site(ix, sites, full) if not set(f.ranks) & named]
    if not found:         # nothing crossed: ranks that stopped at their groups' first use (Flight Recorder pg_id)
        found = by_group_ids(ix, full())
    return found[:MAX_FINDINGS]


USE_COLUMNS = ["rank", "process_group", "call_site", "op_name", "collective_seq_id", "op_id", "start_ns"]


def _first_rows(coll: pd.DataFrame, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """Positions of the kept rows that are the first of their (group, rank), and of their (group, rank,
    call site) among those with a call site: the rows `drop_duplicates` keeps, found on integer codes, so
    that the 2 M collective rows are not copied to be de-duplicated. None (the caller copies) when the
    group or call-site codes are not at hand or do not pack into one int64. The codes are read in place
    when every row is kept, and one int64 key array is the only row-sized temporary (at 1.7 M rows the
    old copies of the group, rank and site codes and two sorts were ~110 MB on top of the trace)."""
    if "gid" not in coll or not isinstance(coll["call_site"].dtype, pd.CategoricalDtype):
        return None
    pos = None if keep.all() else np.flatnonzero(keep)

    def kept(a: np.ndarray) -> np.ndarray:
        return a if pos is None else a[pos]

    gid, rank = kept(coll["gid"].to_numpy()), kept(coll["rank"].to_numpy())
    cs = kept(coll["call_site"].cat.codes.to_numpy())
    if not len(gid):
        return None
    r_lo = int(rank.min())
    n_r = int(rank.max()) - r_lo + 1
    n_c = len(coll["call_site"].cat.categories) + 1
    if (cs < 0).any() or float(int(gid.max()) + 1) * n_r * n_c >= 2.0 ** 62:
        return None
    gr = gid.astype(np.int64) * n_r
    gr += rank
    gr -= r_lo
    users = _firsts(gr)
    named = np.asarray([str(c) != "" for c in coll["call_site"].cat.categories], dtype=bool)[cs]
    if named.all():
        gr *= n_c
        gr += cs
        sites = _firsts(gr)
    else:
        nz = np.flatnonzero(named)
        sites = nz[_firsts(gr[nz] * n_c + cs[nz])]
    del gr
    return (users, sites) if pos is None else (pos[users], pos[sites])


def _firsts(keys: np.ndarray) -> np.ndarray:
    """Ascending positions of the first occurrence of each distinct key (`np.unique`'s return_index,
    sorted): through a table indexed by the key when the keys are small non-negative ints, else by
    np.unique (a sort of the keys and their order: three row-sized arrays)."""
    n = len(keys)
    if not n:
        return np.zeros(0, np.int64)
    lo, hi = int(keys.min()), int(keys.max())
    if lo >= 0 and hi < 4 * n + 4096:
        first = np.full(hi + 1, n, np.int64)
        np.minimum.at(first, keys, np.arange(n, dtype=np.int64))
        return np.sort(first[first < n])
    return np.sort(np.unique(keys, return_index=True)[1])


# --------------------------------------------------------------------------
# Same pg name, another description
# --------------------------------------------------------------------------
def _split_label(label: str) -> tuple[str, str] | None:
    """("mesh_tp", "3") from the loader's "mesh_tp:3" / "mesh_tp:3[0,1]" (vocab.GroupNamer); None for a
    label that is a bare name or a unique description (nothing to compare)."""
    base = _MEMBERS.sub("", str(label))
    if ":" not in base:
        return None
    desc, name = base.rsplit(":", 1)
    return (desc, name) if desc and name else None


def _by_desc(ix: TraceIndex, use: pd.DataFrame, full) -> list[Finding]:
    users = use.drop_duplicates(["process_group", "rank"])[["process_group", "rank"]]
    parts = {g: _split_label(g) for g in users["process_group"].unique()}
    parts = {g: p for g, p in parts.items() if p is not None}
    if not parts:
        return []
    u = users[users["process_group"].isin(list(parts))].copy()
    u["desc"] = u["process_group"].map(lambda g: parts[g][0])
    u["name"] = u["process_group"].map(lambda g: parts[g][1])
    n_desc = u.groupby("name")["desc"].nunique()
    u = u[u["name"].isin(n_desc[n_desc > 1].index)]
    if not len(u):
        return []
    u = u.join(u.groupby(["name", "desc"]).size().rename("n"), on=["name", "desc"])
    variants = u.drop_duplicates(["name", "desc"]).sort_values(["name", "n", "desc"], ascending=[True, False, True])
    ranked = variants.groupby("name", sort=False)[["desc", "n"]].apply(lambda v: list(zip(v["desc"], v["n"])))
    # per (name, rank): the best other description of that name and how many ranks use it
    other = [next((d, n) for d, n in ranked[name] if d != desc) for name, desc in zip(u["name"], u["desc"])]
    u["their_desc"] = [d for d, _ in other]
    u["other_n"] = [n for _, n in other]
    u["disputed"] = u["rank"].map(u.groupby("rank")["name"].nunique())
    culprits = []
    for r, mine in u.groupby("rank", sort=True):
        if (mine["n"] > mine["other_n"]).any():                   # it is the majority on one of them
            continue
        if not (mine["n"] < mine["other_n"]).all():               # a tie somewhere: the more disputed rank is it
            counter = u[u["name"].isin(mine["name"]) & (u["rank"] != r) & ~u.set_index(["name", "desc"]).index
                        .isin(list(zip(mine["name"], mine["desc"])))]
            if len(mine) < MIN_CROSSED or (counter["disputed"] >= len(mine)).any():
                continue
        culprits.append((int(r), mine))
    out = []
    for r, mine in culprits:
        crossed = []
        for row in mine.sort_values("name", key=lambda s: s.map(_name_key)).itertuples(index=False):
            theirs = u[(u["name"] == row.name) & (u["desc"] == row.their_desc)]
            crossed.append({"name": str(row.name), "mine": str(row.process_group), "my_desc": str(row.desc),
                            "theirs": str(theirs["process_group"].iloc[0]), "their_desc": str(row.their_desc),
                            "their_ranks": sorted(int(x) for x in theirs["rank"])})
        shown = [f"its group {c['name']} is {c['my_desc']}, that of {rank_label(ix.trace, c['their_ranks'])} "
                 f"{c['their_desc']}" for c in crossed]
        title = _title(ix, r, "the same group names describe other groups on it", shown)
        out.append(_finding(ix, full(), r, crossed, title, "desc"))
    return out


def _name_key(name: str) -> tuple[int, int | str]:
    return (0, int(name)) if str(name).isdigit() else (1, str(name))


# --------------------------------------------------------------------------
# Call sites crossed between groups
# --------------------------------------------------------------------------
def _by_call_site(ix: TraceIndex, use: pd.DataFrame, full) -> list[Finding]:
    u = use[use["call_site"].astype(str) != ""].drop_duplicates(["process_group", "rank", "call_site"])
    if not len(u):
        return []
    n_site = u.groupby(["process_group", "call_site"])["rank"].nunique().rename("n_site").reset_index()
    n_users = u.groupby("process_group")["rank"].nunique().rename("n_users")
    u = u.merge(n_site, on=["process_group", "call_site"]).merge(n_users, left_on="process_group", right_index=True)
    # crossed (group, rank): the group has other users, and none of them calls it from a site this rank uses
    # there (every site of the rank on the group has the rank as its only user)
    pr = u.groupby(["process_group", "rank"]).agg(mine=("n_site", "max"), n_users=("n_users", "first")).reset_index()
    pr["crossed"] = (pr["mine"] == 1) & (pr["n_users"] > 1)
    cand = pr[pr["crossed"]]
    if not len(cand):
        return []
    sites = u[u["rank"].isin(cand["rank"].unique())].groupby(["process_group", "rank"])["call_site"].agg(frozenset)
    pr = pr.merge(sites.rename("sites").reset_index(), on=["process_group", "rank"], how="left")
    # the site the other users call a crossed group from (their most used one, ties by name): one lookup per
    # crossed pair, of which a healthy trace has none
    top = n_site[n_site["process_group"].isin(pr.loc[pr["crossed"], "process_group"].unique())]
    top = top.sort_values(["n_site", "call_site"], ascending=[False, True], kind="stable")
    ranked = top.groupby("process_group", sort=False)["call_site"].agg(list).to_dict()
    pr["best_site"] = [next((x for x in ranked.get(g, []) if x not in mine), "") if crossed else ""
                       for g, mine, crossed in zip(pr["process_group"], pr["sites"].fillna(""), pr["crossed"])]
    cand = pr[pr["crossed"]]
    counts = cand.groupby("rank").size()
    out = []
    for r in sorted(int(x) for x in counts[counts >= MIN_CROSSED].index):
        c = cand[cand["rank"] == r]
        my_sites = frozenset().union(*c["sites"])
        their_sites = frozenset(c["best_site"])
        if my_sites != their_sites:                    # not a permutation of the same call sites
            continue
        own = pr[(pr["rank"] == r).to_numpy()]
        own = own[own["sites"].map(lambda s: bool(s & my_sites))]
        if not own["crossed"].all():                   # some calls from these sites go where the others' go
            continue
        crossed = []
        for row in c.sort_values("process_group", key=lambda s: s.map(_name_key)).itertuples(index=False):
            others = u[(u["process_group"] == row.process_group) & (u["call_site"] == row.best_site)
                       & (u["rank"] != r)]
            crossed.append({"name": str(row.process_group), "mine": str(row.process_group),
                            "my_sites": sorted(row.sites), "their_site": str(row.best_site),
                            "their_ranks": sorted(int(x) for x in others["rank"].unique())})
        shown = [f"its calls from {', '.join(cr['my_sites'])} go to {ix.label(cr['name'])}, which "
                 f"{rank_label(ix.trace, cr['their_ranks'])} call{'s' if len(cr['their_ranks']) == 1 else ''}"
                 f" from {cr['their_site']}" for cr in crossed]
        title = _title(ix, r, "its calls from each call site land on a group the others call from another site",
                       shown)
        out.append(_finding(ix, full(), r, crossed, title, "call_site"))
    return out


# --------------------------------------------------------------------------
def _title(ix: TraceIndex, r: int, how: str, shown: list[str]) -> str:
    """The headline both bases share: who, how the names crossed, the first MAX_SHOWN crossings."""
    more = f"; and {len(shown) - MAX_SHOWN} more" if len(shown) > MAX_SHOWN else ""
    return (f"{rank_label(ix.trace, [r])} created its process groups in a different order than the other ranks: "
            f"{how} ({'; '.join(shown[:MAX_SHOWN])}{more}), so its collectives on them pair the wrong processes")


def _finding(ix: TraceIndex, use: pd.DataFrame, r: int, crossed: list[dict], title: str, basis: str) -> Finding:
    ev: list[Evidence] = []
    for c in crossed[:12]:
        first = use[(use["rank"] == r) & (use["process_group"] == c["mine"])].sort_values("collective_seq_id").head(1)
        for row in first.itertuples(index=False):
            what = (f"its {c['name']} described as {c['my_desc']} (others: {c['their_desc']})" if basis == "desc"
                    else f"called from {', '.join(c['my_sites'])}; the other users call it from {c['their_site']}")
            ev.append(Evidence(rank=r, note=f"first call on {c['mine']}: {what}", op_name=str(row.op_name),
                               process_group=c["mine"], seq=int(row.collective_seq_id), op_id=int(row.op_id),
                               time_ns=int(row.start_ns)))
        theirs = use[(use["process_group"] == c["theirs" if basis == "desc" else "mine"])
                     & use["rank"].isin(c["their_ranks"])].sort_values(["collective_seq_id", "rank"])
        for row in theirs.drop_duplicates("rank").head(2).itertuples(index=False):
            ev.append(Evidence(rank=int(row.rank), note=f"uses {c['name']} as the other ranks do"
                               + (f" ({c['their_desc']})" if basis == "desc" else f" (from {c['their_site']})"),
                               op_name=str(row.op_name), process_group=str(row.process_group),
                               seq=int(row.collective_seq_id), op_id=int(row.op_id), time_ns=int(row.start_ns)))
    involved = sorted({r} | {x for c in crossed for x in c["their_ranks"]})
    names = [c["name"] for c in crossed]
    inst = InstanceRef(ev[0].process_group, ev[0].seq) if ev and ev[0].rank == r else None
    title += created_at(ix.trace, [r], crossed[0]["mine"])   # the user's new_group line, where recorded
    return Finding(kind="group_mismatch", severity="error", title=title, ranks=[r], evidence=ev,
                   instance=inst, involved=involved,
                   data={"attribute": "creation_order", "process_group": crossed[0]["mine"], "groups": names,
                         "crossed": [dict(c) for c in crossed[:16]]},
                   cause=Cause(basis=CauseBasis(basis), deviant_ranks=(r,), ambiguous=False), layout=ORDER_LAYOUT)


def in_group_creation(trace: Any, roots: list[Finding]) -> set[int]:
    """The ranks of `stuck_in_compute` roots whose last stack dump has them on a line that created a
    process group (any rank's rank.json `group_sites`, innermost frame): they are not computing but
    waiting inside group creation on the ranks that create the group with them, so a disagreement about
    the groups' creation is what holds them, even where the rank that disagrees is not among those the
    wait-for graph involves (seed 20261214 #82 and #317: rank 1 stuck in new_group, its peer waiting on
    it in the group's first collective, the rank that created its groups in another order elsewhere)."""
    stuck = [r for f in roots if f.kind == FindingKind.STUCK_IN_COMPUTE for r in f.ranks]
    if not stuck:
        return set()
    sites = {site.split(" < ")[0] for info in trace.ranks.values() for site in info.group_sites.values()}
    out = set()
    for r in stuck:
        frame, _ = user_frame(trace, int(r), -(1 << 62), 1 << 62, latest=True)
        if frame and frame.rsplit(" in ", 1)[0] in sites:
            out.add(int(r))
    return out
