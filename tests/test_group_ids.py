"""Group creation order told by each process's own numbering of its groups (hang/group_ids.py).

Two gloo jobs of the random-program benchmark (seed 20261212, their Flight Recorder dumps as written): one
rank builds the 2 x 2 mesh's groups dimension by dimension in the other order, so at the first use of its
groups it calls its collective on a group whose name pairs it with nobody. gloo's dumps list no members
and nothing crossed two call sites yet: both read as a HANG rooted at an innocent rank before. Each entry's
`pg_id` is the group's number in its process (1 = the first group the process built).
"""
from __future__ import annotations

import pickle
import shutil
from pathlib import Path

from ncclscope.load.foreign.flight_recorder import load_flight_recorder
from ncclscope.verdict import run

from randprog_data import DATA


def _dumps(name: str, tmp_path: Path, edit=None) -> Path:
    """The fixture's dumps in a fresh directory; `edit(rank, dump)` may change each before it is written."""
    src, dst = DATA / name, tmp_path / name
    dst.mkdir(parents=True)
    for f in sorted(src.glob("nccl_trace_rank_*")):
        if edit is None:
            shutil.copyfile(f, dst / f.name)
            continue
        dump = pickle.loads(f.read_bytes())
        edit(int(f.name.rsplit("_", 1)[1]), dump)
        (dst / f.name).write_bytes(pickle.dumps(dump))
    return dst


def test_the_rank_that_numbers_its_stuck_group_unlike_the_others_created_its_groups_in_another_order(tmp_path):
    """#3: rank 3 builds the shard groups before the cp groups. At DDP's first collective on its shard group
    ranks 0-2 use the 2nd group each built, rank 3 its 1st; rank 3 waits alone in "2", rank 2 alone in "4"."""
    a = run(load_flight_recorder(_dumps("rp20261212_003_group_order_fr", tmp_path)))
    h = a.headline
    assert h is not None and (h.kind, h.ranks) == ("group_mismatch", [3]), a.verdict
    assert h.cause.basis == "group_id" and h.data["majority_id"] == 2
    assert h.data["group_ids"] == {"0": 2, "1": 2, "2": 2, "3": 1}
    assert "uses 1st group it built" in a.verdict and "as rank 2 does" in a.verdict, a.verdict


def test_the_lowest_rank_is_named_when_its_own_number_is_the_odd_one(tmp_path):
    """#110: rank 0 is the one that built the other dimension first: its all_gather goes to its 2nd group,
    the other three ranks' to their 1st. Naming by number, not by the lowest rank of a stopped pair."""
    a = run(load_flight_recorder(_dumps("rp20261212_110_group_order_fr", tmp_path)))
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("group_mismatch", [0]), a.verdict


def test_dumps_without_group_numbers_do_not_raise_it(tmp_path):
    """Dumps of an older torch, or edited, carry no pg_id: the rule has nothing to count and stays silent."""
    def strip(_rank, dump):
        for e in dump["entries"]:
            e.pop("pg_id", None)
    a = run(load_flight_recorder(_dumps("rp20261212_003_group_order_fr", tmp_path, strip)))
    assert not any(f.cause is not None and f.cause.basis == "group_id" for f in a.findings), a.verdict


def test_a_lone_odd_number_without_a_lone_peer_is_not_a_creation_order(tmp_path):
    """Ranks may number one call site's groups differently by design (pipeline pair groups). With rank 2's
    record gone, no rank of the majority waits alone where the odd one should have met it: rank 3 may just
    be waiting for a peer that never came, so the rule says nothing."""
    def drop_rank2(rank, dump):
        if rank == 2:
            dump["entries"] = []
    a = run(load_flight_recorder(_dumps("rp20261212_003_group_order_fr", tmp_path, drop_rank2)))
    assert not any(f.cause is not None and f.cause.basis == "group_id" for f in a.findings), a.verdict


def test_the_numbers_survive_an_export_round_trip(tmp_path):
    """The numbers live on the ranks' records (RankInfo.group_ids), which the Parquet export keeps."""
    from ncclscope.export.parquet import export_parquet, load_parquet
    trace = load_flight_recorder(_dumps("rp20261212_003_group_order_fr", tmp_path))
    assert trace.ranks[3].group_ids == {"2": 1} and trace.ranks[0].group_ids == {"3": 2, "default_pg": 0}
    export_parquet(trace, tmp_path / "ds")
    back = load_parquet(tmp_path / "ds")
    assert {r: i.group_ids for r, i in back.ranks.items()} == {r: i.group_ids for r, i in trace.ranks.items()}
    assert run(back).verdict == run(load_flight_recorder(_dumps("rp20261212_003_group_order_fr",
                                                                tmp_path / "again"))).verdict


def test_a_group_name_another_rank_used_for_another_call_does_not_hide_the_odd_rank(tmp_path):
    """Seed 20261213 #161: rank 0 builds tp before dp, so its 3rd group is its dp pair {0,2}, while rank 1's
    3rd group is its tp pair {0,1}. Rank 0's all_reduce from line 51 and rank 1's all_gather from line 66
    both sit in "#1 on 3": another rank recorded the instance, but as another call. Rank 0 still waits alone
    as a call; by its group number (2nd, where ranks 1-3 use their 1st at line 51) it is the odd one. It
    read as a collective mismatch before (right rank, wrong cause)."""
    a = run(load_flight_recorder(_dumps("rp20261213_161_group_order_fr", tmp_path)))
    h = a.headline
    assert h is not None and (h.kind, h.ranks) == ("group_mismatch", [0]), a.verdict
    assert h.cause.basis == "group_id" and h.data["majority_id"] == 1, h.data
