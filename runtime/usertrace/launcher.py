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


def _rank_meta(run_dir: Path, r: int) -> dict[str, Any]:
    try:
        return json.loads((run_dir / S.rank_dir_name(r) / S.RANK_JSON).read_text())
    except (OSError, ValueError):
        return {}


def launch(script: str, script_args: list[str], nproc: int = 1, out: str = "", timeout_s: float = 60.0,
           quiet: bool = False) -> tuple[Path, dict[str, Any], int]:
    """Run the job; return (run dir, run.json, the job's exit code)."""
    from ncclscope.runtime.launch import prepare_run_dir
    if not out:
        out = os.path.join("runs", "run-" + _dt.datetime.now().strftime("%Y%m%d-%H%M%S"))
    run_dir = prepare_run_dir(out)
    started = time.time()
    import ncclscope
    run: dict[str, Any] = {
        "schema": S.SCHEMA_VERSION, "launcher": "ncclscope run", "world_size": nproc,
        "config": {"script": script, "args": script_args, "timeout_s": timeout_s, "nproc": nproc},
        "versions": {"ncclscope": ncclscope.__version__, "python": sys.version.split()[0],
                     "schema": S.SCHEMA_VERSION},
        "argv": sys.argv, "started": _dt.datetime.now().isoformat(timespec="seconds"), "end_reason": "running",
    }
    _write_json(run_dir / S.RUN_JSON, run)

    import logging

    import torch
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch
    run["versions"]["torch"] = torch.__version__
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)   # its INFO lines are not the job's
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cfg = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                       rdzv_backend="c10d", rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1,
                       start_method="spawn")
    failures: dict[int, Any] = {}
    end_reason, term_signal = "completed", 0
    try:
        elastic_launch(cfg, sys.executable)("-m", "ncclscope.run", "--out", str(run_dir), "--timeout-s",
                                            str(timeout_s), script, *script_args)
    except ChildFailedError as exc:
        failures = dict(exc.failures)
        end_reason = "rank_failed"
    except KeyboardInterrupt:
        end_reason = "interrupted"
    except SignalException as exc:   # the agent turns SIGTERM/SIGHUP to this process into an exception
        end_reason, term_signal = "terminated", int(exc.sigval)
    ranks: dict[str, Any] = {}
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
        else:   # alive when another rank failed: the agent terminated it
            ranks[str(r)] = {"exitcode": None, "signal": "SIGTERM", "pid": meta.get("pid"),
                             "stopped_by_launcher": True}
    code = 0
    if first is not None:
        code = first.exitcode if first.exitcode >= 0 else 128 - first.exitcode
    elif end_reason == "interrupted":
        code = 130
    elif end_reason == "terminated":
        code = 128 + term_signal
    run.update(end_reason=end_reason, ended=_dt.datetime.now().isoformat(timespec="seconds"),
               duration_s=round(time.time() - started, 3), ranks=ranks)
    _write_json(run_dir / S.RUN_JSON, run)
    return run_dir, run, int(code)


def _write_json(path: Path, data: dict[str, Any]) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)
