"""Point-to-point matching: every send needs its recv, and a missing one is a hang.

Flight Recorder does not follow p2p at all (and on gloo it does not even
record it), yet pipeline parallelism hangs through p2p more than anything
else: a stage that posts `recv` from the next stage while that stage posts
`recv` from it, or one microbatch too few sends. We match sends and recvs by
(src, dst, tag, p2p_seq_id): `p2p_seq_id` counts this rank's ops in that
direction with that peer, so the k-th send a -> b pairs with the k-th recv on b
from a. What is left over is the evidence:

- a send or recv with no counterpart whose own status is inflight / timeout /
  error: `unmatched_p2p` naming the rank that never posted the counterpart;
- a matched pair that did not finish ok on both sides (in-flight pair): both
  sides posted, so the wait is not about a missing op (sizes, transport);
- an unmatched op whose absent side left its own routine there (in step s-1
  it posted the counterpart at this point of the step, in step s it went to
  another call site and never posted it, while the poster repeats its own
  step s-1): the absent side skipped it (`with_departure`), the first
  deviation behind the deadlock or hang between them. Without step numbers
  (a loop with no optimizer step) the iterations of the rank's loop stand in
  for steps (`loop_iterations`, repetition.py): there a send to the wrong peer
  from the loop's own call site is a departure too.

Vectorised: one outer merge of the sends against the recvs (p2p_pairs.py, built once
by the index).
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import pandas as pd

from ncclscope import schema as S
from ncclscope.findings import Cause, CauseBasis, Departure, Evidence, Finding
from ncclscope.index.views import IndexLike, TraceIndex, as_index
from ncclscope.index.labels import rank_label
from ncclscope.index.repetition import repeats_to_end, virtual_steps
from ncclscope.hang.wording import since

# The JSON order of an unmatched_p2p finding's `data` (its cause's claims among them), as earlier releases
# wrote it: `departure` and `call_site` come with `with_departure`.
UNMATCHED_LAYOUT = ("poster", "absent", "side", "src", "op_step", "op_name", "dst", "tag", "seq", "count",
                    "tag_mismatch", "departure", "call_site")


@dataclass
class P2PReport:
    findings: list[Finding] = field(default_factory=list)
    pairs: pd.DataFrame = field(default_factory=pd.DataFrame)      # every send/recv, matched or not
    unmatched: pd.DataFrame = field(default_factory=pd.DataFrame)  # one side never posted
    inflight: pd.DataFrame = field(default_factory=pd.DataFrame)   # both posted, not both ok


def _unfinished(status: pd.Series) -> pd.Series:
    return status.notna() & (status != S.STATUS_OK)



def analyze_p2p(source: IndexLike, max_findings: int = 16) -> P2PReport:
    """Match p2p ops; `unmatched_p2p` for blocked ops whose counterpart was never posted."""
    ix = as_index(source)
    pairs = ix.p2p_pairs
    if not len(ix.p2p):
        return P2PReport(pairs=pairs)
    unmatched = pairs[pairs["state"] != "matched"].reset_index(drop=True)
    inflight = pairs[(pairs["state"] == "matched")
                     & (_unfinished(pairs["send_status"]) | _unfinished(pairs["recv_status"]))].reset_index(drop=True)
    findings = [with_departure(ix, f) for f in _unmatched_findings(ix, unmatched, max_findings)]
    return P2PReport(findings=findings, pairs=pairs, unmatched=unmatched, inflight=inflight)


def _unmatched_findings(ix: TraceIndex, unmatched: pd.DataFrame, max_findings: int) -> list[Finding]:
    if not len(unmatched):
        return []
    so = unmatched[(unmatched["state"] == "send_only") & _unfinished(unmatched["send_status"])]
    ro = unmatched[(unmatched["state"] == "recv_only") & _unfinished(unmatched["recv_status"])]
    rows = []
    for side, df, poster_col, absent_col, other in (("send", so, "src", "dst", "recv"), ("recv", ro, "dst", "src", "send")):
        if not len(df):
            continue
        rows.append(pd.DataFrame({
            "side": side, "other": other, "poster": df[poster_col].astype("int64"),
            "absent": df[absent_col].astype("int64"), "src": df["src"], "dst": df["dst"],
            "tag": df["tag"], "seq": df["seq"], "op_id": df[f"{side}_op_id"].astype("int64"),
            "op_name": df[f"{side}_op_name"].astype(str), "status": df[f"{side}_status"].astype(str),
            "start_ns": df[f"{side}_start_ns"].astype("int64"), "step": df[f"{side}_step"].astype("int64"),
            "process_group": df[f"{side}_process_group"].astype(str),
        }))
    if not rows:
        return []
    u = pd.concat(rows, ignore_index=True)
    # A counterpart posted with the same (src, dst, seq) but another tag explains many "missing" ops.
    other_side = unmatched.assign(
        other_side=np.where(unmatched["state"] == "send_only", "send", "recv"))[["src", "dst", "seq", "tag",
                                                                                 "other_side"]]
    hint = u.merge(other_side.rename(columns={"tag": "other_tag", "other_side": "other"}),
                   on=["src", "dst", "seq", "other"], how="left")
    hint = hint[hint["other_tag"].notna() & (hint["other_tag"] != hint["tag"])]
    hint = hint.drop_duplicates(["side", "src", "dst", "seq", "tag"]).set_index(["side", "src", "dst", "seq", "tag"])
    trace, end = ix.trace, ix.end_ns
    findings = []
    u = u.sort_values(["start_ns", "seq"])
    for (poster, absent, side), sub in u.groupby(["poster", "absent", "side"], sort=False):
        first = sub.iloc[0]
        other = "recv" if side == "send" else "send"
        prep = "to" if side == "send" else "from"
        prep2 = "from" if side == "send" else "to"
        tag_note = ""
        hk = (side, int(first["src"]), int(first["dst"]), int(first["seq"]), int(first["tag"]))
        if hk in hint.index:
            tag_note = (f" (rank {int(absent)} posted {other} #{int(first['seq'])} {prep2} rank {int(poster)} "
                        f"with tag {int(hint.loc[hk, 'other_tag'])} instead)")
        title = (f"{rank_label(trace, [int(absent)])} never posted the {other} matching rank {int(poster)}'s "
                 f"{first['op_name']} #{int(first['seq'])} (tag {int(first['tag'])}) {prep} it{tag_note}; "
                 f"rank {int(poster)} waiting in it ({first['status']}){since(end, first['start_ns'])}")
        if len(sub) > 1:
            title += f" ({len(sub) - 1} more unmatched {side}s between them)"
        ev = [Evidence(rank=int(r.poster), note=f"{r.status}; no matching {other} on rank {int(r.absent)}",
                       op_name=str(r.op_name), process_group=str(r.process_group), seq=int(r.seq),
                       op_id=int(r.op_id), time_ns=int(r.start_ns), peer=int(r.absent))
              for r in sub.head(8).itertuples(index=False)]
        findings.append(Finding(
            kind="unmatched_p2p", severity="error", title=title, ranks=[int(absent)], evidence=ev,
            data={"side": str(side), "src": int(first["src"]), "op_step": int(first["step"]),
                  "op_name": str(first["op_name"]), "dst": int(first["dst"]), "tag": int(first["tag"]),
                  "seq": int(first["seq"]), "count": int(len(sub)), "tag_mismatch": bool(tag_note)},
            cause=Cause(poster=int(poster), absent=int(absent)), layout=UNMATCHED_LAYOUT))
        if len(findings) >= max_findings:
            break
    return findings



# --------------------------------------------------------------------------
# The absent side left its own routine: a skipped p2p
# --------------------------------------------------------------------------
def step_tokens(ix: TraceIndex, rank: int, step: int | None) -> list[tuple[str, str, int, str]]:
    """`rank`'s comm ops of one step (every step: None) in order, as (call site, direction or op name, peer,
    op name): p2p ops by direction (send/isend are one token) and peer, collectives by op name."""
    p, c = ix.p2p, ix.coll
    pm, cm = p["rank"].to_numpy() == rank, c["rank"].to_numpy() == rank
    if step is not None:
        pm, cm = pm & (p["step"].to_numpy() == step), cm & (c["step"].to_numpy() == step)
    ps, cs = p[pm], c[cm]
    rows = [(int(t), int(i), str(site), str(d), int(q), str(op)) for t, i, site, d, q, op in
            zip(ps["start_ns"], ps["op_id"], ps["call_site"].astype(str), ps["direction"].astype(str), ps["peer"],
                ps["op_name"].astype(str))]
    rows += [(int(t), int(i), str(site), str(op), -1, str(op)) for t, i, site, op in
             zip(cs["start_ns"], cs["op_id"], cs["call_site"].astype(str), cs["op_name"].astype(str))]
    return [r[2:] for r in sorted(rows)]


def loop_iterations(ix: TraceIndex, r: int, q: int) -> tuple[list, list, int] | None:
    """For a trace without step numbers: (rank r's tokens in the iteration of its loop where it broke the
    repetition, its tokens in the iteration before, that iteration's number), when rank q kept its own
    loop to its last call (repetition.py); else None."""
    toks = step_tokens(ix, r, None)
    rep = virtual_steps([repr(t[:3]) for t in toks])
    if rep is None or not repeats_to_end([repr(t[:3]) for t in step_tokens(ix, q, None)]):
        return None
    steps, brk = rep
    v = int(steps[brk])
    if v < 1:
        return None
    return [t for t, st in zip(toks, steps) if st == v], [t for t, st in zip(toks, steps) if st == v - 1], v


def _one_step(ix: TraceIndex, rank: int) -> bool:
    """Are all of the rank's comm ops in one step (no step numbers: a dump, a loop without an optimizer)?"""
    p, c = ix.p2p, ix.coll
    steps = np.concatenate([p["step"].to_numpy()[p["rank"].to_numpy() == rank],
                            c["step"].to_numpy()[c["rank"].to_numpy() == rank]])
    return len(steps) > 0 and int(steps.min()) == int(steps.max())


def _same(a: tuple, b: tuple) -> bool:
    return a[:3] == b[:3]


def with_departure(ix: TraceIndex, f: Finding) -> Finding:
    """`f` (unmatched_p2p) with `cause.departure` when the absent rank left its own routine there
    (`_routine_departure`), else when its line's earlier calls all went to the poster and its last went
    elsewhere (`with_peer_change`), else when its own unmatched op names a peer that never exchanges with it
    (`with_crossed_peer`); or, the other way round, the poster's departure when it addressed a rank that
    never exchanges with it and went on without it (`with_stranger_addressed`)."""
    for rule in (_routine_departure, with_peer_change, with_crossed_peer, with_stranger_addressed):
        g = rule(ix, f)
        if g is not f:
            return g
    return f


def _routine_departure(ix: TraceIndex, f: Finding) -> Finding:
    """`f` (unmatched_p2p) with `cause.departure` when the absent rank left its own routine there.

    Training repeats itself: in step s-1 the absent rank posted, at this point of the step, the op that
    would have matched (the recv from the poster, say); in step s it posted something else from
    another call site (a barrier after the loop, the next step's first op) and never posted it, while
    the poster's step s is so far its own step s-1 over again. The absent rank skipped it (a loader
    that dropped a batch, an early `continue`): the first deviation, and the deadlock or hang between
    them its consequence (diagnose.explains). Silent when either rank has no previous step to compare
    with, or when the poster left its own routine too (nothing says which of them deviated)."""
    d = f.data
    r, q, s = int(f.cause.absent), int(f.cause.poster), int(d.get("op_step", -1))
    other = "recv" if d["side"] == "send" else "send"
    virtual = s < 1 and _one_step(ix, r)
    if virtual:                                # no step numbers: the loop's repetitions stand in for steps
        it = loop_iterations(ix, r, q)
        if it is None:
            return f
        got, ref, s = it
    elif s < 1:
        return f
    else:
        got, ref = step_tokens(ix, r, s), step_tokens(ix, r, s - 1)
        mine, mine_ref = step_tokens(ix, q, s), step_tokens(ix, q, s - 1)
        if not got or not ref or not mine or len(mine) > len(mine_ref):
            return f
        if not all(_same(a, b) for a, b in zip(mine, mine_ref)):
            return f                           # the poster departed from its own routine too
    i = next((j for j, (a, b) in enumerate(zip(got, ref)) if not _same(a, b)), -1)
    if i < 0:
        return f                               # a prefix of its previous step: it is just behind
    w = next((j for j in range(i, len(ref)) if ref[j][1] == other and ref[j][2] == q), -1)
    if w < 0:                                  # its previous iteration never posted the matching op either
        return f
    want = ref[w]
    # Where it went must be another call (another site; in a loop, another op or peer at the same site)
    there = got[i][:3] == want[:3] if virtual else got[i][0] == want[0]
    if there or any(t[1] == other and t[2] == q for t in got[i:]):
        return f
    x_site, x_op = got[i][0], got[i][3]
    trace = ix.trace
    prep = "from" if other == "recv" else "to"
    went = f"{x_op}" + (f" {'to' if got[i][1] == 'send' else 'from'} rank {got[i][2]}" if got[i][2] >= 0 else "")
    tail = (f"rank {q}'s {d.get('op_name', d['side'])} #{int(d['seq'])} (tag {int(d['tag'])}) "
            f"{'to' if other == 'recv' else 'from'} it is never matched")
    if virtual:
        was = ref[i]
        did = f"{was[3]}" + (f" {'to' if was[1] == 'send' else 'from'} rank {was[2]}" if was[2] >= 0 else "")
        title = (f"{rank_label(trace, [r])} departed from its loop in iteration {s + 1}: where its previous iteration "
                 f"posted {did} ({was[0]}), it posted {went} ({x_site}) and never the {other} {prep} rank {q} "
                 f"({want[0]}), so {tail}")
    else:
        title = (f"{rank_label(trace, [r])} skipped the {other} {prep} rank {q} at step {s} ({want[0]}): where its "
                 f"step {s - 1} posted {want[3]} {prep} rank {q}, it went to {went} ({x_site}), so {tail}")
    skipped = next((f"{t[3]} at {t[0]}" for t in ref[i + 1:w]
                    if t[2] < 0 and not any(_same(t, g) for g in got[i:])), "")
    dep = Departure(step=s, call_site=want[0], went_site=x_site, went_op=x_op, position=i,
                    basis=CauseBasis.LOOP if virtual else CauseBasis.STEP, skipped_first=skipped)
    return replace(f, title=title, data={**d, "call_site": want[0]}, cause=replace(f.cause, departure=dep),
                   involved=sorted({r, q}))


def with_peer_change(ix: TraceIndex, f: Finding) -> Finding:
    """`f` (unmatched_p2p) with `cause.departure` when the absent rank's last op of that direction went to
    another peer from the very line whose every earlier call went to the poster, and never finished.

    Why: a ring or pipeline exchange that breaks in its second iteration leaves one iteration to compare
    with, too few for the loop's period (repetition.py); but the line is the call: rank 1's isend at
    train.py:34 went to rank 2 in each earlier call and to rank 0 now, rank 2 waits in its irecv from 1,
    and rank 0 never posts a recv from 1. Rank 1 sent to the wrong peer: the first deviation, the deadlock
    between the others its consequence. Silent when the line's earlier calls had more than one peer (a line
    that rotates its peers by design) or when the changed op finished."""
    d = f.data
    r, q = int(f.cause.absent), int(f.cause.poster)
    other = "recv" if d["side"] == "send" else "send"
    p = ix.p2p
    mine = p[(p["rank"].to_numpy() == r) & (p["direction"].astype(str).to_numpy() == other)]
    if len(mine) < 2:
        return f
    mine = mine.sort_values(["start_ns", "op_id"], kind="stable")
    last = mine.iloc[-1]
    site, peer = str(last["call_site"]), int(last["peer"])
    before = mine.iloc[:-1]
    before = before[before["call_site"].astype(str).to_numpy() == site]
    if peer == q or not site or not len(before) or not (before["peer"].to_numpy() == q).all():
        return f
    if str(last["status"]) == S.STATUS_OK:
        return f
    prep = "to" if other == "send" else "from"
    went = f"{last['op_name']} {prep} rank {peer}"
    calls = "its earlier call" if len(before) == 1 else f"each of its {len(before)} earlier calls"
    title = (f"{rank_label(ix.trace, [r])} posted {went} at {site}, where {calls} from that line went {prep} "
             f"rank {q}; so rank {q}'s "
             f"{d.get('op_name', d['side'])} #{int(d['seq'])} (tag {int(d['tag'])}) "
             f"{'to' if other == 'recv' else 'from'} it is never matched")
    return _wrong_peer(f, title, int(last["step"]), site, went, {r, q, peer})


def _wrong_peer(f: Finding, title: str, step: int, site: str, went: str, involved: set[int]) -> Finding:
    """`f` retitled, with the departure of a rank whose op at `site` (in `step`) went to the wrong peer."""
    dep = Departure(step=step, call_site=site, went_site=site, went_op=went, position=-1,
                    basis=CauseBasis.HISTORY)
    return replace(f, title=title, data={**f.data, "call_site": site}, cause=replace(f.cause, departure=dep),
                   involved=sorted(involved))


def with_crossed_peer(ix: TraceIndex, f: Finding) -> Finding:
    """`f` (unmatched_p2p: rank q waits in a send to, or a recv from, rank r, which never posted the other
    side) with `cause.departure` when r itself waits in an op of that other side with the same tag, but to or
    from a rank x that never posts any send or recv with r in the whole trace.

    Why: two unmatched ops that would pair if one of them named the other's rank are one mistake, and the
    rank that made it is the one whose named peer has nothing to do with it: rank 0 of a ring posts its
    irecv from rank 4 (a spare that does no p2p at all) while rank 3's isend to rank 0 waits. Rank 0 chose
    the wrong peer, the first deviation; the unmatched send and any cycle through rank 4's next collective
    are its consequences. Needs no earlier iteration (the mistake may be in the first), and is silent when x
    exchanges with r anywhere in the trace (x may only be late: a skip), or when r waits in several such ops."""
    d = f.data
    r, q = int(f.cause.absent), int(f.cause.poster)
    other = "recv" if d["side"] == "send" else "send"
    p = ix.p2p
    rank, peer = p["rank"].to_numpy(), p["peer"].to_numpy()
    mine = p[rank == r]                 # the rank's own p2p ops first: the string columns of a few rows only
    mine = mine[(mine["direction"].astype(str).to_numpy() == other) & (mine["tag"].to_numpy() == d["tag"])
                & (mine["peer"].to_numpy() != q) & (mine["status"].astype(str).to_numpy() != S.STATUS_OK)]
    if len(mine) != 1:
        return f
    x = int(mine["peer"].iloc[0])
    if x < 0 or bool(((rank == x) & (peer == r)).any()) or bool(((rank == r) & (peer == x)).sum() > 1):
        return f
    row = mine.iloc[0]
    site = str(row["call_site"])
    prep = "to" if other == "send" else "from"
    went = f"{row['op_name']} {prep} rank {x}"
    title = (f"{rank_label(ix.trace, [r])} posted {went}{f' at {site}' if site else ''}, a rank that never "
             f"sends to or receives from it; so rank {q}'s {d.get('op_name', d['side'])} #{int(d['seq'])} "
             f"(tag {int(d['tag'])}) {'to' if other == 'recv' else 'from'} it, which that {other} would have "
             f"matched, is never matched")
    return _wrong_peer(f, title, int(row["step"]), site, went, {r, q, x})


def with_stranger_addressed(ix: TraceIndex, f: Finding) -> Finding:
    """`f` (unmatched_p2p: rank q waits in a send to, or a recv from, rank r, which never posted the other
    side) with the POSTER's departure, and q as its rank, when r has no send or recv with q anywhere in the
    trace, waits in no send or recv of its own, and went on to a collective that q alone of its members has
    not begun.

    Why: every rank runs the same program, and r's run agrees with its peers': it finished its exchanges
    (each matched) and waits where the others wait, on q. q's op is the one op of the job with no
    counterpart, addressed to a rank that, by its whole record, never talks to q: q computed the wrong peer
    (a grid's edge test off by one: rank 2 at the end of row 0 sends "east" to rank 3, the start of row 1).
    The cycle through r's collective (r waits on q, q on r) is its consequence. Silent where r exchanges
    with q anywhere (then r may have skipped its side: `_routine_departure`), where r waits in a p2p op
    (`with_crossed_peer`'s case), where r's collective is not one q alone holds up, and where q is not
    blocked in its op to r (a rank that exited with an isend left open is a hang of its own)."""
    d = f.data
    r, q = int(f.cause.absent), int(f.cause.poster)
    p = ix.p2p
    rank, peer = p["rank"].to_numpy(), p["peer"].to_numpy()
    if bool(((rank == r) & (peer == q)).any()):
        return f
    mine = p[rank == r]
    if bool((mine["status"].astype(str).to_numpy() != S.STATUS_OK).any()):
        return f
    b = ix.blocking
    qb = b[(b["rank"].to_numpy() == q)]
    if not ((qb["kind"].astype(str).to_numpy() == S.KIND_P2P) & (qb["peer"].to_numpy() == r)).any():
        return f                                # the poster is not blocked in it (it exited, say)
    rb = b[(b["rank"].to_numpy() == r)]
    if len(rb) != 1 or str(rb["kind"].iloc[0]) != S.KIND_COLLECTIVE:
        return f
    g, k = str(rb["process_group"].iloc[0]), int(rb["collective_seq_id"].iloc[0])
    miss = ix.missing
    absent = miss[(miss["process_group"].astype(str).to_numpy() == g) & (miss["seq"].to_numpy() == k)]
    if set(absent["rank"].astype(int).tolist()) != {q}:
        return f
    qp = p[(rank == q) & (peer == r) & (p["status"].astype(str).to_numpy() != S.STATUS_OK)]
    if not len(qp):
        return f
    row = qp.sort_values(["start_ns", "op_id"], kind="stable").iloc[0]
    site = str(row["call_site"])
    prep = "to" if str(row["direction"]) == "send" else "from"
    went = f"{row['op_name']} {prep} rank {r}"
    coll = f"{rb['op_name'].iloc[0]} #{k} on {ix.label(g) if g in ix.groups else g}"
    title = (f"{rank_label(ix.trace, [q])} posted {went}{f' at {site}' if site else ''}, a rank that never sends "
             f"to or receives from it: rank {r} finished its own exchanges and waits in {coll} with the others, "
             f"which rank {q} alone has not begun; so rank {q}'s {d.get('op_name', d['side'])} "
             f"#{int(d['seq'])} (tag {int(d['tag'])}) is never matched")
    g2 = _wrong_peer(f, title, int(row["step"]), site, went, {r, q})
    return replace(g2, ranks=[q])
