"""Flight Recorder group table rows: each present member's view of the groups the op labels
name, and each rank's own pg_config view of the groups no label names (created but never
used, or listed with different members by different ranks)."""
from __future__ import annotations

from typing import Any

from ncclscope.load.foreign.vocab import group_kind, parse_ranks


def build_group_rows(labels: list[str], members: list[tuple[int, ...]], info: list[tuple[str, str]], present: set[int],
                backend_of: dict[str, str]) -> list[dict[str, Any]]:
    """Group table rows: every present member's view (all alike: FR has one view per group)."""
    order = sorted(range(len(labels)), key=lambda i: (_order_key(info[i][0]), labels[i]))
    rows = []
    for pos, i in enumerate(order):
        lab, mem = labels[i], members[i]
        kind = group_kind(info[i][1], lab)
        for r in mem:
            if r in present:
                rows.append({"rank": r, "process_group": lab, "group_kind": kind, "ranks": [int(x) for x in mem],
                             "creation_order": pos, "backend": str(backend_of.get(lab, ""))})
    return rows


def config_disagreements(dumps: dict[int, dict[str, Any]], taken: set[str], used: set[str]) -> list[dict[str, Any]]:
    """Each rank's own pg_config view of the groups no op label names: groups created but never
    used (a job that stopped before using them), and groups whose member lists differ between ranks'
    dumps (same name, different members: the ranks created their groups differently; op labels
    split those by members), so the group view check can vote on them. Different lists that are
    the slices of one split (`consistent_split`) are no disagreement: unused, each slice is its own
    group ("1[0,1]", "1[2,3]"); used, the op labels carry them."""
    views: dict[str, dict[int, tuple[tuple[int, ...], int, str]]] = {}
    for rank, dump in dumps.items():
        cfg = dump.get("pg_config")
        if not isinstance(cfg, dict):
            continue
        for pos, (pg_name, info) in enumerate(cfg.items()):
            members = parse_ranks(info.get("ranks")) if isinstance(info, dict) else None
            desc = str(info.get("desc", "")) if isinstance(info, dict) else ""
            if members and str(pg_name) and desc != "default_pg":      # gloo's unnamed '' is the default pg
                views.setdefault(str(pg_name), {})[rank] = (members, pos, desc)
    rows = []
    for name, per_rank in views.items():
        agree = len({m for m, _, _ in per_rank.values()}) < 2
        split = not agree and consistent_split({r: m for r, (m, _, _) in per_rank.items()})
        if name in taken or ((agree or split) and name in used):   # an op label already carries it
            continue
        for rank, (members, pos, desc) in sorted(per_rank.items()):
            label = f"{name}[{','.join(map(str, members))}]" if split else name     # one group per slice
            rows.append({"rank": int(rank), "process_group": label, "group_kind": group_kind(desc, name),
                         "ranks": [int(x) for x in members], "creation_order": pos, "backend": ""})
    return rows


def consistent_split(views: dict[int, tuple[int, ...]]) -> bool:
    """Whether ranks' different member lists for one group name are the slices of one split, not a
    disagreement. `split_group` (and a new_group each rank calls for its own slice only) names each
    rank's slice by a counter every rank bumps alike, so ranks in different slices hold one name with
    different members; torch's analyzer keys groups by (name, rank) for that reason. They are one split
    when every rank's list holds itself, the lists are pairwise equal or disjoint (no rank is in two
    slices), and each rank a list names that has a view of the name holds that same list. A rank whose
    list leaves itself out, or two views that overlap without being equal, is a real disagreement."""
    if len(set(views.values())) < 2:
        return False
    for rank, members in views.items():
        if rank not in members or any(views.get(m, members) != members for m in members):
            return False
    slices = list(set(views.values()))
    seen: set[int] = set()
    for members in slices:
        if seen & set(members):
            return False
        seen |= set(members)
    return True


def _order_key(name: str) -> tuple[int, Any]:
    return (0, int(name)) if str(name).isdigit() else (1, str(name))
