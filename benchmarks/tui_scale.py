"""How soon the TUI shows something useful on a very large run (issue 11: ≤ 3 s after load).

    OMP_NUM_THREADS=1 python benchmarks/tui_scale.py                      # 16,384 ranks, 2 M events
    OMP_NUM_THREADS=1 python benchmarks/tui_scale.py --ranks 4096 --events 1000000 --keep /tmp/tui4k

It writes a hung synthetic run (benchmarks/synth.py: one rank skips its last
data-parallel all_reduce), then opens it in the real Textual app, headless
(`App.run_test`, 80x24), exactly as `ncclscope tui DIR` does, and prints the
seconds from start to each stage the app puts on screen:

- preliminary: the first screen (config, mesh, the rank grid coloured from run.json),
  before any event is read;
- loaded:      the trace read, the grid coloured from each rank's last state;
- diagnosed:   a hang's verdict line and root-cause rank on screen, as soon as the hang
               diagnosis has them (the composer's `on_verdict`; the performance analyses
               cannot change a hang's line, their tabs fill in at ready);
- ready:       every analysis done, the composer's whole Analysis on screen.

"after load" is diagnosed - loaded (the verdict) and ready - loaded (everything):
the time from the trace being in memory to each on screen. The run must name the
skipping rank, or the benchmark fails (exit 1). The app runs under a hard
timeout (exit 3 when it expires), so this cannot hang.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


async def _open(run: Path, timeout_s: float) -> tuple[dict[str, float], list[int], str]:
    from ncclscope.tui.app import NcclscopeApp

    app = NcclscopeApp(run)
    deadline = time.monotonic() + timeout_s
    async with app.run_test(size=(80, 24)) as pilot:
        while time.monotonic() < deadline:
            await pilot.pause(0.05)
            m = app.run_model
            if app.error or (m is not None and m.stage == "ready"):
                break
        else:
            raise TimeoutError(f"the TUI did not reach its verdict in {timeout_s:g} s")
        if app.error:
            raise RuntimeError(app.error)
        verdict = app.query_one("#ov-verdict").content
        text = verdict.plain if hasattr(verdict, "plain") else str(verdict)
        return dict(app.timings), list(app.run_model.root_ranks), text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=16384)
    ap.add_argument("--events", type=int, default=2_000_000)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--keep", default="", help="write the run here and keep it (default: a temporary folder)")
    args = ap.parse_args(argv)

    import synth

    tmp = None
    run = Path(args.keep) if args.keep else Path(tmp := tempfile.mkdtemp(prefix="ncclscope-tui-scale-")) / "run"
    try:
        if not (run / "run.json").exists():
            t = time.perf_counter()
            synth.generate(run, ranks=args.ranks, events=args.events)
            print(f"wrote {args.ranks:,} ranks in {time.perf_counter() - t:.1f} s: {run}", flush=True)
        truth = json.loads((run / "run.json").read_text())["synthetic"]["hang_rank"]
        try:
            timings, roots, verdict = asyncio.run(asyncio.wait_for(_open(run, args.timeout_s),
                                                                   args.timeout_s + 30))
        except (TimeoutError, asyncio.TimeoutError) as exc:
            print(f"TIMEOUT: {exc}")
            return 3
        pre, loaded, diagnosed, ready = (timings.get(k, float("nan"))
                                         for k in ("preliminary", "loaded", "diagnosed", "ready"))
        print(f"{args.ranks:,} ranks, {args.events:,} events: first screen {pre:.2f} s, trace on screen "
              f"{loaded:.2f} s, verdict on screen {diagnosed:.2f} s, every analysis on screen {ready:.2f} s; "
              f"after load: verdict {diagnosed - loaded:.2f} s, everything {ready - loaded:.2f} s")
        print(f"verdict: {verdict[:160]}")
        if truth not in roots:
            print(f"FAIL: the skipping rank is {truth}, the TUI's root ranks are {roots[:8]}")
            return 1
        print(f"ok: the TUI's root rank is the skipping rank {truth}")
        return 0
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
