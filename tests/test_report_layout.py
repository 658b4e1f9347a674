"""The report reads right: headline, legend, axes, matrix, size, and layout at 1000/1400 px.

    python -m pytest tests/test_report_layout.py -q

Each test parses the written HTML (the headline, the figure JSON it
carries) or asks headless Chromium what the page measured about itself
(bundle.LOADER writes `data-overflow`: sections wider than their card).
Screenshots of every figure at both widths: benchmarks/report_screens.py.
"""
from __future__ import annotations

import base64
import html
import json
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ncclscope.verdict import run
from ncclscope.report import figures as F
from ncclscope.report import write_report
from ncclscope.load.trace import load

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_report import browse, needs_browser, sections_rendered  # noqa: E402

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parent.parent
SAMPLES = sorted(p.parent for p in (ROOT / "sample_traces").glob("*/run.json"))
sys.path.insert(0, str(ROOT / "benchmarks"))   # synth.py


def figures_of(page: str) -> dict[str, dict[str, Any]]:
    """section id -> the Plotly figure JSON embedded for it."""
    out = {}
    for sid, text in re.findall(r'<script type="application/json" class="fig-data" data-target="fig-([a-z]+)">'
                                r'(.*?)</script>', page, re.S):
        out[sid] = json.loads(text)
    # the layout before the packed bundle (inline Plotly.newPlot), so these tests can be run against it
    for sid, text in re.findall(r'<div id="fig-([a-z]+)" class="plot"></div><script>\(function\(\)\{var f=(.*?);'
                                r'Plotly\.newPlot\(', page, re.S):
        out[sid] = json.loads(text)
    return out


def arr(v: Any) -> np.ndarray:
    """A Plotly data array: a list, or a typed array {"dtype", "bdata", "shape"}."""
    if isinstance(v, dict) and "bdata" in v:
        a = np.frombuffer(base64.b64decode(v["bdata"]), dtype=np.dtype(v["dtype"]))
        return a.reshape([int(s) for s in str(v["shape"]).split(",")]) if "shape" in v else a
    return np.asarray(v, dtype=float)


def headline(page: str) -> str:
    found = re.findall(r"<p class='verdict'>(.*?)</p>", page, re.S)
    assert len(found) == 1, found
    return html.unescape(found[0])


def report(tmp_path: Path, run_dir: Path, name: str | None = None) -> tuple[str, dict]:
    out = tmp_path / f"{name or run_dir.name}.html"
    stats = write_report(load(run_dir), out)
    return out.read_text(encoding="utf-8"), stats


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict]]:
    """name -> (the page `write_report(load(sample), page)` wrote, its stats), once per module for the
    samples the tests read (the pages are only read: parsed here, opened by Chromium)."""
    tmp = tmp_path_factory.mktemp("pages")
    out = {}
    for d in SAMPLES:
        if d.name in ("healthy", "slow-pipeline", "hung-pipeline", "straggler", "stuck-in-compute"):
            page = tmp / f"{d.name}.html"
            out[d.name] = (page, write_report(load(d), page))
    return out


@pytest.fixture(scope="module")
def pages(written: dict[str, tuple[Path, dict]]) -> dict[str, str]:
    return {name: page.read_text(encoding="utf-8") for name, (page, _) in written.items()}


# --- headline and order ----------------------------------------------------------------------

def test_a_section_that_fails_is_in_the_report_and_on_stderr(tmp_path: Path, monkeypatch, capsys) -> None:
    """Every sample's headline and drawn sections: tests/test_faces_agree.py. Here: a section that
    raises is named in the page's notes and on stderr, and the rest is still written."""
    from ncclscope.cli.main import main
    from ncclscope.report import html as H
    def boom(*a, **k):
        raise ValueError("drawing <failed>")
    monkeypatch.setattr(H.F, "skew_heatmap", boom)
    out = tmp_path / "r.html"
    main(["report", str(SAMPLES[0]), "-o", str(out)])
    err = capsys.readouterr().err
    assert "a section could not be drawn" in err and "drawing <failed>" in err, err
    page = out.read_text(encoding="utf-8")
    assert "drawing &lt;failed&gt;" in page and "<section id='verdict'>" in page


def test_warnings_come_before_the_findings(tmp_path: Path) -> None:
    trace = load(ROOT / "sample_traces" / "slow-pipeline")
    trace.warnings.append("rank 3: events file truncated <b>mid-record</b>")
    analysis = run(trace)
    out = tmp_path / "warned.html"
    write_report(trace, out, analysis=analysis)
    page = out.read_text()
    assert headline(page) == analysis.verdict
    w, f = page.index("<section id='warnings'>"), page.index("<section id='findings'>")
    assert page.index("<section id='verdict'>") < w < f
    assert "events file truncated &lt;b&gt;mid-record&lt;/b&gt;" in page[w:f]


# --- 11. timeline ----------------------------------------------------------------------------

def test_timeline_has_a_legend_entry_per_microbatch_and_per_phase(pages: dict[str, str]) -> None:
    tl = figures_of(pages["slow-pipeline"])["timeline"]
    legend = [t["name"] for t in tl["data"] if t.get("showlegend", True) is not False]
    assert {"mb 0", "mb 1", "mb 2", "mb 3"} <= set(legend), legend
    assert "forward (solid)" in legend and "backward (hatched)" in legend, legend
    assert len(legend) == len(set(legend)), legend            # forward and backward no longer share one swatch
    by_phase: dict[str, list[dict]] = {"forward": [], "backward": []}
    for t in tl["data"]:
        for ph in by_phase:
            if t.get("showlegend") is False and any(ph in h for h in t.get("hovertext", [])):
                by_phase[ph].append(t)
    assert by_phase["forward"] and by_phase["backward"]
    assert all("pattern" not in t["marker"] for t in by_phase["forward"])
    assert all(t["marker"]["pattern"]["shape"] for t in by_phase["backward"])   # backward hatched


def test_timeline_collectives_are_grey_and_no_microbatch_shares_their_colour(pages: dict[str, str]) -> None:
    tl = figures_of(pages["slow-pipeline"])["timeline"]
    colour = {t["name"]: t["marker"]["color"] for t in tl["data"] if isinstance(t["marker"].get("color"), str)}
    coll = colour["collective"].lstrip("#")
    r, g, b = (int(coll[i:i + 2], 16) for i in (0, 2, 4))
    assert max(r, g, b) - min(r, g, b) <= 8, coll                      # grey
    mb = {c.lower() for n, c in colour.items() if n.startswith("mb ")}
    assert mb and colour["collective"].lower() not in mb and colour["p2p"].lower() not in mb


def test_timeline_rows_are_ordered_by_stage_then_rank(tmp_path: Path) -> None:
    import synth
    d = synth.generate(tmp_path / "synth16", ranks=16, events=30_000, hang=True, seed=1, tp=2, pp=4)
    page, _ = report(tmp_path, d)
    tl = figures_of(page)["timeline"]
    ya = tl["layout"]["yaxis"]
    rows = sorted(zip(ya["tickvals"], ya["ticktext"]), reverse=True)            # top row first
    keys = [tuple(int(x) for x in re.findall(r"\d+", text)) for _, text in rows]  # (stage, rank)
    assert len(keys) > 4 and all(len(k) == 2 for k in keys), rows
    assert keys == sorted(keys), rows
    assert len({k[0] for k in keys}) == 4                                      # every stage shown


def test_timeline_opens_on_the_healthy_steps_with_a_full_span_button(pages: dict[str, str]) -> None:
    for name in ("hung-pipeline", "stuck-in-compute"):
        tl = figures_of(pages[name])["timeline"]
        lo, hi = tl["layout"]["xaxis"]["range"]
        full = max(float(np.max(arr(t["base"]) + arr(t["x"]))) for t in tl["data"] if t.get("base") is not None)
        assert hi < 0.5 * full, (name, hi, full)                    # the long final wait no longer squashes the steps
        labels = [b["label"] for m in tl["layout"]["updatemenus"] for b in m["buttons"]]
        assert "full span" in labels, labels
    # a run that ends cleanly has nothing to zoom past
    assert "updatemenus" not in figures_of(pages["slow-pipeline"])["timeline"]["layout"]


# --- 12. point-to-point matrix ---------------------------------------------------------------

def test_no_matrix_for_pure_data_parallel_runs(pages: dict[str, str]) -> None:
    for name in ("healthy", "straggler", "stuck-in-compute"):      # only clock-sync pings
        assert "matrix" not in figures_of(pages[name]), name
        assert "<section id='matrix'" not in pages[name]


def test_matrix_colour_bar_starts_at_zero_with_integer_rank_ticks(pages: dict[str, str]) -> None:
    m = figures_of(pages["slow-pipeline"])["matrix"]
    hm = m["data"][0]
    assert hm["zmin"] == 0 and hm["zmax"] > 0
    z = arr(hm["z"])
    assert np.nanmin(z) > 0
    # 4 pipeline sends of 8 KiB per microbatch direction: no 8-byte clock pings mixed in
    assert np.nanmax(z) == pytest.approx(np.nanmin(z))
    for ax in ("xaxis", "yaxis"):
        ticks = m["layout"][ax]["tickvals"]
        assert ticks == [0, 1], (ax, ticks)


def test_clock_sync_pings_are_not_traffic() -> None:
    t = load(ROOT / "sample_traces" / "slow-pipeline")
    mat = F.p2p_traffic(t)
    assert set(zip(mat["src"], mat["dst"])) == {(0, 1), (1, 0)}
    assert (mat["bytes"] % 8192 == 0).all()
    assert not len(F.p2p_traffic(load(ROOT / "sample_traces" / "healthy")))


# --- 13. layout ------------------------------------------------------------------------------

def test_theory_label_is_a_legend_entry_not_an_annotation_on_the_bars(pages: dict[str, str]) -> None:
    b = figures_of(pages["slow-pipeline"])["bubbles"]
    assert not [a for a in b["layout"].get("annotations", []) if "theory" in a.get("text", "")]
    assert any(t["name"].startswith("theory 20.0%") for t in b["data"])


def test_single_step_runs_get_integer_step_ticks() -> None:
    trace = load(ROOT / "sample_traces" / "healthy")
    perf = run(trace).perf
    perf.divergence.norms = perf.divergence.norms[perf.divergence.norms["step"] == 0]
    perf.memory.per_step = perf.memory.per_step[perf.memory.per_step["step"] == 0]
    for fig in (F.grad_norms(perf), F.memory(perf)):
        ax = fig.to_plotly_json()["layout"]["xaxis"]
        assert list(ax["tickvals"]) == [0] and ax["range"] == [-1, 1], ax


def test_arrival_heatmap_labels_every_rank(pages: dict[str, str]) -> None:
    sk = figures_of(pages["straggler"])["skew"]
    assert sk["layout"]["yaxis"]["tickvals"] == [0, 1, 2, 3]


@needs_browser
@pytest.mark.timeout(400)
def test_every_section_fits_its_card_at_1000_and_1400_px(written: dict[str, tuple[Path, dict]], tmp_path: Path) -> None:
    page, stats = written["slow-pipeline"]          # write_report(load(sample_traces/slow-pipeline), page)
    for width in (1000, 1400):
        dom = browse(page, tmp_path, "--dump-dom", f"--window-size={width},1200")
        assert 'data-js-errors="0"' in dom, re.findall(r'<pre id="js-errors"[^>]*>([^<]*)', dom)
        assert f'data-rendered="{len(stats["sections"])}"' in dom
        over = re.search(r'data-overflow="([^"]*)"', dom)
        assert over is not None and over.group(1) == "", (width, over and over.group(1))


# --- 14. size --------------------------------------------------------------------------------

def test_small_run_report_is_at_most_2_mb(written: dict[str, tuple[Path, dict]]) -> None:
    for name in ("slow-pipeline", "straggler"):
        path, stats = written[name]                 # write_report(load(sample_traces/NAME), path)
        page = path.read_text(encoding="utf-8")
        assert stats["bytes"] <= 2_000_000, (name, stats["bytes"])
        assert "cdn." not in page and "<script src" not in page              # still offline


def test_packed_bundle_round_trips_and_is_inert_html() -> None:
    from plotly.offline import get_plotlyjs

    from ncclscope.report.bundle import decode, encode, plotly_packed
    packed = plotly_packed()
    assert decode(packed) == get_plotlyjs().encode("utf-8")
    assert not set(packed) & set("<>&\"'\\`")
    assert decode(encode(b"")) == b"" and decode(encode(b"abcde")) == b"abcde"


@needs_browser
@pytest.mark.timeout(300)
def test_compressed_bundle_unpacks_and_draws_in_chromium(written: dict[str, tuple[Path, dict]], tmp_path: Path) -> None:
    page, stats = written["hung-pipeline"]          # write_report(load(sample_traces/hung-pipeline), page)
    assert stats["bytes"] <= 2_000_000
    dom = browse(page, tmp_path, "--dump-dom")
    assert 'data-js-errors="0"' in dom, re.findall(r'<pre id="js-errors"[^>]*>([^<]*)', dom)
    assert f'data-rendered="{len(stats["sections"])}"' in dom
    drawn = sections_rendered(dom)
    assert set(drawn) == set(stats["sections"]) and all(drawn.values()), drawn
