"""A send and a recv that only their tags keep apart: which side changed its tag?

gloo (and NCCL's p2p) pair a send with a recv by (peer, tag). When rank 0 sends #k to rank 1
with tag 1 and rank 1 receives #k from rank 0 with tag 2, both block: the wait-for graph sees a
2-cycle (a deadlock between the two) and p2p.py two `unmatched_p2p` findings, one per side,
each saying what the other posted instead. Either side may be the wrong one; the rank's own
record tells: training repeats its calls, so the side whose tag differs from the tags its own
earlier calls from the same call site to the same peer used (when those agree, at least
MIN_HISTORY of them) is the one that deviated, if the other side kept its own. Neither or both:
no verdict here (the two findings stand as they are).
"""
from __future__ import annotations

from dataclasses import replace

import pandas as pd

from ncclscope.findings import Evidence, Finding, FindingKind, InstanceRef, WaitSummary
from ncclscope.index.views import TraceIndex
from ncclscope.index.labels import rank_label
from ncclscope.hang.wording import since

MIN_HISTORY = 2        # earlier calls from the site (to that peer) whose tags must all agree


def tag_deviations(ix: TraceIndex, findings: list[Finding]) -> list[Finding]:
    """One `unmatched_p2p` finding (`cause.tag_deviant`) per tag-mismatched pair that history decides."""
    pairs: dict[tuple[int, int, int], dict[str, Finding]] = {}
    for f in findings:
        d = f.data
        if f.kind == FindingKind.UNMATCHED_P2P and d.get("tag_mismatch") and not f.cause.summary:
            pairs.setdefault((int(d["src"]), int(d["dst"]), int(d["seq"])), {})[str(d["side"])] = f
    out: list[Finding] = []
    if not pairs:
        return out
    p2p = ix.p2p
    for (src, dst, seq), sides in sorted(pairs.items()):
        if set(sides) != {"send", "recv"}:
            continue
        ops = {side: _op(p2p, src, dst, seq, side) for side in sides}
        if any(o is None for o in ops.values()):
            continue
        verdicts = {side: _history(p2p, o) for side, o in ops.items()}
        kept = {side for side, (n, tags) in verdicts.items() if n >= MIN_HISTORY and tags == {int(ops[side]["tag"])}}
        changed = {side for side, (n, tags) in verdicts.items()
                   if n >= MIN_HISTORY and len(tags) == 1 and tags != {int(ops[side]["tag"])}}
        if len(changed) != 1 or len(kept) != 1:
            continue
        side = changed.pop()
        other = "recv" if side == "send" else "send"
        out.append(_finding(ix, ops[side], ops[other], verdicts[side], sides[side]))
    return out


def _op(p2p: pd.DataFrame, src: int, dst: int, seq: int, side: str) -> pd.Series | None:
    rank = src if side == "send" else dst
    sel = p2p[(p2p["rank"] == rank).to_numpy() & (p2p["direction"] == side).to_numpy()
              & (p2p["src"] == src).to_numpy() & (p2p["dst"] == dst).to_numpy() & (p2p["seq"] == seq).to_numpy()]
    return sel.iloc[0] if len(sel) else None


def _history(p2p: pd.DataFrame, op: pd.Series) -> tuple[int, set[int]]:
    """(how many, which tags) of the rank's earlier calls from the same site to the same peer."""
    sel = p2p[(p2p["rank"] == op["rank"]).to_numpy() & (p2p["direction"] == op["direction"]).to_numpy()
              & (p2p["peer"] == op["peer"]).to_numpy() & (p2p["call_site"] == op["call_site"]).to_numpy()
              & (p2p["start_ns"] < op["start_ns"]).to_numpy()]
    return len(sel), {int(t) for t in sel["tag"]}


def _finding(ix: TraceIndex, mine: pd.Series, theirs: pd.Series, hist: tuple[int, set[int]],
             base: Finding) -> Finding:
    trace = ix.trace
    r, peer = int(mine["rank"]), int(theirs["rank"])
    prep, prep2 = ("to", "from") if mine["direction"] == "send" else ("from", "to")
    n, tags = hist
    site = str(mine["call_site"])
    title = (f"{rank_label(trace, [r])} posted {mine['op_name']} #{int(mine['seq'])} {prep} rank {peer} with tag "
             f"{int(mine['tag'])} where rank {peer}'s {theirs['op_name']} #{int(theirs['seq'])} {prep2} it has tag "
             f"{int(theirs['tag'])}; its own {n} earlier {mine['op_name']}s {prep} rank {peer} from that line used "
             f"tag {next(iter(tags))}" + (f" (its call at {site})" if site else ""))
    blocked = [int(x["rank"]) for x in (mine, theirs) if str(x["status"]) != "ok"]
    if blocked:
        title += (f"; {rank_label(trace, sorted(blocked))} blocked in it"
                  + since(ix.end_ns, min(int(x["start_ns"]) for x in (mine, theirs)), " for "))
    ev = [Evidence(rank=r, note=f"{mine['op_name']} #{int(mine['seq'])} {prep} rank {peer}: tag {int(mine['tag'])}; "
                                f"its {n} earlier ones from {site or 'the same site'}: tag {next(iter(tags))}",
                   op_name=str(mine["op_name"]), op_id=int(mine["op_id"]), time_ns=int(mine["start_ns"])),
          Evidence(rank=peer, note=f"{theirs['op_name']} #{int(theirs['seq'])} {prep2} rank {r}: tag "
                                   f"{int(theirs['tag'])}, as its earlier ones",
                   op_name=str(theirs["op_name"]), op_id=int(theirs["op_id"]), time_ns=int(theirs["start_ns"]))]
    # the JSON keeps the base finding's order, with the claim that this side changed its tag after it
    layout = tuple(dict.fromkeys([*base.json_data(), "tag_deviant", "poster", "absent", "call_site"]))
    return Finding(kind="unmatched_p2p", severity="error", title=title, ranks=[r], evidence=ev, involved=[r, peer],
                   instance=base.instance if isinstance(base.instance, InstanceRef) else None,
                   wait=WaitSummary(waiting_ranks=tuple(sorted(blocked))), data={**base.data, "call_site": site},
                   cause=replace(base.cause, tag_deviant=True, poster=peer, absent=r), layout=layout)
