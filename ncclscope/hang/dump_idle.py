"""What the dumps' idleness table (`index/dump_gaps.py`, `TraceIndex.dump_gaps`) says on its own.

`ended_early` is the one shape this table answers on its own: some ranks'
dumps were written right after their last op, and before every idle rank's
dump, and they got no further than the idle ranks did. They ended (their
program returned, or left its loop) while their peers sat outside any
collective. Every rank runs the same program, so the smaller side is the one
that left it: a few that ended while most waited ended early (seed 20261210
#89: one rank's data ran out); a few that sat idle while most ended stopped
short of the end (seed 20261209 #245: a pair deadlocked in its last step's
send/recv while four ranks finished).
"""
from __future__ import annotations

from typing import Any

import pandas as pd

from ncclscope.findings import Evidence, Finding
from ncclscope.index.labels import rank_label
from ncclscope.hang.wording import duration


def ended_early(ix: Any, idle: pd.DataFrame, last_ops: str) -> Finding | None:
    """Where some ranks were dumped right after their last op, before every idle rank's dump, having got no
    further than the idle ranks (module docstring): the smaller side left the course the others kept. A
    few ranks that ended while most waited ended early: a `hang` rooted at them. A few that sat idle while
    most ended stopped: a `no_op_in_flight` rooted at them. As many of each: nothing says which side
    deviated, and every rank is named. One idle rank alone, idle past its last op's own timeout, whatever
    the split: `stuck_in_compute` on it. No rank was left running to pair with it, a send/recv with a
    peer that exited fails at once (measured: gloo raises `Connection closed by peer` some 20 ms
    after the peer's exit), and any op
    it was in would have timed out (seed 20261213 #14 and #206: a rank sleeping after its last collective
    while its peers finished, 134 s and 145 s). Within the timeout it may be inside the op whose failure
    ended the others, until the launcher stops it (seed 20261209 #337: 1.5 s after its peer raised in an
    all_to_all). None for any other split."""
    idle_r = sorted(int(r) for r in idle.index[idle["idle"]])
    ended = sorted(int(r) for r in idle.index[~idle["idle"]])
    if not idle_r or not ended:
        return None
    if int(idle.loc[ended, "t"].max()) > int(idle.loc[idle_r, "t"].max()):
        return None                                   # they went further: the idle ranks stopped first
    if int(idle.loc[ended, "dumped"].max()) >= int(idle.loc[idle_r, "dumped"].min()):
        return None                                   # not dumped before the waiters: no order to read
    trace = ix.trace
    sub = idle.loc[idle_r]
    lo, hi = int(sub["gap"].min()), int(sub["gap"].max())
    span = duration(lo) if duration(lo) == duration(hi) else f"{duration(lo)} to {duration(hi)}"
    one, lone = len(ended) == 1, len(idle_r) == 1
    ended_txt = (f"{rank_label(trace, ended)} ended right after {last_ops} ({'its' if one else 'their'} Flight "
                 f"Recorder dump{'' if one else 's'} {'was' if one else 'were'} written then)")
    idle_txt = (f"{rank_label(trace, idle_r)} sat {span} outside any collective after the same point and "
                f"{'was' if lone else 'were'} dumped later")
    if lone and int(idle.at[idle_r[0], "gap"]) > int(idle.at[idle_r[0], "tmo"]):
        kind, roots = "stuck_in_compute", idle_r
        title = (f"{rank_label(trace, idle_r)} never ended: {ended_txt}, while {idle_txt}. Alone, it cannot have "
                 f"been waiting on a send/recv (a peer's exit fails a pending send/recv at once): it was stuck "
                 f"outside communication, in compute, I/O or a wait of its own")
    elif len(ended) < len(idle_r):
        kind, roots = "hang", ended
        title = (f"{ended_txt}, while {idle_txt}: they wait on {'it' if one else 'them'} in something the dumps "
                 f"do not record (a send/recv: gloo records none), or {'it' if one else 'they'} left "
                 f"{'its' if one else 'their'} loop early")
    elif len(idle_r) < len(ended):
        kind, roots = "no_op_in_flight", idle_r
        title = (f"{rank_label(trace, idle_r)} stopped after {last_ops} and sat {span} outside any collective "
                 f"before {'its dump' if lone else 'their dumps'}, while {rank_label(trace, ended)} ended right "
                 f"after it ({'its dump was' if one else 'their dumps were'} written then): "
                 f"{'it' if lone else 'they'} stopped where the rest of the job ended, outside collectives (in a "
                 f"send/recv, which gloo does not record, or in compute)")
    else:
        kind, roots = "no_op_in_flight", sorted(ended + idle_r)
        title = (f"{ended_txt}, while {idle_txt}: as many ranks ended as stopped, and nothing recorded says "
                 f"which side left the program's course")
    ev = [Evidence(rank=r, note=f"dumped {duration(int(idle.at[r, 'gap']))} after its last op, "
                                f"before every idle rank's dump") for r in ended[:30]]
    ev += [Evidence(rank=r, note=f"sat {duration(int(idle.at[r, 'gap']))} outside any collective before its dump "
                                 f"(its longest interval between two ops: "
                                 f"{duration(int(idle.at[r, 'pace'])) if int(idle.at[r, 'pace']) >= 0 else 'unknown'})")
           for r in idle_r[:30]]
    data = {"ended": ended, "waiting": idle_r, "stopped_after": last_ops,
            "idle_before_dump_s": [round(lo / 1e9, 3), round(hi / 1e9, 3)]}
    return Finding(kind=kind, severity="error", title=title, ranks=roots, evidence=ev,
                   involved=sorted(int(r) for r in idle.index), data=data)
