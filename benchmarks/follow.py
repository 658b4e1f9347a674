"""`--follow` on a live run: a poll's cost, full rebuild vs incremental (issue 11 item 2).

    OMP_NUM_THREADS=1 python benchmarks/follow.py                          # 256 ranks, ~1 M event rows, 20 appends
    OMP_NUM_THREADS=1 python benchmarks/follow.py --ranks 64 --events 200000 --appends 10 --no-analysis

It writes a synthetic run (benchmarks/synth.py, healthy, no end marker), then
replays it into a fresh directory as a live job would write it: every rank's
events/metrics/samples streams grow by one batch per append (so an op's begin
and end often land in different appends), `run.json` gets its end reason only
after the last one. After each append two followers read the directory:

- full:        `Follower(incremental=False)`: `trace.assemble` over everything read,
               then the index views `coll`, `p2p`, `step_windows`, `instances`, `max_seq`;
- incremental: `Follower()` (the TUI's): tables, ops join and those views extended
               from the last poll's (tui/follow_trace.py).

and `analysis.run` on each trace (the rest of the index is computed there, as
for any trace). Per poll it prints seconds of trace+views for each, their
ratio, then the same including `analysis.run`; at the end the totals, and it
checks that both give equal `ops` and the same verdict (exit 1 otherwise).
A hard timeout (`--timeout-s`, default 900) ends it with exit 3: it cannot hang.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from ncclscope import schema as S

VIEWS = ("coll", "p2p", "step_windows", "instances", "max_seq")


def _timeout(signum: int, frame: object) -> None:
    print("benchmarks/follow.py: hard timeout, giving up", flush=True)
    os._exit(3)


class Replay:
    """Writes a finished run directory into `dst` piece by piece, as its ranks would have appended it."""

    def __init__(self, src: Path, dst: Path, appends: int) -> None:
        self.dst, self.appends = dst, appends
        dst.mkdir(parents=True)
        run = json.loads((src / S.RUN_JSON).read_text())
        self.final_run = run
        live = {k: v for k, v in run.items() if k not in ("end_reason", "ranks", "duration_s")}
        (dst / S.RUN_JSON).write_text(json.dumps(live))
        self.writers: list[tuple[pa.ipc.RecordBatchStreamWriter, object, pa.Table]] = []
        for d in sorted(src.glob("rank-*")):
            out = dst / d.name
            out.mkdir()
            for f in (S.RANK_JSON, S.GROUPS_JSON):
                if (d / f).exists():
                    meta = json.loads((d / f).read_text())
                    meta.pop("end", None)
                    (out / f).write_text(json.dumps(meta))
            for name in (S.EVENTS_FILE, S.METRICS_FILE, S.SAMPLES_FILE):
                if not (d / name).exists():
                    continue
                table = pa.ipc.open_stream(str(d / name)).read_all()
                fh = open(out / name, "wb")
                self.writers.append((pa.ipc.new_stream(fh, table.schema), fh, table))

    def append(self, k: int) -> int:
        """Write the k-th piece (0-based) of every stream; returns the rows written."""
        rows = 0
        for w, fh, table in self.writers:
            a, b = len(table) * k // self.appends, len(table) * (k + 1) // self.appends
            if b > a:
                w.write_table(table.slice(a, b - a), max_chunksize=b - a)
                fh.flush()
                rows += b - a
        if k == self.appends - 1:
            for w, fh, _ in self.writers:
                w.close()
                fh.close()
            (self.dst / S.RUN_JSON).write_text(json.dumps(self.final_run))
        return rows


def _build(follower, analyse: bool) -> tuple[object, object, float, float]:
    """(trace, analysis, seconds for poll+trace+views, seconds for analysis.run)."""
    from ncclscope import verdict as analysis
    from ncclscope.index.views import index_of
    t0 = time.perf_counter()
    follower.poll()
    trace = follower.trace()
    ix = index_of(trace)
    for v in VIEWS:
        getattr(ix, v)
    t1 = time.perf_counter()
    result = analysis.run(trace) if analyse else None
    return trace, result, t1 - t0, time.perf_counter() - t1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=256)
    ap.add_argument("--events", type=int, default=1_000_000, help="event rows in all (synth.py)")
    ap.add_argument("--appends", type=int, default=20)
    ap.add_argument("--no-analysis", action="store_true", help="time trace + index views only")
    ap.add_argument("--timeout-s", type=float, default=900.0)
    ap.add_argument("--keep", type=Path, default=None, help="write the runs here and keep them")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGALRM, _timeout)
    signal.alarm(int(args.timeout_s))
    faulthandler.dump_traceback_later(args.timeout_s + 30, exit=True)     # even if a C call holds the GIL

    import pandas as pd
    from synth import generate
    from ncclscope.tui.follow import Follower

    base = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="ncclscope-follow-"))
    try:
        t0 = time.perf_counter()
        src = generate(base / "src", ranks=args.ranks, events=args.events, hang=False, seed=1)
        replay = Replay(src, base / "live", args.appends)
        print(f"{args.ranks} ranks, {json.loads((src / S.RUN_JSON).read_text())['synthetic']['events']:,} event "
              f"rows, {args.appends} appends (written in {time.perf_counter() - t0:.1f} s)", flush=True)
        full, inc = Follower(base / "live", incremental=False), Follower(base / "live")
        analyse = not args.no_analysis
        head = f"{'poll':>4} {'rows':>9} {'ops':>9} {'changed':>8} | {'full s':>7} {'incr s':>7} {'ratio':>6}"
        if analyse:
            head += f" | {'full+run':>8} {'incr+run':>8} {'ratio':>6}"
        print(head, flush=True)
        tot = np.zeros(4)
        written = 0
        ok = True
        for k in range(args.appends):
            written += replay.append(k)
            tf, af, f_s, f_run = _build(full, analyse)
            ti, ai, i_s, i_run = _build(inc, analyse)
            info = inc.index_timings
            line = (f"{k + 1:>4} {written:>9,} {len(ti.ops):>9,} {info.get('changed_ops', 0):>8,} | "
                    f"{f_s:>7.3f} {i_s:>7.3f} {f_s / max(i_s, 1e-9):>5.1f}x")
            if analyse:
                line += (f" | {f_s + f_run:>8.3f} {i_s + i_run:>8.3f} "
                         f"{(f_s + f_run) / max(i_s + i_run, 1e-9):>5.1f}x")
            if info.get("full_index"):
                line += f"  (views built whole: {info.get('why_full')})"
            print(line, flush=True)
            tot += [f_s, i_s, f_run, i_run]
            same_ops = tf.ops.equals(ti.ops) and list(tf.ops.dtypes) == list(ti.ops.dtypes)
            if not same_ops or (analyse and (af.verdict, af.level) != (ai.verdict, ai.level)):
                print(f"  MISMATCH at poll {k + 1}: ops equal {same_ops}"
                      + (f"; verdicts {af.verdict!r} / {ai.verdict!r}" if analyse else ""), flush=True)
                ok = False
        print(f"total trace+views: full {tot[0]:.2f} s, incremental {tot[1]:.2f} s "
              f"({tot[0] / max(tot[1], 1e-9):.1f}x)")
        if analyse:
            print(f"total with analysis.run: full {tot[0] + tot[2]:.2f} s, incremental {tot[1] + tot[3]:.2f} s "
                  f"({(tot[0] + tot[2]) / max(tot[1] + tot[3], 1e-9):.1f}x)")
        pd.testing.assert_frame_equal(full.trace().ops, inc.trace().ops)
        print("ops equal after every poll" if ok else "MISMATCH (see above)")
        return 0 if ok else 1
    finally:
        signal.alarm(0)
        faulthandler.cancel_dump_traceback_later()
        if not args.keep:
            shutil.rmtree(base, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
