"""End to end: real jobs fail on purpose; `ncclscope analyze --json` must name the root.

Run: python -m pytest tests/test_drills_e2e.py -q          (about 3 minutes on 2 cores)

Each case runs `ncclscope train ... --inject SPEC` on a real gloo job (DP, TP x DP,
PP 1F1B, EP layouts), then `ncclscope analyze RUN --json`, and checks:
- the headline finding's kind and root ranks (`ranks` = who to look at);
- the verdict line names the root rank with its mesh coordinates;
- `ncclscope train` printed the same verdict line first in its report;
- the job ended by itself and every rank pid in run.json is gone.
Healthy runs of every layout must give no error-severity finding and an OK verdict.

Why a zygote: on 2 shared cores `import torch` plus torch._dynamo costs 5-11 s per
process, more than a drill itself. One server process (this file run as a script
with --zygote) imports and warms torch once, then forks a fresh process per job
that runs `ncclscope.cli.main.main(["train", ...])` and `main(["analyze", RUN, "--json"])`:
the user's exact command path, with fd 1 and 2 redirected to files, in its own
session so a job that overruns its timeout is killed whole (launcher and ranks).
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import pytest

pytestmark = [pytest.mark.spawn, pytest.mark.e2e, pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parent.parent
JOB_TIMEOUT_S = 120.0
DRILL_TIMEOUT = ["--timeout-s", "2"]

# Layouts (4 ranks each: the most 2 cores run quickly)
DP = ["--dp", "4"]
TPDP = ["--tp", "2", "--dp", "2"]
PP1F1B = ["--pp", "2", "--dp", "2", "--schedule", "1f1b", "--microbatches", "2"]
EP = ["--dp", "4", "--ep", "2"]
CPDP = ["--cp", "2", "--dp", "2"]
ZERO2 = ["--dp", "4", "--zero", "2"]
PPIL = ["--pp", "2", "--vpp", "2", "--schedule", "interleaved", "--microbatches", "2", "--n-layer", "4"]


# ---------------------------------------------------------------------------
# The zygote (runs in its own process; never imported by pytest's process for torch)
# ---------------------------------------------------------------------------
def _set_pdeathsig() -> None:
    try:
        import ctypes
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
    except OSError:
        pass


def _zygote_job(req: dict[str, Any]) -> None:
    """In the forked job process: train, then analyze (`Zygote.run`), or one CLI command (`Zygote.cli`),
    or one function of a test module (`Zygote.call`); never returns."""
    code = 99
    try:
        os.setsid()
        _set_pdeathsig()
        work = Path(req["work"])
        run = str(work / "run")

        def redirect(out: str, err: str) -> None:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(os.open(work / out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 1)
            os.dup2(os.open(work / err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), 2)

        from ncclscope.cli.main import main
        if "call" in req:                    # a function of a test module (`Zygote.call`)
            redirect("cli.out", "cli.err")
            import importlib
            mod, _, fn = req["call"].partition(":")
            try:
                ret = getattr(importlib.import_module(mod), fn)(*req.get("args", []))
                code = ret if isinstance(ret, int) else 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except BaseException:
                import traceback
                traceback.print_exc()
                code = 1
            return
        if "cli" in req:                     # one command as given (`Zygote.cli`)
            redirect("cli.out", "cli.err")
            if req.get("cwd"):
                os.chdir(req["cwd"])
            try:
                rc = main(req["cli"])
            except SystemExit as exc:        # as `python -m ncclscope` would end
                rc = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
            except Exception:
                import traceback
                traceback.print_exc()
                rc = 1
            sys.stdout.flush()
            (work / "result.json").write_text(json.dumps({"rc": rc}))
            code = 0
            return
        redirect("train.out", "train.err")
        t0 = time.monotonic()
        rc_train = main(["train", *req["argv"], "--out", run])
        t1 = time.monotonic()
        redirect("analyze.json", "analyze.err")
        rc_analyze = main(["analyze", run, "--json"]) if (Path(run) / "run.json").exists() else -1
        sys.stdout.flush()
        (work / "result.json").write_text(json.dumps({"rc_train": rc_train, "rc_analyze": rc_analyze,
                                                       "train_s": t1 - t0, "analyze_s": time.monotonic() - t1}))
        code = 0
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def zygote_main() -> None:
    """Read one JSON job per stdin line; fork it; answer {"pid"} at once and {"status"} when it ends."""
    _set_pdeathsig()
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    from ncclscope.runtime.train import warm_imports
    warm_imports()                       # torch, torch._dynamo, pyarrow+pandas, the corpus
    import ncclscope.verdict.diagnose   # noqa: F401  (the analyzer's imports, once)
    import ncclscope.perf.performance  # noqa: F401
    import ncclscope.index.summary  # noqa: F401
    proto = sys.stdout
    proto.write(json.dumps({"ready": True}) + "\n")
    proto.flush()
    for line in sys.stdin:
        req = json.loads(line)
        proto.flush()
        pid = os.fork()
        if pid == 0:
            _zygote_job(req)
        proto.write(json.dumps({"pid": pid}) + "\n")
        proto.flush()
        _, status = os.waitpid(pid, 0)
        proto.write(json.dumps({"status": status}) + "\n")
        proto.flush()


# ---------------------------------------------------------------------------
# Test side
# ---------------------------------------------------------------------------
@dataclass
class Job:
    name: str
    argv: list[str]
    work: Path
    seconds: float
    train_out: str
    train_err: str
    report: dict[str, Any]          # `ncclscope analyze --json`
    run: dict[str, Any]             # run.json
    result: dict[str, Any] = field(default_factory=dict)

    @property
    def run_dir(self) -> Path:
        return self.work / "run"

    @property
    def verdict(self) -> str:
        return str(self.report.get("verdict", ""))

    def errors(self) -> list[dict[str, Any]]:
        return [f for f in self.report.get("findings", []) if f["severity"] == "error"]

    def headline(self) -> dict[str, Any]:
        heads = [f for f in self.report["findings"] if f["data"].get("role") == "headline"]
        assert heads, self.explain()
        return heads[0]

    def explain(self) -> str:
        errs = "\n".join(f"  [{f['severity']}] {f['kind']} {f['ranks']}: {f['title']}"
                         for f in self.report.get("findings", [])[:12])
        return (f"{self.name}: ncclscope train {' '.join(self.argv)}\nverdict: {self.verdict}\n{errs}\n"
                f"end: {self.run.get('end_reason')} ranks {self.run.get('ranks')}\n"
                f"--- train stderr (tail)\n{self.train_err[-3000:]}")


class Zygote:
    def __init__(self, base: Path) -> None:
        self.base = base
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                   PYTHONWARNINGS="ignore::FutureWarning")
        self.log = open(base / "zygote.log", "w")
        self.proc = subprocess.Popen([sys.executable, __file__, "--zygote"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=ROOT,
                                     start_new_session=True)
        self._expect("ready", 120.0)

    def _expect(self, key: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        assert self.proc.stdout is not None
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.proc.stdout], [], [], left)[0]:
                raise TimeoutError(key)
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"zygote exited; see {self.base / 'zygote.log'}")
            msg = json.loads(line)
            if key in msg:
                return msg

    def run(self, name: str, argv: list[str], timeout: float = JOB_TIMEOUT_S) -> Job:
        work = self.base / name
        t0 = time.monotonic()
        self._job({"argv": argv}, work, timeout, f"ncclscope train {' '.join(argv)}", "train.err", reap=False)
        seconds = time.monotonic() - t0
        report_text = _read(work / "analyze.json")
        report = json.loads(report_text) if report_text.strip() else {}
        heads = [f for f in report.get("findings", []) if f["data"].get("role") == "headline"]
        with open(self.base / "summary.tsv", "a") as fh:
            fh.write(f"{name}\t{seconds:.1f}\t{heads[0]['kind'] if heads else '-'}\t"
                     f"{heads[0]['ranks'] if heads else ''}\t{report.get('verdict', '')}\n")
        return Job(name=name, argv=argv, work=work, seconds=seconds, train_out=_read(work / "train.out"),
                   train_err=_read(work / "train.err"),
                   report=report,
                   run=json.loads(_read(work / "run" / "run.json") or "{}"),
                   result=json.loads(_read(work / "result.json") or "{}"))

    def cli(self, name: str, argv: list[str], timeout: float = JOB_TIMEOUT_S,
            cwd: str | os.PathLike[str] | None = None) -> subprocess.CompletedProcess:
        """`ncclscope ARGV` in a fresh fork of the warm process (torch already imported), with its own
        session, in `cwd` if given, killed whole past `timeout`; its exit code, stdout and stderr as a
        CompletedProcess."""
        work = self._unique(name)
        self._job({"cli": argv, "cwd": str(cwd or "")}, work, timeout, f"ncclscope {' '.join(argv)}", "cli.err",
                  reap=True)
        rc = json.loads(_read(work / "result.json") or '{"rc": 99}')["rc"]
        return subprocess.CompletedProcess(["ncclscope", *argv], rc, _read(work / "cli.out"), _read(work / "cli.err"))

    def call(self, name: str, target: str, args: list[Any], timeout: float = JOB_TIMEOUT_S
             ) -> subprocess.CompletedProcess:
        """`module:function(*args)` (a module on the tests' path) in a fresh fork of the warm process, with
        its own session, killed whole past `timeout`, whatever it started reaped once it ended. The
        CompletedProcess's returncode is the fork's, as subprocess gives it: the function's int return
        (0 otherwise), 1 on an exception, -N when signal N ended it; stdout and stderr are its fds 1, 2."""
        work = self._unique(name)
        status = self._job({"call": target, "args": args}, work, timeout, target, "cli.err", reap=True)
        rc = os.waitstatus_to_exitcode(status)
        return subprocess.CompletedProcess([target, *map(str, args)], rc, _read(work / "cli.out"),
                                           _read(work / "cli.err"))

    def _unique(self, name: str) -> Path:
        """A fresh job directory named after `name` (a suffix when a job of that name ran already)."""
        work, n = self.base / name, 1
        while work.exists():
            n += 1
            work = self.base / f"{name}-{n}"
        return work

    def _job(self, req: dict[str, Any], work: Path, timeout: float, what: str, err: str, reap: bool) -> int:
        """Send one job, wait for it; past `timeout` kill its session (launcher and ranks) and fail the test.
        `reap`: also kill whatever its session left behind once it ended (the drills leave that to
        `_assert_no_orphans`, which must see it). Returns the job's wait status."""
        work.mkdir(parents=True, exist_ok=False)
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({**req, "work": str(work)}) + "\n")
        self.proc.stdin.flush()
        pid = self._expect("pid", 30.0)["pid"]
        try:
            return int(self._expect("status", timeout)["status"])
        except TimeoutError:
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._expect("status", 30.0)
            pytest.fail(f"{work.name}: {what} did not end by itself in {timeout} s\n" + _read(work / err)[-3000:])
        finally:
            if reap:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def close(self) -> None:
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except FileNotFoundError:
        return ""


def make_zygote(tmp_path_factory: pytest.TempPathFactory) -> Zygote:
    """The warm process, its jobs under NCCLSCOPE_DRILLS_DIR when set (to look at them afterwards).
    conftest's session fixture `zygote` is the one every spawned-job module shares."""
    keep = os.environ.get("NCCLSCOPE_DRILLS_DIR")
    if keep:
        base = Path(keep) / time.strftime("drills-%Y%m%d-%H%M%S")
        base.mkdir(parents=True)
    else:
        base = tmp_path_factory.mktemp("drills")
    return Zygote(base)


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Drill:
    name: str
    layout: list[str]
    inject: tuple[str, ...]
    kind: str                       # expected headline kind
    roots: tuple[int, ...]          # expected root ranks (the headline's `ranks`)
    coords: str                     # expected "rank R (...)" text in the verdict
    extra: tuple[str, ...] = ()
    steps: int = 4

    def argv(self) -> list[str]:
        out = [*self.layout, "--steps", str(self.steps), *DRILL_TIMEOUT, *self.extra]
        for spec in self.inject:
            out += ["--inject", spec]
        return out


SKIP_TIMEOUT_S = 6   # the suspect test needs the op to run > 2 s and > 20x its history before the timeout

DRILLS = [
    Drill("skip-dp", DP, ("skip:rank=2,step=2",), "hang", (2,), "rank 2 (dp 2)",
          extra=("--timeout-s", str(SKIP_TIMEOUT_S))),
    Drill("skip-pp1f1b", PP1F1B, ("skip:rank=1,step=1,group=dp",), "hang", (1,), "rank 1 (pp 0, dp 1)"),
    Drill("hang-tpdp", TPDP, ("hang:rank=3,step=2",), "stuck_in_compute", (3,), "rank 3 (dp 1, tp 1)"),
    Drill("kill-pp1f1b", PP1F1B, ("kill:rank=2,step=2",), "dead_rank", (2,), "rank 2 (pp 1, dp 0)"),
    Drill("crash-ep", EP, ("crash:rank=1,step=2",), "dead_rank", (1,), "rank 1 (dp 1, ep 1)"),
    Drill("kill-dp", DP, ("kill:rank=1,step=2",), "dead_rank", (1,), "rank 1 (dp 1)"),
    Drill("wrong_group-tpdp", TPDP, ("wrong_group:rank=1,step=2,use=tp,group=dp",), "wrong_group", (1,),
          "rank 1 (dp 0, tp 1)"),
    # The rank that broke its schedule (recv before send), not both ranks of the recv/recv cycle.
    Drill("p2p_order-pp1f1b", PP1F1B, ("p2p_order:rank=0,step=1",), "schedule_deviation", (0,),
          "rank 0 (pp 0, dp 0)"),
    Drill("p2p_order-ppil", PPIL, ("p2p_order:rank=0,step=1",), "schedule_deviation", (0,), "rank 0 (pp 0)"),
    # A skip is a skip whatever it led to: a cycle with the next step's ring p2p (CP), gloo's SIGABRT on
    # the paired-off collective (ZeRO-2), an allocation failure from garbage all_to_all counts (EP).
    Drill("skip-cpdp", CPDP, ("skip:rank=1,step=2",), "hang", (1,), "rank 1 (dp 0, cp 1)"),
    Drill("skip-zero2", ZERO2, ("skip:rank=1,step=2",), "hang", (1,), "rank 1 (dp 1)"),
    Drill("skip-ep", EP, ("skip:rank=1,step=2",), "hang", (1,), "rank 1 (dp 1, ep 1)"),
    Drill("mismatch_size-dp", DP, ("mismatch:rank=3,step=2,what=size",), "collective_mismatch", (3,),
          "rank 3 (dp 3)"),
    # 2-member dp group: gloo SIGABRTs the partner, whose rows of the instance die with it
    Drill("mismatch_size-pp1f1b", PP1F1B, ("mismatch:rank=0,step=2,what=size",), "collective_mismatch", (0,),
          "rank 0 (pp 0, dp 0)"),
    Drill("mismatch_dtype-tpdp", TPDP, ("mismatch:rank=2,step=2,what=dtype,group=dp",), "collective_mismatch",
          (2,), "rank 2 (dp 1, tp 0)"),
    # No op=: under EP the step's first collective is an all_to_all_single; the drill must still
    # distort an all_reduce (runtime fix a5cd321), not fire on the all_to_all with no effect.
    Drill("mismatch_type-ep", EP, ("mismatch:rank=2,step=2,what=type",), "collective_mismatch", (2,),
          "rank 2 (dp 2, ep 0)"),
    Drill("group_order-dp", DP, ("group_order:rank=3",), "group_mismatch", (3,), "rank 3 (dp 3)"),
]


@pytest.fixture(scope="module", params=DRILLS, ids=lambda d: d.name)
def drill(request: pytest.FixtureRequest, zygote: Zygote) -> tuple[Drill, Job]:
    d: Drill = request.param
    return d, zygote.run(d.name, d.argv())


def _assert_no_orphans(job: Job) -> None:
    ranks = job.run.get("ranks", {})
    assert ranks, job.explain()
    for r, info in ranks.items():
        pid = info.get("pid")
        assert pid, (r, info)
        if psutil.pid_exists(pid):
            try:
                status = psutil.Process(pid).status()
            except psutil.NoSuchProcess:
                continue
            assert status == psutil.STATUS_ZOMBIE, f"{job.name}: rank {r} (pid {pid}) still {status}"


def test_drill_names_the_root_rank_and_kind(drill: tuple[Drill, Job]) -> None:
    d, job = drill
    assert job.report, job.explain()
    head = job.headline()
    assert (head["kind"], tuple(head["ranks"])) == (d.kind, d.roots), job.explain()
    assert job.errors()[0] is head or job.errors()[0]["title"] == head["title"], job.explain()
    prefix = {"hang": "HANG:", "stuck_in_compute": "STUCK IN COMPUTE:", "dead_rank": "DEAD RANK:",
              "deadlock": "DEADLOCK:", "wrong_group": "WRONG GROUP:", "collective_mismatch": "MISMATCH:",
              "group_mismatch": "GROUP MISMATCH:", "schedule_deviation": "SCHEDULE DEVIATION:"}[d.kind]
    assert job.verdict.startswith(f"{prefix} {d.coords}"), job.explain()


def test_drill_job_ends_by_itself_without_orphans(drill: tuple[Drill, Job]) -> None:
    d, job = drill
    assert job.run.get("end_reason") == "rank_failed", job.explain()
    assert job.result.get("rc_train") == 1 and job.result.get("rc_analyze") == 1, (job.result, job.explain())
    _assert_no_orphans(job)


def test_train_prints_the_same_verdict_first(drill: tuple[Drill, Job]) -> None:
    d, job = drill
    lines = [ln for ln in job.train_out.splitlines() if ln.strip()]
    assert lines and lines[0] == job.verdict, (lines[:2], job.explain())


def test_skip_drill_marks_waiters_suspect_before_their_timeout(zygote: Zygote, drill: tuple[Drill, Job]) -> None:
    d, job = drill
    if d.name != "skip-dp":
        pytest.skip("only the skip drill with a long timeout")
    from ncclscope.load.trace import load
    trace = load(job.run_dir)
    ev = trace.events
    suspect = ev[(ev["status"].astype(str) == "suspect") & (ev["phase"].astype(str) == "instant")]
    waiters = {0, 1, 3}
    timed = trace.ops[(trace.ops["op_name"].astype(str) == "all_reduce")
                      & trace.ops["status"].astype(str).isin(["timeout", "error"])]
    for r in waiters:
        rows = suspect[suspect["rank"] == r]
        assert len(rows), f"rank {r}: no suspect row\n{job.explain()}"
        row = rows.iloc[0]
        assert str(row["op_name"]) == "all_reduce" and str(row["process_group"]) == "dp0"
        end = timed[(timed["rank"] == r) & (timed["op_id"] == row["op_id"])]
        assert len(end) == 1, f"rank {r}: the suspect op {row['op_id']} has no timeout end"
        op = end.iloc[0]
        # more than 2 s in, and before the hard timeout
        assert row["t_ns"] - op["start_ns"] > 2e9
        assert row["t_ns"] < op["end_ns"], (row["t_ns"], op["end_ns"])


# ---------------------------------------------------------------------------
# Performance / divergence drills: the job completes and no hang is claimed
# ---------------------------------------------------------------------------
SOFT = [
    ("soft-dp", DP, ("slow:rank=1,factor=3", "nan:rank=2,step=1", "desync_grad:rank=3,step=2")),
    ("soft-pp1f1b", PP1F1B, ("slow:rank=3,factor=3", "desync_grad:rank=1,step=1")),
]
HANG_KINDS = {"deadlock", "hang", "dead_rank", "stuck_in_compute", "collective_mismatch", "wrong_group",
              "group_mismatch", "unmatched_p2p", "schedule_deviation"}


@pytest.mark.parametrize("name,layout,inject", SOFT, ids=[s[0] for s in SOFT])
def test_soft_drills_complete_without_a_hang_finding(zygote: Zygote, name: str, layout: list[str],
                                                     inject: tuple[str, ...]) -> None:
    argv = [*layout, "--steps", "4", *DRILL_TIMEOUT] + [x for s in inject for x in ("--inject", s)]
    job = zygote.run(name, argv)
    assert job.run.get("end_reason") == "completed", job.explain()
    bad = [f for f in job.errors() if f["kind"] in HANG_KINDS]
    assert not bad, job.explain()
    assert not job.verdict.split(":")[0] in ("HANG", "DEADLOCK", "DEAD RANK", "STUCK IN COMPUTE", "MISMATCH",
                                             "WRONG GROUP", "GROUP MISMATCH", "UNMATCHED P2P",
                                             "SCHEDULE DEVIATION"), job.explain()
    _assert_no_orphans(job)


# ---------------------------------------------------------------------------
# Healthy runs: no false positives
# ---------------------------------------------------------------------------
# Healthy jobs of every layout: tests/test_precision.py::test_healthy_layout_exits_0_with_no_warning (exit 0,
# no warning at all, the verdict printed first, no orphans).


if __name__ == "__main__" and "--zygote" in sys.argv:
    sys.path.insert(0, str(ROOT))
    zygote_main()
