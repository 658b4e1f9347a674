"""A wrong-group call whose new partner gloo aborted, seen in Flight Recorder dumps alone: the partner left
no dump, so nothing of its own says when it died; its peers' records say it was alive at the wrong call
(`group_checks._alive_with_peers`), so its death is the wrong call's consequence."""
from __future__ import annotations

from pathlib import Path

from ncclscope.load.foreign.flight_recorder import load_flight_recorder
from ncclscope.verdict.compose import run
from randprog_data import timed_dumps


def test_a_partner_killed_by_a_wrong_group_call_is_its_consequence_in_dumps(tmp_path) -> None:
    """A plain script (tests/data/user_runs/dmesh_wrong_dim_fr, program.py.txt beside it): a 2 x 2
    DeviceMesh; at step 2 rank 1 all-reduces its gradients on its tp group instead of its dp group. gloo
    pairs that 128-element call with rank 0's next 32-element tp all_reduce and aborts rank 0, which leaves
    no dump. The dumps named the dead rank ("DEAD RANK: rank 0 left no Flight Recorder dump"), the wrong
    call a finding below it. Rank 0 completed tp #3 with rank 1 just before the wrong call #4: it was alive
    then, and its death is the wrong call's doing. The run trace of the same job already said so."""
    dumps = timed_dumps("dmesh_wrong_dim_fr", tmp_path, data=Path(__file__).parent / "data" / "user_runs")
    a = run(load_flight_recorder(dumps))
    assert a.headline is not None and (a.headline.kind, a.headline.ranks) == ("wrong_group", [1]), a.verdict
    assert "program.py" in a.verdict or "dmesh_wrong_dim.py:25" in a.verdict, a.verdict
