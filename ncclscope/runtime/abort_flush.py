"""Write the queued trace rows when the process is aborted (SIGABRT), before it dies.

Why: gloo answers a size mismatch by throwing from one of its own threads, which
ends in `std::terminate` -> `abort()`; NCCL's watchdog aborts the same way. No
Python code runs after that, so the rows the flusher had not yet written (up to
one flush interval, 200 ms) were lost, and they are exactly the ones that say
what the rank was doing: the mismatched collective itself. Seen in the accuracy
sweep: a size mismatch on a TP group aborted both members within 20 ms of the
step's first row, and the trace ended in the step before.

How: a C-level SIGABRT handler made with ctypes. It runs on the aborting thread,
takes the GIL (the training thread is blocked in the op's wait, which released
it), writes the queued rows through each registered callback, puts back the
handler it found (faulthandler's, which then dumps the stacks, or the default
action) and raises the signal again, so the process still dies of SIGABRT and
its exit status is unchanged. `alarm()` is armed first: a flush that cannot
finish (a lock held by the dying thread) ends in SIGALRM a few seconds later
instead of a hung rank. Linux with glibc only; elsewhere `install` is a no-op.
"""
from __future__ import annotations

import ctypes
import signal
import sys
import threading
from typing import Callable

ALARM_S = 3                      # the most a dying rank spends writing its last rows
_SA_NODEFER = 0x40000000         # our own raise() is delivered at once, inside the handler


class _SigSet(ctypes.Structure):
    _fields_ = [("val", ctypes.c_ulong * 16)]        # glibc's sigset_t: 1024 bits


class _SigAction(ctypes.Structure):                  # glibc's struct sigaction (x86_64, aarch64)
    _fields_ = [("sa_handler", ctypes.c_void_p), ("sa_mask", _SigSet), ("sa_flags", ctypes.c_int),
                ("sa_restorer", ctypes.c_void_p)]


_HANDLER_T = ctypes.CFUNCTYPE(None, ctypes.c_int)
_callbacks: list[Callable[[], None]] = []
_lock = threading.Lock()
_state: dict[str, object] = {}   # libc, the handler object (kept alive), the action it replaced


def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.sigaction                                 # noqa: B018 - present in glibc and musl
        return libc
    except (OSError, AttributeError):
        return None


def _on_abort(signum: int) -> None:
    libc = _state["libc"]
    try:
        libc.alarm(ALARM_S)
        for cb in list(_callbacks):
            try:
                cb()
            except BaseException:                      # noqa: BLE001 - dying anyway: write what can be
                pass
    finally:
        libc.sigaction(signum, ctypes.byref(_state["previous"]), None)
        getattr(libc, "raise")(signum)


def install(callback: Callable[[], None]) -> bool:
    """Call `callback` (which must only write queued rows) if this process gets SIGABRT.

    The handler is installed once per process, before faulthandler's (Recorder calls this first),
    and chains to whatever handler was there. Returns False where it cannot be installed."""
    with _lock:
        if callback not in _callbacks:
            _callbacks.append(callback)
        if "handler" in _state:
            return True
        libc = _libc()
        if libc is None or threading.current_thread() is not threading.main_thread():
            return False
        handler = _HANDLER_T(_on_abort)
        new, old = _SigAction(), _SigAction()
        new.sa_handler = ctypes.cast(handler, ctypes.c_void_p).value
        new.sa_flags = _SA_NODEFER
        if libc.sigaction(signal.SIGABRT, ctypes.byref(new), ctypes.byref(old)) != 0:
            return False
        _state.update(libc=libc, handler=handler, previous=old)
        return True


def uninstall(callback: Callable[[], None]) -> None:
    """Forget `callback` (the recorder closed: nothing is queued any more). The handler stays,
    calling whatever callbacks remain; with none it only chains."""
    with _lock:
        if callback in _callbacks:
            _callbacks.remove(callback)
