"""The tracer installed before a user's script runs: torch.distributed as data.

What it wraps (module-level `torch.distributed.X` and `distributed_c10d.X`
are the same objects; both names are replaced):
  - every public collective and p2p call, object collectives included: a
    begin row before the op, an end row when it completes (sync: when the
    call returns; async_op=True / isend / irecv: the Work's future callback,
    or the tracer's poller where the backend has no future), status error /
    timeout when it raised (the exception is re-raised untouched);
  - batch_isend_irecv: one p2p row per P2POp;
  - init_process_group, new_group, new_subgroups(_by_enumeration),
    init_device_mesh: the group table (name, kind, members, creation order)
    on every rank, written through `Recorder.write_meta(groups=...)`.
Calls made from inside a wrapped call (all_gather_object -> all_gather) are
passed straight through: one row per user call.

Sequence numbers: `collective_seq_id` is the process group's own counter
(`ProcessGroup._get_sequence_number_for_group() + 1`), the number Flight
Recorder stores, so a traced all_reduce and the DDP reducer's all_reduces
(which only Flight Recorder sees) are numbered on one scale and the FR merge
(`fr_merge.py`) can tell which FR entries are new. p2p ops count per
(direction, peer), as `ncclscope train` does.

Evidence, never intervention: `--timeout-s` makes the tracer's watchdog dump
stacks, a Flight Recorder snapshot and flush the trace when an op has been in
flight that long; the op goes on and nothing is raised into the script.
SIGTERM (what torchrun sends to the survivors when a rank fails) dumps the
same evidence from a helper thread, then the signal takes its normal course.
"""
from __future__ import annotations

import functools
import inspect
import os
import pickle
import select
import signal
import sys
import threading
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ncclscope import schema as S

ACTIVE: "Tracer | None" = None

from ncclscope.usertrace.fr_merge import FR_FILE  # noqa: E402  (snapshot name; NCCL's own dump is FR_NCCL_PREFIX<rank>)
POLL_S = 0.02
WATCH_S = 0.25
FR_EARLY_S = 1.0   # an op in flight this long gets a Flight Recorder snapshot (cheap, before any kill)

_PKG_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                  for m in (torch, sys.modules["ncclscope"]))

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
# ops the process group's collective counter does not count on every backend
_OWN_SEQ = frozenset({"monitored_barrier"})
_REDUCE_NAMES = {int(getattr(dist.ReduceOp, n)): n.lower() for n in ("SUM", "AVG", "PRODUCT", "MIN", "MAX", "BAND",
                                                                     "BOR", "BXOR") if hasattr(dist.ReduceOp, n)}


class _TLS(threading.local):
    depth = 0


_tls = _TLS()


class GroupInfo:
    __slots__ = ("name", "kind", "ranks", "order", "pg_name", "backend", "member")

    def __init__(self, name: str, kind: str, ranks: list[int], order: int, pg_name: str = "", backend: str = "",
                 member: bool = True) -> None:
        self.name, self.kind, self.ranks, self.order = name, kind, ranks, order
        self.pg_name, self.backend, self.member = pg_name, backend, member

    def describe(self) -> dict[str, Any]:
        """The group-table entry: the same on every rank (member-only facts live in rank.json)."""
        return {"name": self.name, "kind": self.kind, "ranks": self.ranks, "creation_order": self.order,
                "backend": self.backend}


@functools.lru_cache(maxsize=4096)
def _is_library(filename: str) -> bool:
    if not filename or filename.startswith("<"):
        return True
    path = os.path.abspath(filename)
    return path.startswith(_PKG_DIRS) or os.sep + "runpy.py" in path or os.sep + "contextlib.py" in path


@functools.lru_cache(maxsize=4096)
def _short(filename: str) -> str:
    try:
        rel = os.path.relpath(filename)
        return filename if rel.startswith("..") else rel
    except ValueError:
        return filename


_SITES: dict[tuple[Any, int], str] = {}


def call_site() -> str:
    """file:line of the first frame outside torch and ncclscope (the user's line)."""
    f: Any = sys._getframe(2)
    while f is not None:
        code = f.f_code
        if not _is_library(code.co_filename):
            key = (code, f.f_lineno)
            site = _SITES.get(key)
            if site is None:
                site = _SITES[key] = f"{_short(code.co_filename)}:{f.f_lineno}"
            return site
        f = f.f_back
    return ""


_META: dict[tuple[Any, Any], tuple[str, str, int]] = {}


def _tensor_meta(t: Any) -> tuple[str, str, int]:
    key = (t.shape, t.dtype)
    m = _META.get(key)
    if m is None:
        m = _META[key] = ("[" + str(list(t.shape)) + "]", str(t.dtype).replace("torch.", ""),
                          t.numel() * t.element_size())
    return m


def _list_meta(ts: Any) -> tuple[str, str, int]:
    ts = [t for t in (ts or []) if isinstance(t, torch.Tensor)]
    if not ts:
        return "[]", "", -1
    shapes = "[" + ", ".join(str(list(t.shape)) for t in ts) + "]"
    dtypes = ",".join(dict.fromkeys(str(t.dtype).replace("torch.", "") for t in ts))
    return shapes, dtypes, sum(t.numel() * t.element_size() for t in ts)


def _positions(fn: Callable[..., Any]) -> dict[str, int]:
    try:
        return {name: i for i, name in enumerate(inspect.signature(fn).parameters)}
    except (TypeError, ValueError):
        return {}


class Tracer:
    """One rank's tracer. `install()` patches torch.distributed; `close()` writes the last evidence."""

    def __init__(self, rec: Any, rank: int, world_size: int, timeout_s: float = 0.0) -> None:
        self.rec = rec
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = float(timeout_s or 0.0)
        self.groups: dict[Any, GroupInfo] = {}      # ProcessGroup -> info (members only)
        self.table: list[GroupInfo] = []            # every group this rank knows of, creation order
        self._groups_dirty = False
        self._p2p_seq: dict[tuple[str, int], int] = {}
        self._own_seq: dict[str, int] = {}
        self._inflight: dict[int, tuple[float, str, str, int]] = {}   # op_id -> (monotonic start, name, group, seq)
        self._evidenced: set[int] = set()
        self._fr_for: set[int] = set()
        self._pending: dict[int, tuple[Any, int]] = {}   # id(work) -> (work without a future, op_id)
        self._waiting: set[int] = set()             # ids of those works a thread is waiting on now
        self._pending_lock = threading.Lock()
        self._orig: dict[tuple[Any, str], Any] = {}
        self._explicit = False
        self._opt_steps: dict[int, int] = {}
        self._step_t = time.perf_counter()
        self._stop = threading.Event()
        self._hook: Any = None
        self._mesh_count = 0
        self._world_pg: Any = None
        self.ops = 0
        self._threads: list[threading.Thread] = []
        self._fr_lock = threading.Lock()
        self._sites: set[tuple[str, str, str]] = set()
        self._p2p_shift: dict[str, int] = {}        # group -> how far p2p ops moved its counter (gloo)
        self._last_activity = time.perf_counter()   # last op begin or step (same clock as perf/monotonic)
        self._idle_evidenced = -1.0
        import pyarrow as pa
        blank = []
        for fname, typ in S.METRIC_FIELDS:
            blank.append(rank if fname == "rank" else float("nan") if pa.types.is_floating(typ) else
                         [] if pa.types.is_list(typ) else "" if pa.types.is_string(typ) else -1)
        self._metric_blank = tuple(blank)
        self._mi_step, self._mi_time, self._mi_dt = (S.METRIC_COLUMNS.index(c) for c in
                                                     ("step", "time_ns", "step_time_s"))

    # ---- install ------------------------------------------------------------
    def install(self) -> "Tracer":
        global ACTIVE
        ACTIVE = self
        modules = [c10d, dist]
        for name, spec in SPECS.items():
            orig = getattr(c10d, name, None)
            if orig is None:
                continue
            wrapped = self._wrap_op(name, orig, spec)
            self._patch(modules, name, orig, wrapped)
        self._patch(modules, "batch_isend_irecv", c10d.batch_isend_irecv, self._wrap_batch(c10d.batch_isend_irecv))
        self._patch(modules, "init_process_group", c10d.init_process_group,
                    self._wrap_init(c10d.init_process_group))
        self._patch(modules, "new_group", c10d.new_group, self._wrap_new_group(c10d.new_group))
        for name in ("new_subgroups", "new_subgroups_by_enumeration"):
            if hasattr(c10d, name):
                self._patch(modules, name, getattr(c10d, name), self._wrap_outer(getattr(c10d, name)))
        try:
            import torch.distributed.device_mesh as dm
            self._patch([dm, dist], "init_device_mesh", dm.init_device_mesh, self._wrap_mesh(dm.init_device_mesh))
        except (ImportError, AttributeError):
            pass
        work_cls = getattr(dist, "Work", None)
        if work_cls is not None and hasattr(work_cls, "wait"):
            self._patch([work_cls], "wait", work_cls.wait, self._wrap_wait(work_cls.wait))
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook
            self._hook = register_optimizer_step_post_hook(self._optimizer_stepped)
        except (ImportError, AttributeError):
            pass
        if dist.is_available() and dist.is_initialized():   # a script that runs under a pre-initialised world
            self._register_world()
        t = threading.Thread(target=self._watch, name="ncclscope-tracer-watch", daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def _patch(self, modules: list[Any], name: str, orig: Any, wrapped: Any) -> None:
        for m in modules:
            if getattr(m, name, None) is orig:
                self._orig[(m, name)] = orig
                setattr(m, name, wrapped)

    def uninstall(self) -> None:
        global ACTIVE
        for (m, name), orig in self._orig.items():
            setattr(m, name, orig)
        self._orig.clear()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if ACTIVE is self:
            ACTIVE = None

    # ---- groups ---------------------------------------------------------------
    def _add_group(self, info: GroupInfo, pg: Any = None) -> GroupInfo:
        self.table.append(info)
        if pg is not None and info.member:
            self.groups[pg] = info
        self._groups_dirty = True
        return info

    def write_groups(self) -> None:
        self._groups_dirty = False
        backend = next((g.backend for g in self.table if g.backend), "")
        for g in self.table:
            g.backend = g.backend or backend   # non-members cannot ask torch; one backend per job here
        try:
            # fr_pg_names: torch's pg name -> our name, for the groups this rank is in (fr_merge maps FR with it)
            self.rec.write_meta(groups=[g.describe() for g in self.table],
                                fr_pg_names={g.pg_name: g.name for g in self.table if g.member and g.pg_name})
        except OSError as exc:
            print(f"ncclscope: rank {self.rank}: writing the group table failed: {exc}", file=sys.stderr)

    def _register_world(self) -> None:
        pg = c10d._get_default_group()
        self._world_pg = pg
        if pg in self.groups:
            return
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        old = next((g for g in self.table if g.name == "world"), None)
        if old is not None:   # re-initialised after destroy_process_group: the same world, a new handle
            old.pg_name, old.ranks = str(getattr(pg, "group_name", "0")), list(range(self.world_size))
            self.groups[pg] = old
            self._p2p_shift.pop("world", None)
        else:
            self._add_group(GroupInfo("world", "world", list(range(self.world_size)), len(self.table),
                                      str(getattr(pg, "group_name", "0")), str(dist.get_backend(pg))), pg)
        self.write_groups()

    def _group_of(self, pg: Any) -> GroupInfo | None:
        if pg is None:
            pg = self._world_pg
            if pg is None:
                if not dist.is_initialized():
                    return None
                self._register_world()
                pg = self._world_pg
        info = self.groups.get(pg)
        if info is None:
            if pg is c10d.GroupMember.NON_GROUP_MEMBER:
                return None
            try:   # created behind our back (a library's own new_group, split_group): name it by torch's name
                ranks = [int(r) for r in dist.get_process_group_ranks(pg)]
                name = str(getattr(pg, "group_name", ""))
                info = self._add_group(GroupInfo(f"pg{name}", "custom", ranks, len(self.table), name,
                                                 str(dist.get_backend(pg))), pg)
            except (RuntimeError, ValueError, KeyError, AttributeError):
                return None
        return info

    def _wrap_init(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(orig)
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            out = orig(*args, **kwargs)
            self._world_pg = None
            try:
                self._register_world()
                self.rec.write_meta(world_size=self.world_size, backend=str(dist.get_backend()))
            except Exception as exc:   # never let bookkeeping break the user's init
                print(f"ncclscope: rank {self.rank}: recording the world group failed: {exc}", file=sys.stderr)
            return out
        return init_process_group

    def _wrap_new_group(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        pos = _positions(orig)

        @functools.wraps(orig)
        def new_group(*args: Any, **kwargs: Any) -> Any:
            ranks = _arg(args, kwargs, pos, "ranks")
            members = sorted(int(r) for r in ranks) if ranks is not None else list(range(dist.get_world_size()))
            order = len(self.table)
            info = GroupInfo(f"g{order}", "custom", members, order, member=self.rank in members)
            self._add_group(info)
            if _tls.depth == 0:
                self.write_groups()   # the planned group is on disk before creation can hang
            pg = orig(*args, **kwargs)
            if pg is not None and pg is not c10d.GroupMember.NON_GROUP_MEMBER:
                info.pg_name = str(getattr(pg, "group_name", ""))
                try:
                    info.backend = str(dist.get_backend(pg))
                except (RuntimeError, ValueError):
                    pass
                self.groups[pg] = info
            if _tls.depth == 0:
                self.write_groups()
            return pg
        return new_group

    def _wrap_outer(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(orig)
        def outer(*args: Any, **kwargs: Any) -> Any:
            _tls.depth += 1
            try:
                return orig(*args, **kwargs)
            finally:
                _tls.depth -= 1
                if _tls.depth == 0:
                    self.write_groups()
        return outer

    def _wrap_mesh(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(orig)
        def init_device_mesh(*args: Any, **kwargs: Any) -> Any:
            _tls.depth += 1
            try:
                mesh = orig(*args, **kwargs)
            finally:
                _tls.depth -= 1
            try:
                self._record_mesh(mesh)
            except Exception as exc:
                print(f"ncclscope: rank {self.rank}: recording the device mesh failed: {exc}", file=sys.stderr)
            if _tls.depth == 0:
                self.write_groups()
            return mesh
        return init_device_mesh

    def _record_mesh(self, mesh: Any) -> None:
        """Every slice of every mesh dimension as a group named `<dim><i>` (dp0, tp1, ...), on every rank."""
        m = self._mesh_count
        self._mesh_count += 1
        grid = mesh.mesh
        names = list(mesh.mesh_dim_names or [f"mesh{m}d{d}_" for d in range(grid.ndim)])
        for d, dim_name in enumerate(names):
            pg = mesh.get_group(d)
            known = self.groups.get(pg)
            rows = grid.transpose(d, -1).reshape(-1, grid.shape[d]).tolist()
            kind = dim_name if dim_name in S.GROUP_KINDS else "custom"
            for i, members in enumerate(rows):
                members = [int(x) for x in members]
                mine = self.rank in members
                if mine and known is not None and known.ranks == sorted(members) and known.kind == "world":
                    continue   # a 1-D mesh over the world reuses the default group
                info = GroupInfo(f"{dim_name}{i}", kind, members, len(self.table), member=mine)
                if mine:
                    info.pg_name = str(getattr(pg, "group_name", ""))
                    try:
                        info.backend = str(dist.get_backend(pg))
                    except (RuntimeError, ValueError):
                        pass
                    old = self.groups.get(pg)
                    if old is not None and old in self.table and old.name.startswith(("g", "pg")):
                        self.table.remove(old)   # the mesh's name replaces the generic one
                    self._add_group(info, pg)
                else:
                    self._add_group(info)

    # ---- ops ------------------------------------------------------------------
    def _wrap_op(self, fname: str, orig: Callable[..., Any], spec: tuple[Any, ...]) -> Callable[..., Any]:
        op_name, kind, in_arg, in_list, peer_arg, gpeer_arg, p2p_dir, always_async = spec
        pos = _positions(orig)
        i_in, i_group, i_async = pos.get(in_arg, -1), pos.get("group", -1), pos.get("async_op", -1)
        i_op, i_peer, i_tag = pos.get("op", -1), pos.get(peer_arg, -1), pos.get("tag", -1)
        own_seq = fname in _OWN_SEQ
        rec = self.rec
        tls = _tls

        @functools.wraps(orig)
        def traced(*args: Any, **kwargs: Any) -> Any:
            if tls.depth:
                return orig(*args, **kwargs)
            n = len(args)
            pg = args[i_group] if 0 <= i_group < n else kwargs.get("group")
            g = self._group_of(pg)
            if g is None:
                return orig(*args, **kwargs)
            if self._groups_dirty:
                self.write_groups()
            if in_arg:
                t = args[i_in] if 0 <= i_in < n else kwargs.get(in_arg)
                sizes, dtype, nbytes = (_list_meta(t) if in_list else
                                        _tensor_meta(t) if isinstance(t, torch.Tensor) else ("[]", "", -1))
            else:
                sizes, dtype, nbytes = "[]", "", -1
            peer, tag, seq, p2p_seq, reduce_op = -1, -1, -1, -1, ""
            if peer_arg:
                p = args[i_peer] if 0 <= i_peer < n else kwargs.get(peer_arg)
                if p is None and kwargs.get(gpeer_arg) is not None:
                    p = g.ranks[int(kwargs[gpeer_arg])] if int(kwargs[gpeer_arg]) < len(g.ranks) else -1
                peer = -1 if p is None else int(p)
            if p2p_dir:
                tag = int((args[i_tag] if 0 <= i_tag < n else kwargs.get("tag", 0)) or 0) if i_tag >= 0 else 0
                key = (p2p_dir, peer)
                p2p_seq = self._p2p_seq.get(key, 0) + 1
                self._p2p_seq[key] = p2p_seq
            elif own_seq:
                seq = self._own_seq.get(g.name, 0) + 1
                self._own_seq[g.name] = seq
            else:
                try:
                    seq = (pg or self._world_pg)._get_sequence_number_for_group() + 1 - self._p2p_shift.get(g.name, 0)
                except (AttributeError, RuntimeError):
                    seq = self._own_seq.get(g.name, 0) + 1
                    self._own_seq[g.name] = seq
            if i_op >= 0:
                rop = args[i_op] if i_op < n else kwargs.get("op")
                if rop is not None:
                    try:
                        reduce_op = _REDUCE_NAMES.get(int(rop), str(rop))
                    except (TypeError, ValueError):
                        reduce_op = str(rop)
            is_async = always_async or bool(args[i_async] if 0 <= i_async < n else kwargs.get("async_op", False))
            site = call_site()
            op_id = rec.begin(kind, op_name, group=g.name, seq=seq, p2p_seq=p2p_seq, peer=peer, tag=tag,
                              nbytes=nbytes, dtype=dtype, sizes=sizes, reduce_op=reduce_op,
                              timeout_ms=int(self.timeout_s * 1000) if self.timeout_s else -1,
                              call_site=site)
            self._inflight[op_id] = (now := time.monotonic(), op_name, g.name, seq if seq >= 0 else p2p_seq)
            self._last_activity = now
            key = (site, g.name, op_name)
            if key not in self._sites:
                self._new_site(key)
            self.ops += 1
            tls.depth = 1
            if p2p_dir:
                before = self._pg_seq(pg)
            try:
                out = orig(*args, **kwargs)
            except BaseException as exc:
                tls.depth = 0
                self._failed(op_id, exc)
                raise
            finally:
                if p2p_dir:
                    self._count_p2p(g.name, pg, before)
            tls.depth = 0
            if is_async and out is not None and not isinstance(out, (int, list)):
                self._on_complete(out, op_id)
            else:
                self._inflight.pop(op_id, None)
                rec.end(op_id, S.STATUS_OK)
            return out
        traced.__ncclscope_orig__ = orig   # type: ignore[attr-defined]
        return traced

    def _wrap_batch(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        rec = self.rec

        @functools.wraps(orig)
        def batch_isend_irecv(p2p_op_list: Any) -> Any:
            if _tls.depth:
                return orig(p2p_op_list)
            begun = []
            site = call_site()
            for p in p2p_op_list:
                fn = getattr(p.op, "__ncclscope_orig__", p.op)
                name = getattr(fn, "__name__", "isend")
                direction = "recv" if "recv" in name else "send"
                g = self._group_of(getattr(p, "group", None))
                peer = int(getattr(p, "peer", -1) if getattr(p, "peer", None) is not None else -1)
                key = (direction, peer)
                pseq = self._p2p_seq.get(key, 0) + 1
                self._p2p_seq[key] = pseq
                sizes, dtype, nbytes = _tensor_meta(p.tensor) if isinstance(p.tensor, torch.Tensor) else ("[]", "", -1)
                op_id = rec.begin(S.KIND_P2P, "irecv" if direction == "recv" else "isend",
                                  group="" if g is None else g.name, p2p_seq=pseq, peer=peer,
                                  tag=int(getattr(p, "tag", 0) or 0), nbytes=nbytes, dtype=dtype, sizes=sizes,
                                  timeout_ms=int(self.timeout_s * 1000) if self.timeout_s else -1, call_site=site)
                self._inflight[op_id] = (time.monotonic(), name, "" if g is None else g.name, pseq)
                begun.append(op_id)
                key = (site, "" if g is None else g.name, name)
                if key not in self._sites:
                    self._new_site(key)
            self.ops += len(begun)
            _tls.depth = 1
            pgs = {}
            for p in p2p_op_list:
                g = self._group_of(getattr(p, "group", None))
                if g is not None:
                    pgs[g.name] = (getattr(p, "group", None), self._pg_seq(getattr(p, "group", None)))
            try:
                works = orig(p2p_op_list)
            except BaseException as exc:
                _tls.depth = 0
                for op_id in begun:
                    self._failed(op_id, exc, evidence=op_id == begun[-1])
                raise
            finally:
                for name, (pg, before) in pgs.items():
                    self._count_p2p(name, pg, before)
            _tls.depth = 0
            works_list = list(works or [])
            for i, op_id in enumerate(begun):
                if i < len(works_list) and len(works_list) == len(begun):
                    self._on_complete(works_list[i], op_id)
                elif works_list:
                    self._on_complete(works_list[-1], op_id)
                else:
                    self._inflight.pop(op_id, None)
                    rec.end(op_id, S.STATUS_OK)
            return works
        return batch_isend_irecv

    def _pg_seq(self, pg: Any) -> int:
        try:
            return int((pg or self._world_pg)._get_sequence_number_for_group())
        except (AttributeError, RuntimeError, TypeError):
            return -1

    def _count_p2p(self, name: str, pg: Any, before: int) -> None:
        """gloo's group counter also counts p2p ops (NCCL's does not; Flight Recorder's
        collective_seq_id never does): remember how far p2p moved it, so collectives
        keep FR's numbering."""
        if before >= 0:
            after = self._pg_seq(pg)
            if after > before:
                self._p2p_shift[name] = self._p2p_shift.get(name, 0) + (after - before)

    def _new_site(self, key: tuple[str, str, str]) -> None:
        """First op from this (call site, group, op): make the rows so far durable before it is issued.

        The op most likely to kill the process (gloo SIGABRTs a rank whose
        collective does not match its peers') is a call the job has not made
        before, and the flusher's 200 ms interval is longer than such a job
        lives after it. So, once per distinct call site: a Flight Recorder
        snapshot and a synchronous flush (a few ms, a handful of times per job)."""
        self._sites.add(key)
        self.dump_fr()
        try:
            self.rec.flush()
        except Exception:
            pass

    def _on_complete(self, work: Any, op_id: int) -> None:
        """End row when an async op completes: the Work's future, else the poller."""
        try:
            fut = work.get_future()
        except (RuntimeError, AttributeError, NotImplementedError):
            fut = None
        if fut is not None:
            def done(f: Any, op_id: int = op_id) -> None:
                self._inflight.pop(op_id, None)
                try:
                    f.value()
                    self.rec.end(op_id, S.STATUS_OK)
                except Exception as exc:   # the user sees it through wait(); we only record it
                    self.rec.end(op_id, S.STATUS_ERROR, _text(exc))
            try:
                fut.add_done_callback(done)
                return
            except RuntimeError:
                pass
        with self._pending_lock:
            self._pending[id(work)] = (work, op_id)

    def _failed(self, op_id: int, exc: BaseException, evidence: bool = True) -> None:
        self._inflight.pop(op_id, None)
        text = _text(exc)
        low = text.lower()
        status = S.STATUS_TIMEOUT if ("timed out" in low or "timeout" in low) else S.STATUS_ERROR
        self.rec.end(op_id, status, text)
        if evidence:
            self.evidence(f"{status} in op {op_id}: {text[:200]}", stacks=status == S.STATUS_TIMEOUT)

    # ---- steps and markers -------------------------------------------------------
    def _optimizer_stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self._explicit:
            return
        k = id(optimizer)
        n = self._opt_steps.get(k, 0) + 1
        self._opt_steps[k] = n
        if n > self.rec.context.step:      # several optimizers stepping together are one step
            self._close_step(n)

    def _close_step(self, next_step: int) -> None:
        """One metrics row for the step that ended (its wall time), one marker row for the next.

        On the hot path of every optimizer step, so the metrics row is a prebuilt
        tuple filled in place (Recorder.metric builds it field by field: ~15 us) and
        memory is left to the sampler's 10 Hz RSS / NVML samples (reading
        /proc/self/statm every step costs another ~20 us)."""
        now = time.perf_counter()
        ctx = self.rec.context
        if ctx.step >= 0:
            row = list(self._metric_blank)
            row[self._mi_step], row[self._mi_time] = ctx.step, time.time_ns()
            row[self._mi_dt] = now - self._step_t
            self.rec.metrics.rows.append(tuple(row))
        self._step_t = self._last_activity = now
        ctx.step = next_step
        self.rec.instant(S.KIND_MARKER, "step", message=f"step {next_step} begins")

    def explicit_step(self, n: int | None = None) -> None:
        self._explicit = True
        self._close_step(self.rec.context.step + 1 if n is None else int(n))

    def annotate(self, name: str) -> None:
        self.rec.instant(S.KIND_MARKER, "annotation", message=str(name)[:500])

    # ---- evidence -----------------------------------------------------------------
    def dump_fr(self) -> bool:
        """Write this rank's Flight Recorder buffer into the rank directory (atomic)."""
        fn = getattr(torch._C._distributed_c10d, "_dump_fr_trace", None)
        if fn is None:
            return False
        with self._fr_lock:
            try:
                data = fn()
            except Exception:
                return False
            if not data:
                return False
            try:
                tmp = self.rec.dir / (FR_FILE + ".tmp")
                tmp.write_bytes(data if isinstance(data, bytes) else pickle.dumps(data))
                os.replace(tmp, self.rec.dir / FR_FILE)
            except OSError:
                return False
        return True

    def evidence(self, reason: str, stacks: bool = True) -> None:
        if stacks:
            try:
                self.rec.dump_stacks(reason)
            except (OSError, ValueError):
                pass
        self.dump_fr()
        try:
            self.rec.flush()
        except Exception:
            pass

    def _watch(self) -> None:
        next_watch = 0.0
        while not self._stop.is_set():
            with self._pending_lock:
                pending = self._pending
            self._stop.wait(POLL_S if pending else WATCH_S)
            if pending:
                self._poll()
            now = time.monotonic()
            if now < next_watch:
                continue
            next_watch = now + WATCH_S
            idle = now - self._last_activity
            if (self.timeout_s and idle >= self.timeout_s and not self._inflight
                    and self._idle_evidenced != self._last_activity and self._world_pg is not None):
                # nothing the tracer sees is in flight, yet nothing moved: the job may be blocked in an op
                # only the backend knows (DDP's reducer, a DTensor collective) or in compute
                self._idle_evidenced = self._last_activity
                msg = (f"no traced op or step for {idle:.1f} s (--timeout-s {self.timeout_s:g}): stacks, "
                       "Flight Recorder and trace dumped; the job goes on")
                self.rec.instant(S.KIND_MARKER, "idle", message=msg)
                self.evidence(msg)
            for op_id, (start, name, group, seq) in list(self._inflight.items()):
                age = now - start
                if age >= FR_EARLY_S and op_id not in self._fr_for:
                    self._fr_for.add(op_id)
                    self.dump_fr()
                if self.timeout_s and age >= self.timeout_s and op_id not in self._evidenced:
                    self._evidenced.add(op_id)
                    msg = (f"{name} #{seq} on {group} in flight {age:.1f} s (--timeout-s {self.timeout_s:g}): "
                           "stacks, Flight Recorder and trace dumped; the op continues")
                    self.rec.instant(S.KIND_MARKER, name, message=msg, status=S.STATUS_SUSPECT)
                    self.evidence(msg)

    def _poll(self) -> None:
        """End rows for future-less works (gloo p2p) that completed without anyone waiting on them."""
        with self._pending_lock:
            items = list(self._pending.items())
        for key, (work, op_id) in items:
            if key in self._waiting:
                continue   # the wait() wrapper records it, with the outcome
            try:
                done = work.is_completed()
            except Exception:
                done = True
            if done:
                with self._pending_lock:
                    if key in self._waiting or self._pending.pop(key, None) is None:
                        continue
                self._inflight.pop(op_id, None)
                self.rec.end(op_id, S.STATUS_OK)

    def _wrap_wait(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        """Work.wait for the works the tracer has no future for: the end row at the
        wait, with its outcome (a timed-out gloo send is 'completed' too)."""
        pending, waiting, lock = self._pending, self._waiting, self._pending_lock

        @functools.wraps(orig)
        def wait(work: Any, *args: Any, **kwargs: Any) -> Any:
            key = id(work)
            if key not in pending:
                return orig(work, *args, **kwargs)
            waiting.add(key)
            try:
                out = orig(work, *args, **kwargs)
            except BaseException as exc:
                with lock:
                    entry = pending.pop(key, None)
                waiting.discard(key)
                if entry is not None:
                    self._failed(entry[1], exc)
                raise
            with lock:
                entry = pending.pop(key, None)
            waiting.discard(key)
            if entry is not None:
                self._inflight.pop(entry[1], None)
                self.rec.end(entry[1], S.STATUS_OK)
            return out
        return wait

    def close(self) -> None:
        """Last evidence at exit: pending completions, a Flight Recorder snapshot, the last step's metrics."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout=1)
        self._poll()
        if self._groups_dirty:
            self.write_groups()
        self.dump_fr()
        self.uninstall()
        handler = getattr(self, "_sig_handler", None)
        if handler is not None and threading.current_thread() is threading.main_thread():
            try:
                if signal.getsignal(signal.SIGTERM) is handler:
                    signal.signal(signal.SIGTERM, signal.SIG_DFL)
                    signal.set_wakeup_fd(-1)
            except (ValueError, OSError):
                pass

    # ---- SIGTERM --------------------------------------------------------------------
    def watch_sigterm(self) -> None:
        """Dump evidence on SIGTERM even while the main thread is blocked inside a collective.

        A Python signal handler only runs when the main thread gets back to the
        interpreter, which a rank hung in gloo or NCCL never does. The C-level
        handler does write the signal number to the wakeup fd, though, so a helper
        thread reading that fd dumps stacks, Flight Recorder and the trace, then lets
        SIGTERM do what it would have done without ncclscope (terminate), unless the
        script installed its own handler, which then runs as usual."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None):
            return   # the script (or its launcher) owns SIGTERM
        try:
            r, w = os.pipe()
            os.set_blocking(w, False)
            signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        except (ValueError, OSError):
            return

        term_lock = threading.Lock()

        def on_sigterm() -> None:
            """Evidence once (whichever of the two paths gets here first), then the default action."""
            if not term_lock.acquire(blocking=False):
                time.sleep(30)   # the other path is dumping and will end the process
                return
            try:
                self.rec.instant(S.KIND_MARKER, "signal", message="SIGTERM received")
                self.evidence("SIGTERM received")
                self.rec.close("error", "terminated by SIGTERM")
            finally:
                _die(signal.SIGTERM)

        def handler(signum: int, frame: Any) -> None:   # runs only when the main thread is free
            on_sigterm()

        signal.signal(signal.SIGTERM, handler)
        self._sig_handler = handler

        def reader() -> None:
            while True:
                try:
                    ready, _, _ = select.select([r], [], [], 1.0)
                    if not ready:
                        if self._stop.is_set() and ACTIVE is not self:
                            return
                        continue
                    data = os.read(r, 64)
                except OSError:
                    return
                if signal.SIGTERM in data:
                    if signal.getsignal(signal.SIGTERM) is handler:
                        on_sigterm()
                    return

        t = threading.Thread(target=reader, name="ncclscope-sigterm", daemon=True)
        t.start()


def _die(signum: int) -> None:
    """End the process by `signum` with the default action, from any thread."""
    try:
        import ctypes
        libc = ctypes.CDLL(None)
        libc.signal(signum, ctypes.c_void_p(0))   # SIG_DFL, process-wide, no main-thread rule
        os.kill(os.getpid(), signum)
        time.sleep(5)
    finally:
        os._exit(128 + signum)


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], pos: dict[str, int], name: str, default: Any = None) -> Any:
    i = pos.get(name, -1)
    if 0 <= i < len(args):
        return args[i]
    return kwargs.get(name, default)


def _text(exc: BaseException) -> str:
    s = str(exc).strip()
    return (f"{type(exc).__name__}: {s.splitlines()[0] if s else ''}")[:500]


_PROC: Any = None


def _memory_bytes() -> int:
    """CUDA allocated, else this process's RSS (the psutil handle is made once: it costs ~0.5 ms)."""
    global _PROC
    try:
        if torch.cuda.is_initialized():
            return int(torch.cuda.memory_allocated())
        if _PROC is None:
            import psutil
            _PROC = psutil.Process()
        return int(_PROC.memory_info().rss)
    except Exception:
        return -1
