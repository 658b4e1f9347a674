"""One verdict on every face: `analyze --json`, the HTML report's headline and
`ncclscope.verdict.run` say the same string for every sample trace (the TUI's
overview line is checked against the same composer in tests/test_tui.py).

Before the one composer, the report and the TUI composed their own verdict and
said `OK` for stragglers, NaN, divergence, MoE imbalance and slow pipelines
that `analyze` flagged; these tests fail on that.
"""
from __future__ import annotations

import html
import json
import re

import pytest

from conftest import ROOT
from ncclscope.cli.main import main

SAMPLES = sorted(p for p in (ROOT / "sample_traces").iterdir() if (p / "run.json").is_file())


def _report_headline(capsys, path, out) -> str:
    capsys.readouterr()
    main(["report", str(path), "-o", str(out)])
    err = capsys.readouterr().err
    assert "could not be drawn" not in err, err     # every section of every sample is drawn
    page = out.read_text(encoding="utf-8")
    heads = re.findall(r"<p class='verdict'>(.*?)</p>", page, flags=re.S)
    assert len(heads) == 1, f"the report must show exactly one verdict line, found {len(heads)}"
    return html.unescape(heads[0])


@pytest.mark.parametrize("sample", SAMPLES, ids=[p.name for p in SAMPLES])
def test_analyze_report_and_composer_say_the_same_verdict(capsys, tmp_path, sample, composed, analyze_json):
    verdict = composed(sample).verdict      # run(load(sample)), once per session (conftest)
    printed = json.loads(analyze_json(sample).stdout)["verdict"]   # `analyze SAMPLE --json`, once per session
    headline = _report_headline(capsys, sample, tmp_path / "r.html")
    assert printed == verdict
    assert headline == verdict


def test_problem_samples_are_not_called_ok_by_any_face(composed):
    """The straggler, NaN, divergence, MoE and slow-pipeline samples: a problem on every face (each face
    says the composer's verdict: the test above)."""
    for name in ("straggler", "nan", "divergence", "moe-imbalance", "slow-pipeline"):
        a = composed(ROOT / "sample_traces" / name)     # run(load(...)), once per session (conftest)
        assert not a.ok and not a.verdict.startswith("OK"), name
