"""The import graph keeps the layering DESIGN.md describes (every import, function-level ones too).

Planning code (``models``, ``strategy``, ``cluster``, ``vps``, ``ir``, ``cost``, ``sim`` and the
bottom modules ``units``, ``states``, ``collectives``, ``gpus``) never
imports torch.distributed, the runtime (``exec``), ``search``, ``replay`` or ``cli``; ``vps`` and
``ir`` never import the simulator; ``cost`` imports neither ``vps``, ``ir`` nor ``sim``; the bottom
modules import nothing of parashift but its errors; ``exec`` never imports ``cli``, ``search`` or
``replay``.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "parashift"

PLANNING = ("models", "strategy", "cluster", "vps", "ir", "cost", "sim", "units", "states", "collectives", "gpus")
RULES = [(p, ("torch.distributed", "parashift.exec", "parashift.search", "parashift.replay", "parashift.cli"))
         for p in PLANNING]
RULES += [("vps", ("parashift.sim",)), ("ir", ("parashift.sim",)),
          ("cost", ("parashift.vps", "parashift.ir.graph", "parashift.ir.compile", "parashift.sim")),
          *[(b, ("parashift.models", "parashift.strategy", "parashift.cluster", "parashift.vps", "parashift.ir",
                 "parashift.cost", "parashift.sim")) for b in ("units", "states", "collectives", "gpus")],
          ("exec", ("parashift.cli", "parashift.search", "parashift.replay"))]


def _module(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, mod: str | None = None) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in ``path`` (module ``mod``, by default from its
    place in the package), wherever it sits; ``from X import y`` counts as both ``X`` and ``X.y``
    (``y`` may be a submodule)."""
    mod = mod or _module(path)
    pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg.split(".")
                base = base[:len(base) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((node.lineno, name))
            out += [(node.lineno, f"{name}.{a.name}") for a in node.names]
    return out


def _files(top: str) -> list[Path]:
    p = ROOT / top
    return sorted(p.rglob("*.py")) if p.is_dir() else [p.with_suffix(".py")]


def _hits(name: str, banned: tuple[str, ...]) -> bool:
    return any(name == b or name.startswith(b + ".") for b in banned)


@pytest.mark.parametrize("top,banned", RULES, ids=[f"{t}-{'/'.join(b)}" for t, b in RULES])
def test_layer_never_imports(top, banned):
    bad = [f"{f.relative_to(ROOT.parent)}:{line} imports {name}" for f in _files(top)
           for line, name in imports(f) if _hits(name, banned)]
    assert not bad, "layering broken:\n" + "\n".join(bad)


def test_the_checker_sees_relative_and_function_level_imports(tmp_path):
    f = ROOT / "vps" / "transition" / "live.py"
    names = {n for _, n in imports(f)}
    assert "parashift.vps.plan" in names and "parashift.vps.plan.plan_switch" in names
    fake = tmp_path / "probe.py"
    fake.write_text("def f():\n    from ..exec import switch\n    import torch.distributed as dist\n")
    got = {n for _, n in imports(fake, "parashift.vps.probe")}
    assert {"parashift.exec", "parashift.exec.switch", "torch.distributed"} <= got
    assert _hits("parashift.exec.switch", RULES[0][1]) and not _hits("parashift.executor", ("parashift.exec",))
