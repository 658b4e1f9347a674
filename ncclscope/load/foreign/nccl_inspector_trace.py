"""NCCL Inspector records -> Trace: ranks, communicators as groups, one op row pair per record.

    trace = load_inspector([Path("nccl-inspector-1234/node1-pid4242.log"), ...], root)

Why each mapping is what it is (docs/ingest.md has the field table):

- **Ranks.** A record names its process (hostname, pid) and its rank *in one communicator*. The
  global rank of a process is its rank in a communicator of the largest size that every process
  reports (PyTorch's default group, or the data-parallel world); without one, processes are numbered
  in (hostname, pid) order, with a warning, since then no record says which global rank is which.
- **Groups.** A communicator (header.id) is a process group named by its comm_name when that is
  unique, else by its hash; its members are the global ranks of the processes that report it.
- **Sequence.** NCCL counts coll_sn per communicator *and per function*, where ncclscope aligns one
  sequence per group across all collectives. Every rank issues a communicator's collectives in one
  order and Inspector writes them in completion order, so each (function, coll_sn) gets the median
  of its positions in the ranks' files, and the communicator's instances are numbered 1.. in that
  order (coll_sn itself stays in the op's message). A record a rank lacks shifts nothing.
- **Times.** With the verbose event trace an op starts at the first kernel channel the host saw start
  on this rank (the GPU reached the collective: a rank whose GPU is late arrives late) and ends at
  the last channel's stop, or start + coll_exec_time_us. Clocks of different hosts are aligned on
  the ends of shared collectives (a collective ends on all its ranks together, within the link
  latency). Without the event trace only durations are known: a communicator's instances are laid
  back to back in sequence order, every member ending together and starting coll_exec_time_us before
  (a rank whose peers waited for it in the kernel has the shortest time: it arrived last), and the
  rows say "times inferred".
- **P2P.** p2p_peer is a communicator rank, mapped to its global rank; the per-pair sequence is the
  k-th send (or recv) of the rank to that peer, by p2p_sn.
Inspector writes completed operations only: every op has its end row (nothing is ever in flight).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from ncclscope import schema as S
from ncclscope.load.foreign.nccl_inspector import InspectorRead, KNOWN_MAJOR
from ncclscope.load.foreign.nccl_ras import comm_key
from ncclscope.load.foreign.vocab import GroupNamer, events_table, group_kind, normalize_op
from ncclscope.load.trace import RankInfo, RunInfo, Tables, Trace, TraceError, assemble

US = 1000
SOURCE = "nccl_inspector"
INFERRED = "times inferred: no NCCL_INSPECTOR_DUMP_VERBOSE event trace (ops back to back, ending together)"
_FUNCS = {"All2All": "all_to_all", "AllGatherV": "all_gather_v", "Send": "send", "Recv": "recv",
          "SendRecv": "sendrecv"}


@dataclass
class InspectorParts:
    """What the Inspector records add to a Trace, before `assemble`: op rows, group rows, the ranks'
    RankInfo, the world, and per communicator (keyed as RAS keys it: `nccl_ras.comm_key`) its label,
    comm rank -> global rank, and its last instance number (what RAS's rows continue from)."""

    tables: list[pa.Table]
    group_rows: list[dict[str, Any]]
    ranks: dict[int, RankInfo]
    world: int
    warnings: list[str]
    labels: dict[str, str] = field(default_factory=dict)
    comm_ranks: dict[str, dict[int, int]] = field(default_factory=dict)
    last_seq: dict[str, int] = field(default_factory=dict)
    end_ns: int = 0


def load_inspector(read: InspectorRead, root: Path) -> Trace:
    """The Trace of Inspector records (`nccl_inspector.read_inspector`); TraceError when none is readable."""
    parts = inspector_parts(read, root)
    return assemble(root, inspector_run(read, parts.world), parts.world, parts.ranks,
                    Tables(events=parts.tables, group_rows=parts.group_rows, stacks={}, warnings=parts.warnings))


def inspector_run(read: InspectorRead, world: int, **more: Any) -> RunInfo:
    """The run record an Inspector-only trace synthesizes (`more`: further keys, e.g. rank notes)."""
    return RunInfo.from_dict({"source": SOURCE, "world_size": world, "backend": "nccl",
                              "version": sorted(read.versions), "files": [str(p) for p in read.files], **more})


def inspector_parts(read: InspectorRead, root: Path, rank_of: dict[tuple[str, int], int] | None = None,
                    prefix: str = "") -> InspectorParts:
    """Rows, groups and ranks of the records. `rank_of`: (hostname, pid) -> global rank from another
    source of the same job (then the global ranks are its, and a process it does not name is left out);
    `prefix` goes before every group label (beside another source's groups: "nccl:")."""
    warnings = list(read.warnings)
    recs = read.records
    if not len(recs):
        why = warnings[0] if warnings else "the files hold no record"
        raise TraceError(f"{root}: no readable NCCL Inspector record ({why})")
    _check_versions(read.versions, warnings)
    recs = _dedup(recs, warnings)
    if rank_of:
        recs, world = _known_ranks(recs, rank_of, warnings)
    else:
        recs["rank"], world = assign_ranks(recs, warnings)
    comms = Comms(recs, world, warnings, prefix)
    recs["process_group"] = recs["comm"].map(comms.label)
    coll, p2p = recs[~recs["p2p"]].copy(), recs[recs["p2p"]].copy()
    coll["seq"] = collective_seq(coll)
    coll["inst"] = coll["seq"]
    p2p = p2p_pairs(p2p, comms, warnings)
    p2p["inst"] = pair_keys(p2p)
    offsets = {} if rank_of else clock_offsets(coll, warnings)
    tables = [_rows(coll, 0), _rows(p2p, len(coll))]
    ranks = _rank_infos(recs, world, offsets, warnings)
    out = InspectorParts([t for t in tables if t.num_rows], comms.group_rows(), ranks, world, warnings)
    for c, label in comms.label.items():
        key = comm_key(c)
        out.labels[key], out.comm_ranks[key] = label, dict(comms.global_of[c])
        out.last_seq[key] = int(coll.loc[coll["comm"] == c, "seq"].max()) if (coll["comm"] == c).any() else 0
    out.end_ns = max((int(pc.max(t["time_ns"]).as_py() or 0) for t in out.tables), default=0)
    return out


def _known_ranks(recs: pd.DataFrame, rank_of: dict[tuple[str, int], int],
                 warnings: list[str]) -> tuple[pd.DataFrame, int]:
    """Global ranks from the other source's (hostname, pid); records of processes it does not name are
    dropped with one warning (their rank would be a guess)."""
    keys = list(zip(recs["host"], recs["pid"]))
    rank = np.array([rank_of.get(k, -1) for k in keys], dtype=np.int64)
    lost = rank < 0
    if lost.any():
        row = recs[lost].iloc[0]
        warnings.append(f"{int(lost.sum())} NCCL Inspector record(s) of process(es) the other evidence does not name "
                        f"(first: process {row['pid']} on {row['host']}); skipped")
    recs = recs[~lost].copy()
    recs["rank"] = rank[~lost]
    return recs, max(rank_of.values()) + 1


def _check_versions(versions: set[str], warnings: list[str]) -> None:
    odd = sorted(v for v in versions if v.lstrip("v").split(".", 1)[0] != KNOWN_MAJOR)
    if odd:
        warnings.append(f"NCCL Inspector output format {', '.join(odd)}: this reader knows v{KNOWN_MAJOR}.x; "
                        "reading the fields it recognises")


def _dedup(recs: pd.DataFrame, warnings: list[str]) -> pd.DataFrame:
    """One record per (process, communicator, comm rank, kind, function, sn): a line written twice
    (two dump passes over one ring) is one op."""
    key = ["host", "pid", "comm", "comm_rank", "p2p", "func", "sn"]
    dup = recs.duplicated(key)
    if dup.any():
        warnings.append(f"{int(dup.sum())} NCCL Inspector record(s) appear twice (first at "
                        f"{recs.loc[dup, 'file'].iloc[0]}:{recs.loc[dup, 'line'].iloc[0]}); read once")
    return recs[~dup].reset_index(drop=True)


def assign_ranks(recs: pd.DataFrame, warnings: list[str]) -> tuple[np.ndarray, int]:
    """(global rank of each record, world size): the module docstring's rule."""
    procs = recs[["host", "pid"]].drop_duplicates().sort_values(["host", "pid"]).reset_index(drop=True)
    per = recs.drop_duplicates(["comm", "host", "pid", "comm_rank"])
    several = per.duplicated(["comm", "host", "pid"], keep=False)
    if several.any():
        row = per[several].iloc[0]
        warnings.append(f"process {row['pid']} on {row['host']} holds several ranks of communicator {row['comm']} "
                        "(one process driving several GPUs): its records are read as one rank")
    size = per.groupby("comm")["n_ranks"].max()
    cover = per[~several].groupby("comm")[["host", "pid"]].apply(lambda g: len(g.drop_duplicates()))
    count = recs["comm"].value_counts()
    whole = [c for c in size.index if size[c] == size.max() and cover.get(c, 0) == len(procs)
             and not several[per["comm"] == c].any()]
    if whole:
        world_comm = max(whole, key=lambda c: (count[c], c))
        of = per[per["comm"] == world_comm].set_index(["host", "pid"])["comm_rank"]
        world = int(size[world_comm])
    else:
        of = pd.Series(np.arange(len(procs)), index=pd.MultiIndex.from_frame(procs))
        world = len(procs)
        warnings.append(f"no communicator with NCCL Inspector records spans all {len(procs)} processes: ranks "
                        "are numbered in (hostname, pid) order, which need not be the job's global ranks")
    keys = pd.MultiIndex.from_frame(recs[["host", "pid"]])
    return of.reindex(keys).to_numpy(dtype=np.int64), world


class Comms:
    """The communicators as process groups: label, members (global ranks), comm rank -> global rank."""

    def __init__(self, recs: pd.DataFrame, world: int, warnings: list[str], prefix: str = "") -> None:
        per = recs.drop_duplicates(["comm", "comm_rank"]).sort_values(["comm", "comm_rank"])
        self.size = recs.groupby("comm")["n_ranks"].max().to_dict()
        self.names = recs.groupby("comm")["comm_name"].first().to_dict()
        self.global_of = {c: dict(zip(g["comm_rank"].tolist(), g["rank"].tolist())) for c, g in per.groupby("comm")}
        for c, size in self.size.items():      # a world-sized communicator whose ranks are the global ranks
            if size == world and all(k == v for k, v in self.global_of[c].items()):
                self.global_of[c] = {r: r for r in range(world)}
        partial = sorted(c for c, m in self.global_of.items() if len(m) < self.size[c])
        if partial:
            warnings.append(f"communicator(s) {', '.join(partial[:4])}{' ...' if len(partial) > 4 else ''}: "
                            "records from fewer ranks than it has; the others' global ranks are unknown")
        members = {c: tuple(sorted(set(m.values()))) for c, m in self.global_of.items()}
        namer = GroupNamer((c, self._desc(c), members[c]) for c in members)
        self.label = {c: prefix + namer(c, self._desc(c), members[c]) for c in members}
        self.members = members

    def _desc(self, comm: str) -> str:
        name = self.names.get(comm, "")
        return "" if name in ("", "unknown") else name

    def group_rows(self) -> list[dict[str, Any]]:
        """Every member's view of every communicator (all alike: one hash is one communicator)."""
        order = sorted(self.members, key=lambda c: (-self.size[c], self.label[c]))
        return [{"rank": r, "process_group": self.label[c], "group_kind": group_kind(self._desc(c), self.label[c]),
                 "ranks": list(self.members[c]), "creation_order": pos, "backend": "nccl"}
                for pos, c in enumerate(order) for r in self.members[c]]


def collective_seq(coll: pd.DataFrame) -> np.ndarray:
    """Per record, its instance number in its communicator (1..): the module docstring's order."""
    if not len(coll):
        return np.zeros(0, dtype=np.int64)
    pos = coll.groupby(["rank", "comm"], sort=False).cumcount()
    keyed = coll.assign(pos=pos.to_numpy())
    order = keyed.groupby(["comm", "func", "sn"], as_index=False)["pos"].median()
    order = order.sort_values(["comm", "pos", "sn", "func"], kind="stable")
    order["seq"] = order.groupby("comm").cumcount() + 1
    return keyed.merge(order[["comm", "func", "sn", "seq"]], on=["comm", "func", "sn"], how="left")["seq"].to_numpy()


def p2p_pairs(p2p: pd.DataFrame, comms: Comms, warnings: list[str]) -> pd.DataFrame:
    """Peers as global ranks and the per-pair sequence (k-th send of this rank to that peer, by p2p_sn);
    records whose peer's global rank is unknown are dropped with one warning."""
    if not len(p2p):
        return p2p.assign(seq=np.zeros(0, dtype=np.int64))
    p2p["peer"] = [comms.global_of.get(c, {}).get(int(p), -1) for c, p in zip(p2p["comm"], p2p["peer"])]
    lost = p2p["peer"] < 0
    if lost.any():
        warnings.append(f"{int(lost.sum())} NCCL Inspector p2p record(s) name a peer whose global rank is unknown "
                        f"(first at {p2p.loc[lost, 'file'].iloc[0]}:{p2p.loc[lost, 'line'].iloc[0]}); skipped")
        p2p = p2p[~lost]
    p2p = p2p.sort_values(["rank", "comm", "peer", "func", "sn"], kind="stable")
    p2p["seq"] = p2p.groupby(["rank", "comm", "peer", "func"]).cumcount().to_numpy() + 1
    return p2p


def clock_offsets(coll: pd.DataFrame, warnings: list[str]) -> dict[str, int]:
    """ns to add to each host's clock to read the first host's: the median, over the collectives both
    hosts ran, of the difference of their ends (one host: nothing to align)."""
    timed = coll[coll["start_us"] > 0]
    hosts = sorted(timed["host"].unique())
    if len(hosts) < 2:
        return {}
    ends = timed.assign(end=_ends_us(timed)).groupby(["comm", "seq", "host"])["end"].median().unstack("host")
    ref, out = hosts[0], {}
    for h in hosts[1:]:
        both = ends[[ref, h]].dropna()
        if len(both):
            out[h] = int(np.median(both[ref] - both[h]) * US)
        else:
            warnings.append(f"host {h} shares no timed collective with {ref}: its clock is not aligned")
    return out


def _ends_us(df: pd.DataFrame) -> np.ndarray:
    end, start, dur = df["end_us"].to_numpy(), df["start_us"].to_numpy(), df["exec_us"].to_numpy()
    return np.where(end > 0, end, start + dur)


def _times(df: pd.DataFrame) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(start ns, end ns, inferred) of each row: measured where the communicator's every record has the
    event trace, else its instances (`inst`) laid back to back, each member ending with the instance
    and starting its own execution time before (module docstring)."""
    measured = df.groupby("comm")["start_us"].transform("min").to_numpy() > 0
    start = df["start_us"].to_numpy().astype(np.int64) * US
    end = _ends_us(df).astype(np.int64) * US
    if measured.all():
        return start, end, np.zeros(len(df), dtype=bool)
    inf = df[~measured]
    span = inf.groupby(["comm", "inst"])["exec_us"].max().reset_index()      # sorted by comm, instance
    first_dump = span["comm"].map(inf.groupby("comm")["dump_us"].min()).clip(lower=0)
    base = (first_dump - span.groupby("comm")["exec_us"].transform("sum")).clip(lower=0)
    # every op was written after it completed: the last one ends by the first line's dump time;
    # instances 1 us apart, so two never share an end
    span["end"] = base + span.groupby("comm")["exec_us"].cumsum() + span.groupby("comm").cumcount()
    at = inf[["comm", "inst"]].merge(span, on=["comm", "inst"], how="left")["end"].to_numpy().astype(np.int64) * US
    end[~measured], start[~measured] = at, at - inf["exec_us"].to_numpy().astype(np.int64) * US
    return start, end, ~measured


def pair_keys(p2p: pd.DataFrame) -> np.ndarray:
    """A p2p op's instance: (sender, receiver, k), so a send and its recv are one instance."""
    send = np.array([normalize_op(_FUNCS.get(f, f)) == "send" for f in p2p["func"]], dtype=bool)
    src = np.where(send, p2p["rank"], p2p["peer"]).astype(np.int64)
    dst = np.where(send, p2p["peer"], p2p["rank"]).astype(np.int64)
    return (src * (1 << 21) + dst) * (1 << 22) + p2p["seq"].to_numpy()


def _rows(df: pd.DataFrame, id_base: int) -> pa.Table:
    """Begin and end rows (schema.EVENTS_SCHEMA) for the records of one kind; op ids from `id_base`."""
    n = len(df)
    if not n:
        return events_table({}, 0)
    start, end, inferred = _times(df)
    is_p2p = df["p2p"].to_numpy(dtype=bool)
    seq = df["seq"].to_numpy()
    op_id = np.empty(n, dtype=np.int64)
    op_id[np.lexsort((seq, start, df["rank"].to_numpy()))] = id_base + np.arange(n)
    common = {"rank": df["rank"].to_numpy(), "op_id": op_id,
              "kind": np.where(is_p2p, S.KIND_P2P, S.KIND_COLLECTIVE),
              "op_name": [normalize_op(_FUNCS.get(f, f)) for f in df["func"]],
              "process_group": df["process_group"].to_numpy(),
              "collective_seq_id": np.where(is_p2p, -1, seq), "p2p_seq_id": np.where(is_p2p, seq, -1),
              "peer": np.where(is_p2p, df["peer"].to_numpy(), -1), "tag": np.where(is_p2p, 0, -1),
              "bytes": df["bytes"].to_numpy()}
    begin = events_table({**common, "phase": S.PHASE_BEGIN, "time_ns": start}, n)
    finish = events_table({**common, "phase": S.PHASE_END, "time_ns": end, "status": S.STATUS_OK,
                           "message": np.where(inferred, INFERRED, "")}, n)
    return pa.concat_tables([begin, finish])


def _rank_infos(recs: pd.DataFrame, world: int, offsets: dict[str, int], warnings: list[str]) -> dict[int, RankInfo]:
    """RankInfo per rank: host and pid of its process, its host's clock offset; ranks with no record are
    not present (one warning names them)."""
    first = recs.drop_duplicates("rank").set_index("rank")
    ranks = {r: RankInfo(rank=r, present=False) for r in range(world)}
    for r, row in first.iterrows():
        ranks[int(r)] = RankInfo(rank=int(r), present=True, host=str(row["host"]), pid=int(row["pid"]),
                                 clock_offset_ns=offsets.get(str(row["host"]), 0))
    absent = [r for r, info in ranks.items() if not info.present]
    if absent:
        shown = ", ".join(map(str, absent[:8])) + (" ..." if len(absent) > 8 else "")
        warnings.append(f"rank(s) {shown}: no NCCL Inspector record (no file from the process, or no completed "
                        "operation of the tracked size); analyzing the other ranks")
    return ranks
