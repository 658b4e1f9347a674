"""The trace index: derived views built once per trace, typed, with errors that say what exists.

Run: python -m pytest tests/test_index.py -q

Hand-built traces (`TraceBuilder`) for the views, and one 4,096-rank hang
assembled straight from numpy columns and one shared group view (the way the
loader keeps byte-identical groups.json files), diagnosed inside the budget.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from trace_builder import NS, TraceBuilder, events_table

from ncclscope import schema as S
from ncclscope.index import views as index_module
from ncclscope.verdict import run
from ncclscope.verdict.diagnose import diagnose
from ncclscope.index.views import GroupInfo, IndexLookupError, RankState, TraceIndex, index_of
from ncclscope.index.membership import groups_from_views
from ncclscope.load.trace import GroupViews, RankInfo, RunInfo, Tables, assemble

pytestmark = pytest.mark.timeout(120)


def small() -> TraceBuilder:
    b = TraceBuilder(4, groups={"dp0": [0, 1], "dp1": [2, 3], "world": [0, 1, 2, 3]})
    for r in range(4):
        b.heartbeats(r, 0.0, 5.0)
        b.compute(r, "forward", start=0.5, end=0.9, step=0)
        b.collective(r, "dp0" if r < 2 else "dp1", 1, start=1.0, end=1.5, step=0)
        b.collective(r, "world", 1, start=2.0, end=2.5 if r != 3 else None, step=1)
    return b


# ---------------------------------------------------------------------------
# Groups
# ---------------------------------------------------------------------------
def test_membership_is_the_view_most_ranks_recorded():
    b = small()
    b.group_view(3, "dp1", [2, 3, 0])                     # rank 3 disagrees
    b.group_view(2, "world", [0, 1, 2], kind="custom")    # rank 2 disagrees on members and kind
    trace = b.build()
    ix = index_of(trace)
    dp1 = ix.group("dp1")
    assert isinstance(dp1, GroupInfo)
    assert (dp1.members, dp1.kind, dp1.holders, dp1.n_views, dp1.recorded) == ((2, 3), "dp", 4, 2, True)
    world = ix.group("world")
    assert (world.members, world.kind, world.size, world.n_views) == ((0, 1, 2, 3), "world", 4, 2)
    assert ix.members["dp0"] == [0, 1] and ix.kinds["dp0"] == "dp"
    assert ix.label("dp1") == "dp1[2,3]"
    gt = ix.group_table
    assert list(gt.columns) == ["process_group", "group_kind", "size", "members"]
    assert gt.set_index("process_group").loc["world", "members"] == [0, 1, 2, 3]


def test_a_tie_between_views_goes_to_the_lowest_holder():
    b = TraceBuilder(2, groups={"pair": [0, 1]}, group_kinds={"pair": "dp"})
    b.group_view(1, "pair", [1, 0])
    trace = b.build()
    g = index_of(trace).group("pair")
    assert (g.members, g.n_views) == ((0, 1), 2)      # rank 0's [0, 1], sorted; 1 vote each


def test_a_group_used_but_never_recorded_gets_the_ranks_seen_using_it():
    b = small()
    b.collective(0, "side7", 1, start=3.0, end=3.1)
    b.collective(2, "side7", 1, start=3.0, end=3.1)
    trace = b.build()
    ix = index_of(trace)
    g = ix.group("side7")
    assert (g.members, g.recorded, g.holders, g.kind) == ((0, 2), False, 0, "side")
    assert "side7" not in ix.recorded and "side7" not in set(ix.group_table["process_group"])


def test_membership_votes_over_distinct_views_not_ranks_times_groups():
    """One view held by 16,384 ranks: one pass over one view, holders counted, not expanded."""
    view = json.dumps([{"name": f"dp{d}", "kind": "dp", "ranks": list(range(d, 16384, 8)), "creation_order": d}
                       for d in range(8)]).encode()
    gv = GroupViews()
    for r in range(16384):
        gv.add(r, view, [], Path("."))
    assert len(gv.views) == 1
    got = groups_from_views(gv)
    assert got["dp3"].holders == 16384 and got["dp3"].members[:3] == (3, 11, 19) and got["dp3"].n_views == 1


def test_one_view_gives_what_the_vote_over_equal_views_gives():
    """The one-view shortcut (a healthy run) must equal the vote: the same plan written as two byte
    strings is two views with one member list per group, so the vote runs and must agree."""
    plan = [{"name": f"tp{t}", "kind": "tp", "ranks": [t * 2 + 1, t * 2], "creation_order": t} for t in range(4)]
    plan.append({"name": "world", "kind": "world", "ranks": list(range(7, -1, -1)), "creation_order": 9})
    one, two = GroupViews(), GroupViews()
    for r in range(8):
        one.add(r, json.dumps(plan).encode(), [], Path("."))
        two.add(r, json.dumps(plan, indent=r % 2 or None).encode(), [], Path("."))
    assert (len(one.views), len(two.views)) == (1, 2)
    fast, voted = groups_from_views(one), groups_from_views(two)
    assert fast == voted and fast["tp1"].members == (2, 3) and fast["world"].holders == 8


# ---------------------------------------------------------------------------
# Errors that say what is there
# ---------------------------------------------------------------------------
def test_unknown_group_names_the_groups_there_are():
    trace = small().build()
    ix = index_of(trace)
    with pytest.raises(IndexLookupError) as err:
        ix.group("dp3")
    assert str(err.value) == "no process group 'dp3' in this trace: groups are dp0, dp1, world"
    assert isinstance(err.value, LookupError)


def test_long_group_lists_are_cut_with_a_count():
    b = TraceBuilder(2, groups={f"tp{i}": [0, 1] for i in range(20)})
    trace = b.build()
    with pytest.raises(LookupError, match=r"groups are tp0, tp1, .*, \.\.\. \(20 in all\)"):
        index_of(trace).group("dp0")


def test_unknown_rank_instance_and_step_say_what_exists():
    trace = small().build()
    ix = index_of(trace)
    with pytest.raises(IndexLookupError, match=r"^no rank 9 in this trace: ranks are 0-3 \(world size 4\)$"):
        ix.rank_state(9)
    with pytest.raises(IndexLookupError, match=r"^no collective #7 on dp0 in this trace: dp0 has #1-#1$"):
        ix.instance("dp0", 7)
    with pytest.raises(IndexLookupError, match=r"^no process group 'tp0'"):
        ix.instance("tp0", 1)
    with pytest.raises(IndexLookupError, match=r"^rank 1 recorded no ops in step 5: its steps are 0-1$"):
        ix.step_window(1, 5)
    assert ix.instance("world", 1)["n_began"] == 4


def test_an_empty_trace_says_it_has_no_groups():
    trace = TraceBuilder(2).build()
    with pytest.raises(IndexLookupError, match="it records no process groups"):
        index_of(trace).group("dp0")


# ---------------------------------------------------------------------------
# Ranks and steps
# ---------------------------------------------------------------------------
def test_rank_states_and_a_missing_rank():
    b = small()
    b.rank_state(1, present=False)         # its directory is gone: its events are dropped
    trace = b.build()
    ix = index_of(trace)
    st = ix.rank_state(1)
    assert isinstance(st, RankState)
    assert (st.role, st.state) == ("dead", "missing") and "no trace directory" in st.dead_reason
    three = ix.rank_state(3)
    assert three.role == "blocked" and three.blocking == ("all_reduce #1 on world",)
    assert list(ix.rank_states.index) == [0, 1, 2, 3]
    assert set(ix.blocking["rank"]) == {3}


def test_step_windows():
    trace = small().build()
    ix = index_of(trace)
    w0 = ix.step_window(0, 0)
    assert (w0.n_ops, w0.end_ns - w0.start_ns) == (2, NS)         # forward 0.5 s .. all_reduce end 1.5 s
    assert ix.step_window(3, 1).end_ns == -1                      # its world all_reduce never ended
    assert ix.step_window(0, 1).end_ns > 0


# ---------------------------------------------------------------------------
# Built once
# ---------------------------------------------------------------------------
def test_the_index_is_built_once_and_every_analysis_reuses_it(monkeypatch):
    trace = small().build()
    built: list[str] = []
    for name in ("collective_ops", "p2p_ops", "end_states", "recorded_groups", "instance_table"):
        real = getattr(index_module, name)
        monkeypatch.setattr(index_module, name, lambda *a, _real=real, _n=name, **k: built.append(_n) or _real(*a, **k))
    inits: list[int] = []
    real_init = TraceIndex.__init__
    monkeypatch.setattr(TraceIndex, "__init__", lambda self, t: inits.append(1) or real_init(self, t))
    ix = index_of(trace)
    assert index_of(trace) is ix
    analysis = run(trace)                  # hang diagnosis and every performance analysis
    assert analysis.errors == [], analysis.errors
    assert index_of(trace) is ix and len(inits) == 1
    assert sorted(built) == sorted(set(built)), built          # each view at most once
    assert {"collective_ops", "end_states", "recorded_groups"} <= set(built)


def test_replaced_tables_get_a_new_index():
    trace = small().build()
    ix = index_of(trace)
    trace.ops = trace.ops.iloc[:-1].reset_index(drop=True)
    assert index_of(trace) is not ix


def test_the_index_does_not_keep_its_trace_alive():
    trace = small().build()
    ix = index_of(trace)
    assert ix.trace is trace
    del trace
    import gc
    gc.collect()
    with pytest.raises(IndexLookupError, match="keep the Trace"):
        ix.trace


# ---------------------------------------------------------------------------
# Scale: 4,096 ranks, a few events each
# ---------------------------------------------------------------------------
def synthetic_4096(world: int = 4096, tp: int = 8, skipper: int = 1234) -> "object":
    """tp groups of 8 consecutive ranks, dp groups strided by 8 (512 members), one world group.

    Step 0: tp all_reduce #1, dp all_reduce #1 (both end). Step 1: tp #2, then
    `skipper` skips dp #2 and enters the world barrier #1; its 511 dp peers
    block in dp #2; every other rank finishes dp #2 and blocks in the barrier.
    Columns from numpy; one group view shared by every rank, as the loader
    keeps byte-identical groups.json files."""
    n_tp = world // tp
    names = [f"tp{t}" for t in range(n_tp)] + [f"dp{d}" for d in range(tp)] + ["world"]
    ranks = np.arange(world)
    tp_g, dp_g = ranks // tp, n_tp + ranks % tp
    peers = (ranks % tp == skipper % tp) & (ranks != skipper)
    # per rank: (group code, seq, op, step, start s, ended)
    slots = [(tp_g, 1, 0, 0, 1.0, True), (dp_g, 1, 0, 0, 1.5, True), (tp_g, 2, 0, 1, 2.0, True),
             (dp_g, 2, 0, 1, 2.5, ~peers), (np.full(world, n_tp + tp), 1, 1, 1, 3.0, False)]
    rows = []
    for g, seq, op, step, start, ended in slots:
        keep = ~(ranks == skipper) if (seq == 2 and g is dp_g) else np.ones(world, bool)
        keep &= ~peers if op == 1 else True                      # the blocked peers never reach the barrier
        rows.append(pd.DataFrame({"rank": ranks[keep], "g": np.broadcast_to(g, world)[keep], "seq": seq, "op": op,
                                  "step": step, "start": start,
                                  "ended": np.broadcast_to(ended, world)[keep]}))
    ops = pd.concat(rows, ignore_index=True).sort_values(["rank", "start"], kind="stable")
    ops["op_id"] = ops.groupby("rank").cumcount() + 1
    t0 = 1_700_000_000 * NS
    n = len(ops)

    def cat(codes, values):
        return pd.Categorical.from_codes(np.asarray(codes, dtype=int), categories=values)

    begin = pd.DataFrame({
        "rank": ops["rank"].to_numpy(), "op_id": ops["op_id"].to_numpy(), "phase": cat(np.zeros(n), ["begin", "end"]),
        "time_ns": t0 + (ops["start"].to_numpy() * NS).astype(np.int64),
        "kind": cat(np.zeros(n), [S.KIND_COLLECTIVE]), "op_name": cat(ops["op"], ["all_reduce", "barrier"]),
        "process_group": cat(ops["g"], names), "collective_seq_id": ops["seq"].to_numpy(),
        "step": ops["step"].to_numpy(), "status": cat(np.zeros(n), ["", "ok"]),
        "call_site": cat(ops["op"], ["train.py:80", "train.py:99"]),
        "input_sizes": cat(np.zeros(n), ["[[1024]]"]), "input_dtypes": cat(np.zeros(n), ["float32"])})
    done = ops["ended"].to_numpy()
    end = begin[done].assign(phase=cat(np.ones(done.sum()), ["begin", "end"]),
                             status=cat(np.ones(done.sum()), ["", "ok"]),
                             time_ns=begin["time_ns"].to_numpy()[done] + NS // 10)
    beats = np.array([0.0, 2.0, 4.0])
    m = world * len(beats)
    hb = pd.DataFrame({"rank": np.repeat(ranks, len(beats)), "phase": cat(np.zeros(m), ["instant"]),
                       "kind": cat(np.zeros(m), [S.KIND_MARKER]), "op_name": cat(np.zeros(m), [S.HEARTBEAT]),
                       "time_ns": t0 + (np.tile(beats, world) * NS).astype(np.int64)})
    view = json.dumps([{"name": name, "kind": name.rstrip("0123456789"),
                        "ranks": (list(range(i * tp, i * tp + tp)) if i < n_tp else
                                  list(range(i - n_tp, world, tp)) if i < n_tp + tp else list(range(world))),
                        "creation_order": i, "backend": "gloo"} for i, name in enumerate(names)]).encode()
    views = GroupViews()
    for r in range(world):
        views.add(r, view, [], Path("."))
    infos = {r: RankInfo(rank=r, present=True, coords={"tp": r % tp, "dp": r // tp}) for r in range(world)}
    tables = [events_table(pd.concat([begin, end, hb], ignore_index=True))]
    return assemble(Path("<synthetic 4096>"), RunInfo.from_dict({"world_size": world}), world, infos,
                    Tables(events=tables, group_views=views, warnings=[]))


def test_a_4096_rank_hang_is_diagnosed_in_budget_and_names_the_skipper():
    t = time.perf_counter()
    trace = synthetic_4096()
    built_s = time.perf_counter() - t
    t = time.perf_counter()
    d = diagnose(trace)
    elapsed = time.perf_counter() - t
    assert elapsed < 45.0, f"diagnose took {elapsed:.1f} s (building the trace {built_s:.1f} s)"
    h = d.findings[0]
    assert (h.kind, h.ranks, h.role) == ("hang", [1234], "headline"), d.verdict
    assert d.verdict.startswith("HANG: rank 1234 (dp 154, tp 2) never posted all_reduce #2 on dp2[2,10,...,4090] "
                                "(511 of 512 members did) and went on to barrier #1 on world[0-4095]"), d.verdict
    assert h.instance is not None and (h.instance.group, h.instance.seq) == ("dp2", 2)
    assert h.wait is not None and len(h.wait.waiting_ranks) == 4095
    assert len(index_of(trace).groups) == 4096 // 8 + 8 + 1


def test_collective_wait_edges_are_the_merge_of_waiters_and_absent_members_without_it():
    # wait_edges._expand must give exactly the rows (and order) of b.merge(m, on=(group, seq)), minus self-edges,
    # "not begun" first; strings as categoricals (a 16,384-rank world barrier is 4.1 M edges)
    from ncclscope.index.wait_edges import EDGE_COLUMNS, _expand
    rng = np.random.default_rng(3)
    b = pd.DataFrame({"waiter": rng.integers(0, 40, 60), "process_group": rng.choice(["dp0", "tp1", "world"], 60),
                      "seq": rng.integers(1, 4, 60), "op_name": rng.choice(["all_reduce", "barrier"], 60),
                      "op_id": np.arange(60), "start_ns": rng.integers(0, 10**9, 60), "status": "inflight",
                      "peer": -1, "tag": -1})
    m = pd.DataFrame({"process_group": rng.choice(["dp0", "tp1", "world"], 30), "seq": rng.integers(1, 4, 30),
                      "member": rng.integers(0, 40, 30), "n_members": 8, "n_began": rng.integers(0, 8, 30),
                      "reason": rng.choice(["not begun", "died in it"], 30)})
    e = b.merge(m, on=["process_group", "seq"])
    e = e[e["member"] != e["waiter"]]
    e = pd.concat([e[e["reason"] == "not begun"], e[e["reason"] != "not begun"]])
    want = e.rename(columns={"member": "target"}).assign(via="collective")[EDGE_COLUMNS].reset_index(drop=True)
    got = _expand(b, m)
    assert list(got.columns) == EDGE_COLUMNS and len(got) == len(want) > 0
    for c in EDGE_COLUMNS:
        assert got[c].astype(str).tolist() == want[c].astype(str).tolist(), c
    assert isinstance(got["process_group"].dtype, pd.CategoricalDtype) and got["waiter"].dtype == np.int64


# ---------------------------------------------------------------------------
# Memory: categorical collective columns, per-op views released after the hang questions
# ---------------------------------------------------------------------------
def test_collective_columns_as_sorted_categoricals_act_as_the_plain_strings():
    from ncclscope.index.instances import CAT_COLUMNS, STR_COLUMNS
    from ncclscope.index.labels import plain_str
    b = small()
    b.collective(0, "dp0", 2, start=3.0, step=1, call_site="z.py:9")
    b.collective(1, "dp0", 2, start=3.0, step=1, call_site="a.py:1")
    b.collective(2, "dp1", 2, start=3.1, step=1, call_site="")
    trace = b.build()
    coll = index_of(trace).coll
    ops = trace.ops
    sel = ((ops["kind"] == S.KIND_COLLECTIVE) & (ops["collective_seq_id"] >= 0)
           & (plain_str(ops["process_group"]) != "")).to_numpy()
    for c in STR_COLUMNS:
        want = plain_str(ops.loc[sel, c]).reset_index(drop=True)
        got = coll[c]
        assert isinstance(got.dtype, pd.CategoricalDtype) == (c in CAT_COLUMNS)
        assert got.astype("str").tolist() == want.tolist(), c
        if c in CAT_COLUMNS:
            cats = [str(x) for x in got.cat.categories]
            assert cats == sorted(set(want)), c                   # only values present, sorted
            plain = pd.DataFrame({"k": want, "i": np.arange(len(want))})
            cat = pd.DataFrame({"k": got, "i": np.arange(len(want))})
            assert cat.sort_values(["k", "i"])["i"].tolist() == plain.sort_values(["k", "i"])["i"].tolist()
            assert cat.groupby("k")["i"].sum().tolist() == plain.groupby("k")["i"].sum().tolist()
            assert (got == "").tolist() == (want == "").tolist()


def test_per_op_views_are_released_after_the_hang_questions_and_rebuilt_the_same(monkeypatch):
    trace = small().build()
    ix = index_of(trace)
    before = {v: getattr(ix, v).copy() for v in index_module.ROW_VIEWS}
    index_module.release_views(trace)                       # a small trace: kept
    assert all(v in ix.__dict__ for v in index_module.ROW_VIEWS)
    monkeypatch.setattr(index_module, "BIG_OPS", 1)
    run(trace)                                              # releases them between hang and performance
    assert not any(v in ix.__dict__ for v in index_module.ROW_VIEWS)
    for v, df in before.items():
        pd.testing.assert_frame_equal(getattr(ix, v), df)    # rebuilt on the next use, the same


def _crossed_trace(desc: bool):
    """Rank 2 calls g1 from the site the others call g2 from and the other way round (a creation-order
    swap by call site); "tp:0" / "dp:0" style names give the description check something to compare."""
    groups = {"g1": [0, 1, 2], "g2": [0, 1, 2], "tp:0": [0, 1, 2], "dp:0": [0, 1, 2], "world": [0, 1, 2]}
    b = TraceBuilder(3, groups=groups)
    for r in range(3):
        b.heartbeats(r, 0.0, 9.0)
        s1, s2 = ("a.py:1", "b.py:2") if r < 2 else ("b.py:2", "a.py:1")
        for k in range(1, 4):
            b.collective(r, "g1", k, start=float(k), end=k + 0.2, step=k, call_site=s1)
            b.collective(r, "g2", k, start=k + 0.3, end=k + 0.5, step=k, call_site=s2)
            if desc:
                b.collective(r, "tp:0" if r < 2 else "dp:0", k, start=k + 0.6, end=k + 0.7, step=k, call_site="")
        b.collective(r, "world", 1, start=5.0, end=5.1, step=4)
    return b.build()


@pytest.mark.parametrize("desc", [False, True])
def test_creation_order_on_first_rows_is_the_copy_and_drop_duplicates(monkeypatch, desc):
    from ncclscope.hang import group_order as GO
    trace = _crossed_trace(desc)
    coll = index_of(trace).coll
    assert GO._first_rows(coll, np.ones(len(coll), dtype=bool)) is not None
    fast = GO.creation_order_findings(index_of(trace))
    assert [(f.cause.basis, f.ranks) for f in fast] == [("desc" if desc else "call_site", [2])]
    with monkeypatch.context() as m:
        m.setattr(GO, "_first_rows", lambda coll, keep: None)              # the plain pandas path
        slow = GO.creation_order_findings(index_of(trace))
    assert [f.to_json() for f in fast] == [f.to_json() for f in slow]
