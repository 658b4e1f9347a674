"""Every command in a ```bash block of README.md, docs/**/*.md and sample_traces/README.md runs.

The blocks are extracted from the files, split on `&&`, and each command is
sorted by an explicit rule below. A command no rule knows fails this test
loudly: a new doc command must get a rule (usually: it just runs).

Rules:
- `ncclscope SUB ...`: first parsed by the real argument parser (a renamed or
  removed flag fails here), then run as written (through the CLI's `main`:
  analyze, report and export in this process, train in a fork of the suite's
  warm zygote (conftest), the rest as `python -m ncclscope ...`) inside a
  scratch copy of the repository's layout: the working directory is a
  temporary directory holding a copy of sample_traces/, so `runs/...`, `a.html`
  and `sample_traces/...` resolve there and nothing in the checkout is written;
  absolute `/tmp/...` paths are moved under it too. Exit status 0 or 1 (1 =
  the analyzer found problems, which is what the drills are for); never 2 or a
  traceback. Where a doc quotes what `ncclscope analyze|report sample_traces/X`
  prints (a plain ``` block right after a one-command ```bash block), the
  first line must be exactly what it prints today: the samples are fixed.
  Commands of one file run in order in one directory, so
  `ncclscope analyze runs/b` sees the run an earlier `ncclscope train --out
  runs/b` wrote.
  * `ncclscope tui RUN` is not run: it needs a terminal (tests/test_tui.py
    drives the app headless). Its arguments are parsed, RUN must exist, and
    `ncclscope tui --help` runs.
  * `ncclscope demo ...` is not run in full (five jobs, minutes): its arguments
    are parsed, and its reduced form `ncclscope demo --quick` runs in
    tests/test_demo.py.
- `python benchmarks/scale.py ...`: run reduced (`--sizes 8 --events-per-rank 1000`).
- `python benchmarks/*.py ...`, `python sample_traces/make.py ...`: `--help` runs
  (the full runs are benchmarks, or re-make the samples that test_samples checks).
- setup (`python3 -m venv`, `. .venv/bin/activate`, `pip install ...`): not run.
- `python -m pytest ...`: not run (it is this test suite).
- `torchrun ... -m ncclscope.runtime.train ...`: not run here;
  tests/test_dp_runtime.py::test_entry_point_runs_unchanged_under_torchrun runs it.
"""
from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import ROOT, cli_env, cli_in_process, run_cli

DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), ROOT / "sample_traces" / "README.md"]
ENV_ASSIGN = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")
SHELL_SYNTAX = {"|", "||", ";", ">", ">>", "<", "2>", "2>&1", "&"}


def _blocks(path: Path) -> list[tuple[str, int, list[str]]]:
    """(language, line number of the first content line, lines) of every fenced block."""
    blocks: list[tuple[str, int, list[str]]] = []
    cur: tuple[str, int, list[str]] | None = None
    for no, line in enumerate(path.read_text().splitlines(), 1):
        stripped = line.strip()
        if cur is None:
            if stripped.startswith("```"):
                cur = (stripped[3:].strip(), no + 1, [])
            continue
        if stripped.startswith("```"):
            blocks.append(cur)
            cur = None
        else:
            cur[2].append(line)
    assert cur is None, f"{path}: unterminated ``` block"
    return blocks


def bash_commands(path: Path) -> list[tuple[int, list[str]]]:
    """(line number, argv) of every command in the file's ```bash blocks, in order."""
    cmds: list[tuple[int, list[str]]] = []
    for lang, first, lines in _blocks(path):
        if lang not in ("bash", "sh", "shell", "console"):
            continue
        pending, start = "", first
        for no, line in enumerate(lines, first):
            stripped = line.strip()
            if not pending:
                start = no
            if stripped.endswith("\\"):
                pending += stripped[:-1] + " "
                continue
            text, pending = pending + stripped, ""
            if not text or text.startswith("#"):
                continue
            seg: list[str] = []
            for tok in [*shlex.split(text, comments=True), "&&"]:
                if tok == "&&":
                    if seg:
                        cmds.append((start, seg))
                    seg = []
                else:
                    seg.append(tok)
    return cmds


def quoted_outputs(path: Path) -> dict[int, str]:
    """Line number of a one-command ```bash block running `ncclscope analyze|report sample_traces/...`
    -> the first line of the plain ``` block right after it: the doc's claim of what it prints."""
    out: dict[int, str] = {}
    blocks = _blocks(path)
    for (lang, first, lines), nxt in zip(blocks, blocks[1:]):
        cmds = [ln for ln in lines if ln.strip() and not ln.strip().startswith("#")]
        if lang != "bash" or len(cmds) != 1 or nxt[0] != "" or not nxt[2]:
            continue
        argv = shlex.split(cmds[0], comments=True)
        if argv[:2] in (["ncclscope", "analyze"], ["ncclscope", "report"]) and argv[2].startswith("sample_traces/") \
                and "--json" not in argv:
            out[first + lines.index(cmds[0])] = nxt[2][0]
    return out


def classify(argv: list[str]) -> tuple[str, str]:
    """(action, reason): action is 'ncclscope', 'script', 'skip'."""
    while argv and ENV_ASSIGN.match(argv[0]):
        argv = argv[1:]
    if not argv:
        return "skip", "empty"
    if bad := SHELL_SYNTAX.intersection(argv):
        return "unknown", f"shell syntax {sorted(bad)} is not supported here"
    head = argv[0]
    if head == "ncclscope":
        return "ncclscope", ""
    if argv[:3] == ["python3", "-m", "venv"] or head in (".", "source") or head == "pip" or argv[:3] == [
            "python", "-m", "pip"]:
        return "skip", "environment setup"
    if head in ("python", "python3") and argv[1:3] == ["-m", "pytest"]:
        return "skip", "the test suite itself"
    if head == "torchrun" and "ncclscope.runtime.train" in argv:
        return "skip", "tests/test_dp_runtime.py::test_entry_point_runs_unchanged_under_torchrun runs it"
    if head in ("python", "python3") and len(argv) > 1 and (
            re.fullmatch(r"benchmarks/\w+\.py", argv[1]) or argv[1] == "sample_traces/make.py"):
        return "script", ""
    return "unknown", "no rule for this command"


def _moved(arg: str, ws: Path) -> str:
    """Absolute /tmp paths go under the scratch directory."""
    if arg.startswith("/tmp/"):
        return str(ws / arg.lstrip("/"))
    for flag in ("-o=", "--output=", "--out=", "--perfetto=", "--parquet="):
        if arg.startswith(flag) and arg[len(flag):].startswith("/tmp/"):
            return flag + str(ws / arg[len(flag):].lstrip("/"))
    return arg


# Analyzer commands never import torch: they run here, through the same `main` the console
# script calls, in the scratch directory (an interpreter start per command cost ~1 s of the suite
# each). `train` starts ranks: it runs through the same `main` in a fork of the suite's warm zygote
# (conftest), in the scratch directory, in its own session with a hard timeout (a fresh interpreter
# importing torch cost ~4 s per command; `python -m ncclscope train` itself is run by
# test_dp_runtime.py and test_faults_cli.py).
IN_PROCESS = {"analyze", "report", "export"}
IN_ZYGOTE = {"train"}
# `ncclscope analyze` of a sample trace writes nothing and reads only the fixed samples (each doc's scratch
# directory holds the same copy): the same command quoted in several docs runs once per module, its result
# held to every rule in each place (docs/guide/analyze.md and docs/troubleshooting.md show wrong-group,
# docs/troubleshooting.md and sample_traces/README.md hung-pipeline).
_SAMPLE_ANALYSES: dict[tuple[str, ...], object] = {}


def _sample_analysis(args: list[str], ws: Path):
    """`ncclscope analyze ARGS` in `ws`, once per module for ARGS whose input is a sample trace."""
    key = tuple(args)
    if key not in _SAMPLE_ANALYSES:
        _SAMPLE_ANALYSES[key] = cli_in_process(args, ws)
    return _SAMPLE_ANALYSES[key]


def run_ncclscope(argv: list[str], ws: Path, where: str, quoted: str = "", zygote=None) -> None:
    """`zygote`: a callable giving the suite's warm zygote (started on first use), or None."""
    from ncclscope.cli.parser import build_parser
    args = [_moved(a, ws) for a in argv[1:]]
    for a in args:
        if a.startswith(str(ws / "tmp")):
            Path(a).parent.mkdir(parents=True, exist_ok=True)
    try:
        ns = build_parser().parse_args(args)
    except SystemExit as exc:
        pytest.fail(f"{where}: `{shlex.join(argv)}` does not parse (exit {exc.code})")
    if ns.command == "tui":
        run = ws / ns.run
        assert (run / "run.json").exists() or run.is_dir(), f"{where}: `{shlex.join(argv)}`: {ns.run} does not exist"
        res = run_cli("tui", "--help", timeout=60, cwd=ws)
        assert res.returncode == 0 and "--follow" in res.stdout, f"{where}: ncclscope tui --help: {res.stderr}"
        return
    if ns.command == "demo":
        return   # parsed above; the reduced tour runs in tests/test_demo.py
    if ns.command == "run":
        return   # parsed above; tests/test_run_examples.py runs the examples under `ncclscope run`
    if ns.command == "analyze" and Path(ns.run).parts[:1] == ("sample_traces",) and ".." not in Path(ns.run).parts:
        res = _sample_analysis(args, ws)
    elif ns.command in IN_PROCESS:
        res = cli_in_process(args, ws)
    elif ns.command in IN_ZYGOTE and zygote is not None:
        res = zygote().cli(f"docs-{ns.command}", args, timeout=150, cwd=ws)
    else:
        res = run_cli(*args, timeout=150, cwd=ws)
    assert res.returncode in (0, 1), (f"{where}: `{shlex.join(argv)}` exited {res.returncode}\n"
                                      f"stdout:\n{res.stdout[-2000:]}\nstderr:\n{res.stderr[-3000:]}")
    assert "Traceback" not in res.stderr, f"{where}: `{shlex.join(argv)}`:\n{res.stderr[-3000:]}"
    if ns.command in ("analyze", "report", "train") and not getattr(ns, "json", False):
        first = res.stdout.splitlines()[0] if res.stdout.strip() else ""
        assert re.match(r"^[A-Z][A-Z0-9 ]+: ", first), f"{where}: `{shlex.join(argv)}` printed no verdict: {first!r}"
        if quoted:   # a sample trace is fixed, so what the doc quotes must be what it prints today
            assert first == quoted, (f"{where}: the doc quotes `{shlex.join(argv)}` as printing\n  {quoted}\n"
                                     f"but it prints\n  {first}")


def run_script(argv: list[str], ws: Path, where: str) -> None:
    while ENV_ASSIGN.match(argv[0]):
        argv = argv[1:]
    script = ROOT / argv[1]
    assert script.is_file(), f"{where}: {argv[1]} does not exist"
    if argv[1] == "benchmarks/scale.py":
        args = ["--sizes", "8", "--events-per-rank", "1000", "--tmp", str(ws)]
    else:
        args = ["--help"]
    proc = subprocess.run([sys.executable, str(script), *args], cwd=ROOT, env=cli_env(), capture_output=True,
                          text=True, timeout=150)
    assert proc.returncode == 0, f"{where}: `{argv[1]} {' '.join(args)}` exited {proc.returncode}\n{proc.stderr[-3000:]}"


def _id(path: Path) -> str:
    return str(path.relative_to(ROOT))


def test_extraction_finds_the_documented_commands():
    found = {_id(p): [c for _, c in bash_commands(p)] for p in DOC_FILES}
    assert any(c[:2] == ["ncclscope", "demo"] for c in found["README.md"])
    for page in ("train", "analyze", "report", "tui", "export", "demo"):
        cmds = found[f"docs/guide/{page}.md"]
        assert any(c[:2] == ["ncclscope", page] for c in cmds), f"docs/guide/{page}.md shows no `ncclscope {page}`"
    assert sum(c[0] == "ncclscope" for cs in found.values() for c in cs) >= 20
    assert sum(len(quoted_outputs(p)) for p in DOC_FILES) >= 10, "quoted sample outputs are checked"


def test_every_command_has_a_rule():
    unknown = [f"{_id(p)}:{no}: `{shlex.join(c)}` ({why})" for p in DOC_FILES for no, c in bash_commands(p)
               if (why := classify(c))[0] == "unknown" and (why := why[1])]
    assert not unknown, "doc commands that tests/test_docs_commands.py does not know how to run:\n" + "\n".join(unknown)


@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize("doc", [p for p in DOC_FILES if bash_commands(p)], ids=_id)
def test_doc_commands_run(doc: Path, tmp_path: Path, request: pytest.FixtureRequest):
    ws = tmp_path / "ws"
    ws.mkdir()
    shutil.copytree(ROOT / "sample_traces", ws / "sample_traces")
    ran = 0
    quoted = quoted_outputs(doc)
    for no, argv in bash_commands(doc):
        where = f"{_id(doc)}:{no}"
        action, why = classify(argv)
        if action == "unknown":
            pytest.fail(f"{where}: `{shlex.join(argv)}`: {why}; add a rule to tests/test_docs_commands.py")
        if action == "skip":
            continue
        core = argv
        while ENV_ASSIGN.match(core[0]):
            core = core[1:]
        if action == "ncclscope":
            run_ncclscope(core, ws, where, quoted.get(no, ""), lambda: request.getfixturevalue("zygote"))
        else:
            run_script(core, ws, where)
        ran += 1
    assert ran, f"{_id(doc)}: no command ran"
