"""The HTML report: self-contained, escaped, and it really renders.

    python -m pytest tests/test_report.py -q

Browser checks run Debian's chromium headless (flags from
/work/shared/platform-notes.md, plus --enable-unsafe-swiftshader so the
WebGL scatter plots draw without a GPU). The report counts its own
JavaScript errors into <html data-js-errors> and its drawn figures into
<body data-rendered>; the tests read those from the dumped DOM.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from trace_builder import TraceBuilder

from ncclscope.report import write_report
from ncclscope.load.trace import load

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))   # synth.py

pytestmark = pytest.mark.timeout(120)

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_browser = pytest.mark.skipif(CHROMIUM is None, reason="chromium not installed (apt-get install -y chromium)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-unsafe-swiftshader", "--virtual-time-budget=15000"]
EVIL_OP = "<script>alert(1)</script>"
EVIL_GROUP = "<img src=x onerror=alert(2)>"


def browse(page: Path, tmp: Path, *args: str, timeout: float = 90) -> str:
    """Run headless chromium on a local file; its stdout. Killed (whole session) on timeout."""
    profile = tmp / f"profile-{len(list(tmp.glob('profile-*')))}"
    proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args, page.resolve().as_uri()],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        pytest.fail(f"chromium did not finish in {timeout} s")
    return out


def sections_rendered(dom: str) -> dict[str, bool]:
    """section id -> whether a Plotly SVG was drawn inside it."""
    out = {}
    for m in re.finditer(r'<section id="([a-z]+)" class="fig">(.*?)</section>', dom, re.S):
        out[m.group(1)] = 'class="main-svg"' in m.group(2)
    return out


def evil_trace():
    """A slow collective whose op and group names are HTML: they reach a finding title,
    the timeline hover text, the collectives figure and the tables."""
    b = TraceBuilder(2, groups={EVIL_GROUP: [0, 1]}, group_kinds={EVIL_GROUP: "dp"})
    for seq in range(1, 12):
        dur = 0.100 if seq == 7 else 0.010
        for r in range(2):
            b.compute(r, EVIL_OP, float(seq) - 0.5, float(seq) - 0.1, step=seq, microbatch=0)
            b.collective(r, EVIL_GROUP, seq, op=EVIL_OP, start=float(seq), end=seq + dur, step=seq,
                         call_site=EVIL_OP, message=EVIL_OP)
    return b.build()


def test_trace_strings_are_escaped_everywhere(tmp_path: Path) -> None:
    out = tmp_path / "evil.html"
    stats = write_report(evil_trace(), out)
    page = out.read_text()
    assert "slow_collective" in page                       # the finding that quotes the op name is there
    assert EVIL_OP not in page and "<img src=x" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    # no figure payload can close its own <script>: only ours end scripts
    n_open = len(re.findall(r"<script[ >]", page))
    assert page.count("</script>") == n_open
    assert stats["failed"] == [] and "collectives" in stats["sections"]


@needs_browser
def test_escaped_op_name_renders_as_text(tmp_path: Path) -> None:
    out = tmp_path / "evil.html"
    write_report(evil_trace(), out)
    dom = browse(out, tmp_path, "--dump-dom")
    assert 'data-js-errors="0"' in dom
    assert "<script>alert(1)" not in dom and "<img src=" not in dom
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dom   # shown as text in the findings


@pytest.fixture(scope="module")
def real_run(healthy_dp2: Path) -> Path:
    """`ncclscope train --dp 2 --steps 3` (conftest's shared run, made once through the warm zygote; the
    report is written under tmp_path, the run only read)."""
    return healthy_dp2


@needs_browser
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_real_run_report_renders_in_chromium(real_run: Path, tmp_path: Path) -> None:
    out = tmp_path / "report.html"
    trace = load(real_run)
    stats = write_report(trace, out)
    assert stats["failed"] == [] and stats["bytes"] < 15 * 2**20
    required = {"timeline", "skew", "gradnorm", "collectives", "memory"} | ({"utilization"} if len(trace.samples) else set())
    assert required <= set(stats["sections"])
    # one Chromium run loads and draws the page once, then dumps its DOM and takes the screenshot
    shot = tmp_path / "report.png"
    dom = browse(out, tmp_path, "--dump-dom", f"--screenshot={shot}", "--window-size=1300,2400")
    assert 'data-js-errors="0"' in dom, re.findall(r'<pre id="js-errors"[^>]*>([^<]*)', dom)
    drawn = sections_rendered(dom)
    assert set(drawn) == set(stats["sections"]) and all(drawn.values()), drawn
    assert f'data-rendered="{len(stats["sections"])}"' in dom
    assert 'id="verdict"' in dom and 'id="findings"' in dom
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 30_000


@pytest.mark.timeout(180)
def test_synthetic_pipeline_report_has_every_section(tmp_path: Path) -> None:
    import synth
    run = synth.generate(tmp_path / "synth", ranks=64, events=150_000, hang=True, seed=1)
    trace = load(run)
    stats = write_report(trace, tmp_path / "synth.html")
    assert stats["failed"] == [] and stats["skipped"] == []
    assert stats["sections"] == ["timeline", "bubbles", "skew", "utilization", "gradnorm", "collectives", "matrix",
                                 "experts", "memory"]
    page = (tmp_path / "synth.html").read_text()
    assert "pipeline stage" in page and "expert_imbalance" in page     # the synthetic's built-in problems
    assert stats["bytes"] < 15 * 2**20


def test_report_runs_without_browser_on_a_tiny_healthy_trace(tmp_path: Path) -> None:
    b = TraceBuilder(1)
    b.compute(0, "forward", 0.0, 1.0, step=0, microbatch=0)
    stats = write_report(b.build(), tmp_path / "tiny.html")
    page = (tmp_path / "tiny.html").read_text()
    assert "OK: no hang" in page
    assert "Plotly" in page and "cdn." not in page.split("<script>", 2)[1][:200]   # plotly.js inline
    assert stats["failed"] == []
