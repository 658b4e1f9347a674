"""Labels and small shared helpers of the hang analyses: the leaf every other module imports.

Nothing here knows about findings, groups' checks or the index: how ranks,
groups and durations are written in titles (`rank_label`, `group_label`,
`fmt_ranks`, `seconds`), the vectorised majority vote every deviation check
uses, plain-string decoding of the loader's categorical columns, and
`sorted_categorical` (a column as a categorical of its values, in sorted order).
Keeping them in one leaf module is what lets collectives, groups, p2p and the
wait-for graph import each other's ideas without an import cycle.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable

import numpy as np
import pandas as pd
import pyarrow as pa

if TYPE_CHECKING:
    from ncclscope.load.trace import Trace

from ncclscope.ranklists import fmt_ranks  # noqa: F401 (re-exported: every hang module words ranks with it)

NS = 1_000_000_000
COORD_ORDER = ("pp", "dp", "cp", "tp", "ep")


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
    coords = []
    if len(rs) <= 8:
        for k in varying_coords(trace):
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
    return trace.start_ns



def kind_of(name: str, kinds: dict[str, str]) -> str:
    return kinds.get(name) or name.rstrip("0123456789") or name


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



def plain_str(s: pd.Series) -> pd.Series:
    """A string column as plain strings ("" for nulls).

    Categoricals are decoded through Arrow's dictionary cast: ~10x faster than
    pandas' own decode on millions of rows.
    """
    if isinstance(s.dtype, pd.CategoricalDtype):
        codes = s.cat.codes.to_numpy()
        cats = pa.array([str(c) for c in s.cat.categories], type=pa.string())
        arr = pa.DictionaryArray.from_arrays(pa.array(codes, mask=codes < 0), cats).cast(pa.string())
        return pd.Series(arr.fill_null(""), index=s.index, dtype="str")
    return s.astype("str").fillna("")


def take_str(s: pd.Series, mask: np.ndarray) -> np.ndarray:
    """The few rows of a (possibly Arrow-backed) string column under a boolean mask, as a numpy array:
    select first, convert after (converting a 2-million-row column to pick 100 names costs 0.2 s)."""
    return s.iloc[np.flatnonzero(mask)].to_numpy()


def sorted_categorical(s: pd.Series) -> pd.Categorical:
    """A string column as a categorical of its values ("" for nulls) whose categories are the values present,
    in sorted order: sorting and grouping by it order rows as by the plain strings, comparing it with a
    string compares values. Built from the codes of a categorical input: nothing is decoded per row."""
    if isinstance(s.dtype, pd.CategoricalDtype):
        codes, cats = s.cat.codes.to_numpy(), s.cat.categories
    else:
        codes, cats = pd.factorize(s.astype("str"))
    names = np.asarray([str(c) for c in cats] + [""], dtype=object)     # code -1 (null) -> ""
    codes = np.where(codes < 0, len(names) - 1, codes)
    used = np.flatnonzero(np.bincount(codes, minlength=len(names))) if len(codes) else np.zeros(0, dtype=np.int64)
    vals = names[used]
    uniq, inv = np.unique(vals.astype(str), return_inverse=True) if len(vals) else (np.zeros(0, dtype=str),
                                                                                    np.zeros(0, dtype=np.int64))
    remap = np.full(len(names), -1, dtype=np.int64)
    remap[used] = inv.reshape(-1)
    small = np.int8 if len(uniq) < 127 else np.int16 if len(uniq) < 32_000 else np.int32
    return pd.Categorical.from_codes(remap[codes].astype(small),
                                     categories=pd.Index([str(u) for u in uniq], dtype="str"))



def created_at(trace: Any, ranks: Any, group: str) -> str:
    """"; rank R created G at SITE" from the first of `ranks` whose rank.json says where it created the
    group (the user's new_group / init_device_mesh line), "" when none does."""
    for r in ranks:
        info = trace.ranks.get(int(r))
        site = info.group_sites.get(group, "") if info is not None else ""
        if site:
            return f"; rank {int(r)} created {group} at {site}"
    return ""
