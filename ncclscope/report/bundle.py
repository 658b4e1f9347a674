"""plotly.js, compressed, inside the page; and the loader that unpacks it and draws the figures.

Why: the minified plotly.js bundle is 4.8 MB and every report carried it as
is. Gzipped it is 1.5 MB; written in a base-85 alphabet (25 % overhead,
against 33 % for base64) it is about 1.8 MB of plain ASCII. The page then
unpacks it with the browser's own `DecompressionStream('gzip')` (Chrome 80,
Firefox 113, Safari 16.4 and later), so it stays one offline file with no
JavaScript inflater of our own.

The alphabet is printable ASCII without `< > & " ' \\ / - backtick`: the
text cannot form a tag, an entity or a comment, so it is inert wherever the
HTML parser meets it.

Because unpacking is asynchronous, figures are not drawn by inline scripts:
each figure's JSON sits in `<script type="application/json"
class="fig-data" data-target="...">` and the loader draws them all once
Plotly exists, then writes `data-rendered` / `data-figures` on <body> (the
headless-browser tests read those) and `data-overflow`: the ids of sections
whose content is wider than the section (a layout check).
"""
from __future__ import annotations

import base64
import functools
import gzip
import json

_B85 = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz!#$%&()*+-;<=>?@^_`{|}~"
# ours: printable ASCII minus " & ' - / < > \ `   (85 characters, in code order)
ALPHABET = "".join(c for c in map(chr, range(33, 127)) if c not in "\"&'-/<>\\`")
assert len(ALPHABET) == 85 and len(set(ALPHABET)) == 85
_TO_OURS = bytes.maketrans(_B85, ALPHABET.encode())


def encode(data: bytes) -> str:
    """gzip, then base-85 in ALPHABET (padded to 4 bytes; the decoder cuts to the length it is given)."""
    z = gzip.compress(data, compresslevel=9, mtime=0)
    return f"{len(z)}:" + base64.b85encode(z, pad=True).translate(_TO_OURS).decode("ascii")


def decode(text: str) -> bytes:
    """Inverse of encode (used by the tests; the page has the JavaScript twin)."""
    n, body = text.split(":", 1)
    z = base64.b85decode(body.encode("ascii").translate(bytes.maketrans(ALPHABET.encode(), _B85)))[: int(n)]
    return gzip.decompress(z)


@functools.lru_cache(maxsize=1)
def plotly_packed() -> str:
    from plotly.offline import get_plotlyjs
    return encode(get_plotlyjs().encode("utf-8"))


LOADER = """<script>
(function () {
  var A = "%(alphabet)s", T = new Int32Array(128);
  for (var i = 0; i < 85; i++) T[A.charCodeAt(i)] = i;
  function unpack(s) {
    var c = s.indexOf(":"), n = parseInt(s.slice(0, c)), m = s.length - c - 1;
    var out = new Uint8Array(m / 5 * 4), o = 0;
    for (var p = c + 1; p < s.length; p += 5) {
      var v = T[s.charCodeAt(p)];
      v = v * 85 + T[s.charCodeAt(p + 1)]; v = v * 85 + T[s.charCodeAt(p + 2)];
      v = v * 85 + T[s.charCodeAt(p + 3)]; v = v * 85 + T[s.charCodeAt(p + 4)];
      out[o++] = (v / 16777216) & 255; out[o++] = (v >>> 16) & 255; out[o++] = (v >>> 8) & 255; out[o++] = v & 255;
    }
    return out.subarray(0, n);
  }
  function overflow() {
    var bad = [];
    document.querySelectorAll("section").forEach(function (s) {
      if (s.scrollWidth > s.clientWidth + 1) bad.push(s.id);
    });
    return bad.join(" ");
  }
  function fail(e) {
    var n = parseInt(document.documentElement.dataset.jsErrors || "0") + 1;
    document.documentElement.dataset.jsErrors = String(n);
    var box = document.getElementById("js-errors");
    if (box) box.textContent += String(e && e.stack || e) + "\\n";
    finish(0);
  }
  function finish(n) {
    document.body.dataset.rendered = String(n);
    document.body.dataset.figures = String(document.querySelectorAll(".fig").length);
    document.body.dataset.overflow = overflow();
    document.body.dataset.done = "1";
  }
  function draw() {
    var only = /[#&]only=([a-z]+)/.exec(location.hash);
    if (only) document.querySelectorAll("main > section, header").forEach(function (s) {
      if (s.id !== only[1]) s.style.display = "none";
    });
    var jobs = [], tpl = JSON.parse(document.getElementById("plotly-template").textContent);
    document.querySelectorAll("script.fig-data").forEach(function (d) {
      try {
        var f = JSON.parse(d.textContent);
        if (!f.layout.template) f.layout.template = tpl;
        jobs.push(Plotly.newPlot(d.dataset.target, f.data, f.layout, {responsive: true, displaylogo: false}));
      } catch (e) { jobs.push(Promise.reject(e)); }
    });
    return Promise.all(jobs).then(function () {
      finish(document.querySelectorAll(".js-plotly-plot .main-svg").length ?
        document.querySelectorAll(".js-plotly-plot").length : 0);
    }).catch(fail);
  }
  var src = document.getElementById("plotly-packed");
  if (!window.DecompressionStream) {
    document.getElementById("js-errors").textContent =
      "This browser cannot unpack the plotly.js inside the report (it needs DecompressionStream: " +
      "Chrome/Edge 80, Firefox 113, Safari 16.4 or later). The verdict, findings and tables above still hold.";
    finish(0);
    return;
  }
  var stream = new Blob([unpack(src.textContent)]).stream().pipeThrough(new DecompressionStream("gzip"));
  new Response(stream).text().then(function (js) {
    var s = document.createElement("script");
    s.textContent = js;
    document.head.appendChild(s);
    return draw();
  }).catch(fail);
})();
</script>"""


def template_html(template: dict) -> str:
    """The shared layout template, once, for the loader to give each figure."""
    text = json.dumps(template, sort_keys=True).replace("<", "\\u003c")
    return f'<script type="application/json" id="plotly-template">{text}</script>'


def loader_html() -> str:
    """The packed bundle and its loader: put both at the end of <body>."""
    return (f'<script type="text/plain" id="plotly-packed">{plotly_packed()}</script>'
            + LOADER % {"alphabet": ALPHABET})
