"""The bug catalogue: every class of user bug the random programs inject, and what a right verdict says.

One entry per class. `kinds` is the set of headline kinds (ncclscope.findings.FindingKind values) a
right verdict may have; the reasoning per class is in `doc`. The culprit ranks are in each program's
ground truth (`Truth.culprits`, `Truth.accept_roots`).

Why these sets (the same measured gloo facts as /work/shared/platform-notes.md):

  skip          The culprit does not post one collective. gloo pairs ops by per-group sequence, so its
                NEXT op on that group pairs with the peers' skipped one: if sizes differ gloo aborts a
                process or the ops mismatch; if they are equal the job runs on one op out of step and
                the peers hang at the end. A right verdict is a hang rooted at the culprit or the
                mismatch it caused: {hang, collective_mismatch}.
  extra         The culprit posts one collective no peer posts (behind `if rank == ...`, e.g. logging a
                loss). Symmetric to skip: {hang, collective_mismatch}.
  wrong_group   The culprit passes another group (another mesh dimension, the world group, or a slice
                it is not a member of) to one all_reduce. Its own group's peers wait on it; the other
                group's members may pair the stray op with one of theirs (equal sizes pair silently):
                {wrong_group, hang, collective_mismatch}.
  wrong_peer    The culprit sends to (or receives from) the wrong rank in a ring / pipeline: a send
                nobody receives, a receive nobody sends: {unmatched_p2p, hang}.
  swap_order    In a blocking pairwise exchange (even ranks send first) the culprit flips its order, so
                both ranks of the pair receive first (or send first: gloo does not buffer sends). That
                is a true deadlock of the pair; naming the pair or the culprit alone is right:
                {deadlock, unmatched_p2p, hang}, roots [culprit] or [culprit, partner].
  size          The culprit's tensor of one collective has another number of elements (all_to_all:
                other split sizes, same total): {collective_mismatch}.
  dtype         The culprit's tensor of one collective has another dtype (always another item size):
                {collective_mismatch}.
  op_type       The culprit issues another collective (broadcast for all_reduce, ...) at that
                sequence number: {collective_mismatch} (a hang names no cause).
  uneven_loop   The culprit's data shard is one batch short (drop_last), so it leaves its loop one
                iteration early and its post-loop ops pair with its peers' loop ops:
                {hang, collective_mismatch}. The line is the loop header it left.
  exception     The culprit raises in compute at some step; its peers wait in their next op:
                {dead_rank}.
  exit          The culprit calls os._exit(...) at some step: {dead_rank}.
  hang_compute  The culprit sleeps far past the timeout in compute; its peers wait in their next op:
                {stuck_in_compute, hang}.
  slow          The culprit sleeps 50-150 ms every step (no hang): {straggler}. No line is judged.
  nan           One batch of the culprit gets a NaN at some step (then the gradient all_reduce spreads
                it to every rank): {nan}. No line is judged.
  group_order   The culprit creates the mesh's groups (new_group) in another dimension order. gloo
                hangs in new_group or pairs the groups wrongly: {group_mismatch, wrong_group}.
  short_objlist The culprit (not the source) passes a shorter object list to broadcast_object_list:
                the object-size broadcast has another size: {collective_mismatch}.
  healthy       No bug: a right verdict has no finding of severity error and exit code 0.

Flight Recorder evidence (dumps only): a rank whose process died (exception, exit, or killed by a
signal it did not get from the launcher) writes no dump, so where a culprit's dump is missing its
class also accepts {dead_rank}: a rank with no dump is all the dumps can show. gloo records no p2p
op in Flight Recorder, so p2p classes are judged the same way but are expected to be hard.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BugClass:
    name: str
    kinds: tuple[str, ...]          # acceptable headline kinds
    line_judged: bool = True        # is a user file:line expected in the verdict?
    hangs: bool = True              # does the bug make the job fail (hang, die, abort)?
    kills_culprit: bool = False     # does the culprit's process end by itself (no FR dump)?
    needs_world: int = 2            # smallest world size the class can be injected in


CATALOGUE: dict[str, BugClass] = {b.name: b for b in (
    BugClass("skip", ("hang", "collective_mismatch")),
    BugClass("extra", ("hang", "collective_mismatch")),
    BugClass("wrong_group", ("wrong_group", "hang", "collective_mismatch"), needs_world=4),
    BugClass("wrong_peer", ("unmatched_p2p", "hang"), needs_world=3),
    BugClass("swap_order", ("deadlock", "unmatched_p2p", "hang")),
    BugClass("size", ("collective_mismatch",)),
    BugClass("dtype", ("collective_mismatch",)),
    BugClass("op_type", ("collective_mismatch",)),
    BugClass("uneven_loop", ("hang", "collective_mismatch")),
    BugClass("exception", ("dead_rank",), kills_culprit=True),
    BugClass("exit", ("dead_rank",), kills_culprit=True),
    BugClass("hang_compute", ("stuck_in_compute", "hang")),
    BugClass("slow", ("straggler",), line_judged=False, hangs=False),
    BugClass("nan", ("nan",), line_judged=False, hangs=False),
    BugClass("group_order", ("group_mismatch", "wrong_group"), needs_world=4),
    BugClass("short_objlist", ("collective_mismatch",)),
)}
HEALTHY = "healthy"
BUG_NAMES: tuple[str, ...] = tuple(CATALOGUE)
FR_MISSING_DUMP_KINDS = ("dead_rank",)   # accepted in addition when a culprit's dump is missing
UNRECORDED_BY_GLOO_FR = ("wrong_peer", "swap_order")   # the faulty op is a send/recv: gloo's dumps keep none


def fault_in_unrecorded_op(bug: str, detail: str) -> bool:
    """Is the injected fault in an op gloo's Flight Recorder keeps no record of (a send/recv), or in a field
    it does not record (all_to_all_single's split sizes: only the tensors' shapes are kept)? The dumps then
    hold no trace of the departure itself, only of what followed it; the benchmark prints their scores apart."""
    return bug in UNRECORDED_BY_GLOO_FR or (bug == "size" and "split sizes" in detail)
