"""The import graph keeps the layering DESIGN.md describes (every import, function-level ones too).

Planning code (``models``, ``strategy``, ``cluster``, ``vps``, ``ir``, ``cost``, ``sim`` and the
bottom modules ``units``, ``states``, ``collectives``, ``gpus``, ``plots``) never
imports torch.distributed, the runtime (``exec``), ``search``, ``replay`` or ``cli``; ``vps`` and
``ir`` never import the simulator; ``cost`` imports neither ``vps``, ``ir`` nor ``sim``; the bottom
modules import nothing of parashift but its errors; ``exec`` never imports ``cli``, ``search`` or
``replay``; ``data`` (token files and the sampler), ``train`` (schedules) and ``export`` import neither torch nor the runtime, ``search``,
``replay`` or ``cli``.

No module-level cycle either: counting every import (function-level ones too), no module reaches itself
again; shared records sit below their users (as ``collectives`` does), not behind imports in functions.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "parashift"

PLANNING = ("models", "strategy", "cluster", "vps", "ir", "cost", "sim", "units", "states", "collectives",
            "schedules", "gpus", "plots")
RULES = [(p, ("torch.distributed", "parashift.exec", "parashift.search", "parashift.replay", "parashift.cli"))
         for p in PLANNING]
RULES += [("vps", ("parashift.sim",)), ("ir", ("parashift.sim",)),
          ("cost", ("parashift.vps", "parashift.ir.graph", "parashift.ir.compile", "parashift.sim")),
          *[(b, ("parashift.models", "parashift.strategy", "parashift.cluster", "parashift.vps", "parashift.ir",
                 "parashift.cost", "parashift.sim"))
            for b in ("units", "states", "collectives", "schedules", "gpus", "plots")],
          ("exec", ("parashift.cli", "parashift.search", "parashift.replay")),
          *[(p, ("torch", "parashift.exec", "parashift.search", "parashift.replay", "parashift.cli"))
            for p in ("data", "train", "export")]]


def _module(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root.parent).with_suffix("")
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


# ---- cycles -------------------------------------------------------------------------------------------

Graph = dict[str, dict[str, list[tuple[str, int]]]]


def import_graph(root: Path = ROOT) -> Graph:
    """module -> {imported module -> [(file, line), ...]} over the package at ``root``, every import
    counted wherever it sits. An import names the module it loads: ``from pkg import sub`` (``sub`` a
    submodule) is an edge to ``pkg.sub`` alone, ``from pkg import name`` an edge to ``pkg``'s
    ``__init__`` and ``import a.b.c`` an edge to ``a.b.c``; the parent packages' ``__init__`` modules
    Python runs on the way are not edges (they re-export their children, so counting them would make
    every child that imports a sibling look like a cycle through its package). Imports under
    ``if TYPE_CHECKING:`` count like any other: a type two modules share sits below both too."""
    files = {_module(f, root): f for f in sorted(root.rglob("*.py"))}

    def known(name: str) -> str | None:           # the longest prefix of ``name`` that is one of our modules
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph: Graph = {m: {} for m in files}
    for mod, path in files.items():
        pkg = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        where = str(path.relative_to(root.parent))
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [known(a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1] if node.level else []
                name = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{name}.{a.name}" if f"{name}.{a.name}" in files else known(name) for a in node.names]
            else:
                continue
            for t in targets:
                if t is not None and t != mod:
                    graph[mod].setdefault(t, []).append((where, node.lineno))
    return graph


def cycles(graph: Graph) -> list[frozenset[str]]:
    """The strongly connected sets of two or more modules (Tarjan's algorithm, iterative), each a
    module-level import cycle or several sharing modules."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[frozenset[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, {})))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                scc = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    scc.append(w)
                    if w == v:
                        break
                if len(scc) > 1:
                    out.append(frozenset(scc))
    return out


def describe(graph: Graph, scc: frozenset[str]) -> str:
    """A cycle's modules and every import line that joins two of them."""
    lines = [" <-> ".join(sorted(scc))]
    for a in sorted(scc):
        for b in sorted(set(graph.get(a, {})) & scc):
            at = ", ".join(f"{f}:{n}" for f, n in sorted(set(graph[a][b])))
            lines.append(f"    {a} -> {b}  ({at})")
    return "\n".join(lines)


def test_no_module_level_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    assert not found, ("import cycles (move the shared record below its users instead of importing inside a "
                       "function):\n" + "\n".join(describe(graph, c) for c in found))


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_the_cycle_finder_sees_function_level_and_submodule_imports(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "from .sub import Thing\nfrom .sub.a import A\n",   # re-exports: no cycle
        "bottom.py": "X = 1\n",
        "sub/__init__.py": "from .a import A as Thing\n",
        "sub/a.py": "from ..bottom import X\nfrom . import b\nA = 1\n",
        "sub/b.py": "def f():\n    from pkg.sub import c\n",                     # function level, submodule
        "sub/c.py": "import pkg.sub.a\n",
    })
    graph = import_graph(root)
    assert graph["pkg.sub.b"] == {"pkg.sub.c": [("pkg/sub/b.py", 2)]}          # not the package pkg.sub
    assert "pkg" not in graph["pkg.sub.a"] and "pkg.sub" not in graph["pkg.sub.a"]
    found = cycles(graph)
    assert found == [frozenset({"pkg.sub.a", "pkg.sub.b", "pkg.sub.c"})]
    text = describe(graph, found[0])
    assert "pkg.sub.b -> pkg.sub.c  (pkg/sub/b.py:2)" in text and "pkg.sub.c -> pkg.sub.a  (pkg/sub/c.py:1)" in text
    (root / "sub" / "c.py").write_text("X = 2\n")                        # break it: the package is clean
    assert cycles(import_graph(root)) == []


def test_a_cycle_through_a_package_init_counts(tmp_path):
    """``from pkg import name`` (not a submodule) runs pkg/__init__, so an __init__ that imports the
    importer back closes a cycle."""
    root = _package(tmp_path, {"__init__.py": "from .a import f\n",
                               "a.py": "def f():\n    from pkg import VERSION\n"})
    assert cycles(import_graph(root)) == [frozenset({"pkg", "pkg.a"})]


def test_parsing_a_strategy_loads_no_ir():
    """The schedule records sit below ``strategy``: a cold ``Strategy.parse`` imports none of the IR."""
    code = ("import sys; from parashift.strategy import Strategy; Strategy.parse('dp=2,pp=2,schedule=zb-h1'); "
            "print(sorted(m for m in sys.modules if m.startswith(('parashift.ir', 'parashift.cost', 'parashift.sim'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=ROOT.parent, timeout=60)
    assert out.stdout.strip() == "[]"
