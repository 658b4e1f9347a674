"""Device samples on a timer (NVML, or host samples where there is no GPU) and
clock alignment between ranks.

Why a sampler next to the event log: "rank 5 was at 0% utilization while
everyone waited" is the most common first clue in a hang or a straggler, and
it only exists if someone sampled the device while it happened.

Why clock offsets: the analyzer compares times across ranks (who arrived
last, who waited how long). On one host the offset is ~0; across hosts it is
not, so at start each rank measures its offset to rank 0 over a few
ping-pong rounds (Cristian's method, keeping the round with the smallest
round trip) and stores it with its uncertainty in rank.json. Here the pings
are traced p2p ops on the runtime's own world group; `ncclscope run`, which
must issue nothing on a user's groups, does the same exchange through the
job's c10d store instead (runtime/usertrace/clock.py) and writes the same
fields.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import psutil
import torch

SAMPLE_HZ = 10.0


def _gpu_expected() -> bool:
    """True where a GPU should be there: the NVIDIA driver's device nodes exist
    (no CUDA call, so nothing is initialised in a forked rank). Only then is a
    missing NVML worth a line."""
    return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/nvidia0")


class Sampler:
    """Background thread appending one samples row per tick to the recorder."""

    def __init__(self, recorder: Any, local_rank: int = 0, hz: float = SAMPLE_HZ, announce: bool = True) -> None:
        self.rec = recorder
        self.interval = 1.0 / hz
        self.source = "host"
        self.reason = ""
        self._nvml: Any = None
        self._handle: Any = None
        self._device = -1
        self._proc = psutil.Process(os.getpid())
        self._proc.cpu_percent(None)  # prime: the first call always returns 0.0
        try:
            import pynvml  # from nvidia-ml-py
            pynvml.nvmlInit()
            count = pynvml.nvmlDeviceGetCount()
            if count == 0:
                raise RuntimeError("no NVIDIA devices")
            self._device = local_rank % count
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(self._device)
            self._nvml = pynvml
            self.source = "nvml"
        except Exception as exc:  # NVMLError_LibraryNotFound and friends: fall back, never crash
            self.reason = f"{type(exc).__name__}: {exc}".strip()
            if announce and _gpu_expected():   # a CPU-only machine has nothing to announce
                print(f"ncclscope: no GPU telemetry ({type(exc).__name__}); sampling CPU % and RSS instead",
                      file=sys.stderr, flush=True)
        self.rec.write_meta(telemetry={"source": self.source, "reason": self.reason, "device": self._device})
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="ncclscope-sampler", daemon=True)

    def start(self) -> "Sampler":
        self._thread.start()
        return self

    def sample_once(self) -> tuple[Any, ...]:
        now = time.time_ns()
        cpu = self._proc.cpu_percent(None)
        rss = self._proc.memory_info().rss
        if self._nvml is not None:
            n, h = self._nvml, self._handle
            util = n.nvmlDeviceGetUtilizationRates(h)
            mem = n.nvmlDeviceGetMemoryInfo(h)
            try:
                power = n.nvmlDeviceGetPowerUsage(h) / 1000.0
            except n.NVMLError:
                power = float("nan")
            temp = float(n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU))
            return (self.rec.rank, now, "nvml", self._device, float(util.gpu), float(util.memory), int(mem.used),
                    power, temp, cpu, rss)
        nan = float("nan")
        return (self.rec.rank, now, "host", -1, nan, nan, -1, nan, nan, cpu, rss)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.rec.sample(self.sample_once())
            except Exception as exc:  # a flaky driver must not end training
                print(f"ncclscope: rank {self.rec.rank}: sampling stopped: {exc}", file=sys.stderr)
                return

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=2)
        if self._nvml is not None:
            try:
                self._nvml.nvmlShutdown()
            except Exception:
                pass


def measure_clock_offsets(comm: Any, world: Any, rounds: int = 5) -> tuple[int, int]:
    """Return (offset_ns, uncertainty_ns) of this rank's clock to rank 0's:
    aligned = local + offset. Rank 0 returns (0, 0). Uses the traced p2p ops
    (they appear in the trace as ordinary sends/recvs before step 0)."""
    if comm.world_size == 1:
        return 0, 0
    buf = torch.zeros(1, dtype=torch.int64)
    if comm.rank == 0:
        for peer in range(1, comm.world_size):
            for _ in range(rounds):
                comm.recv(buf, peer, world, tag=7)
                buf[0] = time.time_ns()
                comm.send(buf, peer, world, tag=7)
        return 0, 0
    best: tuple[int, int] | None = None
    for _ in range(rounds):
        t1 = time.time_ns()
        buf[0] = t1
        comm.send(buf, 0, world, tag=7)
        comm.recv(buf, 0, world, tag=7)
        t3 = time.time_ns()
        t2 = int(buf[0])
        rtt = t3 - t1
        offset = t2 - (t1 + t3) // 2
        if best is None or rtt < best[1] * 2:
            best = (offset, rtt // 2)
    assert best is not None
    return best
