"""What each wrapped torch.distributed call is: its row's name and kind, where
its tensor, group and peer arguments are, and the row fields taken from them.

    SPECS["send"] == ("send", "p2p", "tensor", False, "dst", "group_dst", "send", False)

A spec is plain data; `ops.py` turns it into a wrapper once, at install, with
the argument positions resolved from the function's signature, so the call
itself does tuple indexing, not `inspect`.
"""
from __future__ import annotations

import inspect
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist

from ncclscope import schema as S

# name -> (op_name written, kind, input arg, input is a list, peer arg, group-local peer kwarg, p2p direction, always async)
_C, _P = S.KIND_COLLECTIVE, S.KIND_P2P
SPECS: dict[str, tuple[str, str, str, bool, str, str, str, bool]] = {
    "broadcast": ("broadcast", _C, "tensor", False, "src", "group_src", "", False),
    "all_reduce": ("all_reduce", _C, "tensor", False, "", "", "", False),
    "all_reduce_coalesced": ("all_reduce_coalesced", _C, "tensors", True, "", "", "", False),
    "reduce": ("reduce", _C, "tensor", False, "dst", "group_dst", "", False),
    "all_gather": ("all_gather", _C, "tensor", False, "", "", "", False),
    "all_gather_single": ("all_gather_into_tensor", _C, "input_tensor", False, "", "", "", False),
    "all_gather_into_tensor": ("all_gather_into_tensor", _C, "input_tensor", False, "", "", "", False),
    "_all_gather_base": ("all_gather_into_tensor", _C, "input_tensor", False, "", "", "", False),
    "all_gather_coalesced": ("all_gather_coalesced", _C, "input_tensor_list", True, "", "", "", False),
    "gather": ("gather", _C, "tensor", False, "dst", "group_dst", "", False),
    "scatter": ("scatter", _C, "tensor", False, "src", "group_src", "", False),
    "reduce_scatter": ("reduce_scatter", _C, "input_list", True, "", "", "", False),
    "reduce_scatter_single": ("reduce_scatter_tensor", _C, "input", False, "", "", "", False),
    "reduce_scatter_tensor": ("reduce_scatter_tensor", _C, "input", False, "", "", "", False),
    "_reduce_scatter_base": ("reduce_scatter_tensor", _C, "input", False, "", "", "", False),
    "all_to_all_single": ("all_to_all_single", _C, "input", False, "", "", "", False),
    "all_to_all": ("all_to_all", _C, "input_tensor_list", True, "", "", "", False),
    "barrier": ("barrier", _C, "", False, "", "", "", False),
    "monitored_barrier": ("monitored_barrier", _C, "", False, "", "", "", False),
    "all_gather_object": ("all_gather_object", _C, "", False, "", "", "", False),
    "gather_object": ("gather_object", _C, "", False, "dst", "group_dst", "", False),
    "broadcast_object_list": ("broadcast_object_list", _C, "", False, "src", "group_src", "", False),
    "scatter_object_list": ("scatter_object_list", _C, "", False, "src", "group_src", "", False),
    "isend": ("isend", _P, "tensor", False, "dst", "group_dst", "send", True),
    "irecv": ("irecv", _P, "tensor", False, "src", "group_src", "recv", True),
    "send": ("send", _P, "tensor", False, "dst", "group_dst", "send", False),
    "recv": ("recv", _P, "tensor", False, "src", "group_src", "recv", False),
    "send_object_list": ("send_object_list", _P, "", False, "dst", "group_dst", "send", False),
    "recv_object_list": ("recv_object_list", _P, "", False, "src", "group_src", "recv", False),
}
# object collectives: the list every member must size alike (the output list of all_gather_object has one
# slot per member; broadcast_object_list's list is as long on every rank): its length is the op's size
OBJECT_LISTS = {"broadcast_object_list": "object_list", "all_gather_object": "object_list",
                "scatter_object_list": "scatter_object_output_list"}
# ops the process group's collective counter does not count on every backend: gloo runs a monitored_barrier
# as tagged sends and receives, so it has no place in the group's collective order; it is numbered on a
# channel of its own, "<group>/barriers" (schema.BARRIER_CHANNEL: the two numberings once shared one
# instance, a healthy job's monitored_barrier and reduce_scatter both "#1", a false mismatch)
OWN_SEQ = frozenset({"monitored_barrier"})
REDUCE_NAMES = {int(getattr(dist.ReduceOp, n)): n.lower() for n in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND",
                                                                    "BOR", "BXOR") if hasattr(dist.ReduceOp, n)}
NO_META = ("[]", "", -1)


class _TLS(threading.local):
    depth = 0


# depth > 0 while a wrapped call runs on this thread: calls made from inside it
# (all_gather_object -> all_gather, new_subgroups -> new_group) pass straight through
tls = _TLS()


def list_meta(ts: Any) -> tuple[str, str, int]:
    """`comm_site.tensor_meta` (input_sizes text, dtype, bytes) for a list of tensors: every shape,
    the distinct dtypes, the bytes summed."""
    if not isinstance(ts, (list, tuple)):   # a wrong argument: torch's call will say so, not ours
        return NO_META
    ts = [t for t in ts if isinstance(t, torch.Tensor)]
    if not ts:
        return NO_META
    shapes = "[" + ", ".join(str(list(t.shape)) for t in ts) + "]"
    dtypes = ",".join(dict.fromkeys(str(t.dtype).replace("torch.", "") for t in ts))
    return shapes, dtypes, sum(t.numel() * t.element_size() for t in ts)


def object_list_meta(objs: Any) -> tuple[str, str, int]:
    """(input_sizes text, dtype, bytes) of an object collective's list: its length as the op's size, so a
    list one short on one rank is a size mismatch the analyzer can see (the objects' own sizes are
    pickled inside torch's call, after this row is written)."""
    if not isinstance(objs, list):
        return NO_META
    return f"[[{len(objs)}]]", "object", 0


def positions(fn: Callable[..., Any]) -> dict[str, int]:
    """Parameter name -> position in `fn`'s signature (empty when it has none Python can read)."""
    try:
        return {name: i for i, name in enumerate(inspect.signature(fn).parameters)}
    except (TypeError, ValueError):
        return {}


def arg(args: tuple[Any, ...], kwargs: dict[str, Any], pos: dict[str, int], name: str, default: Any = None) -> Any:
    i = pos.get(name, -1)
    if 0 <= i < len(args):
        return args[i]
    return kwargs.get(name, default)


def a2a_list_splits(inp: Any, out: Any, n: int) -> str:
    """The same ` splits [..]->[..]` for the list form, `all_to_all(output_tensor_list, input_tensor_list)`:
    the rows of input_tensor_list[j] go to member j, output_tensor_list[j] receives member j's (a 0-d tensor
    counts as one row). "" when either list is not n tensors."""
    def rows(ts: Any) -> list[int]:
        if not isinstance(ts, (list, tuple)) or len(ts) != n:
            return []
        return [int(t.shape[0]) if t.dim() else 1 for t in ts if hasattr(t, "dim")]
    try:
        return _splits_text(rows(inp), rows(out), n)
    except (TypeError, ValueError, AttributeError):
        return ""


def _splits_text(a: list[int], b: list[int], n: int) -> str:
    """` splits [a,b,..]->[c,d,..]`, "" unless both lists have one entry per member."""
    if len(a) != n or len(b) != n:
        return ""
    return f" splits [{','.join(map(str, a))}]->[{','.join(map(str, b))}]"


def a2a_splits(inp: Any, out: Any, in_splits: Any, out_splits: Any, n: int) -> str:
    """` splits [a,b,..]->[c,d,..]`: the rows `all_to_all_single` sends to each member and expects
    from each (an omitted split list is the even split of the tensor's first dimension), appended to
    the call's sizes (schema: `SPLITS_RE` in ncclscope/hang/a2a.py reads it back). Member i's
    send to j must equal j's receive from i; the sizes alone legitimately differ between ranks
    (MoE routing), so only these pairs can say which rank broke the exchange. "" when unknown."""
    try:
        def split(given: Any, t: Any) -> list[int]:
            if given is not None and len(given):
                return [int(x) for x in given]
            rows = int(t.shape[0]) if getattr(t, "dim", lambda: 0)() else 0
            return [rows // n] * n if n and rows % n == 0 else []
        return _splits_text(split(in_splits, inp), split(out_splits, out), n)
    except (TypeError, ValueError, AttributeError):
        return ""
