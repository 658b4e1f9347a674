"""Skips in a rank's own record: which call it left out before it died, or where its last step left its own
order, when the step census has no finished step to count.

    from ncclscope.hang.skips import deviations_before_death, sequence_skips
    dev = sequence_skips(index_of(trace), [0, 1, 2, 3])     # columns as deviations_before_death

- `deviations_before_death`: a dead rank whose stack dump, traceback or last compute span shows it
  past a call site the others posted from (basis stack / stack-ahead / traceback / span), or whose
  step census shows the skip (census);
- `sequence_skips`: a rank whose call sites on a group in its last step jump ahead of its own
  previous step (basis sequence).
hang/before_death.py words both as findings.
"""
from __future__ import annotations

import re

import numpy as np
import pandas as pd

from ncclscope.hang.census import CENSUS_COLUMNS, step_census_deviations
from ncclscope.index.repetition import virtual_steps
from ncclscope.index.rank_states import own_error
from ncclscope import sites

_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+)')


def stack_call_sites(text: str) -> list[str]:
    """"path:line" of the main thread's frames in a faulthandler dump, innermost first."""
    from ncclscope.index.stack_excerpts import stack_excerpt
    return [f"{m.group(1)}:{m.group(2)}" for m in _FRAME_RE.finditer(stack_excerpt(text, max_frames=64,
                                                                                    max_chars=20000))]


def _site_in_stack(stack: list[str], known: set[str]) -> str:
    """The known call site whose frames sit innermost in the stack (suffix match on path:line)."""
    for i in range(len(stack)):
        for k in known:
            if k and sites.in_stack(stack[i:i + len(sites.frames(k))], k):
                return k
    return ""


def _step_order(coll: pd.DataFrame, rank: int, group: str, before_step: int) -> list[str]:
    """The call sites `rank` issued on `group` in its last complete step before `before_step`, in order."""
    mine = coll[(coll["rank"] == rank) & (coll["process_group"] == group) & (coll["step"] >= 0)
                & (coll["step"] < before_step)]
    if not len(mine):
        return []
    last = int(mine["step"].max())
    return [str(s) for s in mine[mine["step"] == last].sort_values("start_ns")["call_site"]]


MAX_DEAD_CHECKED = 16


def deviations_before_death(ix, dead: list[int]) -> pd.DataFrame:
    """Dead ranks whose record shows they left the others' order before dying: the first deviation.

    For a dead rank r that never posted an unfinished instance (g, k) the others began (from call
    site Y in step s):
    - `stack`: r's stack dump shows it inside a collective call site X != Y that it issues on g after
      Y in its own earlier steps: it skipped Y and its X paired with the others' Y;
    - `span`: r's last compute span of step s ended (with an error) without the collective from Y
      that every earlier span of that name on r issued, and it ran longer than r needed to reach Y
      there: it went past Y without issuing it.
    Columns: rank, process_group, seq, step, call_site (Y), op_name, ref_ranks, basis, went_site, note.
    """
    cols = ["rank", "process_group", "seq", "step", "call_site", "op_name", "ref_ranks", "basis", "went_site", "note"]
    miss = ix.missing
    if not len(miss) or not dead:
        return pd.DataFrame(columns=cols)
    coll, trace = ix.coll, ix.trace
    dead = sorted(set(int(x) for x in dead))[:MAX_DEAD_CHECKED]     # a lost node: its first ranks say enough
    rows = []
    # A skip in a step every member finished, earlier than the death: the census sees it directly.
    groups = sorted(g for g, ms in ix.members.items() if set(ms) & set(int(x) for x in dead))
    cen = step_census_deviations(coll, ix.members, groups) if groups else pd.DataFrame(columns=CENSUS_COLUMNS)
    cen = cen[cen["rank"].isin([int(x) for x in dead]) & (cen["direction"] == "skipped")]
    for c in cen.drop_duplicates("rank").itertuples(index=False):
        rows.append({"rank": int(c.rank), "process_group": str(c.process_group), "seq": int(c.ref_seq),
                     "step": int(c.step), "call_site": str(c.call_site), "op_name": str(c.op_name),
                     "ref_ranks": list(c.ref_ranks), "basis": "census", "went_site": "",
                     "note": f"it issued {int(c.count)} where the others issued {int(c.expected)}"})
    for r in sorted(set(int(x) for x in dead) - {row["rank"] for row in rows}):
        mine = miss[miss["rank"] == r].sort_values("first_start_ns")
        for m in mine.itertuples(index=False):
            g, k = str(m.process_group), int(m.seq)
            inst = coll[(coll["process_group"] == g) & (coll["collective_seq_id"] == k)]
            if not len(inst):
                continue
            site = str(inst["call_site"].mode().iloc[0])
            op = str(inst["op_name"].mode().iloc[0])
            step = int(inst["step"].mode().iloc[0])
            refs = sorted(int(x) for x in inst["rank"])
            if not site or step < 0:
                continue
            first_k = coll.loc[(coll["process_group"] == g) & (coll["step"] == step) & (coll["rank"] != r),
                               "collective_seq_id"]
            pos = k - int(first_k.min()) if len(first_k) else -1       # the others' position in the step
            hit = (_stack_rule(trace, coll, r, g, site, step, pos) or _past_rule(trace, coll, r, site, step)
                   or _span_rule(trace, ix, coll, r, site, step))
            if hit:
                basis, went, note = hit
                rows.append({"rank": r, "process_group": g, "seq": k, "step": step, "call_site": site, "op_name": op,
                             "ref_ranks": refs, "basis": basis, "went_site": went, "note": note})
                break
    return pd.DataFrame(rows, columns=cols)


def _stack_rule(trace, coll: pd.DataFrame, r: int, g: str, site: str, step: int, pos: int = -1):
    text = (getattr(trace, "stacks", None) or {}).get(r, "")
    if not text or not text.strip():
        return None
    # The step's order on g: the longest of the rank's own and a few peers' last steps before `step`
    # (a SIGABRT loses the rank's last rows, so its own last step may be cut short).
    others = coll.loc[(coll["process_group"] == g) & (coll["rank"] != r), "rank"].unique()
    orders = [_step_order(coll, r, g, step)] + [_step_order(coll, int(q), g, step) for q in sorted(others)[:4]]
    orders = [o for o in orders if site in o]
    if not orders:
        return None
    order = max(orders, key=len)
    x = _site_in_stack(stack_call_sites(text), set(order))
    if not x or x == site:
        return None
    # The others must be where the step's order puts them: if their call at this position is not the
    # order's, they left it themselves (a skip of theirs the dead rank paired with), no evidence against it.
    if 0 <= pos < len(order) and order[pos] != site:
        return None
    # X must come after Y in the step: it went past Y (a skip), not back to an earlier one.
    py = pos if 0 <= pos < len(order) and order[pos] == site else order.index(site)
    later = [i for i, o in enumerate(order) if o == x and i > py]
    if not later:
        return None
    px = later[0]
    op = coll[(coll["process_group"] == g) & (coll["call_site"] == x)]["op_name"]
    name = str(op.iloc[-1]) if len(op) else "a collective"
    ahead = px - py
    exact = py == 0 or ahead == px
    calls = "one call" if ahead == 1 else f"{ahead} calls"
    note = f"its stack shows it in {name} from {x} instead, {calls} ahead in the step's order on {g}"
    return ("stack" if exact else "stack-ahead"), x, note


_FUNC_FRAME_RE = re.compile(r'File "([^"]+)", line (\d+) in (\S+)(?: \(def line (\d+)\))?')


def _past_rule(trace, coll: pd.DataFrame, r: int, site: str, step: int):
    """r's last stack (an exception's, or a dump) has a frame in the function that issues Y, at a later
    line than Y's, and r issued nothing from Y in this step: it went past Y without issuing it.

    The function of Y comes from rank.json `call_sites` (name and def line); a frame must match both
    where the dump says its def line (the runtime's exception dumps do), else the name. A loop that
    issued Y earlier in the step and is past it again is excluded by the no-Y-in-this-step test."""
    text = (getattr(trace, "stacks", None) or {}).get(r, "")
    path, line = sites.path_line(sites.inner(site))
    if not text.strip() or line < 0 or (_died_of_itself(trace, r) and not _has_compute(trace, r)):
        return None
    info = next((i.call_sites[site] for q, i in sorted(trace.ranks.items(), key=lambda kv: kv[0] != r)
                 if site in i.call_sites), None)
    if info is None:
        return None
    if len(coll[(coll["rank"] == r) & (coll["step"] == step) & (coll["call_site"] == site)]):
        return None
    from ncclscope.index.stack_excerpts import main_thread_dumps
    dumps = main_thread_dumps(text)
    if not dumps:
        return None
    func, first = info
    for fl in dumps[-1][1]:                              # innermost first
        m = _FUNC_FRAME_RE.search(fl)
        if not m or not (m.group(1) == path or m.group(1).endswith("/" + path)) or m.group(3) != func:
            continue
        if m.group(4) is not None and int(m.group(4)) != first:
            continue
        at = int(m.group(2))
        if at > line:
            return ("traceback", "", f"its last stack shows it at line {at} of {func} ({path}), past the "
                                     f"line {line} collective it issued there in earlier steps")
        return None                                      # in Y's function, not past Y
    return None


def _has_compute(trace, r: int) -> bool:
    """Whether r's trace has compute spans: the runtime's steps are explicit there. A user script's steps
    come from its optimizer.step() hook, wherever in the loop body that call sits."""
    ops = trace.ops
    return bool(((ops["rank"] == r) & (ops["kind"] == "compute")).any())


def _died_of_itself(trace, r: int) -> bool:
    """r ended of its own error (an exception of its own, os._exit), not a peer's (a timeout, a closed
    socket): its last stack is where it died. In a user script that may lie past Y's line in the
    iteration before the one its peers wait in (an exit after the optimizer step that began a new step),
    so the stack proves no skip there."""
    return own_error(getattr(trace.ranks.get(r), "end_message", ""))


SPAN_MARGIN = 1.2     # the failing span ran this much longer than the rank needed to reach Y before


def _span_rule(trace, ix, coll: pd.DataFrame, r: int, site: str, step: int):
    ops = trace.ops
    mine = ops[(ops["rank"].to_numpy() == r) & (ops["kind"].astype(str).to_numpy() == "compute")]
    if not len(mine):
        return None
    comp = mine[(mine["kind"].astype(str) == "compute")]
    fail = comp[(comp["step"] == step) & (comp["status"].astype(str) == "error") & (comp["end_ns"] >= 0)]
    if not len(fail):
        return None
    f = fail.sort_values("start_ns").iloc[-1]
    name, mb = str(f["op_name"]), int(f["microbatch"])
    dur = int(f["end_ns"]) - int(f["start_ns"])
    c = coll[(coll["rank"] == r) & (coll["step"] == step)]
    if len(c[(c["start_ns"] >= int(f["start_ns"])) & (c["start_ns"] <= int(f["end_ns"]))]):
        return None                                     # it issued collectives in the span: not this rule
    earlier = comp[(comp["op_name"].astype(str) == name) & (comp["step"] >= 0) & (comp["step"] < step)
                   & (comp["microbatch"] == mb) & (comp["end_ns"] >= 0) & (comp["status"].astype(str) == "ok")]
    if len(earlier) < 1:
        return None
    mc = coll[(coll["rank"] == r) & (coll["call_site"] == site)]
    offsets = []
    for s in earlier.sort_values("start_ns").itertuples(index=False):
        inside = mc[(mc["start_ns"] >= int(s.start_ns)) & (mc["start_ns"] <= int(s.end_ns))]
        if not len(inside):
            return None                                 # not every earlier span issued Y: no rule
        offsets.append(int(inside["start_ns"].min()) - int(s.start_ns))
    # How long the rank needed to reach Y: its steady state (the first step warms up), the median.
    steady = offsets[1:] if len(offsets) > 1 else offsets
    if dur <= SPAN_MARGIN * float(np.median(steady)):
        return None
    return ("span", "", f"its {name} span of step {step} ended ({str(f['status'])}) without the {site} collective "
                        f"each of its {len(earlier)} earlier {name} spans issued")


MAX_SEQUENCE_RANKS = 64


def _dead_at_site(ix, g: str, r: int, site: str) -> list[int]:
    """Dead members of `g` (not `r`) whose stack dump's innermost known call site is `site`."""
    stacks = getattr(ix.trace, "stacks", None) or {}
    st = ix.rank_states
    out = []
    for q in ix.members.get(g, []):
        if q == r or q not in st.index or not bool(st.at[q, "dead"]) or not str(stacks.get(q, "")).strip():
            continue
        if _site_in_stack(stack_call_sites(stacks[q]), {site}) == site:
            out.append(int(q))
    return out


def _dead_without_record(ix, g: str, r: int) -> list[int]:
    """Dead members of `g` (not `r`) with no op recorded at all (no dump, no trace)."""
    st, have = ix.rank_states, set(int(q) for q in ix.coll["rank"].unique())
    return [int(q) for q in ix.members.get(g, []) if q != r and q in st.index and bool(st.at[q, "dead"])
            and int(q) not in have]


def _last_two_passes(c: pd.DataFrame):
    """Per (rank, group) of `c` (collective rows), in (rank, group) order: (rank, group, the calls of its
    last pass, those of the pass before, whether the passes are virtual steps, the last step), each pass
    as arrays in start order (call_site, op_name, collective_seq_id, status). A pass is a step; when one step
    holds every call (a loop without step markers) the passes are its loop's repetitions (repetition.py),
    and a (rank, group) whose calls never repeat is left out. One sort for all of them: 64 ranks x their
    groups were 320 small frames."""
    if not len(c):
        return
    rank, step, start = (c[k].to_numpy(np.int64) for k in ("rank", "step", "start_ns"))
    group = c["process_group"].astype(str).to_numpy(dtype=object)
    cols = {k: c[k].astype(str).to_numpy(dtype=object) for k in ("call_site", "op_name")}
    cols["collective_seq_id"] = c["collective_seq_id"].to_numpy(np.int64)
    cols["status"] = c["status"].astype(str).to_numpy(dtype=object)
    gcode, gnames = pd.factorize(group, sort=True)
    order = np.lexsort((start, gcode, rank))
    rank, gcode, step = rank[order], gcode[order], step[order]
    cols = {k: v[order] for k, v in cols.items()}
    cut = np.flatnonzero(np.r_[True, (rank[1:] != rank[:-1]) | (gcode[1:] != gcode[:-1]), True])
    for lo, hi in zip(cut[:-1], cut[1:]):
        st = step[lo:hi]
        s = int(st.max())
        virtual = int(st.min()) == s and hi - lo > 1       # one step for everything: its loop's repetitions
        if virtual:
            rep = virtual_steps(cols["call_site"][lo:hi].tolist())
            if rep is None:
                continue
            v = int(rep[0][rep[1]])
            now_m, prev_m = rep[0] == v, rep[0] == v - 1
        else:
            now_m, prev_m = st == s, st == s - 1
        now = {k: col[lo:hi][now_m] for k, col in cols.items()}
        prev = {k: col[lo:hi][prev_m] for k, col in cols.items()}
        yield int(rank[lo]), str(gnames[gcode[lo]]), now, prev, virtual, s


def sequence_skips(ix, ranks: list[int]) -> pd.DataFrame:
    """Ranks whose call sites on a group in their last (unfinished) step depart from their own previous
    step by jumping ahead: where step s-1 went Y, X, the rank went X at the instance the others posted Y.

    The rank skipped Y; its X paired with the others' Y (a size or dtype mismatch, garbage counts, a
    hang one instance off). The others' record of that instance must show them at Y; when gloo aborted
    the partner and its rows of the instance died with it, its stack dump in Y says the same; when it left
    no record at all (a Flight Recorder dump never written) and the rank's X returned (so the partner
    posted its #k), the partner is taken to have run the program the rank's own loop shows (seed 20261219
    #42: rank 0 skipped a helper's all_gather, the other rank died on the size mismatch without a dump).
    A rank with no step marked on any row (a dump) is read by its loop's repetitions. Same
    columns as `deviations_before_death` (basis "sequence")."""
    cols = ["rank", "process_group", "seq", "step", "call_site", "op_name", "ref_ranks", "basis", "went_site", "note"]
    coll = ix.coll
    if not len(coll) or not ranks:
        return pd.DataFrame(columns=cols)
    want = sorted(set(int(r) for r in ranks))[:MAX_SEQUENCE_RANKS]
    c = coll[coll["rank"].isin(want).to_numpy()]          # a few ranks' rows first, then the row tests
    # a rank's steps, or (no step marked on any of its rows: a Flight Recorder dump) its loop's repetitions
    unmarked = c.groupby("rank")["step"].transform("max").to_numpy() < 0
    c = c[(((c["step"] >= 0).to_numpy() | unmarked) & (c["call_site"] != "").to_numpy())]
    rows = []
    for r, g, now, prev, virtual, s in _last_two_passes(c):
        ref, got = prev["call_site"].tolist(), now["call_site"].tolist()
        if not ref or not got:
            continue
        i = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), -1)
        if i < 0 or got[i] not in ref[i + 1:]:
            continue
        y, x = ref[i], got[i]
        op_row = {key: col[i] for key, col in now.items()}
        k = int(op_row["collective_seq_id"])
        inst = coll[(coll["process_group"] == g) & (coll["collective_seq_id"] == k) & (coll["rank"] != r)]
        seen_in = ""
        if not len(inst):
            # the partner's rows of #k died with it (gloo's abort): its stack dump still says where it was
            refs = _dead_at_site(ix, g, r, y)
            seen_in = "; the partner's stack shows it in " + y if refs else ""
            if not refs and str(op_row["status"]) == "ok":
                # #k returned, so its partners posted it; those that died leaving no record at all are taken
                # to have run the program the rank's own loop shows, Y there
                refs = _dead_without_record(ix, g, r)
                seen_in = "; the partner that died left no record" if refs else ""
        else:
            refs = sorted(int(q) for q in inst["rank"]) if (inst["call_site"] == y).all() else []
        if not refs:
            continue                        # the others were not at Y there: no evidence it paired off
        yop = str(prev["op_name"][i])
        rows.append({"rank": r, "process_group": g, "seq": k, "step": -1 if virtual else s, "call_site": y,
                     "op_name": yop,
                     "ref_ranks": refs, "basis": "sequence", "went_site": x,
                     "note": f"its #{k} was {op_row['op_name']} from {x}, which comes after {y} in "
                             + (f"its previous iteration of the calls it repeats on {g}" if virtual
                                else f"its step {s - 1}") + seen_in})
    out = pd.DataFrame(rows, columns=cols)
    return out.sort_values(["step", "seq"], kind="stable").drop_duplicates("rank").reset_index(drop=True)
