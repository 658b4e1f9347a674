"""Groups are data: every process group the job creates, on every rank.

`init_process_group`, `new_group`, `new_subgroups(_by_enumeration)` and
`init_device_mesh` are wrapped so that the group table (name, kind, member
ranks, creation order, backend) is written through
`Recorder.write_meta(groups=...)` on every rank, members or not, the planned
group before its creation can hang. A device mesh's dimensions become groups
named `<dim><i>` (dp0, tp1, ...); a group made behind the tracer's back (a
library's own new_group) is named by torch's name, `pg<name>`, the first time
an op uses it. `fr_pg_names` (torch's pg name -> ours) lets the loader map
Flight Recorder entries onto the same names.

`GroupsMixin` is one facet of `tracer.Tracer`; the state it reads
(`groups`, `table`, `_world_pg`, `_p2p_shift`, ...) is set in `Tracer.__init__`.
"""
from __future__ import annotations

import functools
import sys
from typing import Any, Callable

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ncclscope import schema as S

from ncclscope.runtime.usertrace.callsite import call_site
from ncclscope.runtime.usertrace.opspec import arg, positions, tls


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


class GroupsMixin:
    rec: Any
    rank: int
    world_size: int
    groups: dict[Any, GroupInfo]
    table: list[GroupInfo]
    _groups_dirty: bool
    _world_pg: Any
    _p2p_shift: dict[str, int]
    _mesh_count: int
    _group_sites: dict[str, str]      # group name -> the user's new_group line (rank.json `group_sites`)

    def _add_group(self, info: GroupInfo, pg: Any = None) -> GroupInfo:
        self.table.append(info)
        if pg is not None and info.member:
            self.groups[pg] = info
        self._groups_dirty = True
        return info

    def write_groups(self) -> None:
        """The group table and any pending rank.json fields, written from the thread that calls this
        (the script's: the recorder's write_meta is not meant for two writers at once)."""
        self._groups_dirty = False
        backend = next((g.backend for g in self.table if g.backend), "")
        for g in self.table:
            g.backend = g.backend or backend   # non-members cannot ask torch; one backend per job here
        pending = self._take_pending_meta()
        try:
            # fr_pg_names: torch's pg name -> our name, for the groups this rank is in (fr_merge maps FR with it)
            self.rec.write_meta(groups=[g.describe() for g in self.table],
                                fr_pg_names={g.pg_name: g.name for g in self.table if g.member and g.pg_name},
                                group_sites=dict(self._group_sites), **pending)
        except OSError as exc:
            print(f"ncclscope: rank {self.rank}: writing the group table failed: {exc}", file=sys.stderr)

    def _take_pending_meta(self) -> dict[str, Any]:   # overridden by the Tracer (clock offsets)
        return {}

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

    def _world_ready(self) -> None:   # overridden by the Tracer (clock offsets through the store)
        pass

    def _wrap_init(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(orig)
        def init_process_group(*args: Any, **kwargs: Any) -> Any:
            out = orig(*args, **kwargs)
            self._world_pg = None
            try:
                self._register_world()
                self.rec.write_meta(world_size=self.world_size, backend=str(dist.get_backend()))
                self._world_ready()
            except Exception as exc:   # never let bookkeeping break the user's init
                print(f"ncclscope: rank {self.rank}: recording the world group failed: {exc}", file=sys.stderr)
            return out
        return init_process_group

    def _wrap_new_group(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        pos = positions(orig)

        @functools.wraps(orig)
        def new_group(*args: Any, **kwargs: Any) -> Any:
            ranks = arg(args, kwargs, pos, "ranks")
            members = sorted(int(r) for r in ranks) if ranks is not None else list(range(dist.get_world_size()))
            order = len(self.table)
            info = GroupInfo(f"g{order}", "custom", members, order, member=self.rank in members)
            if tls.depth == 0 and (site := call_site()):   # where this rank created it (not inside a mesh)
                self._group_sites[info.name] = site
            self._add_group(info)
            if tls.depth == 0:
                self.write_groups()   # the planned group is on disk before creation can hang
            pg = orig(*args, **kwargs)
            if pg is not None and pg is not c10d.GroupMember.NON_GROUP_MEMBER:
                info.pg_name = str(getattr(pg, "group_name", ""))
                try:
                    info.backend = str(dist.get_backend(pg))
                except (RuntimeError, ValueError):
                    pass
                self.groups[pg] = info
            if tls.depth == 0:
                self.write_groups()
            return pg
        return new_group

    def _wrap_outer(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(orig)
        def outer(*args: Any, **kwargs: Any) -> Any:
            tls.depth += 1
            try:
                return orig(*args, **kwargs)
            finally:
                tls.depth -= 1
                if tls.depth == 0:
                    self.write_groups()
        return outer

    def _wrap_mesh(self, orig: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(orig)
        def init_device_mesh(*args: Any, **kwargs: Any) -> Any:
            site = call_site() if tls.depth == 0 else ""
            tls.depth += 1
            try:
                mesh = orig(*args, **kwargs)
            finally:
                tls.depth -= 1
            try:
                before = len(self.table)
                self._record_mesh(mesh)
                if site:
                    self._group_sites.update((g.name, site) for g in self.table[before:])
            except Exception as exc:
                print(f"ncclscope: rank {self.rank}: recording the device mesh failed: {exc}", file=sys.stderr)
            if tls.depth == 0:
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
