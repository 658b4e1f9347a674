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
    split those by members), so the group view check can vote on them."""
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
        if name in taken or (agree and name in used):   # an op label already carries it
            continue
        for rank, (members, pos, desc) in sorted(per_rank.items()):
            rows.append({"rank": int(rank), "process_group": name, "group_kind": group_kind(desc, name),
                         "ranks": [int(x) for x in members], "creation_order": pos, "backend": ""})
    return rows


def _order_key(name: str) -> tuple[int, Any]:
    return (0, int(name)) if str(name).isdigit() else (1, str(name))
