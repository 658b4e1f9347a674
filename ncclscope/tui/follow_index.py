"""The index of a followed run, extended from the last poll's instead of rebuilt (`--follow`).

`index/views.py`'s `TraceIndex` computes each view from the whole trace on
first use. A poll changes few ops (`follow_ops.LiveOps.changed`: the new ones
and the ones an end row just closed), so the views that are per-op rows or
mergeable aggregates are computed on those ops only and merged into the last
poll's values, then handed to the new trace's index (`index.seed_index`):

- `coll`, `p2p` (per-op rows): the last rows minus the changed ops', plus the
  view of the changed ops, in ops order (by op uid); `coll`'s `gid` (group code
  by first appearance) is renumbered over the merged rows; a categorical column
  gets the categories a view of all the rows has (codes remapped, `_align`: the
  ops' categories, as p2p's, or the values present, sorted, as coll's);
- `instances` (per (group, seq)): the instances the changed collectives belong
  to are recomputed from their rows; the others are kept; order (group code, seq);
- `max_seq` (per (group, rank)): the max of the last value and the changed rows',
  in order of first appearance;
- `step_windows` (per (rank, step)): the windows the changed ops fall in are
  recomputed from their ops; the others are kept.

Each view is evaluated by the index's own `cached_property` on a stand-in
trace holding only the changed ops (so a change to a view's body applies here
too); only the merge is this module's. Everything else (groups and members,
`missing`, `p2p_pairs`, `end` (blocking ops, rank states), the wait-for graph,
the analyses themselves) is not cheaply mergeable and is recomputed on first
use, as for any trace. A full build (every view from the whole ops) is done
on the first poll, after a rank's file was recreated, after a clock offset
changed, when ops are not in start order (`build_ops` then sorts), and when a
category disappeared.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from ncclscope.index.views import TraceIndex

MERGED = ("coll", "p2p", "step_windows", "instances", "max_seq")


class _OpsOnly:
    """The stand-in trace a view is evaluated on: only `ops` is read by the merged views."""

    def __init__(self, ops: pd.DataFrame) -> None:
        self.ops, self.events, self.groups, self.group_views, self.world_size = ops, None, None, None, 0


class _Fallback(Exception):
    """The last poll's view cannot be extended: build it whole."""


def _view(name: str, ops: pd.DataFrame | None = None, **seeded: Any) -> Any:
    stand_in = _OpsOnly(ops if ops is not None else pd.DataFrame({"op_id": np.empty(0, np.int64)}))
    ix = TraceIndex(stand_in)
    ix.__dict__.update(seeded)
    return getattr(ix, name)


def _rows(name: str, ops: pd.DataFrame, uid: np.ndarray) -> tuple[pd.DataFrame, np.ndarray]:
    """(view of these ops, the uid of each row): op_id is swapped for the row number while the view is made."""
    tagged = ops.assign(op_id=np.arange(len(ops), dtype=np.int64))
    out = _view(name, tagged)
    at = out["op_id"].to_numpy()
    out["op_id"] = ops["op_id"].to_numpy()[at]
    return out, uid[at]


def _in_sorted(a: np.ndarray, sorted_b: np.ndarray) -> np.ndarray:
    if not len(sorted_b) or not len(a):
        return np.zeros(len(a), dtype=bool)
    p = np.minimum(np.searchsorted(sorted_b, a), len(sorted_b) - 1)
    return sorted_b[p] == a


@dataclass
class IndexState:
    """The merged views of one poll, and what the next poll needs to extend them."""

    views: dict[str, Any]
    coll_uid: np.ndarray
    p2p_uid: np.ndarray
    ms_first: np.ndarray                    # the uid of the first collective of each max_seq row
    reg: dict[str, int] = field(default_factory=dict)   # group name -> a code that never changes
    inst_reg: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))   # its code per instances row
    ms_reg: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))     # ... per max_seq row
    full: bool = True                       # built whole (not merged) ...
    reason: str = ""                        # ... and why
    timings: dict[str, float] = field(default_factory=dict)


def full_state(ops: pd.DataFrame, uid: np.ndarray) -> IndexState:
    coll, coll_uid = _rows("coll", ops, uid)
    p2p, p2p_uid = _rows("p2p", ops, uid)
    inst = _view("instances", coll=coll)
    ms = _view("max_seq", coll=coll)
    ms_first = _first_uid(coll, coll_uid, ms)
    views = {"coll": coll, "p2p": p2p, "step_windows": _view("step_windows", ops), "instances": inst, "max_seq": ms}
    reg: dict[str, int] = {}
    return IndexState(views, coll_uid, p2p_uid, ms_first, reg=reg, inst_reg=_name_codes(inst["process_group"], reg),
                      ms_reg=_name_codes(ms["process_group"], reg), full=True)


def extend(prev: IndexState | None, ops: pd.DataFrame, uid: np.ndarray, changed: np.ndarray,
           mergeable: bool) -> IndexState:
    """This poll's views: `prev` extended by the `changed` ops (uids, sorted), or built whole."""
    if prev is None or not mergeable:
        state = full_state(ops, uid)
        state.reason = "first poll" if prev is None else "recreated file, clock offset or op order"
        return state
    try:
        return _extend(prev, ops, uid, changed)
    except _Fallback as exc:
        state = full_state(ops, uid)
        state.reason = f"categories of {exc}"
        return state


def _extend(prev: IndexState, ops: pd.DataFrame, uid: np.ndarray, changed: np.ndarray) -> IndexState:
    at = np.searchsorted(uid, changed)
    delta = ops.iloc[at]
    dcoll, dcoll_uid = _rows("coll", delta, changed)
    coll, coll_uid = _merge_rows(prev.views["coll"], prev.coll_uid, dcoll, dcoll_uid, changed, ops)
    if "gid" in coll and len(coll):
        pg = ops["process_group"]
        codes = pg.cat.codes.to_numpy() if isinstance(pg.dtype, pd.CategoricalDtype) else pd.factorize(pg)[0]
        coll["gid"] = pd.factorize(codes[np.searchsorted(uid, coll_uid)])[0].astype(np.int64)
    dp2p, dp2p_uid = _rows("p2p", delta, changed)
    p2p, p2p_uid = _merge_rows(prev.views["p2p"], prev.p2p_uid, dp2p, dp2p_uid, changed, ops)
    reg = prev.reg
    inst, inst_reg = _merge_instances(prev.views["instances"], prev.inst_reg, coll, dcoll, reg)
    ms, ms_reg, ms_first = _merge_max_seq(prev.views["max_seq"], prev.ms_reg, prev.ms_first, dcoll, dcoll_uid, reg)
    sw = _merge_steps(prev.views["step_windows"], ops, delta)
    views = {"coll": coll, "p2p": p2p, "step_windows": sw, "instances": inst, "max_seq": ms}
    return IndexState(views, coll_uid, p2p_uid, ms_first, reg=reg, inst_reg=inst_reg, ms_reg=ms_reg, full=False)


def _merge_rows(prev: pd.DataFrame, prev_uid: np.ndarray, new: pd.DataFrame, new_uid: np.ndarray,
                changed: np.ndarray, ops: pd.DataFrame) -> tuple[pd.DataFrame, np.ndarray]:
    """The last rows minus the changed ops', plus the changed ops' rows, in uid (= ops) order."""
    keep = ~_in_sorted(prev_uid, changed)
    if not keep.any():
        return new.reset_index(drop=True), new_uid
    kept = prev[keep] if not keep.all() else prev
    kept, new = _align(kept, new, ops)
    if not len(new):
        return kept.reset_index(drop=True), prev_uid[keep]
    all_uid = np.concatenate([prev_uid[keep], new_uid])
    order = np.argsort(all_uid, kind="stable")
    both = pd.concat([kept, new], ignore_index=True)
    return both.take(order).reset_index(drop=True), all_uid[order]


def _present(cat: pd.Series) -> set[str]:
    codes = cat.cat.codes.to_numpy()
    cats = cat.cat.categories
    used = np.flatnonzero(np.bincount(codes[codes >= 0], minlength=len(cats))) if len(codes) else []
    return {str(cats[i]) for i in used}


def _align(kept: pd.DataFrame, new: pd.DataFrame, ops: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """`kept` and `new` with the categories a view of all their rows has, for the three ways a view's
    categorical is made: fixed categories, the ops column's categories (p2p: `_categorical`), or the
    values present, sorted (coll: `sorted_categorical`). Any other way: build whole (_Fallback)."""
    fix_old, fix_new = {}, {}
    for c in new.columns:
        dt = new[c].dtype
        if not isinstance(dt, pd.CategoricalDtype):
            continue
        if not isinstance(kept[c].dtype, pd.CategoricalDtype):
            raise _Fallback(c)
        old_cats, new_cats = list(kept[c].cat.categories), list(dt.categories)
        if old_cats == new_cats:
            continue                                   # unchanged, whichever the rule
        if c in ops and isinstance(ops[c].dtype, pd.CategoricalDtype) and new_cats == list(ops[c].cat.categories):
            if not set(old_cats) <= set(new_cats):
                raise _Fallback(c)
            target = dt.categories                     # the ops' categories
        elif new_cats == sorted(_present(new[c])):
            target = pd.Index(sorted(_present(kept[c]) | set(new_cats)), dtype=dt.categories.dtype)
            if list(target) != new_cats:
                fix_new[c] = new[c].cat.set_categories(target)
        else:
            raise _Fallback(c)
        fix_old[c] = kept[c].cat.set_categories(target)
    return (kept.assign(**fix_old) if fix_old else kept), (new.assign(**fix_new) if fix_new else new)


def _group_codes(coll: pd.DataFrame) -> dict[str, int]:
    first = ~pd.Series(coll["gid"].to_numpy()).duplicated().to_numpy()
    return dict(zip(coll["process_group"].to_numpy()[first].tolist(), coll["gid"].to_numpy()[first].tolist()))


def _name_codes(names: pd.Series, reg: dict[str, int]) -> np.ndarray:
    """Each row's group name as its code in `reg` (new names are added): decoded per distinct name only."""
    if isinstance(names.dtype, pd.CategoricalDtype):
        codes, cats = names.cat.codes.to_numpy(), names.cat.categories
    else:
        codes, cats = pd.factorize(names.to_numpy(object))
    lut = np.asarray([reg.setdefault(str(c), len(reg)) for c in cats] + [-1], dtype=np.int64)
    return lut[codes]


def _merge_instances(prev: pd.DataFrame, prev_reg: np.ndarray, coll: pd.DataFrame, dcoll: pd.DataFrame,
                     reg: dict[str, int]) -> tuple[pd.DataFrame, np.ndarray]:
    if not len(dcoll):
        return prev, prev_reg
    if "gid" not in coll:
        raise _Fallback("gid")
    gid_of = np.full(len(reg) + len(_group_codes(coll)), -1, dtype=np.int64)
    for name, g in _group_codes(coll).items():                  # this poll's group code of each stable code
        code = reg.setdefault(name, len(reg))
        if code >= len(gid_of):
            gid_of = np.concatenate([gid_of, np.full(code + 1 - len(gid_of), -1, dtype=np.int64)])
        gid_of[code] = g
    m = int(coll["collective_seq_id"].max()) + 1
    key = coll["gid"].to_numpy() * m + coll["collective_seq_id"].to_numpy(np.int64)
    dkey = gid_of[_name_codes(dcoll["process_group"], reg)] * m + dcoll["collective_seq_id"].to_numpy(np.int64)
    touched = np.unique(dkey)
    sub = _view("instances", coll=coll[_in_sorted(key, touched)].reset_index(drop=True))
    sub_reg = _name_codes(sub["process_group"], reg)
    if len(prev):
        keep = ~_in_sorted(gid_of[prev_reg] * m + prev["seq"].to_numpy(np.int64), touched)
        both = pd.concat([prev[keep], sub], ignore_index=True) if keep.any() else sub
        both_reg = np.concatenate([prev_reg[keep], sub_reg]) if keep.any() else sub_reg
    else:
        both, both_reg = sub, sub_reg
    order = np.argsort(gid_of[both_reg] * m + both["seq"].to_numpy(np.int64), kind="stable")
    return both.take(order).reset_index(drop=True), both_reg[order]


def _first_uid(coll: pd.DataFrame, coll_uid: np.ndarray, ms: pd.DataFrame) -> np.ndarray:
    if not len(ms):
        return np.empty(0, dtype=np.int64)
    first = pd.Series(coll_uid).groupby([coll["process_group"].to_numpy(), coll["rank"].to_numpy()]).min()
    return first.reindex(pd.MultiIndex.from_arrays([ms["process_group"].to_numpy(),
                                                    ms["rank"].to_numpy()])).to_numpy(np.int64)


def _merge_max_seq(prev: pd.DataFrame, prev_reg: np.ndarray, prev_first: np.ndarray, dcoll: pd.DataFrame,
                   duid: np.ndarray, reg: dict[str, int]) -> tuple[pd.DataFrame, np.ndarray, np.ndarray]:
    if not len(dcoll):
        return prev, prev_reg, prev_first
    g = _name_codes(dcoll["process_group"], reg)
    rank, seq, first = dcoll["rank"].to_numpy(np.int64), dcoll["collective_seq_id"].to_numpy(np.int64), duid
    if len(prev):
        g = np.concatenate([prev_reg, g])
        rank = np.concatenate([prev["rank"].to_numpy(np.int64), rank])
        seq = np.concatenate([prev["max_seq"].to_numpy(np.int64), seq])
        first = np.concatenate([prev_first, first])
    span = int(rank.max()) + 1
    agg = pd.DataFrame({"seq": seq, "first": first}).groupby(g * span + rank, sort=False).agg(
        max_seq=("seq", "max"), first=("first", "min"))
    agg = agg.take(np.argsort(agg["first"].to_numpy(), kind="stable"))
    key = agg.index.to_numpy()
    names = np.asarray(list(reg), dtype=object)[key // span]
    out = pd.DataFrame({"process_group": pd.Series(names, dtype="str"), "rank": (key % span).astype(np.int64),
                        "max_seq": agg["max_seq"].to_numpy(np.int64)})
    return out, key // span, agg["first"].to_numpy(np.int64)


def _step_keys(df: pd.DataFrame) -> np.ndarray:
    return (df["rank"].to_numpy(np.int64) << 32) | (df["step"].to_numpy(np.int64) & 0xFFFFFFFF)


def _merge_steps(prev: pd.DataFrame, ops: pd.DataFrame, delta: pd.DataFrame) -> pd.DataFrame:
    sel = delta["step"].to_numpy() >= 0
    if not sel.any():
        return prev
    touched = np.unique(_step_keys(delta[sel]))
    rows = pd.Series(_step_keys(ops)).isin(touched).to_numpy()
    sub = _view("step_windows", ops[rows].reset_index(drop=True))
    if len(prev):
        kept = prev[~_in_sorted(_step_keys(prev), touched)]
        both = [p for p in (kept, sub) if len(p)]
    else:
        both = [sub] if len(sub) else []
    if not both:
        return _view("step_windows", ops.iloc[:0])
    out = pd.concat(both, ignore_index=True) if len(both) > 1 else both[0]
    return out.take(np.argsort(_step_keys(out), kind="stable")).reset_index(drop=True)
