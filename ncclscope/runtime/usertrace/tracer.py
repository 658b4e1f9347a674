"""The tracer installed before a user's script runs: torch.distributed as data.

    tracer = Tracer(rec, rank, world, timeout_s=60).install()   # what bootstrap.py does
    ...the script...
    tracer.close()

What it wraps (module-level `torch.distributed.X` and `distributed_c10d.X`
are the same objects; both names are replaced):
  - every public collective and p2p call, object collectives included, and
    batch_isend_irecv (one p2p row per P2POp): begin/end rows (ops.py, the
    specs in opspec.py, the call site in callsite.py, all_reduce and its
    one-tensor kin through the lean wrapper of hotpath.py; on NCCL the end is
    the GPU completion, gpu.py);
  - init_process_group, new_group, new_subgroups(_by_enumeration),
    init_device_mesh: the group table on every rank (groups.py); after
    init_process_group, the clock offset to rank 0 through the job's store
    (clock.py);
  - optimizer steps: step boundaries (steps.py);
  - the inputs of reducing collectives and DDP's gradients: the first
    non-finite one on a rank is a `nonfinite` marker (nancheck.py);
  - Work.wait, for the works that have no future (patched when the first
    one is issued: `patch_wait`).
Calls made from inside a wrapped call (all_gather_object -> all_gather) are
passed straight through: one row per user call.

Evidence, never intervention (evidence.py): `--timeout-s` makes the watch
thread dump stacks, a Flight Recorder snapshot and flush the trace when an op
has been in flight that long; the op goes on and nothing is raised into the
script. SIGTERM dumps the same evidence from a helper thread, then the signal
takes its normal course.

This module is the assembly: `Tracer` is its facets' mixins plus the state
they share, `install` / `uninstall` / `close`. `ACTIVE` is the installed
tracer (`ncclscope.step()` finds it here).
"""
from __future__ import annotations

import threading
import time
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from ncclscope.runtime.usertrace.callsite import call_site, text_of
from ncclscope.runtime.usertrace.clock import ClockSync, default_store
from ncclscope.runtime.usertrace.evidence import FR_EARLY_S, POLL_S, WATCH_S, EvidenceMixin, warm_fr_dump
from ncclscope.runtime.usertrace.gpu import GpuEnds
from ncclscope.runtime.usertrace.group_calls import GroupInfo, GroupsMixin
from ncclscope.runtime.usertrace.nancheck import MODES as NAN_MODES, NanCheckMixin, mode_from_env
from ncclscope.runtime.usertrace.ops import OpsMixin
from ncclscope.runtime.usertrace.opspec import SPECS
from ncclscope.runtime.usertrace.steps import StepsMixin, metric_blank

ACTIVE: "Tracer | None" = None
_text = text_of   # the old private name, kept for importers
__all__ = ["ACTIVE", "FR_EARLY_S", "POLL_S", "WATCH_S", "SPECS", "GroupInfo", "Tracer", "call_site", "text_of"]


class Tracer(GroupsMixin, OpsMixin, EvidenceMixin, StepsMixin, NanCheckMixin):
    """One rank's tracer. `install()` patches torch.distributed; `close()` writes the last evidence."""

    def __init__(self, rec: Any, rank: int, world_size: int, timeout_s: float = 0.0,
                 clock_sync: bool = True, nan_check: str | None = None) -> None:
        self.rec = rec
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = float(timeout_s or 0.0)
        # groups.py
        self.groups: dict[Any, GroupInfo] = {}      # ProcessGroup -> info (members only)
        self.table: list[GroupInfo] = []            # every group this rank knows of, creation order
        self._groups_dirty = False                  # the group table (or a pending rank.json field) to write
        self._mesh_count = 0
        self._group_sites: dict[str, str] = {}
        self._world_pg: Any = None
        # ops.py
        self._p2p_seq: dict[tuple[str, int], int] = {}
        self._own_seq: dict[str, int] = {}
        self._p2p_shift: dict[str, int] = {}        # group -> how far p2p ops moved its counter (gloo)
        self._inflight: dict[int, tuple[float, str, str, int]] = {}   # op_id -> (monotonic start, name, group, seq)
        self._pending: dict[int, tuple[Any, int]] = {}   # id(work) -> (work polled for completion, op_id)
        self._waiting: set[int] = set()             # ids of those works a thread is waiting on now
        self._gpu_works: set[int] = set()           # ids of those works on CUDA tensors (ended by the poller only)
        self._pending_lock = threading.Lock()
        self._sites: set[tuple[str, str, str]] = set()
        self.ops = 0
        self._gpu = GpuEnds(rec, self._inflight)
        # nancheck.py: auto (CPU tensors), on (every device: a CUDA check syncs), off
        self.nan_mode = nan_check if nan_check in NAN_MODES else mode_from_env()
        self._nan_live = self.nan_mode != "off"
        # evidence.py
        self._evidenced: set[int] = set()
        self._fr_for: set[int] = set()
        self._fr_lock = threading.Lock()
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._gpu.wake = self._wake.set
        self._last_activity = time.perf_counter()   # last op begin or step (same clock as perf/monotonic)
        self._idle_evidenced = -1.0
        # steps.py
        self._explicit = False
        self._opt_steps: dict[int, int] = {}
        self._step_t = time.perf_counter()
        self._metric_blank = metric_blank(rank)
        # clock.py
        self._clock_sync = clock_sync
        self._clock: ClockSync | None = None
        self._meta_lock = threading.Lock()
        self._pending_meta: dict[str, Any] = {}
        # this module
        self._orig: dict[tuple[Any, str], Any] = {}
        self._hook: Any = None
        self._installed = False
        self._wait_patched = False
        self._threads: list[threading.Thread] = []

    # ---- install ------------------------------------------------------------
    def install(self) -> "Tracer":
        global ACTIVE
        warm_fr_dump()   # before the watch thread can dump Flight Recorder (evidence.warm_fr_dump)
        ACTIVE = self
        self._installed = True
        self._stop.clear()
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
        self.install_nan_check(self._patch)   # DistributedDataParallel.__init__: hooks on its gradients
        self._wait_patched = False   # Work.wait: at the first work that needs it (patch_wait)
        try:
            from torch.optim.optimizer import register_optimizer_step_post_hook
            self._hook = register_optimizer_step_post_hook(self._optimizer_stepped)
        except (ImportError, AttributeError):
            pass
        if dist.is_available() and dist.is_initialized():   # a script that runs under a pre-initialised world
            self._register_world()
            self._world_ready()
        t = threading.Thread(target=self._watch, name="ncclscope-tracer-watch", daemon=True)
        t.start()
        self._threads.append(t)
        return self

    def patch_wait(self) -> None:
        """Wrap Work.wait, once, when the first work without a future (gloo p2p) or on a CUDA tensor
        is pending: until then the wrapper would only pass every wait through, and every sync
        collective calls wait() (c10d does, after the op): measured ~1 us of CPU per tiny
        all_reduce on the 2-core dev box (in situ, between the op's own work; ~0.3 us in a loop).
        Called by the op's wrapper before the work is returned to the script, so the script's own
        wait() of that work is already the wrapped one."""
        if self._wait_patched:
            return
        with self._pending_lock:
            if self._wait_patched or not self._installed:
                return
            self._wait_patched = True
            work_cls = getattr(dist, "Work", None)
            if work_cls is not None and hasattr(work_cls, "wait"):
                self._patch([work_cls], "wait", work_cls.wait, self._wrap_wait(work_cls.wait))

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
        self._wait_patched = False
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._installed = False
        self._nan_live = False   # hooks left on a DDP model's parameters go quiet
        if ACTIVE is self:
            ACTIVE = None

    # ---- clock offsets (clock.py) ----------------------------------------------
    def _world_ready(self) -> None:
        """The world exists: measure this rank's clock offset to rank 0 through its store, once, on a thread."""
        if not self._clock_sync or self._clock is not None or self.world_size <= 1:
            return
        store = default_store()
        if store is None:
            return
        self._clock = ClockSync(store, self.rank, self.world_size, self._clock_measured).start()

    def _clock_measured(self, result: dict[str, Any]) -> None:
        """From the clock thread: queue the fields; the script's thread writes them (next op, group or close)."""
        with self._meta_lock:
            self._pending_meta.update(result)
        self._groups_dirty = True

    def _take_pending_meta(self) -> dict[str, Any]:
        with self._meta_lock:
            out, self._pending_meta = self._pending_meta, {}
        return out

    def wait_clock(self, timeout: float) -> bool:
        """Wait (bounded) for the clock exchange to end; True when it has (tests, close)."""
        c = self._clock
        if c is None or c.thread is None:
            return True
        c.thread.join(timeout)
        return not c.thread.is_alive()

    # ---- close ------------------------------------------------------------------
    def close(self) -> None:
        """Last evidence at exit: pending completions, a Flight Recorder snapshot, the last step's metrics."""
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout=1)
        self._poll()
        if self.rank != 0:
            self.wait_clock(1.0)   # a short job: let the offset land in rank.json (bounded)
        if len(self._gpu):
            self._gpu.poll()   # what completed by now ends; the rest stays open (never completed)
        if self._groups_dirty or self._pending_meta:
            self.write_groups()
        self.dump_fr()
        self.uninstall()
        self._restore_sigterm()
        self._restore_exit()

