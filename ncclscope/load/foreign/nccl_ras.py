"""NCCL RAS output (`ncclras`, NCCL 2.24-2.30) read into one typed snapshot.

    ncclras -f json > ras.json          # NCCL 2.28.7+: the raw data RAS gathered from every process
    ncclras > ras.txt                   # the text summary (outliers only)
    ncclras -m -f json > ras_events.json   # 2.29+ monitor mode: PEER_DEAD and other peer events

What RAS knows (src/ras/client_support.cc, docs ras.rst): per communicator (`hash`, `size`), every
rank that answered (`rank` in the communicator, `host` as an IP address, `pid`, `cuda_dev`,
`nvml_dev`, `status`: init_state, async_error, finalize_called, destroy_flag, abort_flag, and
`collective_counts`: per function how many collectives the rank has *launched*) and the
`missing_ranks` (`unresponsive`: RAS could not reach the process; `considered_dead`: unreachable for
60 s). Monitor events name a process (`peer`: host, pid, cuda_devs) and an `event` (PEER_DEAD, ...).
The text mode prints the same outliers in sections: `#<group>-<comm> (<hash>) INCOMPLETE` (missing
ranks), `... ERROR` (initialization / asynchronous errors), `... MISMATCH` (different status, or
"N ranks have launched up to operation V" per function), `DEAD` and `INCOMPLETE` process lists.

The JSON writer indents every communicator by four spaces, so a document cut off in the middle
still gives its complete communicators (one warning says what was lost). Text lines that match no
known form are ignored; a text file with no recognisable section is no RAS output at all.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ncclscope.load import safe_io

FUNCS = ("Broadcast", "Reduce", "AllGather", "ReduceScatter", "AllReduce")   # ncclFuncStr, NCCL_NUM_FUNCTIONS
ERRORS = {1: "Unhandled CUDA error", 2: "System error", 3: "Internal error", 4: "Invalid argument",
          5: "Invalid usage", 6: "Remote process error", 7: "NCCL operation in progress"}
_ERROR_CODE = {v: k for k, v in ERRORS.items()}
_PROC = r"(?:GPU (?P<gpu>[\d,]+)(?: \(NVML [\d,]+\))? managed by )?process (?P<pid>\d+) on node (?P<host>\S+)"
_RE = {
    "comm": re.compile(r"^#(?P<group>\d+)-\d+ \((?P<hash>[0-9a-fA-F]+)\) (?P<what>INCOMPLETE|ERROR|MISMATCH)\s*$"),
    "summary": re.compile(r"^\s*(?P<group>\d+)\s+\d+\s+\d+\s+[\d-]+\s+(?P<size>\d+)\s+\d+\s+[A-Z]+\s+[A-Z,]+\s*$"),
    "funcs": re.compile(r"^\s*Communicator ranks have different (?:(?P<func>\w+) )?(?:collective )?operation counts"),
    "status": re.compile(r"^\s*Communicator ranks have different status"),
    "err": re.compile(r"^\s*(?P<kind>Initialization|Asynchronous) errors? on \d+ ranks?"),
    "missing": re.compile(r"^\s*Missing communicator data from \d+ ranks?"),
    "group_n": re.compile(r"^\s*(?P<n>\d+) ranks have (?:launched up to operation (?P<v>\d+)|(?P<none>not launched any "
                          r"operations)|status (?P<st>[A-Z]+))|^\s*(?P<n2>\d+) ranks reported (?P<err>[A-Za-z ]+?)\s*$"),
    "rank": re.compile(r"^\s*Rank (?P<rank>\d+)(?: has launched up to operation (?P<v>\d+)| has (?P<none>not launched "
                       r"any operations)| has status (?P<st>[A-Z]+)| reported (?P<err>[A-Za-z ]+?))? -- (?:" + _PROC +
                       r"|\[process information not found\])"),
    "missing_list": re.compile(r"^\s*The missing ranks?: (?P<ranks>[\d, ]+)"),
    "process": re.compile(r"^\s*Process (?P<pid>\d+) on node (?P<host>\S+) managing GPUs? (?P<gpu>[\d,]+)"),
    "section": re.compile(r"^(?P<name>DEAD|INCOMPLETE|TIMEOUT)\s*$"),
    "event": re.compile(r"^\[(?P<when>[\d-]+ [\d:]+)\] (?P<event>PEER_[A-Z_]+): Process (?P<pid>\d+) on node "
                        r"(?P<host>\S+) managing GPUs? (?P<gpu>[\d,]+)"),
}


@dataclass
class RasRank:
    """One rank of one communicator as RAS saw it; `counts` holds only what the output says."""

    rank: int
    host: str = ""
    pid: int = -1
    gpu: int = -1                       # nvml_dev (unique on a node), else cuda_dev; -1 unknown
    init_state: int = 0
    async_error: int = 0
    finalize: bool = False
    abort: bool = False
    counts: dict[str, int] = field(default_factory=dict)
    missing: bool = False
    unresponsive: bool = False
    dead: bool = False


@dataclass
class RasComm:
    """One communicator: its ranks as RAS saw them (answered or missing), keyed by rank in it."""

    hash: str                           # hex digits, lower case, no 0x (the key shared with Inspector: comm_key)
    size: int
    ranks: dict[int, RasRank] = field(default_factory=dict)

    def rank(self, r: int) -> RasRank:
        """Rank `r` of this communicator, created on first mention."""
        return self.ranks.setdefault(r, RasRank(rank=r))


@dataclass
class RasProcess:
    """A process a monitor event or the DEAD / INCOMPLETE lists name."""

    host: str
    pid: int
    gpus: tuple[int, ...]
    dead: bool
    when: str = ""


@dataclass
class RasSnapshot:
    """Everything the RAS files given say, merged: communicators by hash, named processes, warnings."""

    comms: dict[str, RasComm] = field(default_factory=dict)
    processes: list[RasProcess] = field(default_factory=list)
    timestamp: str = ""
    nccl_version: str = ""
    files: list[Path] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    # per status document (or text file), in the order read: (comm, rank) -> its counts then
    marks: list[dict[tuple[str, int], dict[str, int]]] = field(default_factory=list)

    def mark(self, ranks: set[tuple[str, int]]) -> None:
        """Close one snapshot: the counts of the ranks it spoke of (repeated queries tell stuck from slow)."""
        seen = {(c, r): dict(self.comms[c].ranks[r].counts) for c, r in ranks if self.comms[c].ranks[r].counts}
        if seen:
            self.marks.append(seen)

    def moved(self, comm: str) -> tuple[int, bool]:
        """(snapshots that gave `comm`'s counts, whether any count of it changed between the last two)."""
        marks = [{r: m[(c, r)] for c, r in m if c == comm} for m in self.marks]
        marks = [m for m in marks if m]
        if len(marks) < 2:
            return len(marks), False
        a, b = marks[-2], marks[-1]
        return len(marks), any(a[r].get(f) != n for r in set(a) & set(b) for f, n in b[r].items() if f in a[r])

    def comm(self, key: str, size: int) -> RasComm:
        """The communicator `key`, created on first mention; a size past any job's is junk (0: unknown)."""
        size = size if 0 <= size <= safe_io.MAX_RANK else 0
        c = self.comms.setdefault(key, RasComm(hash=key, size=size))
        c.size = max(c.size, size)
        return c


def comm_key(value: Any) -> str:
    """A communicator hash as RAS ("0x%lx", text "%016lx") or Inspector ("0x%lx" cut to 14 digits) prints it,
    reduced to what both share: hex digits without leading zeros, at most 14."""
    text = str(value or "").strip().lower()
    text = text[2:] if text.startswith("0x") else text
    return (text.lstrip("0") or "0")[:14] if text and all(ch in "0123456789abcdef" for ch in text) else ""


def sniff_head(head: bytes) -> bool:
    """True when the first bytes of a file are `ncclras` output (JSON, monitor events or text)."""
    if b'"communicators"' in head and (b'"nccl_version"' in head or b'"missing_ranks' in head):
        return True
    if b'"event"' in head and b'"PEER_' in head and b'"group"' in head:
        return True
    text = head.decode("utf-8", "replace")
    return bool(re.search(r"^Job summary\n=+$|^Communicators\.\.\.|^#\d+-\d+ \([0-9a-f]{16}\) (INCOMPLETE|ERROR|MISMATCH)$"
                          r"|^\[[\d-]+ [\d:]+\] PEER_[A-Z_]+: |^RAS Monitor Mode", text, re.M))


def read_ras(paths: list[Path]) -> RasSnapshot:
    """Every RAS file given, merged into one snapshot (a file that cannot be read costs itself only)."""
    snap = RasSnapshot()
    for path in paths:
        try:
            text = safe_io.read_text(path, safe_io.JSON_LIMIT)
        except safe_io.InputError as exc:
            snap.warnings.append(f"{exc}; its NCCL RAS output is not read")
            continue
        before = (len(snap.comms), len(snap.processes))
        _read_text(path, text, snap)
        if (len(snap.comms), len(snap.processes)) != before:
            snap.files.append(path)
    return snap


def _read_text(path: Path, text: str, snap: RasSnapshot) -> None:
    """JSON documents (each opens with "{" and closes with "}" at the start of a line) and text lines."""
    lines = text.splitlines()
    plain: list[str] = []
    i = 0
    while i < len(lines):
        if lines[i].startswith("{"):
            j = next((k for k in range(i, len(lines)) if lines[k].rstrip() == "}"), len(lines) - 1)
            _json_doc(path, i + 1, "\n".join(lines[i:j + 1]), snap)
            i = j + 1
        else:
            plain.append(lines[i])
            i += 1
    if plain:
        TextReader(snap).read(plain)


def _json_doc(path: Path, line: int, chunk: str, snap: RasSnapshot) -> None:
    try:
        doc = safe_io.loads(chunk, f"{path}:{line}")
    except safe_io.InputError:
        _salvage(path, line, chunk, snap)
        return
    if isinstance(doc, dict) and isinstance(doc.get("communicators"), list):
        snap.timestamp = snap.timestamp or _str(doc.get("timestamp"))
        snap.nccl_version = snap.nccl_version or _str(doc.get("nccl_version"))
        touched: set[tuple[str, int]] = set()
        for c in doc["communicators"]:
            _json_comm(c, snap, touched)
        snap.mark(touched)
    elif isinstance(doc, dict) and isinstance(doc.get("event"), str):
        _json_event(doc, snap)
    else:
        snap.warnings.append(f"{path}:{line}: a JSON document that is no RAS status or event; ignored")


def _salvage(path: Path, line: int, chunk: str, snap: RasSnapshot) -> None:
    """A status document cut off (or damaged): its communicators that are whole, one warning."""
    parts = re.findall(r"^    \{\n.*?^    \}", chunk, re.S | re.M)
    got = 0
    for part in parts:
        try:
            _json_comm(safe_io.loads(part, f"{path}:{line}"), snap)
            got += 1
        except safe_io.InputError:
            continue
    m = re.search(r'"timestamp": "([^"]*)"', chunk)
    snap.timestamp = snap.timestamp or (m.group(1) if m else "")
    snap.warnings.append(f"{path}:{line}: NCCL RAS JSON cut off or damaged; read {got} whole communicator(s) of it")


def _json_comm(c: Any, snap: RasSnapshot, touched: set[tuple[str, int]] | None = None) -> None:
    if not isinstance(c, dict) or not comm_key(c.get("hash")):
        return
    comm = snap.comm(comm_key(c.get("hash")), max(_int(c.get("size")), 0))
    ranks, missing = c.get("ranks"), c.get("missing_ranks")
    for r in ranks if isinstance(ranks, list) else []:
        if isinstance(r, dict) and 0 <= _int(r.get("rank")) <= safe_io.MAX_RANK:
            st = r.get("status") if isinstance(r.get("status"), dict) else {}
            counts = r.get("collective_counts") if isinstance(r.get("collective_counts"), dict) else {}
            rr = comm.rank(_int(r.get("rank")))
            _who(rr, r)
            rr.init_state, rr.async_error = _int(st.get("init_state"), 0), _int(st.get("async_error"), 0)
            rr.finalize = bool(st.get("finalize_called")) or bool(st.get("destroy_flag"))
            rr.abort = bool(st.get("abort_flag"))
            rr.counts = {str(k)[:32]: n for k, v in counts.items() if (n := _int(v)) >= 0}
            if touched is not None:
                touched.add((comm.hash, rr.rank))
    for r in missing if isinstance(missing, list) else []:
        if isinstance(r, dict) and 0 <= _int(r.get("rank")) <= safe_io.MAX_RANK:
            st = r.get("status") if isinstance(r.get("status"), dict) else {}
            rr = comm.rank(_int(r.get("rank")))
            _who(rr, r)
            rr.missing, rr.unresponsive, rr.dead = True, bool(st.get("unresponsive")), bool(st.get("considered_dead"))


def _who(rr: RasRank, r: dict[str, Any]) -> None:
    rr.host, rr.pid = _str(r.get("host"))[:256], _int(r.get("pid"))
    nvml, cuda = _int(r.get("nvml_dev")), _int(r.get("cuda_dev"))
    rr.gpu = nvml if nvml >= 0 else cuda


def _json_event(doc: dict[str, Any], snap: RasSnapshot) -> None:
    """A monitor event; PEER_DEAD marks its process dead (the other events are transient)."""
    peer = doc.get("peer") if isinstance(doc.get("peer"), dict) else {}
    if doc.get("event") != "PEER_DEAD" or _int(peer.get("pid")) < 0:
        return
    gpus = peer.get("nvml_devs") if isinstance(peer.get("nvml_devs"), list) else peer.get("cuda_devs")
    gpus = tuple(g for g in (_int(x) for x in (gpus if isinstance(gpus, list) else [])) if g >= 0)
    snap.processes.append(RasProcess(_str(peer.get("host"))[:256], _int(peer.get("pid")), gpus, True,
                                     _str(doc.get("timestamp"))))


def _int(value: Any, default: int = -1) -> int:
    return safe_io.trace_int(value, default) if not isinstance(value, bool) else default


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _str(value: Any) -> str:
    """A string field: bounded, no lone surrogate, no control character (U+FFFD instead)."""
    return _CONTROL.sub("\ufffd", safe_io.clean_text(value)[:256]) if isinstance(value, str) else ""


class TextReader:
    """The text mode, line by line: which communicator and which list a `Rank ...` line belongs to."""

    def __init__(self, snap: RasSnapshot) -> None:
        self.snap = snap
        self.sizes: dict[int, int] = {}          # summary table: group number -> ranks per communicator
        self.comm: RasComm | None = None
        self.topic: tuple[str, str] = ("", "")   # (counts | status | init | async | missing | DEAD | INCOMPLETE, key)
        self.value: Any = None                   # the value a "N ranks ..." line set for the ranks listed under it
        self.groups: dict[tuple[str, str], list[tuple[int, int, list[int]]]] = {}   # (comm, func) -> [(n, v, ranks)]
        self.touched: set[tuple[str, int]] = set()   # (comm, rank) whose counts this file gives

    def read(self, lines: list[str]) -> None:
        """Every line, then the majority count group RAS did not list rank by rank; one snapshot."""
        for line in lines:
            self.line(line)
        self.fill_unlisted()
        self.snap.mark(self.touched)

    def line(self, line: str) -> None:
        """One line: a summary row, a monitor event, a section or communicator heading, or a topic line."""
        m = _RE["summary"].match(line)
        if m and self.comm is None and not self.topic[0]:
            self.sizes[int(m["group"][:9])] = int(m["size"][:9])
            return
        if m := _RE["event"].match(line):
            if m["event"] == "PEER_DEAD":
                self.snap.processes.append(RasProcess(_str(m["host"]), _num(m["pid"]), _gpus(m["gpu"]), True,
                                                      m["when"]))
            return
        if m := _RE["comm"].match(line):
            self.comm = self.snap.comm(comm_key(m["hash"]), self.sizes.get(int(m["group"][:9]), 0))
            self.topic = ("missing", "") if m["what"] == "INCOMPLETE" else ("", "")
            return
        if m := _RE["section"].match(line):
            self.comm, self.topic = None, (m["name"], "")
            return
        self.topic_line(line)

    def topic_line(self, line: str) -> None:
        """A line inside a section: what its lists are about, a count group, a rank, a process."""
        if m := _RE["funcs"].match(line):
            self.topic, self.value = ("counts", m["func"] or "collective"), None
        elif _RE["status"].match(line):
            self.topic, self.value = ("status", ""), None
        elif m := _RE["err"].match(line):
            self.topic, self.value = ("init" if m["kind"] == "Initialization" else "async", ""), None
        elif _RE["missing"].match(line):
            self.topic = ("missing", "")
        elif m := _RE["group_n"].match(line):
            self.value = m["st"] or m["err"] or (0 if m["none"] else int((m["v"] or "0")[:18]))
            if self.topic[0] == "counts" and self.comm is not None:
                self.groups.setdefault((self.comm.hash, self.topic[1]), []).append(
                    (int((m["n"] or m["n2"] or "0")[:9]), self.value, []))
        elif m := _RE["rank"].match(line):
            self.rank_line(m)
        elif m := _RE["missing_list"].match(line):
            for r in re.findall(r"\d{1,7}", m["ranks"])[:4096]:
                if self.comm is not None and int(r) <= safe_io.MAX_RANK:
                    self.comm.rank(int(r)).missing = True
        elif (m := _RE["process"].match(line)) and self.topic[0] in ("DEAD", "INCOMPLETE"):
            dead = self.topic[0] == "DEAD"
            self.snap.processes.append(RasProcess(_str(m["host"]), _num(m["pid"]), _gpus(m["gpu"]), dead))

    def rank_line(self, m: re.Match[str]) -> None:
        """A `Rank N ...` line: its rank's host, pid, GPU and the value of the list it is in."""
        if self.comm is None or len(m["rank"]) > 7 or int(m["rank"]) > safe_io.MAX_RANK:
            return
        rr = self.comm.rank(int(m["rank"]))
        if m["pid"]:
            rr.host, rr.pid = _str(m["host"]), _num(m["pid"])
            rr.gpu = _gpus(m["gpu"])[0] if m["gpu"] else rr.gpu
        what, key = self.topic
        own = m["st"] or m["err"] or (0 if m["none"] else (int(m["v"][:18]) if m["v"] else None))
        value = own if own is not None else self.value
        if what == "missing":
            rr.missing = rr.unresponsive = True
        elif what == "counts" and value is not None:
            rr.counts[key] = int(value)
            self.touched.add((self.comm.hash, rr.rank))
            if own is not None:
                self.groups.setdefault((self.comm.hash, key), []).append((1, int(value), [rr.rank]))
            elif self.groups.get((self.comm.hash, key)):
                self.groups[(self.comm.hash, key)][-1][2].append(rr.rank)
        elif what == "status" and value:
            rr.abort, rr.finalize = value == "ABORT", value == "FINALIZE"
        elif what in ("init", "async") and isinstance(value, str) and value in _ERROR_CODE:
            setattr(rr, "init_state" if what == "init" else "async_error", _ERROR_CODE[value])

    def fill_unlisted(self) -> None:
        """The one count group RAS did not list rank by rank (the majority) is every other rank that answered."""
        for (key, func), groups in self.groups.items():
            comm = self.snap.comms[key]
            unlisted = [g for g in groups if not g[2]]
            if len(unlisted) != 1 or not comm.size:
                continue
            listed = {r for g in groups for r in g[2]} | {r for r, rr in comm.ranks.items() if rr.missing}
            for r in range(comm.size):
                if r not in listed:
                    comm.rank(r).counts[func] = int(unlisted[0][1])
                    self.touched.add((key, r))


def _gpus(text: str) -> tuple[int, ...]:
    """GPU numbers as RAS lists them ("0,1"), at most 64, each of sane length."""
    return tuple(_num(g) for g in re.findall(r"\d+", text or "")[:64])


def _num(text: str) -> int:
    """A decimal from a text line; -1 for one longer than any pid or count (a hostile line)."""
    return int(text) if text and len(text) <= 18 else -1
