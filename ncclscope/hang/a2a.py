"""`all_to_all_single` and `all_to_all` exchanges that cannot match: what one member sends another must be what
that member expects from it.

The input sizes of an all_to_all legitimately differ between ranks (MoE routing sends each
expert a different number of tokens), so the instance vote in instances.py exempts them, and a
rank that passed a wrong split list left the job hung with "every member posted it: no rank is
missing". The tracer (`ncclscope run`) appends each call's split lists to its sizes,
` splits [rows sent to member 0, 1, ...]->[rows expected from member 0, 1, ...]` (for the list form,
`all_to_all`, the rows of each input and output tensor), and the exchange is consistent when member i's
send to j equals j's receive from i, for every pair.

The deviant is the member that is an end of every inconsistent pair (one wrong split list
breaks the pairs with each member it disagrees with, and only those); when no single member
is, or two are (a pair that disagrees with each other only), the finding names the lowest
candidate and says it is ambiguous, the rule of the instance vote.
"""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from ncclscope.index.views import TraceIndex
from ncclscope.index.instances import DEVIATION_COLUMNS
from ncclscope.index.labels import fmt_ranks

OPS = ("all_to_all_single", "all_to_all")
SPLITS_RE = re.compile(r" splits \[([0-9,]*)\]->\[([0-9,]*)\]")


def parse_splits(sizes: str) -> tuple[list[int], list[int]] | None:
    """(rows sent to each member, rows expected from each) from a call's sizes; None if absent."""
    m = SPLITS_RE.search(sizes)
    if not m or not m.group(1) or not m.group(2):
        return None
    return [int(x) for x in m.group(1).split(",")], [int(x) for x in m.group(2).split(",")]


def split_deviations(ix: TraceIndex, max_instances: int = 64) -> pd.DataFrame:
    """Deviation rows (instances.DEVIATION_COLUMNS, category "split") for the all_to_all(_single)
    instances whose members' split lists do not pair up; at most `max_instances` instances."""
    coll = ix.coll
    empty = pd.DataFrame(columns=DEVIATION_COLUMNS)
    if not len(coll):
        return empty
    sel = coll[coll["op_name"].isin(OPS).to_numpy()]
    if not len(sel):
        return empty
    sel = sel[sel["input_sizes"].astype(str).str.contains(" splits [", regex=False).to_numpy()]
    rows: list[dict] = []
    n_found = 0
    for (g, k), sub in sel.groupby(["process_group", "collective_seq_id"], sort=True, observed=True):
        members = sorted(int(r) for r in ix.members.get(str(g), []))
        if not members or len(sub) != len(members) or set(int(r) for r in sub["rank"]) != set(members):
            continue                                   # every member's lists are needed to pair them
        parsed = {int(r.rank): parse_splits(str(r.input_sizes)) for r in sub.itertuples(index=False)}
        if any(v is None or len(v[0]) != len(members) or len(v[1]) != len(members) for v in parsed.values()):
            continue
        send = np.array([parsed[r][0] for r in members])
        recv = np.array([parsed[r][1] for r in members])
        bad = send != recv.T                           # bad[i, j]: i sends j other than j expects from i
        if not bad.any():
            continue
        pairs = np.argwhere(bad)
        cover = [i for i in range(len(members)) if all(i in p for p in pairs)]
        tie = len(cover) != 1
        cand = cover or [int(i) for i in np.flatnonzero(np.bincount(pairs.ravel(), minlength=len(members))
                                                       == np.bincount(pairs.ravel()).max())]
        c = cand[0]
        row = sub[sub["rank"] == members[c]].iloc[0]
        rows.append({
            "process_group": str(g), "seq": int(k), "category": "split", "rank": members[c],
            "value": _sentence(members, c, send, recv), "majority": "", "n_voters": len(members),
            "n_majority": len(members) - len(cand), "tie": tie, "op_name": str(row["op_name"]),
            "op_id": int(row["op_id"]),
            "start_ns": int(row["start_ns"]), "status": str(row["status"]), "call_site": str(row["call_site"]),
            "step": int(row["step"]), "basis": "instance",
            # why no one rank is named for sure (collectives.py puts it in the ambiguous title)
            "ref_note": f"the broken pairs point at ranks {fmt_ranks(members[i] for i in cand)} equally" if tie
            else ""})
        n_found += 1
        if n_found >= max_instances:
            break
    return pd.DataFrame(rows, columns=DEVIATION_COLUMNS) if rows else empty


def _sentence(members: list[int], c: int, send: np.ndarray, recv: np.ndarray) -> str:
    """What member c sends / expects against what its peers expect from / send to it."""
    out = []
    expects_other = recv[c] != send[:, c]
    if (send[c] != recv[:, c]).any():
        out.append(f"sends {_list(send[c])} rows to ranks {fmt_ranks(members)} where they expect "
                   f"{_list(recv[:, c])} from it")
        expects_other[c] = False                       # its exchange with itself is the same mistake
    if expects_other.any():
        out.append(f"expects {_list(recv[c])} rows from ranks {fmt_ranks(members)} where they send "
                   f"{_list(send[:, c])} to it")
    return " and ".join(out)


def _list(a: np.ndarray) -> str:
    return "[" + ",".join(str(int(x)) for x in a) + "]"
