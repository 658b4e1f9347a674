"""`wrong_group` from call sites (split out of groups.py): a rank's op on group h at a call site whose calls
go to groups of another kind everywhere else, in an instance of h its peers entered from a call site of h's
own kind. `group_checks.analyze_groups` runs it after `find_wrong_group`; the index supplies the collective rows,
kinds, membership and max-seq table.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ncclscope.findings import Cause, CauseBasis, Evidence, Finding, InstanceRef, WaitSummary, WrongCall
from ncclscope.index.views import IndexLike, TraceIndex, as_index
from ncclscope.index.labels import created_at, kind_of, rank_label
from ncclscope.hang.wording import duration, wait_seconds, wait_since


SITE_MIN_USES = 3            # calls from a site before its group kind counts as established
SITE_MAJORITY = 0.75         # share of a site's calls on its kind (a helper used for every kind has none)
# The JSON order of a wrong_group finding's `data` (its cause's claims among them), as earlier releases
# wrote it; this module's and groups' `find_wrong_group` share it (`partner_deaths` comes last when known).
WRONG_GROUP_LAYOUT = ("process_group", "seq", "wrong_group", "call_site", "step", "basis", "wrong_seq", "wrong_ns",
                      "partner_deaths")


def find_wrong_group_by_site(source: IndexLike, max_findings: int = 16) -> list[Finding]:
    """`wrong_group` from call sites: a rank's op on group h at a call site whose calls go to
    groups of another kind everywhere else, in an instance of h its peers entered from a call
    site of h's own kind.

    On gloo nothing hangs at the wrong call itself: h's peers pair it with their own (say the
    gradient all-reduce, same size) and the job deadlocks a few ops later on crossed sequence
    numbers. The dumps still hold the crossing: instance (h, j) holds calls from two sites, and
    one rank's site is the one every rank otherwise uses on the groups of kind K (say tp). That
    rank should have called it on its own group of kind K, g; the instance of g it never
    entered is the one its partners wait in.
    """
    ix = as_index(source)
    coll, kinds, members = ix.coll, ix.kinds, ix.members
    if not len(coll) or not _any_site_crossing(coll, kinds):
        return []
    c = coll[(coll["call_site"] != "").to_numpy()]
    if not len(c):
        return []
    names = {n: site_kind_of(str(n), kinds) for n in pd.unique(c["process_group"])}   # per name, not per row
    c = c.assign(kind=c["process_group"].map(names).astype(str))
    c = c[~c["kind"].isin(["world", "custom"]).to_numpy()]
    use = c.groupby(["call_site", "kind"], sort=False).size().rename("n").reset_index()
    tot = use.groupby("call_site")["n"].transform("sum")
    top = use[(use["n"] >= SITE_MIN_USES) & (use["n"] >= SITE_MAJORITY * tot)]
    site_kind = dict(zip(top["call_site"], top["kind"]))
    if len(site_kind) < 2:
        return []
    c = c.assign(site_kind=c["call_site"].astype("str").map(site_kind))
    odd = c[c["site_kind"].notna() & (c["site_kind"] != c["kind"])]
    findings: list[Finding] = []
    for r in odd.sort_values("start_ns").itertuples(index=False):
        peers = c[(c["process_group"] == r.process_group) & (c["collective_seq_id"] == r.collective_seq_id)
                  & (c["rank"] != r.rank)]
        if len(peers) and not (peers["site_kind"] == r.kind).all():
            continue                 # the peers did not use h's own call site there: no crossing
        own = [n for n in kinds if site_kind_of(n, kinds) == r.site_kind and int(r.rank) in members.get(n, [])]
        if len(own) != 1:
            continue
        g = own[0]
        ms = ix.max_seq
        mine = ms[(ms["process_group"] == g) & (ms["rank"] == r.rank)]["max_seq"]
        k = int(mine.iloc[0]) + 1 if len(mine) else 1
        waiting = _waiting(coll, g, k, int(r.rank))
        # no peer paired the call (its partner had gone on past that call site on its own group: seed 20261214
        # #327), so nothing crossed; it still went to the wrong group where the rank waits in it alone and
        # members of its own group of the site's kind wait in the very instance it never entered
        if not len(peers) and (str(r.status) == "ok" or not len(waiting)):
            continue
        findings.append(_site_finding(ix, r, g, k, peers, waiting))
        if len(findings) >= max_findings:
            break
    return findings


def site_kind_of(name: str, kinds: dict[str, str]) -> str:
    """The kind of group a call site's calls are told apart by: the group's kind, or, for a Flight Recorder
    group labelled by its DeviceMesh dimension ("mesh_fsdp:4"), that dimension. Two dimensions the schema
    files under one kind (fsdp and dp are both "dp") are two kinds of group to a call site: a line that
    all-reduces on the dp group every step does not go to the fsdp group (seed 20261214 #327)."""
    kind = kind_of(name, kinds)
    if name.startswith("mesh_") and kind not in ("world", "custom"):
        return name.split(":", 1)[0]
    return kind


def _waiting(coll: pd.DataFrame, g: str, k: int, rank: int) -> pd.DataFrame:
    """The other members' unfinished records of instance #k of group g, by rank."""
    return coll[(coll["process_group"] == g) & (coll["collective_seq_id"] == k) & (coll["rank"] != rank)
                & (coll["status"].astype(str) != "ok")].sort_values("rank")


def _any_site_crossing(coll: pd.DataFrame, kinds: dict[str, str]) -> bool:
    """Whether some call on a named group comes from a call site whose calls go to groups of another kind
    (the `odd` rows of find_wrong_group_by_site), decided on integer codes: without such a row there is
    nothing to look at, and the 2 M collective rows of a big healthy run are never copied."""
    gid = coll["gid"].to_numpy() if "gid" in coll else pd.factorize(coll["process_group"])[0]
    site = coll["call_site"]
    sc, sites = pd.factorize(site)
    empty = np.flatnonzero(np.asarray([str(x) == "" for x in sites]))
    keep = sc >= 0
    if len(empty):
        keep &= ~np.isin(sc, empty)
    if not keep.any():
        return False
    u, first = np.unique(gid, return_index=True)
    names = coll["process_group"].iloc[first].tolist()
    kind_names = [site_kind_of(str(n), kinds) for n in names]
    kcodes, klist = pd.factorize(pd.Series(kind_names, dtype=object))
    per_gid = np.full(int(u.max()) + 1 if len(u) else 1, -1, dtype=np.int64)
    per_gid[u] = kcodes
    skip = np.asarray([k in ("world", "custom") for k in klist] + [True])
    row_kind = per_gid[gid]
    keep &= ~skip[row_kind]
    if not keep.any():
        return False
    n_k = len(klist)
    pair = sc[keep].astype(np.int64) * n_k + row_kind[keep]
    n = np.bincount(pair, minlength=len(sites) * n_k).reshape(len(sites), n_k)
    tot = n.sum(axis=1, keepdims=True)
    top = (n >= SITE_MIN_USES) & (n >= SITE_MAJORITY * tot)
    if int(top.any(axis=1).sum()) < 2:
        return False
    site_kind = np.where(top.any(axis=1), top.argmax(axis=1), -1)
    sk = site_kind[sc[keep]]
    return bool(((sk >= 0) & (sk != row_kind[keep])).any())


def _site_finding(ix: TraceIndex, r, g: str, k: int, peers: pd.DataFrame, waiting: pd.DataFrame) -> Finding:
    trace = ix.trace
    h, b, site = str(r.process_group), int(r.rank), str(r.call_site)
    peer_sites = ", ".join(sorted(set(peers["call_site"].astype(str))))
    entered = f"which its peers entered from {peer_sites}" if len(peers) else "which no other member entered"
    title = (f"{rank_label(trace, [b])} called {r.op_name} on {ix.label(h)} instead of {ix.label(g)} at {site} "
             f"(#{int(r.collective_seq_id)} on {h}, {entered}; every other "
             f"call from {site} is on a group like {g})" + created_at(trace, [b], h))
    since = wait_since(ix.end_ns, waiting["start_ns"])
    if len(waiting):
        title += (f"; {rank_label(trace, waiting['rank'])} waiting in {waiting['op_name'].iloc[0]} #{k} on {g}"
                  + (f" since {duration(since)}" if duration(since) else ""))
    ev = [Evidence(rank=b, note=f"called it from {site} on {h} (#{int(r.collective_seq_id)}); that call site "
                                f"goes to groups like {g} everywhere else", op_name=str(r.op_name),
                   process_group=h, seq=int(r.collective_seq_id), op_id=int(r.op_id), time_ns=int(r.start_ns))]
    ev += [Evidence(rank=int(p.rank), note=f"entered {h} #{int(p.collective_seq_id)} from {p.call_site}",
                    op_name=str(p.op_name), process_group=h, seq=int(p.collective_seq_id), op_id=int(p.op_id),
                    time_ns=int(p.start_ns)) for p in peers.head(8).itertuples(index=False)]
    ev += [Evidence(rank=int(w.rank), note=f"in {g} #{k}: {w.status}, waiting for rank {b}", op_name=str(w.op_name),
                    process_group=g, seq=k, op_id=int(w.op_id), time_ns=int(w.start_ns))
           for w in waiting.head(8).itertuples(index=False)]
    wait_s = wait_seconds(ix.end_ns, waiting["start_ns"].min()) if len(waiting) else None
    return Finding(kind="wrong_group", severity="error", title=title, ranks=[b], evidence=ev,
                   instance=InstanceRef(g, k),
                   wait=WaitSummary(waiting_ranks=tuple(int(x) for x in waiting["rank"]), wait_s=wait_s),
                   data={"process_group": g, "seq": k, "call_site": site, "step": int(r.step)},
                   cause=Cause(basis=CauseBasis.CALL_SITE, wrong=WrongCall(h, int(r.collective_seq_id), int(r.start_ns))),
                   layout=WRONG_GROUP_LAYOUT)

