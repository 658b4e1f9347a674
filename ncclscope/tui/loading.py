"""Opening a run in the TUI without freezing it: a thread worker loads in
stages, each handed to the UI thread as soon as it is ready (run.json alone,
then the loaded trace, then a hang's verdict as soon as the hang diagnosis
has it, then the whole `ncclscope.verdict.run(trace)`), and with
--follow keeps polling for appended rows. A mixin of `NcclscopeApp`; the UI
thread only ever receives presenter models (`model.py`).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from textual import work
from textual.worker import get_current_worker

from ncclscope.load.run_info import RunInfo
from ncclscope.tui.frame import rank_frame
from ncclscope.tui.live_pace import LivePace
from ncclscope.tui.model import build_run_model, preliminary_model
from ncclscope.tui.screens.overview import OverviewView

EXIT_UNREADABLE = 2        # as `ncclscope analyze` on a directory it cannot read
MIN_GAP_S = 0.1            # --follow: the least pause between two polls


class LoadingMixin:
    """`load` (the worker) and what it calls; the app provides `path`, `follow`,
    `poll_s`, `_given`, `_stop`, `live_note` and `apply`."""

    @work(thread=True, exclusive=True, group="load")
    def load(self) -> None:
        """Stages, each applied as soon as it is ready; then, with --follow, poll for appended rows."""
        worker = get_current_worker()
        progress = self._progress_cb()
        run = RunInfo.from_dict(_read_run(self.path))
        if run.world_size and self._given is None:
            self._ui(self.apply, preliminary_model(self.path, run), None)
            self._stop.wait(0.15)   # let the UI thread paint the first screen before loading takes the GIL
        from ncclscope.load.trace import TraceError
        follower = None
        try:
            if self._given is not None:
                trace = self._given
            elif self.follow:
                from ncclscope.tui.follow import Follower
                follower = Follower(self.path)
                progress("reading rank files", 0, None)
                follower.poll(progress=lambda i, n: progress(f"reading rank files {i}/{n}", i, n))
                trace = follower.trace()
            else:
                from ncclscope.load.foreign import load_any
                progress(f"loading trace ({run.world_size or '?'} ranks)", 1, 3)
                trace = load_any(self.path)
        except TraceError as exc:
            if follower is None:
                self._ui(self._fail, str(exc))
                return
            self._ui(self._set_progress, f"waiting for rank files: {exc}", None, None)
            trace = None
        except Exception as exc:  # a reader bug: say so instead of taking the terminal down
            self._ui(self._fail, f"{type(exc).__name__}: {exc}")
            return
        while trace is None and not self._stop.wait(self.poll_s):   # --follow before the first rank dir
            try:
                follower.poll()
                trace = follower.trace()
            except TraceError:
                continue
        if trace is None or worker.is_cancelled:
            return
        live = follower is not None and not follower.ended
        frame = rank_frame(trace)
        self._ui(self.apply, build_run_model(trace, None, live=live, stage="loaded", frame=frame), trace)
        progress("analysing", 2, 3)
        pace = LivePace()
        self._analyse(trace, live, pace, frame)
        progress("", None, None)
        started = time.monotonic()
        # polls start every poll_s (a poll's own time counts into the second), with a moment for the UI
        # thread to paint when one ran long
        while (follower is not None and not self._stop.wait(max(MIN_GAP_S, started + self.poll_s - time.monotonic()))
               and not worker.is_cancelled):
            started = time.monotonic()
            try:
                # each poll reads only the appended batches and extends the last poll's trace and index
                # views from them (Follower is incremental: follow_trace.py); the composer runs at most once
                # per poll, the performance analyses only when due (live_pace.py)
                if follower.poll():
                    self._analyse(follower.trace(), not follower.ended, pace)
            except Exception as exc:  # keep following: the next poll may read a complete file
                self._ui(self._set_progress, f"follow: {type(exc).__name__}: {str(exc)[:60]}", None, None)

    def _analyse(self, trace: Any, live: bool, pace: LivePace, frame: Any = None) -> None:
        """Compose the verdict (`verdict.run`, paced by `pace` while live) and apply it; while a job is live,
        hold a premature hang."""
        frame = rank_frame(trace) if frame is None else frame

        def diagnosed(early: Any) -> None:
            # a hang settles the verdict line: on screen now, the performance tabs when they are done
            self._ui(self.apply, build_run_model(trace, early, live=False, stage="diagnosed", frame=frame),
                     trace, early)
            self._ui(self._set_progress, "analysing performance", 2.5, 3)

        try:
            analysis, note = pace.analyse(trace, live, None if live else diagnosed)
        except Exception as exc:  # the composer guards each analysis; this is a bug in it: say so
            self._ui(self._set_progress, f"analysis failed: {type(exc).__name__}: {exc}", None, None)
            return
        self.live_note = note
        model = build_run_model(trace, analysis, live=live, stage="ready", frame=frame)
        self._ui(self.apply, model, trace, analysis)

    def _ui(self, fn: Any, *args: Any) -> None:
        """call_from_thread that tolerates the app having quit meanwhile."""
        if self._stop.is_set():
            return
        try:
            self.call_from_thread(fn, *args)
        except RuntimeError:   # the app exited between the check and the call; else a real bug: raise
            if self.is_running and not self._stop.is_set():
                raise
            self._stop.set()

    def _progress_cb(self) -> Any:
        def progress(text: str, done: float | None, total: float | None) -> None:
            self._ui(self._set_progress, text, done, total)
        return progress

    def _set_progress(self, text: str, done: float | None, total: float | None) -> None:
        self.query_one(OverviewView).set_progress(text, done, total)

    def _fail(self, message: str) -> None:
        """The run cannot be opened: leave, and let run_tui print the one-line error (exit 2)."""
        self.error = message
        self.exit(return_code=EXIT_UNREADABLE)


def _read_run(path: Path) -> dict[str, Any]:
    try:
        data = json.loads((path / "run.json").read_text(errors="replace"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}
