"""`ncclscope report RUN -o report.html`: one self-contained HTML file.

Why this shape: the person reading it is on a laptop, maybe offline, maybe
on a plane with a run directory copied from a cluster. So the file carries
plotly.js inside it (no CDN; gzipped, unpacked by the browser: bundle.py),
opens with the verdict (exactly Analysis.verdict), the warnings that limit
the evidence, and the findings (what to do), then the pictures that back
them up: timeline with bubbles, bubble per
stage vs theory, arrival skew, utilization, grad norms, collective latency
and bandwidth, the p2p matrix, expert load, memory.

Safety: everything from a trace is escaped (html.escape) before it is put
in the page, in a table, a title or a hover text; the figure JSON also has
every "<" written as "\\u003c" so no string can close the <script> it lives in.

Self-check: a tiny script counts JavaScript errors into
`<html data-js-errors>`; the loader writes the drawn figures into
`<body data-rendered>` and sections wider than their card into
`data-overflow`, which is what the headless-browser tests read.
"""
from __future__ import annotations

import datetime as _dt
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import plotly.io as pio

from ncclscope.perf.performance import PerfResult
from ncclscope.findings import Finding
from ncclscope.load.trace import Trace
from ncclscope.report import figures as F
from ncclscope.report.bundle import loader_html, template_html
from ncclscope.report.style import esc, template_json
from ncclscope.report.timeline import timeline

if TYPE_CHECKING:
    from ncclscope.verdict.compose import Analysis

SIZE_BUDGET = 15 * 2**20

CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:0;color:#222;background:#fafafa}
header{background:#1f2d3d;color:#fff;padding:16px 28px} header h1{margin:0;font-size:22px}
header .meta{opacity:.8;font-size:13px;margin-top:4px} main{padding:8px 28px 40px;max-width:1500px}
section{background:#fff;border:1px solid #e3e3e3;border-radius:6px;margin:16px 0;padding:12px 18px}
h2{font-size:17px;margin:4px 0 10px} .muted{color:#777;font-size:13px}
.verdict{font-size:16px;font-weight:600} .sev{display:inline-block;padding:1px 8px;border-radius:10px;color:#fff;
font-size:12px} .sev-error{background:#c0392b} .sev-warning{background:#e67e22} .sev-info{background:#2980b9}
table.tbl{border-collapse:collapse;font-size:13px;max-width:100%} table.tbl td,table.tbl th{border-bottom:1px solid #eee;
padding:3px 6px;text-align:left} table.tbl td{overflow-wrap:anywhere} table.tbl th{vertical-align:bottom;font-size:12px} details{margin:4px 0 8px} .fig{min-height:300px} nav a{margin-right:12px;font-size:13px}
.err{color:#c0392b}
"""

GUARD = """<script>
document.documentElement.dataset.jsErrors = "0";
window.addEventListener("error", function (e) {
  var n = parseInt(document.documentElement.dataset.jsErrors || "0") + 1;
  document.documentElement.dataset.jsErrors = String(n);
  var box = document.getElementById("js-errors");
  if (box) { box.textContent += (e.message || "error") + "\\n"; }
});
</script>"""


# (section id, title, figure builder, explanation)
SECTIONS: list[tuple[str, str, Callable[[Trace, PerfResult, list[Finding]], Any], str]] = [
    ("timeline", "Timeline", lambda t, p, f: timeline(t, p, f),
     "Last healthy steps of one pipeline (and the ranks named in findings), rows by stage then rank. Hue = "
     "microbatch (legend), forward solid, backward lighter and hatched; the thin lane under each row is "
     "communication (p2p cyan, collectives grey); light grey = idle inside the pipeline window (the bubble). "
     "When a long final wait would squash the steps, the axis opens on the healthy ones: 'full span' shows all."),
    ("bubbles", "Pipeline bubble per stage", lambda t, p, f: F.bubbles_by_stage(p),
     "Idle share of each stage split into warm-up/cool-down (what the schedule costs with perfectly balanced "
     "stages), waiting on a slower stage, and communication stall (what a free interconnect would save)."),
    ("skew", "Arrival skew", lambda t, p, f: F.skew_heatmap(p),
     "How late each rank arrived at its collectives, per step (sum over the step). A bright row is a straggler."),
    ("utilization", "Utilization", lambda t, p, f: F.utilization(p),
     "Sampled device (or host) utilization over time."),
    ("gradnorm", "Gradient norms", lambda t, p, f: F.grad_norms(p),
     "Replicas must agree after the reduction; a line that leaves the others is a divergence."),
    ("collectives", "Collective latency and bandwidth", lambda t, p, f: F.collectives(p),
     "Per instance, measured from the last arrival (waiting for a straggler is not link time); bus bandwidth "
     "uses the nccl-tests definitions."),
    ("matrix", "Point-to-point traffic", lambda t, p, f: F.comm_matrix(t, p),
     "Bytes sent from each rank to each rank (the clock-sync pings before step 0 left out)."),
    ("experts", "Expert load", lambda t, p, f: F.expert_heatmap(p), "Tokens routed to each MoE expert per step."),
    ("memory", "Memory", lambda t, p, f: F.memory(p),
     "Measured memory per rank per step; dashed: parameters + gradients + Adam states for this sharding."),
]


def _figure_html(fig: Any, div_id: str) -> str:
    """The div and the figure's JSON; bundle.LOADER draws it once plotly.js is unpacked.
    The template (7 KB a figure) is left out: the page has it once (bundle.template_html).
    Every "<" in the JSON is written \\u003c: no string can end the script or open a comment."""
    if fig.layout.template.to_plotly_json() == template_json():
        fig.layout.template = None
    payload = pio.to_json(fig, validate=False, remove_uids=True).replace("<", "\\u003c")
    return (f'<div id="{div_id}" class="plot"></div>'
            f'<script type="application/json" class="fig-data" data-target="{div_id}">{payload}</script>')


def _findings_html(findings: list[Finding]) -> str:
    if not findings:
        return "<p>No findings.</p>"
    rows = []
    for f in findings:
        ev = "".join(f"<li>{esc(e.describe())}</li>" for e in f.evidence[:12])
        more = f"<li class='muted'>... {len(f.evidence) - 12} more</li>" if len(f.evidence) > 12 else ""
        rows.append(f"<details><summary><span class='sev sev-{esc(f.severity)}'>{esc(f.severity)}</span> "
                    f"<b>{esc(f.kind)}</b>: {esc(f.title)}</summary><ul>{ev}{more}</ul></details>")
    return "\n".join(rows)


def _tables(perf: PerfResult) -> dict[str, str]:
    """Small tables shown under some figures."""
    out: dict[str, str] = {}
    st = perf.bubbles.stages
    if len(st):
        t = st.assign(**{c.replace("_ns", "_ms"): st[c] / 1e6 for c in st.columns if c.endswith("_ns")})
        out["bubbles"] = F.table_html(t, ["stage", "window_ms", "compute_ms", "forward_ms", "backward_ms", "comm_ms",
                                          "idle_ms", "bubble", "theory", "warmup_cooldown_ms", "imbalance_ms",
                                          "comm_stall_ms"])
    r = perf.stragglers.ranks
    if len(r):
        out["skew"] = F.table_html(r.assign(saving_ms=r["saving_ns"] / 1e6, caused_ms=r["caused_ns"] / 1e6),
                                   ["rank", "times_last", "collectives", "last_frac", "compute_ratio", "caused_ms",
                                    "saving_ms", "saving_frac"], max_rows=10)
    bk = perf.comm.by_kind
    if len(bk):
        out["collectives"] = F.table_html(bk, max_rows=30)
    w = perf.utilization.waits
    if len(w):
        top = w.groupby("waiting_on", as_index=False)["samples"].sum().sort_values("samples", ascending=False)
        out["utilization"] = "<p class='muted'>Idle samples by what the rank was in:</p>" + F.table_html(top, max_rows=10)
    dv = perf.divergence.deviations
    if len(dv):
        out["gradnorm"] = F.table_html(dv, max_rows=15, floatfmt="{:.9g}")
    ms = perf.moe.steps
    if len(ms):
        out["experts"] = F.table_html(ms.tail(10), max_rows=10)
    cpv = perf.moe.cp_volume
    if len(cpv):
        out["experts"] = out.get("experts", "") + "<p class='muted'>Context-parallel exchange:</p>" + F.table_html(cpv)
    return out


def write_report(trace: Trace, out_path: str | Path, analysis: "Analysis | None" = None,
                 size_budget: int = SIZE_BUDGET) -> dict[str, Any]:
    """Write the report; return stats (path, bytes, seconds, sections drawn/skipped/failed).

    `analysis`: the composed Analysis (ncclscope.verdict.run) whose verdict
    and findings the report shows; computed here when None. The report never
    composes a verdict of its own."""
    t0 = time.perf_counter()
    if analysis is None:
        from ncclscope.verdict import run
        analysis = run(trace)
    perf = analysis.perf if analysis.perf is not None else PerfResult()
    findings = list(analysis.findings)
    verdicts = [analysis.verdict]

    tables = _tables(perf)
    body, drawn, skipped, failed = [], [], [], []
    for sid, title, build, note in SECTIONS:
        try:
            fig = build(trace, perf, findings)
        except Exception as exc:  # one bad figure must not take the report down
            failed.append(f"{sid}: {type(exc).__name__}: {exc}")
            body.append(f"<section id='{sid}'><h2>{esc(title)}</h2><p class='err'>could not draw: "
                        f"{esc(type(exc).__name__)}: {esc(exc)}</p></section>")
            continue
        if fig is None:
            skipped.append(sid)
            continue
        drawn.append(sid)
        body.append(f"<section id='{sid}' class='fig'><h2>{esc(title)}</h2><p class='muted'>{esc(note)}</p>"
                    f"{_figure_html(fig, 'fig-' + sid)}{tables.get(sid, '')}</section>")

    cfg = trace.run.config
    mesh = " ".join(f"{k}={cfg[k]}" for k in ("tp", "cp", "pp", "dp", "ep") if isinstance(cfg.get(k), int) and cfg[k] > 1)
    meta = (f"{trace.world_size} ranks" + (f" · {esc(mesh)}" if mesh else "")
            + (f" · schedule {esc(cfg.get('schedule'))}, {esc(cfg.get('microbatches'))} microbatches" if cfg.get("pp", 1) > 1 else "")
            + f" · end: {esc(trace.run.end_reason or 'unknown')}")
    nav = " ".join(f"<a href='#{s}'>{esc(t)}</a>" for s, t, _, _ in SECTIONS if s in drawn)
    warn = ""
    notes = list(trace.warnings) + list(analysis.errors) + failed
    if notes:
        items = "".join(f"<li>{esc(w)}</li>" for w in notes[:50])
        warn = f"<section id='warnings'><h2>Warnings ({len(notes)})</h2><ul class='muted'>{items}</ul></section>"
    page = "".join([
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>",
        f"<title>ncclscope report: {esc(trace.path.name)}</title><style>{CSS}</style>{GUARD}",
        "</head><body>",
        f"<header><h1>ncclscope report: {esc(trace.path.name)}</h1><div class='meta'>{meta} · generated "
        f"{_dt.datetime.now().isoformat(timespec='seconds')}</div></header><main>",
        "<section id='verdict'><h2>Verdict</h2>" + "".join(f"<p class='verdict'>{esc(v)}</p>" for v in verdicts),
        f"<nav>{nav}</nav></section>",
        warn,   # what limits the evidence comes before what was concluded from it
        f"<section id='findings'><h2>Findings ({len(findings)})</h2>{_findings_html(findings)}</section>",
        *body, "<pre id='js-errors' class='err'></pre></main>", template_html(template_json()), loader_html(), "</body></html>",
    ])
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = page.encode("utf-8")
    out.write_bytes(data)
    return {"path": str(out), "bytes": len(data), "over_budget": len(data) > size_budget,
            "seconds": time.perf_counter() - t0, "sections": drawn, "skipped": skipped, "failed": failed,
            "findings": len(findings)}
