"""Screenshots of every report figure at 1000 and 1400 px, in headless Chromium.

    python benchmarks/report_screens.py sample_traces/slow-pipeline /tmp/e-run --out /tmp/report-shots/after
    python benchmarks/report_screens.py report.html --widths 1000      # an existing report

For each run directory (or .html report) and each width it writes
OUT/NAME-WIDTH-top.png (verdict, warnings, findings) and
OUT/NAME-WIDTH-SECTION.png per drawn figure (the page's `#only=SECTION`
hides the others), then prints what the page says about itself: JavaScript
errors, figures drawn, and sections wider than their card (`data-overflow`).
Exit status 1 if any page had an error, an undrawn figure or an overflow.
Look at the PNGs yourself: this checks that nothing is broken, not that it reads well.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--enable-unsafe-swiftshader", "--hide-scrollbars", "--virtual-time-budget=15000"]


def chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if not exe:
        sys.exit("chromium not found (apt-get install -y chromium)")
    return exe


def browse(url: str, *args: str, timeout: float = 90) -> str:
    with tempfile.TemporaryDirectory(prefix="ncclscope-shot-") as profile:
        proc = subprocess.Popen([chromium(), *FLAGS, f"--user-data-dir={profile}", *args, url],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return out


def page_state(dom: str) -> dict[str, str]:
    """What the page wrote about itself (bundle.LOADER): errors, figures drawn, overflowing sections."""
    html_tag = re.search(r"<html[^>]*>", dom)
    body = re.search(r"<body[^>]*>", dom)
    attrs = dict(re.findall(r'data-([a-z-]+)="([^"]*)"', (html_tag.group(0) if html_tag else "")
                            + (body.group(0) if body else "")))
    return attrs


def figure_sections(page: str) -> list[str]:
    return re.findall(r"<section id='([a-z]+)' class='fig'>", page)


def heights(page: str) -> dict[str, int]:
    """A window tall enough for each section: the figure's layout height plus its table."""
    out = {}
    for sid, body in re.findall(r"<section id='([a-z]+)' class='fig'>(.*?)</section>", page, re.S):
        h = re.search(r'"height":(\d+)', body)
        rows = body.count("<tr>")
        out[sid] = min(3000, (int(h.group(1)) if h else 450) + 120 + 26 * rows + 80)
    return out


def shoot(report: Path, out: Path, widths: list[int]) -> bool:
    page = report.read_text(encoding="utf-8")
    url = report.resolve().as_uri()
    ok = True
    for w in widths:
        state = page_state(browse(url, f"--window-size={w},1200", "--dump-dom"))
        drawn, figs = state.get("rendered", "?"), state.get("figures", "?")
        bad = state.get("js-errors") != "0" or drawn != figs or state.get("overflow", "")
        ok &= not bad
        print(f"{report.stem} @ {w}px: js-errors={state.get('js-errors')} drawn={drawn}/{figs} "
              f"overflow=[{state.get('overflow', '')}]" + ("  <-- CHECK" if bad else ""))
        browse(url, f"--window-size={w},1100", f"--screenshot={out / f'{report.stem}-{w}-top.png'}")
        for sid, h in heights(page).items():
            browse(f"{url}#only={sid}", f"--window-size={w},{h}", f"--screenshot={out / f'{report.stem}-{w}-{sid}.png'}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("inputs", nargs="+", help="run directories or report .html files")
    ap.add_argument("--out", default="/tmp/report-shots/after")
    ap.add_argument("--widths", default="1000,1400")
    ns = ap.parse_args()
    out = Path(ns.out)
    out.mkdir(parents=True, exist_ok=True)
    widths = [int(w) for w in ns.widths.split(",")]
    ok = True
    for item in map(Path, ns.inputs):
        if item.suffix == ".html":
            report = item
        else:
            from ncclscope.report import write_report
            from ncclscope.load.trace import load
            report = out / f"{item.resolve().name}.html"
            write_report(load(item), report)
        ok &= shoot(report, out, widths)
    print(f"screenshots in {out}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
