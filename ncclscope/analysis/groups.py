"""Process-group checks, plus the small helpers every hang analysis shares.

Why this module exists: a hang often starts before the first collective, in
the group table. If rank 3 built dp0 as [0,1,3] while everyone else built
[0,1,2], every later dp0 collective pairs the wrong processes; if one rank
created groups in a different order, NCCL/gloo communicators are cross-wired.
And a rank that calls `all_reduce(group=world)` where its peers call
`all_reduce(group=dp0)` from the same line of code waits forever in a group
nobody else entered. These are cheap to detect from the recorded data:

- `check_group_views`   `group_mismatch`: ranks' views of a group's members or
                        creation order disagree (majority vote names the odd ones).
- `check_orthogonality` `group_mismatch`: groups of one kind overlap (error) or
                        do not cover the world (warning): the mesh is not a set
                        of orthogonal slices.
- `find_wrong_group`    `wrong_group`: a rank missing from a collective instance
                        called the same op from the same call site and step on
                        another group instead.

The shared helpers (membership table, majority vote, labels for titles) live
here because every other analysis module depends on groups anyway.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from ..findings import Evidence, Finding

if TYPE_CHECKING:
    from ..trace import Trace

NS = 1_000_000_000
COORD_ORDER = ("pp", "dp", "cp", "tp", "ep")
NOT_ORTHOGONAL_KINDS = ("custom", "world")  # kinds that need not partition the world


# --------------------------------------------------------------------------
# Shared helpers
# --------------------------------------------------------------------------
def fmt_ranks(ranks: Iterable[int], limit: int = 12) -> str:
    """0,1,2,3,5 -> "0-3,5"; long lists are cut with a count."""
    rs = sorted({int(r) for r in ranks})
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts.append(f"{rs[i]}-{rs[j]}" if j - i >= 2 else ",".join(str(r) for r in rs[i:j + 1]))
        i = j + 1
    text = ",".join(parts)
    if len(parts) > limit:
        text = ",".join(parts[:limit]) + f",... ({len(rs)} ranks)"
    return text


def group_label(name: str, members: Iterable[int] | None) -> str:
    """"dp1[1,3,5,7]": the group's name with its member list (strided lists as "5,13,...,253")."""
    if members is None:
        return str(name)
    rs = sorted({int(r) for r in members})
    if len(rs) > 6:
        steps = np.diff(rs)
        if len(set(steps.tolist())) == 1 and steps[0] > 1:
            return f"{name}[{rs[0]},{rs[1]},...,{rs[-1]}]"
    return f"{name}[{fmt_ranks(rs, limit=8)}]"


def varying_coords(trace: Trace) -> list[str]:
    """Coordinate names whose value differs between ranks (the degrees above 1)."""
    seen: dict[str, set[int]] = {}
    for info in trace.ranks.values():
        for k, v in info.coords.items():
            seen.setdefault(k, set()).add(v)
    keys = [k for k, vals in seen.items() if len(vals) > 1]
    return sorted(keys, key=lambda k: (COORD_ORDER.index(k) if k in COORD_ORDER else len(COORD_ORDER), k))


def rank_label(trace: Trace, ranks: Iterable[int]) -> str:
    """"rank 5 (pp 1, dp 1)" or "ranks 2,3 (pp 1,2)": ranks with their mesh coordinates."""
    rs = sorted({int(r) for r in ranks})
    if not rs:
        return "no rank"
    keys = varying_coords(trace)
    coords = []
    if len(rs) <= 8:
        for k in keys:
            vals = [trace.ranks[r].coords.get(k) for r in rs if r in trace.ranks]
            vals = [v for v in vals if v is not None]
            if len(vals) != len(rs):
                continue
            coords.append(f"{k} {vals[0]}" if len(set(vals)) == 1 else f"{k} {','.join(map(str, vals))}")
    head = f"rank {rs[0]}" if len(rs) == 1 else f"ranks {fmt_ranks(rs)}"
    return head + (f" ({', '.join(coords)})" if coords else "")


def seconds(ns: float) -> str:
    return f"{ns / NS:.1f} s"


def trace_start_ns(trace: Trace) -> int:
    ev = trace.events
    return int(ev["t_ns"].min()) if len(ev) else 0


def view_keys(ranks: pd.Series) -> np.ndarray:
    """Each recorded member list as one "0,1,2" string.

    1,024 ranks each recording every group of the world are 1.4 million lists
    (10 million ints). The loader shares one list object per distinct view
    (trace.py parses each distinct groups.json view once), so the lists are
    deduplicated by identity first and only the distinct ones are joined,
    through Arrow; readers that do not share objects still get the Arrow join
    over all rows.
    """
    if not len(ranks):
        return np.array([], dtype=object)
    vals = ranks.to_numpy(dtype=object) if hasattr(ranks, "to_numpy") else np.asarray(ranks, dtype=object)
    ids = np.fromiter(map(id, vals), dtype=np.int64, count=len(vals))
    _, first, inverse = np.unique(ids, return_index=True, return_inverse=True)
    uniq = vals[first]
    try:
        arr = pa.array([list(r) if r is not None else [] for r in uniq], type=pa.list_(pa.int64()))
        texts = pc.binary_join(arr.cast(pa.list_(pa.string())), ",").to_numpy(zero_copy_only=False)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError, ValueError):
        texts = [",".join(str(int(x)) for x in r) for r in uniq]
    return np.asarray(texts, dtype=object)[inverse.reshape(-1)]


def _parse_key(key: str) -> list[int]:
    return [int(x) for x in key.split(",")] if key else []


def majority_members(views: pd.DataFrame) -> dict[str, list[int]]:
    """Group name -> the member list most ranks recorded (same answer as Trace.group_members, vectorised)."""
    if not len(views):
        return {}
    cnt = views.groupby(["process_group", "members"], sort=False).size().rename("n").reset_index()
    cnt = cnt.sort_values(["process_group", "n"], ascending=[True, False], kind="stable")
    top = cnt.drop_duplicates("process_group")
    return {str(g): sorted(_parse_key(str(k))) for g, k in zip(top["process_group"], top["members"])}


def membership(trace: Trace, coll: pd.DataFrame | None = None,
               views: pd.DataFrame | None = None) -> dict[str, list[int]]:
    """Group name -> members: the majority view, else the ranks seen using the group."""
    members = majority_members(group_views(trace) if views is None else views)
    if coll is not None and len(coll):
        known = coll["process_group"].isin(list(members)).to_numpy()
        unknown = coll.loc[~known, ["process_group", "rank"]].drop_duplicates()
        for name, ranks in unknown.groupby("process_group", sort=False)["rank"]:
            if str(name):
                members[str(name)] = sorted(int(r) for r in ranks)
    return members


def group_kinds(trace: Trace) -> dict[str, str]:
    """Group name -> kind (tp, dp, ...): the recorded kind most ranks agree on, else the name's prefix."""
    g = trace.groups
    cached = _KINDS_CACHE.get(id(g))
    if cached is not None and cached[0]() is g:
        return dict(cached[1])
    out: dict[str, str] = {}
    if len(g):
        cnt = g.groupby(["process_group", "group_kind"], sort=False).size().rename("n").reset_index()
        top = cnt.sort_values("n", ascending=False, kind="stable").drop_duplicates("process_group")
        out = {str(k): str(v) for k, v in zip(top["process_group"], top["group_kind"])}
    _KINDS_CACHE.clear()                 # one trace at a time: keep the last answer only
    try:
        _KINDS_CACHE[id(g)] = (weakref.ref(g), out)
    except TypeError:
        pass
    return dict(out)


# The analyses of one diagnosis ask for the kinds of a 1.4-million-row group table several times;
# remember the last answer (weakly: the cache never keeps a trace's table alive).
_KINDS_CACHE: dict[int, tuple[weakref.ref, dict[str, str]]] = {}


def kind_of(name: str, kinds: dict[str, str]) -> str:
    return kinds.get(name) or name.rstrip("0123456789") or name


def member_table(members: dict[str, list[int]]) -> pd.DataFrame:
    """Long form of `membership`: columns process_group (str), member (int64), n_members."""
    names = [n for n, rs in members.items() for _ in rs]
    ranks = [int(r) for rs in members.values() for r in rs]
    sizes = [len(rs) for rs in members.values() for _ in rs]
    return pd.DataFrame({"process_group": pd.Series(names, dtype="str"),
                         "member": np.asarray(ranks, dtype=np.int64),
                         "n_members": np.asarray(sizes, dtype=np.int64)})


def majority_vote(df: pd.DataFrame, keys: list[str], value: str, rank: str = "rank") -> pd.DataFrame:
    """Rows of `df` whose `value` differs from the most common value within their `keys`.

    Vectorised over all key groups at once. Returned columns: the input's plus
    `majority` (the winning value), `n_voters`, `n_majority`, `tie` (the top
    count is shared; the winner is then the value whose lowest rank is
    highest, so the lowest rank lands among the deviants and is named as an
    ambiguous guess rather than silently blamed).
    """
    if not len(df):
        return df.assign(majority=pd.Series(dtype=object), n_voters=0, n_majority=0, tie=False).iloc[0:0]
    cnt = (df.groupby(keys + [value], observed=True, sort=False, dropna=False)[rank]
             .agg(n="size", low="min").reset_index())
    nvals = cnt.groupby(keys, observed=True, sort=False)[value].transform("size")
    cnt = cnt[nvals > 1]
    if not len(cnt):
        return df.assign(majority=pd.Series(dtype=object), n_voters=0, n_majority=0, tie=False).iloc[0:0]
    cnt = cnt.sort_values(keys + ["n", "low"], ascending=[True] * len(keys) + [False, False], kind="stable")
    first = ~cnt.duplicated(keys, keep="first")
    top = cnt[first].rename(columns={value: "majority", "n": "n_majority"})
    rest = cnt[~first]
    second = rest[~rest.duplicated(keys, keep="first")][keys + ["n"]].rename(columns={"n": "n_second"})
    voters = cnt.groupby(keys, observed=True, sort=False)["n"].sum().rename("n_voters").reset_index()
    top = top.merge(second, on=keys, how="left").merge(voters, on=keys, how="left")
    top["tie"] = top["n_second"] == top["n_majority"]
    top = top[keys + ["majority", "n_majority", "n_voters", "tie"]]
    out = df.merge(top, on=keys, how="inner")
    return out[out[value].to_numpy() != out["majority"].to_numpy()].reset_index(drop=True)


# --------------------------------------------------------------------------
# Group checks
# --------------------------------------------------------------------------
@dataclass
class GroupReport:
    findings: list[Finding] = field(default_factory=list)
    view_deviations: pd.DataFrame = field(default_factory=pd.DataFrame)


def group_views(trace: Trace) -> pd.DataFrame:
    """trace.groups with each member list as one comparable string (`members`)."""
    g = trace.groups
    if not len(g):
        return pd.DataFrame(columns=["rank", "process_group", "group_kind", "members", "creation_order"])
    # Categoricals: 1.4 million rows of a few thousand distinct names and member lists.
    return pd.DataFrame({
        "rank": g["rank"].astype("int64").to_numpy(),
        "process_group": _as_categorical(g["process_group"]),
        "group_kind": _as_categorical(g["group_kind"]),
        "members": _as_categorical(pd.Series(view_keys(g["ranks"]), dtype=object)),
        "creation_order": g["creation_order"].astype("int64").to_numpy(),
    })


def _as_categorical(s: pd.Series) -> pd.Categorical:
    codes, uniq = pd.factorize(s)
    names = pd.Index([str(u) for u in uniq], dtype=object)
    if (codes < 0).any():
        names = names.append(pd.Index([""], dtype=object)) if "" not in names else names
        codes = np.where(codes < 0, names.get_loc(""), codes)
    return pd.Categorical.from_codes(codes, categories=names)


def check_group_views(trace: Trace, views: pd.DataFrame | None = None,
                      max_findings: int = 16) -> tuple[list[Finding], pd.DataFrame]:
    """`group_mismatch` where ranks disagree on a group's members or creation order.

    Ranks whose disagreements cover the same groups share one finding (a rank
    that built the whole mesh in another order is one problem, not 12).
    """
    views = group_views(trace) if views is None else views
    findings: list[Finding] = []
    frames = []
    for attr in ("members", "creation_order"):
        dev = majority_vote(views, ["process_group"], attr)
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
    ev = [Evidence(rank=int(r), note=f"view of {g} {what}: {shown(v)} (majority {shown(m)})", process_group=str(g))
          for r, g, v, m in sub.sort_values(["rank", "process_group"])[["rank", "process_group", attr, "majority"]]
          .head(24).itertuples(index=False)]
    return Finding(kind="group_mismatch", severity="error", title=title, ranks=odd[:1] if tie else odd,
                   evidence=ev, data={"process_group": names[0], "groups": names, "attribute": attr,
                                      "majority": str(first["majority"].iloc[0]), "ambiguous": tie,
                                      "deviant_ranks": odd})


def check_orthogonality(trace: Trace, views: pd.DataFrame | None = None,
                        members: dict[str, list[int]] | None = None) -> list[Finding]:
    """Groups of one kind must be disjoint slices that together cover the world."""
    views = group_views(trace) if views is None else views
    if not len(views):
        return []
    members = majority_members(views) if members is None else members
    kinds = group_kinds(trace)
    rows = [(str(kinds.get(n, "custom")), n, int(r)) for n, rs in members.items() for r in rs]
    long = pd.DataFrame(rows, columns=["kind", "process_group", "rank"])
    long = long[~long["kind"].isin(NOT_ORTHOGONAL_KINDS)]
    findings: list[Finding] = []
    world = set(range(trace.world_size))
    count = long.groupby(["kind", "rank"])["process_group"].nunique()
    overl = count[count > 1].reset_index()
    for kind, sub in overl.groupby("kind", sort=True):
        ranks = sorted(int(r) for r in sub["rank"])
        gs = long[(long["kind"] == kind) & long["rank"].isin(ranks)]["process_group"].unique()
        labels = ", ".join(group_label(str(g), members[str(g)]) for g in sorted(gs)[:4])
        ev = [Evidence(rank=r, note=f"member of more than one {kind} group", process_group=str(gs[0]))
              for r in ranks[:16]]
        findings.append(Finding(
            kind="group_mismatch", severity="error",
            title=f"{rank_label(trace, ranks)} belong{'s' if len(ranks) == 1 else ''} to more than one "
                  f"{kind} group ({labels}): {kind} groups must be disjoint slices of the mesh",
            ranks=ranks, evidence=ev, data={"group_kind": str(kind), "check": "overlap"}))
    for kind, sub in long.groupby("kind", sort=True):
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


# --------------------------------------------------------------------------
# Wrong group
# --------------------------------------------------------------------------
def _match_key(df: pd.DataFrame) -> pd.Series:
    """How two ranks' ops correspond: the call site, or the shapes when no call site was recorded."""
    cs = df["call_site"].astype(str)
    return cs.where(cs != "", "sizes:" + df["input_sizes"].astype(str))


def find_wrong_group(trace: Trace, coll: pd.DataFrame, missing: pd.DataFrame,
                     members: dict[str, list[int]], max_findings: int = 16) -> list[Finding]:
    """`wrong_group`: who skipped instance (g, k) because it called the same op elsewhere.

    For each missing participant b of an unfinished instance (g, k) (from
    `collectives.missing_participants`), take the op the others issued there
    (op name, call site, step). If b, after its last op on g, issued that same
    op from the same call site and step on another group h that none of the
    ranks in (g, k) used there, b used the wrong group: h instead of g.
    """
    if not len(missing) or not len(coll):
        return []
    miss = missing.head(max_findings * 8)[["process_group", "seq", "rank", "n_began", "n_members"]]
    inst = coll.merge(miss[["process_group", "seq"]].drop_duplicates(),
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
    kinds = group_kinds(trace)
    kind = lambda s: s.map(lambda n: kind_of(str(n), kinds))  # noqa: E731  (few distinct names)
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
    # The group b chose must be less supported than the one it skipped: in the case above 2 of 3
    # dp0 members entered dp0 #3 but only b entered its world instance, never the other way round.
    if len(c):
        # Support for h's instance: members that issued the same call there (a member that is in
        # (h, seq) from another call site was doing its own thing, not joining b).
        cand_inst = c[["wrong_group", "wrong_seq", "key"]].drop_duplicates()
        h_rows = coll.merge(cand_inst[["wrong_group", "wrong_seq"]].drop_duplicates(),
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
            & (c["ref_call_site"].map(site_kind) == g_kind) & (c["wrong_kind"] != g_kind)
        c = c[(h_frac < g_frac) | tie_ok]
    c = c.sort_values("start_ns").drop_duplicates(["process_group", "seq", "rank"])
    findings = []
    end = trace.end_ns
    for (g, k), sub in c.groupby(["process_group", "seq"], sort=True):
        findings.append(_wrong_group_finding(trace, str(g), int(k), sub, inst, members, end))
        if len(findings) >= max_findings:
            break
    return findings


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


def _wrong_group_finding(trace: Trace, g: str, k: int, sub: pd.DataFrame, inst: pd.DataFrame,
                         members: dict[str, list[int]], end_ns: int) -> Finding:
    deviants = sorted(int(r) for r in sub["rank"])
    row = sub.iloc[0]
    h = str(row["wrong_group"])
    began = inst[(inst["process_group"] == g) & (inst["seq"] == k)].sort_values("rank")
    waiting = began[began["status"].astype(str) != "ok"]
    site = str(row["ref_call_site"]) or "the same call site"
    step = int(row["step"])
    title = (f"{rank_label(trace, deviants)} called {row['op_name']} on {group_label(h, members.get(h))} "
             f"instead of {group_label(g, members.get(g))} (#{k}) at {site}"
             + (f" (step {step})" if step >= 0 else ""))
    if len(waiting):
        title += (f"; {rank_label(trace, waiting['rank'])} waiting in {row['op_name']} #{k} on {g} "
                  f"since {seconds(end_ns - int(waiting['start_ns'].min()))}")
    ev = [Evidence(rank=int(r.rank), note=f"called it on {h} (#{int(r.wrong_seq)}) instead of {g}; "
                                           f"status {r.status}", op_name=str(r.op_name), process_group=h,
                   seq=int(r.wrong_seq), op_id=int(r.op_id), time_ns=int(r.start_ns))
          for r in sub.itertuples(index=False)]
    ev += [Evidence(rank=int(r.rank), note=f"in {g} #{k}: {r.status}"
                    + (f", waiting since {seconds(end_ns - int(r.start_ns))}" if str(r.status) != "ok" else ""),
                    op_name=str(r.op_name), process_group=g, seq=k, op_id=int(r.op_id), time_ns=int(r.start_ns))
           for r in began.head(16).itertuples(index=False)]
    return Finding(kind="wrong_group", severity="error", title=title, ranks=deviants, evidence=ev,
                   data={"process_group": g, "seq": k, "instance": [g, k], "wrong_group": h,
                         "call_site": str(row["ref_call_site"]), "step": step,
                         "waiting_ranks": [int(r) for r in waiting["rank"]]})


def analyze_groups(trace: Trace, coll: pd.DataFrame | None = None, missing: pd.DataFrame | None = None,
                   members: dict[str, list[int]] | None = None, views: pd.DataFrame | None = None) -> GroupReport:
    """All group checks. `coll`/`missing`/`members`/`views` may be passed to reuse work (see diagnose)."""
    from . import collectives  # local import: collectives imports this module

    if coll is None:
        coll = collectives.collective_ops(trace.ops)
    if views is None:
        views = group_views(trace)
    if members is None:
        members = membership(trace, coll, views)
    if missing is None:
        missing = collectives.missing_participants(coll, members)
    view_findings, table = check_group_views(trace, views)
    findings = view_findings + check_orthogonality(trace, views, majority_members(views))
    findings += find_wrong_group(trace, coll, missing, members)
    return GroupReport(findings=findings, view_deviations=table)
