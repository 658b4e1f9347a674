"""`ncclscope run --nproc N -- SCRIPT ARGS`: the ranks on this node, through torchrun's own machinery.

The ranks are started by torch's elastic launch API (what `torchrun
--standalone --nproc-per-node N` runs: c10d rendezvous on a free local port,
one agent, no restarts), each as `python -m ncclscope.run --out DIR SCRIPT
ARGS`, so the per-rank bootstrap is the same one that runs under a user's own
torchrun or srun. When a rank fails, the agent stops the others (SIGTERM; the
tracer dumps their evidence first); this launcher then writes run.json with
every rank's exit code, and returns the job's own exit code: 0, or the first
failed rank's (128 + signal for a signal).
"""
from __future__ import annotations

import datetime as _dt
import json
import os
import signal
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from ncclscope import schema as S


def _signal_name(code: int) -> str | None:
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return None


class _Terminated(BaseException):
    """SIGTERM or SIGHUP before torchrun's agent has its own handler (which raises SignalException)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated(signum)


def _rank_meta(run_dir: Path, r: int) -> dict[str, Any]:
    try:
        return json.loads((run_dir / S.rank_dir_name(r) / S.RANK_JSON).read_text())
    except (OSError, ValueError):
        return {}


def launch(script: str, script_args: list[str], nproc: int = 1, out: str = "", timeout_s: float = 60.0,
           quiet: bool = False, nan_check: str = "auto") -> tuple[Path, dict[str, Any], int]:
    """Run the job; return (run dir, run.json, the job's exit code). `nan_check`: auto (CPU tensors),
    on (every device; a CUDA tensor's check syncs), off (runtime/usertrace/nancheck.py)."""
    from ncclscope.runtime.launch import prepare_run_dir
    if not out:
        out = os.path.join("runs", "run-" + _dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    run_dir = prepare_run_dir(out)
    started = time.time()
    import ncclscope
    run: dict[str, Any] = {
        "schema": S.SCHEMA_VERSION, "launcher": "ncclscope run", "world_size": nproc,
        "config": {"script": script, "args": script_args, "timeout_s": timeout_s, "nproc": nproc,
                   "nan_check": nan_check},
        "versions": {"ncclscope": ncclscope.__version__, "python": sys.version.split()[0],
                     "schema": S.SCHEMA_VERSION},
        "argv": sys.argv, "started": _dt.datetime.now().isoformat(timespec="seconds"), "end_reason": "running",
    }
    _write_json(run_dir / S.RUN_JSON, run)

    failures: dict[int, Any] = {}
    end_reason, term_signal = "completed", 0
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGHUP)}
    if threading.current_thread() is not threading.main_thread():
        previous = {}      # only the main thread may install handlers (the agent needs it too)
    for sig in previous:   # until the agent installs its own: a SIGTERM now would leave run.json "running"
        signal.signal(sig, _raise_terminated)
    try:
        import logging

        import torch
        from torch.distributed.launcher.api import LaunchConfig, elastic_launch
        run["versions"]["torch"] = torch.__version__
        logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)   # its INFO lines are not the job's
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                           rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                           start_method="spawn")
        elastic_launch(cfg, sys.executable)("-m", "ncclscope.run", "--out", str(run_dir), "--timeout-s",
                                            str(timeout_s), f"--nan-check={nan_check}", script, *script_args)
    except _Terminated as exc:
        end_reason, term_signal = "terminated", exc.signum
    except KeyboardInterrupt:
        end_reason = "interrupted"
    except Exception as exc:
        from torch.distributed.elastic.multiprocessing.api import SignalException
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        if isinstance(exc, ChildFailedError):
            failures = dict(exc.failures)
            end_reason = "rank_failed"
        elif isinstance(exc, SignalException):   # the agent turns SIGTERM/SIGHUP into this
            end_reason, term_signal = "terminated", int(exc.sigval)
        else:
            raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    ranks, end_reason, code = rank_records(run_dir, nproc, failures, end_reason, term_signal)
    run.update(end_reason=end_reason, ended=_dt.datetime.now().isoformat(timespec="seconds"),
               duration_s=round(time.time() - started, 3), ranks=ranks)
    _write_json(run_dir / S.RUN_JSON, run)
    return run_dir, run, int(code)


def rank_records(run_dir: Path, nproc: int, failures: dict[int, Any], end_reason: str,
                 term_signal: int) -> tuple[dict[str, Any], str, int]:
    """How each rank ended, for run.json, and the job's end reason and exit code.

    `failures` are the agent's (rank -> a record with exitcode, pid, timestamp; empty when the
    job completed or this launcher was itself stopped); each rank's own end record in rank.json
    fills in what the agent did not say. A rank is `stopped_by_launcher` when its end was the
    job being stopped, not something it did: the agent's SIGTERM after another rank's failure,
    or a SIGTERM that reached the whole job."""
    ranks: dict[str, Any] = {}
    if failures and all(int(f.exitcode) == -int(signal.SIGTERM) for f in failures.values()):
        # every rank that ended was SIGTERMed and none failed on its own: the job was stopped from
        # outside (a scheduler's time limit or preemption signals every process of the job, and the
        # agent may see its ranks go before its own SIGTERM), not by one of its ranks
        failures, end_reason, term_signal = {}, "terminated", int(signal.SIGTERM)
    first = min(failures.values(), key=lambda f: f.timestamp) if failures else None
    for r in range(nproc):
        meta = _rank_meta(run_dir, r)
        end = meta.get("end") if isinstance(meta.get("end"), dict) else {}
        f = failures.get(r)
        if f is not None:
            code = int(f.exitcode)
            # the agent SIGTERMs every rank still running once one fails: those failures are its doing
            stopped = f is not first and code == -int(signal.SIGTERM) and f.timestamp >= first.timestamp
            ranks[str(r)] = {"exitcode": code if code >= 0 else None, "signal": _signal_name(code),
                             "pid": int(f.pid) if f.pid else meta.get("pid"), "stopped_by_launcher": stopped}
        elif end.get("status") == "ok" or end_reason == "completed":
            ranks[str(r)] = {"exitcode": 0, "signal": None, "pid": meta.get("pid"), "stopped_by_launcher": False}
        elif end.get("status") == "error" and end.get("message") != S.END_TERMINATED:
            # it ended on its own (an exception, gloo's abort) before the job was stopped, and this
            # launcher never heard of it (itself terminated while the agent was stopping the job)
            aborted = end.get("message") == S.END_ABORTED
            ranks[str(r)] = {"exitcode": None, "signal": "SIGABRT" if aborted else None, "pid": meta.get("pid"),
                             "stopped_by_launcher": False}
        else:   # alive when another rank failed or the job was stopped: the agent terminated it
            ranks[str(r)] = {"exitcode": None, "signal": "SIGTERM", "pid": meta.get("pid"),
                             "stopped_by_launcher": True}
    code = 0
    if first is not None:
        code = first.exitcode if first.exitcode >= 0 else 128 - first.exitcode
    elif end_reason == "interrupted":
        code = 130
    elif end_reason == "terminated":
        code = 128 + term_signal
    return ranks, end_reason, int(code)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)
