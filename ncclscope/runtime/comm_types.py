"""What the rest of the runtime holds of the comm layer: a `Group` (name, kind,
members, torch handle), the errors a wrapped op raises, an `Op` (one row of
the op table in comm.py), a `Call` (one op as a before-issue hook sees it) and
a `Handle` (an in-flight isend/irecv). No torch.distributed calls here; comm.py
makes them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, NamedTuple


class CommError(RuntimeError):
    """A wrapped op failed (not by timeout): peer died, group dead, bad call."""


class CommTimeoutError(CommError):
    """A wrapped op did not finish within its timeout."""

    def __init__(self, message: str, *, op: str, group: str, seq: int, peer: int, timeout_s: float) -> None:
        super().__init__(message)
        self.op, self.group, self.seq, self.peer, self.timeout_s = op, group, seq, peer, timeout_s


@dataclass
class Group:
    """A process group as the rest of the runtime sees it: a name, a kind,
    member global ranks (in group-rank order) and the torch handle."""

    name: str
    kind: str
    ranks: tuple[int, ...]
    pg: Any                      # torch ProcessGroup, or None when this rank is not a member
    creation_order: int
    rank: int = -1               # this process's rank inside the group (-1: not a member)
    dead: str = ""               # why the group must not be used again
    backend: str = "gloo"

    @property
    def size(self) -> int:
        return len(self.ranks)

    def label(self) -> str:
        """`dp1[1,3,5,7]`: the name plus members, as verdicts print it."""
        return f"{self.name}[{','.join(map(str, self.ranks))}]"

    def describe(self) -> dict[str, Any]:
        return {"name": self.name, "kind": self.kind, "ranks": list(self.ranks),
                "creation_order": self.creation_order, "backend": self.backend if self.pg is not None else ""}


class Op(NamedTuple):
    """One wrapped torch.distributed call, as `Comm._call` issues it."""

    name: str
    kind: str                                   # S.KIND_COLLECTIVE or S.KIND_P2P
    issue: Callable[[Any, Any, Any, Any, int], Any]
    alone: Callable[[Any, Any, Any], Any] | None
    arg: str = ""                               # what `arg` is in the row: "reduce_op", "peer" or ""
    p2p: str = ""                               # "send" / "recv": per-peer sequence direction


class Call:
    """One op as a before-issue hook sees it. A hook may replace `op` (another
    row of the table), `group`, `t` (the tensor sent / reduced), `arg` or
    `timeout_s`, sleep (a delay), or set `skip` (the op is not issued and
    leaves no row). `out` is what the caller gets back either way."""

    __slots__ = ("op", "group", "t", "out", "arg", "tag", "timeout_s", "skip")

    def __init__(self, op: Op, group: Group, t: Any, out: Any, arg: Any, tag: int, timeout_s: float | None) -> None:
        self.op, self.group, self.t, self.out, self.arg, self.tag = op, group, t, out, arg, tag
        self.timeout_s, self.skip = timeout_s, False


class Handle:
    """An in-flight async op (isend/irecv): `wait()` records its end row
    (on NCCL the completion thread does, and wait() orders the stream)."""

    def __init__(self, comm: Any, work: Any, op_id: int, desc: tuple[str, Group, int, int], timeout_s: float) -> None:
        self._comm, self._work, self._op_id, self._desc, self._timeout_s = comm, work, op_id, desc, timeout_s
        self.done = work is None

    def wait(self, timeout_s: float | None = None) -> None:
        if self.done:
            return
        self.done = True
        if self._comm._completions is not None:
            self._comm._order_after(self._work)
        else:
            self._comm._finish(self._work, self._op_id, self._desc, timeout_s or self._timeout_s)


# a skipped isend/irecv: nothing to wait for. Public: `Comm._call` returns it when a hook skips a p2p op
DONE = Handle.__new__(Handle)
DONE.done = True
