"""Clock offsets to rank 0 for a user's job, through the c10d store it already has.

`ncclscope train` measures offsets with traced p2p pings on its own world
group. In a user's job the tracer must not issue ops on the user's groups or
create groups (either would shift the job's own sequence numbers, group
creation order and Flight Recorder pg names), so this uses only the store
that `init_process_group` made (`distributed_c10d._get_default_store()`),
with non-blocking calls (`set`, `add`, `check`, `get` of a key known to
exist), from a daemon thread, under a deadline:

    rank 0      sets  clock/host = its hostname, then answers tickets in order:
                sees  clock/q<k>, sets clock/a<k> = its time_ns (t2)
    rank r > 0  on rank 0's host: offset 0, uncertainty 0 (one clock per host)
                else, ROUNDS times: k = add(clock/n, 1); t1 = time_ns();
                set clock/q<k>; poll check(clock/a<k>); t3 = time_ns()
                offset = t2 - (t1 + t3) / 2, uncertainty = (t3 - t1) / 2
                (Cristian's method; the round with the smallest round trip wins)
                then add(clock/done, 1), which lets rank 0 stop early

The result goes to rank.json as `clock_offset_ns` / `clock_uncertainty_ns`
(what `ncclscope train` writes and the loader reads), with `clock_sync`
saying how it was measured. It never blocks or fails the job: a store that
misbehaves, a rank 0 that never answers or a deadline that passes leaves the
offset at 0 with `clock_sync.method` "none" and one line on stderr. Polling
costs one store round trip per poll; ranks back off to POLL_MAX_S.
"""
from __future__ import annotations

import socket
import sys
import threading
import time
from typing import Any, Callable

PREFIX = "ncclscope/clock/"
ROUNDS = 5
DEADLINE_S = 5.0        # rank 0 answers this long at most; a rank gives up after this long
POLL_MIN_S = 0.0001
POLL_MAX_S = 0.005

Result = dict[str, Any]   # clock_offset_ns, clock_uncertainty_ns, clock_sync: {method, rounds, rtt_ns, ...}


def default_store() -> Any:
    """The job's own c10d store (the default group's), or None."""
    try:
        import torch.distributed.distributed_c10d as c10d
        return c10d._get_default_store()
    except Exception:
        return None


class ClockSync:
    """One rank's side of the exchange, run on a daemon thread by `start()`; `on_result(result)` at the end."""

    def __init__(self, store: Any, rank: int, world_size: int, on_result: Callable[[Result], None], *,
                 host: str | None = None, same_host_shortcut: bool = True, rounds: int = ROUNDS,
                 deadline_s: float = DEADLINE_S, clock: Callable[[], int] = time.time_ns) -> None:
        self.store, self.rank, self.world = store, rank, world_size
        self.on_result = on_result
        self.host = socket.gethostname() if host is None else host
        self.same_host_shortcut = same_host_shortcut
        self.rounds = max(1, rounds if world_size <= 64 else min(rounds, 2))
        self.deadline_s = deadline_s
        self.clock = clock
        self.thread: threading.Thread | None = None

    def start(self) -> "ClockSync":
        self.thread = threading.Thread(target=self._run, name="ncclscope-clock", daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        t0 = time.monotonic()
        try:
            result = self._serve(t0) if self.rank == 0 else self._measure(t0)
        except Exception as exc:   # the job's store is the job's: whatever it does, we only lose the offset
            print(f"ncclscope: rank {self.rank}: clock offset not measured ({type(exc).__name__}: {exc})"[:300],
                  file=sys.stderr)
            result = {"clock_offset_ns": 0, "clock_uncertainty_ns": 0,
                      "clock_sync": {"method": "none", "reason": f"{type(exc).__name__}: {exc}"[:200]}}
        result["clock_sync"]["seconds"] = round(time.monotonic() - t0, 4)
        try:
            self.on_result(result)
        except Exception:
            pass

    def _poll(self, key: str, until: float) -> bool:
        """Wait for `key` with non-blocking checks, backing off; False at the deadline."""
        wait = POLL_MIN_S
        while not self.store.check([key]):
            if time.monotonic() >= until:
                return False
            time.sleep(wait)
            wait = min(wait * 2, POLL_MAX_S)
        return True

    def _serve(self, t0: float) -> Result:
        s = self.store
        s.set(PREFIX + "host", self.host)
        until = t0 + self.deadline_s
        served, k = 0, 1
        expected = self.world - 1
        wait = POLL_MIN_S
        while time.monotonic() < until:
            if s.check([f"{PREFIX}q{k}"]):
                s.set(f"{PREFIX}a{k}", str(self.clock()))
                served += 1
                k += 1
                wait = POLL_MIN_S
                continue
            if int(s.add(PREFIX + "done", 0)) >= expected:
                break
            time.sleep(wait)
            wait = min(wait * 2, POLL_MAX_S)
        return {"clock_offset_ns": 0, "clock_uncertainty_ns": 0,
                "clock_sync": {"method": "store", "role": "reference", "answered": served}}

    def _measure(self, t0: float) -> Result:
        s = self.store
        until = t0 + self.deadline_s
        none = {"clock_offset_ns": 0, "clock_uncertainty_ns": 0}
        try:
            if not self._poll(PREFIX + "host", until):
                print(f"ncclscope: rank {self.rank}: clock offset not measured (rank 0 did not publish its host "
                      f"within {self.deadline_s:g} s)", file=sys.stderr)
                return {**none, "clock_sync": {"method": "none", "reason": "rank 0 silent"}}
            host0 = s.get(PREFIX + "host").decode(errors="replace")
            if self.same_host_shortcut and host0 == self.host:
                return {**none, "clock_sync": {"method": "same-host", "host": host0}}
            best: tuple[int, int] | None = None   # (rtt, offset)
            done = 0
            for _ in range(self.rounds):
                k = int(s.add(PREFIX + "n", 1))
                t1 = self.clock()
                s.set(f"{PREFIX}q{k}", str(self.rank))
                if not self._poll(f"{PREFIX}a{k}", until):
                    break
                t2 = int(s.get(f"{PREFIX}a{k}"))
                t3 = self.clock()
                done += 1
                rtt = t3 - t1
                if best is None or rtt < best[0]:
                    best = (rtt, t2 - (t1 + t3) // 2)
        finally:
            try:
                s.add(PREFIX + "done", 1)
            except Exception:
                pass
        if best is None:
            print(f"ncclscope: rank {self.rank}: clock offset not measured (no answer from rank 0 within "
                  f"{self.deadline_s:g} s)", file=sys.stderr)
            return {**none, "clock_sync": {"method": "none", "reason": "no answer from rank 0"}}
        rtt, offset = best
        return {"clock_offset_ns": int(offset), "clock_uncertainty_ns": int((rtt + 1) // 2),
                "clock_sync": {"method": "store", "rounds": done, "rtt_ns": int(rtt), "host0": host0}}
