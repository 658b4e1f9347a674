"""Screenshots of the TUI for the docs: the Overview and the headline's Rank view, as PNG.

    python benchmarks/tui_screens.py sample_traces/hung-pipeline --out docs/img

The app runs headless (`App.run_test`, 100x30), waits for the composer's
verdict, saves `tui-overview.svg` (`App.save_screenshot`), presses Enter on the
headline finding, saves `tui-rank.svg`, then renders each SVG to PNG with
headless Chromium (skipped, with a line, where Chromium is absent). The app and
Chromium run under hard timeouts, so this cannot hang.
"""
from __future__ import annotations

import argparse
import asyncio
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZE = (100, 30)


async def _shoot(run: Path, out: Path, timeout_s: float) -> list[Path]:
    from ncclscope.tui.app import NcclscopeApp

    app = NcclscopeApp(run)
    saved = []
    async with app.run_test(size=SIZE) as pilot:
        deadline = time.monotonic() + timeout_s
        while not (app.error or (app.run_model is not None and app.run_model.stage == "ready")):
            if time.monotonic() > deadline:
                raise TimeoutError(f"the TUI did not reach its verdict in {timeout_s:g} s")
            await pilot.pause(0.1)
        if app.error:
            raise RuntimeError(app.error)
        await pilot.pause(0.5)
        saved.append(Path(app.save_screenshot("tui-overview.svg", str(out))))
        await pilot.press("enter")
        await pilot.pause(1.0)
        saved.append(Path(app.save_screenshot("tui-rank.svg", str(out))))
    return saved


def _png(svg: Path, chromium: str) -> Path:
    """Render the SVG at its own size (the terminal's cells) into a PNG beside it."""
    text = svg.read_text()
    import re
    m = re.search(r'viewBox="0 0 ([\d.]+) ([\d.]+)"', text)
    w, h = (int(float(m.group(1))), int(float(m.group(2)))) if m else (1240, 800)
    png = svg.with_suffix(".png")
    with tempfile.TemporaryDirectory() as prof:
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--user-data-dir={prof}", f"--window-size={w},{h}", f"--screenshot={png}",
                        svg.resolve().as_uri()], check=True, timeout=120, capture_output=True)
    return png


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="a run directory")
    ap.add_argument("--out", default="docs/img")
    ap.add_argument("--timeout-s", type=float, default=120.0)
    ap.add_argument("--keep-svg", action="store_true")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    svgs = asyncio.run(_shoot(Path(args.run), out, args.timeout_s))
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    for svg in svgs:
        if chromium:
            print(f"wrote {_png(svg, chromium)}")
            if not args.keep_svg:
                svg.unlink()
        else:
            print(f"wrote {svg} (no Chromium here: no PNG)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
