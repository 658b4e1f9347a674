"""The analyzer's import rule, checked on the source: nothing under `ncclscope/` but the runtime itself
(`ncclscope/runtime/`) imports torch or the runtime (lazily or not), except `run.py`, the shim behind `torchrun -m ncclscope.run`. The job
commands reach the CLI through the `ncclscope.commands` entry point instead.
"""
from __future__ import annotations

import argparse
import ast
from pathlib import Path
from types import SimpleNamespace

import pytest

import ncclscope
from ncclscope.cli import parser as cli_parser

PKG = Path(ncclscope.__file__).parent
ALLOWED = {"run.py"}
FORBIDDEN = ("torch", "ncclscope.runtime")


def _package(path: Path) -> list[str]:
    """The package a file under ncclscope/ belongs to, as name parts (relative imports start there)."""
    return list(path.relative_to(PKG.parent).with_suffix("").parts[:-1])


def _imports(path: Path, package: list[str]) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file, lazy ones included."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            out += [(node.lineno, mod)] + [(node.lineno, f"{mod}.{a.name}") for a in node.names]
    return out


def test_the_analyzer_never_imports_torch_or_the_runtime():
    bad = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if str(rel) in ALLOWED or rel.parts[0] == "runtime":
            continue
        for line, mod in _imports(path, _package(path)):
            if any(mod == f or mod.startswith(f + ".") for f in FORBIDDEN):
                bad.append(f"{path.relative_to(PKG.parent)}:{line} imports {mod}")
    assert not bad, "\n".join(bad)


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    """The rule above cannot pass vacuously: a lazy relative import of the runtime is found."""
    probe = tmp_path / "probe.py"
    probe.write_text("def f():\n    from ..runtime import config\n    import torch.distributed\n")
    mods = {m for _, m in _imports(probe, ["ncclscope", "analysis"])}
    assert "ncclscope.runtime" in mods and "torch.distributed" in mods


def test_the_runtime_registers_its_commands():
    ns = cli_parser.build_parser().parse_args(["train", "--dp", "2", "--steps", "1"])
    assert ns.func.__module__ == "ncclscope.runtime.commands"
    sub = cli_parser.build_parser()._subparsers._group_actions[0].choices  # noqa: SLF001 - argparse has no API
    assert {"analyze", "report", "tui", "export", "train", "run", "demo"} <= set(sub)


def test_a_broken_plugin_leaves_the_analyzer_commands(monkeypatch, capsys):
    def broken(_sub):
        raise ImportError("No module named 'torch'")
    eps = [SimpleNamespace(name="broken", value="x.y:register", load=lambda: broken)]
    monkeypatch.setattr(cli_parser, "entry_points", lambda group: eps)
    p = cli_parser.build_parser()
    assert p.parse_args(["analyze", "somewhere"]).func.__name__ == "cmd_analyze"
    err = capsys.readouterr().err
    assert "'broken' commands (x.y:register) could not be loaded: ImportError" in err
    with pytest.raises(SystemExit):
        p.parse_args(["train"])
    assert isinstance(p, argparse.ArgumentParser)
