"""What an NCCL RAS snapshot says about the job's global ranks: which are dead or unresponsive, and
which launched fewer collectives than their peers on a communicator.

    facts = ras_facts(read_ras(paths), RankMap.build(snapshot, world=4, pids={41000: 0, ...}))

Why it is shaped so:

- **Ranks.** RAS names a rank by its place in one communicator (and the process's IP address and
  pid); ncclscope's ranks are global. A communicator as large as the job is PyTorch's default group,
  whose NCCL ranks are the global ranks; every process it lists gives pid -> global rank. Other
  communicators are mapped through those pids, or through the mapping another source (NCCL
  Inspector, which shares the communicator hash) already has. A rank that cannot be mapped is left
  out with one warning: naming the wrong rank is worse than naming none.
- **Dead.** `considered_dead` (unreachable for 60 s), a PEER_DEAD monitor event or the text mode's DEAD
  list: the process is gone. `unresponsive`: RAS could not reach it for this query. Both make the
  rank a root candidate; the words say which, with RAS as the source.
- **Behind.** `collective_counts` are collectives *launched*, per function. Every member launches a
  communicator's collectives in one order, so a rank's total over the functions is its position in
  that order: the members at the lowest total launched fewer than their peers and are what the
  peers' next collective waits for. NCCL's guide (docs ras.rst) warns that collectives outpace RAS's
  query, so a mismatch is a hang only when the counts stop moving: with two or more snapshots of a
  communicator (files, or documents in one file, in the order given), counts that changed between
  the last two are a job still running (one warning, no root); unchanged ones are stuck, and the
  words say over how many snapshots. A single snapshot is taken as the user took it, at a hang, and
  its words say it is one.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ncclscope.load.foreign.nccl_ras import RasComm, RasSnapshot

DEAD_WORDS = "is considered dead (unreachable over the RAS network)"
UNRESPONSIVE_WORDS = "did not answer (unresponsive to the RAS query)"


@dataclass
class RankMap:
    """comm hash -> {comm rank: global rank}, and pid -> global rank; `world` 0 when unknown."""

    world: int
    by_comm: dict[str, dict[int, int]] = field(default_factory=dict)
    by_pid: dict[int, int] = field(default_factory=dict)

    @classmethod
    def build(cls, snap: RasSnapshot, world: int, pids: dict[int, int] | None = None,
              known: dict[str, dict[int, int]] | None = None) -> "RankMap":
        """The module docstring's rule: `pids` (pid -> global rank, unique pids only) and `known`
        (communicator mappings another source has) first, then RAS's own world-sized communicator."""
        out = cls(world=world, by_comm=dict(known or {}), by_pid=dict(pids or {}))
        whole = world_comm(snap, world)
        if whole is not None and whole.hash not in out.by_comm:
            out.by_comm[whole.hash] = {r: r for r in range(whole.size)}
            out.world = max(out.world, whole.size)
        for key, m in out.by_comm.items():
            comm = snap.comms.get(key)
            for r, rr in (comm.ranks.items() if comm else ()):
                if r in m and rr.pid >= 0:
                    out.by_pid.setdefault(rr.pid, m[r])
        return out

    def global_rank(self, comm: RasComm, r: int) -> int:
        """The global rank of comm rank `r`, or -1 when nothing says it."""
        m = self.by_comm.get(comm.hash)
        if m is not None and r in m:
            return m[r]
        rr = comm.ranks.get(r)
        return self.by_pid.get(rr.pid, -1) if rr is not None and rr.pid >= 0 else -1


def world_comm(snap: RasSnapshot, world: int) -> RasComm | None:
    """The communicator whose ranks are the global ranks: of the job's size when that is known, else
    the largest (ties: the one with the most ranks answering, then by hash, so the choice is stable)."""
    comms = [c for c in snap.comms.values() if c.size > 0 and (world <= 0 or c.size == world)]
    if not comms:
        return None
    return max(comms, key=lambda c: (c.size, len(c.ranks), c.hash))


@dataclass
class Lag:
    """Members of one communicator that launched fewer collectives than their peers."""

    comm: str                      # RAS hash (comm_key)
    ranks: list[int]               # global ranks at the lowest total
    peers: list[int]               # global ranks that launched more
    launched: int                  # the laggards' total
    peers_launched: int            # the most any peer launched
    func: str                      # the function the laggards are behind in ("" when several)
    counts: tuple[int, int] = (0, 0)   # in that function: (the laggards', the peers' most)
    snapshots: int = 1             # RAS snapshots that gave these counts, unchanged

    def words(self, cite: bool = True) -> str:
        """"launched 41 AllReduce where its peers launched 42 (NCCL RAS, one snapshot)" (`cite`: the
        source named, and how many snapshots agree)."""
        what = f"{self.counts[0]} {self.func}" if self.func else f"{self.launched} collectives"
        theirs = self.counts[1] if self.func else self.peers_launched
        seen = "one snapshot" if self.snapshots < 2 else f"unchanged in {self.snapshots} snapshots"
        return f"launched {what} where its peers launched {theirs}" + (f" (NCCL RAS, {seen})" if cite else "")


@dataclass
class RasFacts:
    dead: dict[int, str] = field(default_factory=dict)      # global rank -> why, in words naming RAS
    lags: list[Lag] = field(default_factory=list)
    answered: set[int] = field(default_factory=set)         # global ranks RAS knows, not dead
    members: dict[str, list[int]] = field(default_factory=dict)   # comm hash -> its global ranks
    warnings: list[str] = field(default_factory=list)

    @property
    def quiet(self) -> bool:
        """Nothing wrong: no dead rank, nobody behind."""
        return not self.dead and not self.lags


def ras_facts(snap: RasSnapshot, rmap: RankMap) -> RasFacts:
    """Dead and lagging global ranks (module docstring); what cannot be mapped is one warning."""
    out = RasFacts(warnings=list(snap.warnings))
    unmapped: set[str] = set()
    for comm in snap.comms.values():
        glob = {r: rmap.global_rank(comm, r) for r in comm.ranks}
        if any(g < 0 for g in glob.values()):
            unmapped.add(comm.hash)
        known = rmap.by_comm.get(comm.hash, {})
        out.members[comm.hash] = sorted({g for g in glob.values() if g >= 0} | set(known.values()))
        for r, rr in comm.ranks.items():
            if glob[r] >= 0 and (rr.dead or rr.unresponsive):
                out.dead.setdefault(glob[r], _dead_words(rr.dead, rr.host, rr.pid))
        out.answered.update(out.members[comm.hash])
        n, moved = snap.moved(comm.hash)
        lag = _lag(comm, glob)
        if lag is not None and moved:
            out.warnings.append(f"NCCL RAS: counts on communicator 0x{comm.hash} still moved between the last two "
                                f"snapshots (rank(s) {', '.join(map(str, lag.ranks))} behind): a running job, not a hang")
        elif lag is not None:
            lag.snapshots = max(n, 1)
            out.lags.append(lag)
    _processes(snap, rmap, out)
    out.answered -= set(out.dead)
    if unmapped:
        out.warnings.append(f"NCCL RAS: the global ranks of communicator(s) {', '.join(sorted(unmapped)[:4])} are "
                            "unknown (no communicator of the job's size, no pid another source names): those ranks "
                            "are left out")
    return out


def _dead_words(dead: bool, host: str, pid: int) -> str:
    who = f"process {pid} on {host}" if pid >= 0 and host else "its process"
    return f"{who} {DEAD_WORDS if dead else UNRESPONSIVE_WORDS}"


def _processes(snap: RasSnapshot, rmap: RankMap, out: RasFacts) -> None:
    """PEER_DEAD events and the DEAD / INCOMPLETE lists name processes: mapped through their pids."""
    for p in snap.processes:
        g = rmap.by_pid.get(p.pid, -1)
        if g < 0:
            out.warnings.append(f"NCCL RAS names process {p.pid} on {p.host} ({'dead' if p.dead else 'unreachable'}), "
                                "whose global rank no communicator says; not used")
            continue
        if p.dead or g not in out.dead:          # considered dead wins over unresponsive
            out.dead[g] = _dead_words(p.dead, p.host, p.pid)


def _lag(comm: RasComm, glob: dict[int, int]) -> Lag | None:
    """The members at the lowest launched total, when some peer launched more (module docstring)."""
    counted = {r: rr for r, rr in comm.ranks.items()
               if rr.counts and not rr.missing and glob.get(r, -1) >= 0}
    if len(counted) < 2:
        return None
    total = {r: sum(rr.counts.values()) for r, rr in counted.items()}
    low, high = min(total.values()), max(total.values())
    if low == high:
        return None
    lag = sorted(glob[r] for r, t in total.items() if t == low)
    peers = sorted(glob[r] for r, t in total.items() if t > low)
    funcs = sorted({f for r, t in total.items() if t == low for f, n in counted[r].counts.items()
                    if n < max(rr.counts.get(f, 0) for rr in counted.values())})
    func = funcs[0] if len(funcs) == 1 else ""
    counts = (0, 0)
    if func:
        counts = (min(counted[r].counts.get(func, 0) for r, t in total.items() if t == low),
                  max(rr.counts.get(func, 0) for rr in counted.values()))
    return Lag(comm.hash, lag, peers, low, high, func, counts)

