"""`wrong_group` from the absent rank's own calls (hang/wrong_call.py), on hand-built traces: the wrong call made
from another line of the same function (matched by the site's callers and the shapes)."""
from __future__ import annotations

import pytest
from trace_builder import TraceBuilder

from ncclscope.verdict.diagnose import diagnose

TP, DP_SITE, BAD_SITE = "layer.py:53", "train.py:32 < train.py:63", "train.py:36 < train.py:63"


def _job(steps: bool, dump_lost: bool = False):
    """tp0 [0,1], tp1 [2,3], dp0 [0,2], dp1 [1,3]; each step a tp all_reduce [4,8] from the layer and the
    gradient's dp all_reduce [8,8] through a helper; at step 4 rank 2's helper takes its fallback branch (line
    36), which passes the tp group: its tp partner 3 pairs its next tp call with it and is aborted (SIGABRT),
    rank 0 waits in dp0 #5, rank 1 in tp0 #6. With `steps=False` no step numbers (Flight Recorder); with
    `dump_lost` rank 3 left no record at all (a Flight Recorder dump never written: seen as DEAD RANK 3)."""
    b = TraceBuilder(4, groups={"tp0": [0, 1], "tp1": [2, 3], "dp0": [0, 2], "dp1": [1, 3]})
    st = (lambda s: s) if steps else (lambda s: -1)
    for r in range(4):
        b.heartbeats(r, 0.0, 6.0 if r != 3 else 5.0)
        tp, dp = f"tp{r // 2}", f"dp{r % 2}"
        for s in range(5):
            b.collective(r, tp, s + 1, start=s, end=s + 0.1, sizes="[[4, 8]]", call_site=TP, step=st(s))
            if (r, s) == (2, 4):
                b.collective(r, tp, 6, start=s + 0.5, end=None, sizes="[[8, 8]]", call_site=BAD_SITE, step=st(s))
            elif (r, s) == (0, 4):
                b.collective(r, dp, 5, start=s + 0.5, end=None, sizes="[[8, 8]]", call_site=DP_SITE, step=st(s))
            else:
                b.collective(r, dp, s + 1, start=s + 0.5, end=s + 0.6, sizes="[[8, 8]]", call_site=DP_SITE,
                             step=st(s))
    b.collective(3, "tp1", 6, start=5.0, end=None, sizes="[[4, 8]]", call_site=TP, step=st(5))
    b.collective(1, "tp0", 6, start=5.0, end=None, sizes="[[4, 8]]", call_site=TP, step=st(5))
    b.rank_state(3, signal="SIGABRT", present=not dump_lost)
    return b.build()


@pytest.mark.parametrize("steps,dump_lost", [(True, False), (False, False), (False, True)])
def test_a_branch_that_passes_another_group_is_the_wrong_group(steps, dump_lost):
    d = diagnose(_job(steps, dump_lost))
    h = d.headline
    assert (h.kind, h.ranks) == ("wrong_group", [2]), d.verdict
    assert h.data["call_site"] == BAD_SITE and "its peers' call: " + DP_SITE in h.title
    assert h.cause.partner_deaths == (3,)          # the death it caused is explained, not the root
