"""`RunInfo`: what a trace says about its run as a whole, typed once at load.

Run directories record it in run.json (written by the launcher); the foreign
readers synthesize it (Flight Recorder dumps, profiler traces), and a Parquet
dataset carries it in its dataset json. Whatever the source, `RunInfo.from_dict`
is the one place that reads the raw object: every field a face or an analysis
reads has its type here, and a field of the wrong type (a hostile run.json with
`"config": 5`) becomes its empty value, with a warning when the caller collects
them. The raw object is kept verbatim in `raw` for the outputs that dump it
(the Parquet dataset json).

    >>> RunInfo.from_dict({"world_size": 2, "config": {"pp": 2}}).config["pp"]
    2
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ncclscope.load import safe_io


@dataclass(frozen=True)
class RankExit:
    """How the launcher saw one rank end (run.json `ranks[str(rank)]`)."""

    exitcode: int | None = None          # None: unknown (not recorded, or not an int)
    signal: str | None = None            # e.g. "SIGKILL" when a signal ended it
    stopped_by_launcher: bool = False    # still running when the launcher ended the job


@dataclass(frozen=True)
class RunInfo:
    """The run's own record. `raw` is the object as read (or synthesized); the other fields are typed views
    of it. Frozen: build a new one with `from_dict` rather than editing (tests build theirs from a dict)."""

    source: str = ""                     # "" (a run directory), "flight_recorder", "torch_profiler", ...
    world_size: int = 0                  # as declared; 0 when not recorded
    config: dict[str, Any] = field(default_factory=dict)    # the run config as recorded ({} when none)
    end_reason: str = ""                 # completed | rank_failed | terminated | ...; "" while running or unknown
    n_params: int | None = None          # the model's parameter count, when recorded
    backend: str = ""                    # gloo, nccl, ... (foreign traces; "" when not recorded)
    exits: dict[int, RankExit] = field(default_factory=dict)   # run.json `ranks`, by rank
    raw: dict[str, Any] = field(default_factory=dict)       # verbatim, for the outputs that dump it

    @classmethod
    def from_dict(cls, raw: Any, warnings: list[str] | None = None, where: str = "run.json") -> "RunInfo":
        """The typed record of `raw` (a dict; anything else is an empty record). A field of the wrong type
        is its empty value, and one line in `warnings` (when given) names it."""
        if not isinstance(raw, dict):
            if raw is not None and warnings is not None:
                warnings.append(f"{where}: expected a JSON object, got {type(raw).__name__}; ignored")
            raw = {}
        bad: list[str] = []

        def typed(key: str, kinds: tuple[type, ...], empty: Any) -> Any:
            v = raw.get(key)
            if v is None:
                return empty
            if isinstance(v, kinds) and not isinstance(v, bool):
                return v
            bad.append(f"{key} ({type(v).__name__})")
            return empty

        world = typed("world_size", (int, float, str), 0)
        world = max(safe_io.trace_int(world, 0), 0)
        n_params = safe_io.trace_int(typed("n_params", (int, float, str), None), 0)
        end_reason = typed("end_reason", (str, int, float), "")
        info = cls(source=str(typed("source", (str,), "")), world_size=world, config=dict(typed("config", (dict,), {})),
                   end_reason=str(end_reason), n_params=n_params if n_params > 0 else None,
                   backend=str(typed("backend", (str,), "")), exits=_exits(typed("ranks", (dict,), {})),
                   raw=raw)
        if bad and warnings is not None:
            warnings.append(f"{where}: {', '.join(bad)} of an unexpected type; ignored")
        return info


def _exits(ranks: dict[Any, Any]) -> dict[int, RankExit]:
    """run.json `ranks` ({"3": {"exitcode": 1, "signal": "SIGKILL", ...}}): entries under a canonical rank
    number whose value is an object; any other entry is dropped."""
    out: dict[int, RankExit] = {}
    for key, ex in ranks.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 12 and str(int(key)) == key):
            continue
        if isinstance(ex, dict):
            code, sig = ex.get("exitcode"), ex.get("signal")
            out[int(key)] = RankExit(exitcode=int(code) if isinstance(code, int) else None,
                                     signal=str(sig) if sig else None,
                                     stopped_by_launcher=bool(ex.get("stopped_by_launcher", False)))
    return out
