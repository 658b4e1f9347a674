"""`--follow` on healthy live jobs: does the live verdict ever cry wolf? (issue 25, class 10)

    OMP_NUM_THREADS=1 python benchmarks/follow_watch.py                       # three layouts, 200 s each
    OMP_NUM_THREADS=1 python benchmarks/follow_watch.py --minutes 10 --layouts dp4,pp2dp2,tp2dp2

For each layout it starts a healthy `ncclscope train` job sized to outlast the watch, and polls its run
directory every `--poll-s` seconds exactly as `ncclscope tui RUN --follow` does: `Follower.poll()` (only
the appended batches), then `tui.live_pace.LivePace.analyse`: the one verdict composer on the extended
trace, each part when due (the hang diagnosis when something could change it, the performance analyses
every few seconds), and the live hold (`tui.follow.hold_premature_hang`). A poll whose live headline is a
hang or mismatch verdict (ALARMS) is a false verdict: it is printed with its poll number and the live
note; with `--keep DIR` the trace that poll read is pickled there (`LAYOUT-pollN.pkl`: `pickle.load` it and
call `LivePace().analyse(trace, True)` to reproduce); with `--keep-slow S` also the trace of every poll
slower than S seconds (`LAYOUT-slow-pollN.pkl`: a slow poll froze the live view for that long). When the
watch ends the job is stopped (its process group gets SIGTERM, then SIGKILL; also when the watcher itself
gets SIGTERM) and the totals are printed: polls, false verdicts, a poll's seconds (median, 95th percentile,
slowest, and the share that fit in one poll interval).

Exit 0 when no poll gave a false verdict, 1 otherwise. Every job has a hard deadline: it cannot hang.
"""
from __future__ import annotations

import argparse
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

LAYOUTS = {
    "dp4": ["--dp", "4"],
    "pp2dp2": ["--pp", "2", "--dp", "2", "--microbatches", "4"],
    "tp2dp2": ["--tp", "2", "--dp", "2"],
    "cp2pp2": ["--cp", "2", "--pp", "2", "--microbatches", "4", "--schedule", "gpipe"],
}
# the verdicts a live view must not cry while the job is healthy: the hang and mismatch kinds (performance
# and numerics warnings are facts of the run the post-mortem says too, and are not counted)
ALARMS = ("HANG", "DEADLOCK", "DEAD RANK", "STUCK IN COMPUTE", "STOPPED", "MISMATCH", "WRONG GROUP",
          "GROUP MISMATCH", "UNMATCHED P2P", "SCHEDULE DEVIATION")


def _stop(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            continue


def _keep_trace(trace: object, path: Path) -> None:
    """Pickle the trace a poll read, without the index the analysis cached on it (the index refers back to its
    trace weakly, and a weak reference cannot be pickled: the replay builds a fresh one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    state = dict(vars(trace))
    state.pop("_ncclscope_index", None)
    bare = object.__new__(type(trace))
    vars(bare).update(state)
    with open(path, "wb") as fh:
        pickle.dump(bare, fh)


def watch(layout: str, seconds: float, poll_s: float, out: Path, keep: Path | None = None,
          keep_slow: float | None = None) -> tuple[int, list[str], list[float], float, bool]:
    """Polls, false verdicts (one line each), every poll's seconds, the seconds watched, and whether the job
    ended before the watch did (then it watched less than asked, and says so)."""
    from ncclscope.tui.follow import Follower
    from ncclscope.tui.live_pace import LivePace

    # more steps than the watch can see end: a tiny 4-rank job runs ~20 steps a second on two free cores
    # (at 4 steps per watched second, stop 39's 3-minute watches ended with their jobs after ~1 minute)
    steps = max(20, int(seconds * 100))
    cmd = [sys.executable, "-m", "ncclscope", "train", *LAYOUTS[layout], "--steps", str(steps),
           "--timeout-s", "30", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                            start_new_session=True)
    false: list[str] = []
    polls, times = 0, []
    t_start = time.monotonic()
    try:
        t_end = t_start + seconds
        while not (out / "rank-00000").is_dir() and time.monotonic() < t_end and proc.poll() is None:
            time.sleep(0.2)
        fol, pace = Follower(out), LivePace()
        while time.monotonic() < t_end and proc.poll() is None:
            t0 = time.monotonic()
            try:
                if fol.poll():
                    trace = fol.trace()
                    analysis, note = pace.analyse(trace, live=True)
                    polls += 1
                    if analysis.verdict.startswith(ALARMS):
                        false.append(f"{layout} poll {polls}: {analysis.verdict[:160]} ({note or 'no hold'})")
                        print("  FALSE " + false[-1], file=sys.stderr, flush=True)
                        if keep is not None:
                            _keep_trace(trace, keep / f"{layout}-poll{polls}.pkl")
            except Exception as exc:  # a torn read: the next poll reads the whole batch
                print(f"  poll error: {type(exc).__name__}: {exc}", file=sys.stderr)
            dt = time.monotonic() - t0
            times.append(dt)
            if keep is not None and keep_slow is not None and dt > keep_slow and polls:
                # a slow poll is a defect of its own (the live view froze): keep what it read to replay it
                print(f"  SLOW {layout} poll {polls}: {dt:.1f} s", file=sys.stderr, flush=True)
                _keep_trace(trace, keep / f"{layout}-slow-poll{polls}.pkl")
            time.sleep(max(0.0, poll_s - dt))
    finally:
        ended = proc.poll() is not None
        _stop(proc)
    return polls, false, times, time.monotonic() - t_start, ended


def _poll_times(times: list[float], poll_s: float) -> str:
    """A poll's seconds: median, 95th percentile, slowest, and the share that fit in one poll interval (a
    poll longer than that delays the next: the view then refreshes less often than every `poll_s`)."""
    if not times:
        return "no polls"
    t = sorted(times)
    within = sum(x <= poll_s for x in t) / len(t)
    return (f"poll s median {t[len(t) // 2]:.2f} p95 {t[min(len(t) - 1, int(0.95 * len(t)))]:.2f} "
            f"slowest {t[-1]:.2f}, {100 * within:.0f} % within {poll_s:g} s")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layouts", default="dp4,pp2dp2,tp2dp2")
    ap.add_argument("--seconds", type=float, default=200.0, help="watch time per layout")
    ap.add_argument("--minutes", type=float, default=None, help="watch time per layout, in minutes")
    ap.add_argument("--poll-s", type=float, default=1.0)
    ap.add_argument("--keep", type=Path, default=None, help="pickle the trace of each false verdict here")
    ap.add_argument("--keep-slow", type=float, default=None, metavar="S",
                    help="with --keep, also pickle the trace of every poll that took more than S seconds")
    args = ap.parse_args()
    # a SIGTERM (kill, a CI step's timeout) unwinds through `watch`'s finally, which stops the job: without
    # this the job outlived the watcher and kept loading the machine (seen: it failed other jobs' start-up)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    seconds = args.minutes * 60 if args.minutes else args.seconds
    total_polls, total_false = 0, []
    with tempfile.TemporaryDirectory(prefix="follow_watch_") as tmp:
        for layout in args.layouts.split(","):
            if layout not in LAYOUTS:
                print(f"follow_watch: unknown layout {layout!r} (choose from {', '.join(LAYOUTS)})",
                      file=sys.stderr)
                return 2
            polls, false, times, watched, ended = watch(layout, seconds, args.poll_s, Path(tmp) / layout,
                                                        args.keep, args.keep_slow)
            print(f"{layout:8s} polls {polls:4d}  false verdicts {len(false):3d}  {_poll_times(times, args.poll_s)}"
                  f"  watched {watched:.0f} s" + ("  (the job ended first)" if ended else ""), flush=True)
            total_polls += polls
            total_false += false
    print(f"total    polls {total_polls:4d}  false verdicts {len(total_false):3d}")
    for line in total_false:
        print("  " + line)
    return 0 if not total_false else 1


if __name__ == "__main__":
    sys.exit(main())
