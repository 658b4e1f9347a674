"""Profiler traces: which CPU op launched each NCCL kernel, and what that op says the kernel was.

A kernel is named for how NCCL runs it, not for what the program asked:
`all_to_all` is a group of sends and receives, so its kernel is
`ncclDevKernel_SendRecv`, and so can be an `all_gather` of uneven sizes. Newer
Kineto copies the launching `record_param_comms` op's args ("Collective
name", "Process Group Name", ...) onto the kernel; where it did not (older
PyTorch, or a kernel linked to another op of the call), the kernel is read
through the op that launched it:

- its "External id" is the launching CPU op's (Kineto links the innermost op
  open at the launch); without one, its "correlation" is the CUDA runtime or
  driver launch event's, which ran on a CPU thread at a time;
- the ops open around that op or launch on that thread say the rest: the
  outermost `c10d::*` op is the call (`c10d::alltoall_base_`), the innermost
  `record_param_comms` holds the call's args, an `nccl:*` annotation names it.

Kernels one collective launched become that collective's one row (its first
kernel's start to its last one's end), so collective alignment sees them; a
kernel launched by `c10d::send` / `c10d::recv_` stays a p2p op.

    rows = link_kernels(kernels, cpu_ops, launches, ns)
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, Callable

from ncclscope.load import safe_io
from ncclscope.load.foreign.vocab import P2P_OPS, normalize_op

# The record_param_comms args a kernel takes over from its launcher (Kineto copies the same ones).
COMM_ARGS = ("Collective name", "dtype", "In msg nelems", "Out msg nelems", "Group size", "In split size",
             "Out split size", "Process Group Name", "Process Group Description", "Process Group Ranks",
             "Src Rank", "Dst Rank", "Seq")
PARAM_COMMS = "record_param_comms"
MAX_NESTED = 16      # CPU ops looked back through for the ones open around a launch
Launches = Callable[[set[int]], dict[int, dict[str, Any]]]      # correlation ids -> their launch events


@dataclass(frozen=True)
class CpuOp:
    """A CPU op that can launch NCCL kernels: a `c10d::*` call, `record_param_comms`, an `nccl:*` annotation."""

    name: str
    tid: Any
    start: int          # ns, on the rank's clock
    end: int
    ext: int            # Kineto's "External id" (-1 when it has none)
    args: dict[str, Any]


def cpu_op(ev: dict[str, Any], args: dict[str, Any], start: int, end: int) -> CpuOp:
    """The CpuOp of one trace event (times already in ns)."""
    return CpuOp(name=str(ev.get("name", "")), tid=_tid(ev.get("tid")), start=start, end=end,
                 ext=_id(args, "External id"), args=args)


def _id(args: dict[str, Any], key: str) -> int:
    """An "External id" / "correlation" of the args, -1 when there is none (or it is junk)."""
    return safe_io.to_int(args.get(key), -1, 0, 2**62)


def _tid(value: Any) -> Any:
    """A thread id as a hashable key (a hostile list or dict one is no thread)."""
    return value if isinstance(value, (int, float, str)) or value is None else repr(value)


class Launchers:
    """The CPU ops of one rank, by External id and by thread (in start order), to find a kernel's launcher."""

    def __init__(self, ops: list[CpuOp]) -> None:
        self.by_ext = {o.ext: o for o in ops if o.ext >= 0}
        self.by_tid: dict[Any, list[CpuOp]] = {}
        for o in sorted(ops, key=lambda o: o.start):
            self.by_tid.setdefault(o.tid, []).append(o)
        self.starts = {t: [o.start for o in lst] for t, lst in self.by_tid.items()}

    def around(self, tid: Any, t: int) -> list[CpuOp]:
        """The ops on thread `tid` open at time `t`, outermost first (among the few that began last: a
        call's ops nest a handful deep, so its outermost one is never far back)."""
        lst = self.by_tid.get(_tid(tid), [])
        k = bisect.bisect_right(self.starts.get(_tid(tid), []), t)
        return [o for o in lst[max(0, k - MAX_NESTED):k] if o.end >= t]

    def chain(self, args: dict[str, Any], launch: dict[str, Any] | None, ns: Callable[[Any], int]) -> list[CpuOp]:
        """The ops around a kernel's launch, outermost first: through its External id, else its launch event."""
        op = self.by_ext.get(_id(args, "External id"))
        if op is None and launch is not None:
            op = self.by_ext.get(_id(launch["args"] if isinstance(launch.get("args"), dict) else {}, "External id"))
            if op is None:
                return self.around(launch.get("tid"), ns(launch.get("ts")))
        if op is None:
            return []
        return [o for o in self.around(op.tid, op.start) if o is not op] + [op]


def _named(chain: list[CpuOp]) -> tuple[str, CpuOp | None, Any]:
    """(the collective's name, its record_param_comms op, the key of the call) from the ops around a launch."""
    call = next((o for o in chain if o.name.startswith("c10d::")), None)
    param = next((o for o in reversed(chain) if o.name == PARAM_COMMS), None)
    note = next((o for o in reversed(chain) if o.name.startswith("nccl:")), None)
    if param is not None and param.args.get("Collective name"):
        name = str(param.args["Collective name"])
    else:
        name = (call or note).name if (call or note) is not None else ""
    head = call or param or note
    return name, param, (head.tid, head.start, head.name) if head is not None else None


def link_kernels(kernels: list[dict[str, Any]], ops: list[CpuOp], launches: Launches | None,
                 ns: Callable[[Any], int]) -> list[dict[str, Any]]:
    """The kernel rows with what their launchers say: args taken over where the kernel has none, and the
    kernels of one collective call merged into one row. Kernels whose args already name their collective,
    and those whose launcher cannot be found, are returned as they are."""
    if not ops:
        return kernels
    finder = Launchers(ops)
    bare = [k for k in kernels if not k["args"].get("Collective name")]
    if not bare:
        return kernels
    # launch events are read (a second look at the text) only for kernels their External id does not place
    wanted = {_id(k["args"], "correlation") for k in bare if _id(k["args"], "External id") not in finder.by_ext}
    wanted.discard(-1)
    found = launches(wanted) if launches is not None and wanted else {}
    out: list[dict[str, Any]] = []
    calls: dict[Any, dict[str, Any]] = {}
    for k in kernels:
        if k["args"].get("Collective name"):
            out.append(k)
            continue
        name, param, key = _named(finder.chain(k["args"], found.get(_id(k["args"], "correlation")), ns))
        if not name:
            out.append(k)
            continue
        args = {a: param.args[a] for a in COMM_ARGS if param is not None and a in param.args}
        args.update(k["args"])
        args["Collective name"] = name
        row = {**k, "args": args}
        if normalize_op(name) in P2P_OPS or key is None:
            out.append(row)
        elif key in calls:         # another kernel of the same call: the call's row spans both
            calls[key]["start"] = min(calls[key]["start"], row["start"])
            calls[key]["end"] = max(calls[key]["end"], row["end"])
        else:
            calls[key] = row
            out.append(row)
    return out
