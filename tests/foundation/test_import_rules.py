"""Imports only go up the package table of docs/architecture.md, and no module imports itself round a circle.

Every import of every product module counts, the ones inside functions too (a lazy import is still a
dependency): `from a import b` is an edge to the module `a.b` when that is a module, else to `a`.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("protocol", "shardcast", "verifier", "environments", "inference_worker", "trainer", "orchestrator",
    "swarmrl")
# What each package may import of ours: whole packages, or single modules (docs/architecture.md's table).
MAY_IMPORT = {
    "protocol": set(),
    "shardcast": {"protocol"},
    # shardcast.adapter: what a LoRA version holds (adapter, config, base hash), read by all three sides.
    "verifier": {"protocol", "shardcast.adapter", "environments"},
    "environments": {"protocol"},  # the tasks (prompts and their rewards) live here: environments.tasks
    "inference_worker": {"protocol", "shardcast.client", "shardcast.config", "shardcast.adapter", "verifier.proofs",
    "environments"},
    # precision: the published cast of the master
    "trainer": {"protocol", "shardcast.origin", "shardcast.precision", "shardcast.adapter"},
    "orchestrator": {"protocol", "verifier", "trainer.advantages", "environments"},
    "swarmrl": {"protocol", "shardcast", "verifier", "environments", "inference_worker", "trainer", "orchestrator"},
}


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def product_modules(root: Path) -> dict[str, Path]:
    return {module_name(p, root): p for pkg in PACKAGES for p in (root / pkg).rglob("*.py")}


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Every module of ours that `path` imports, at any depth of its code."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                for a in node.names]
        else:
            continue
        out |= {n for n in names if n.split(".")[0] in (*PACKAGES, "tools")}
    return out


def graph(root: Path) -> dict[str, set[str]]:
    modules = product_modules(root)
    return {name: imports_of(path, set(modules)) for name, path in modules.items()}


def upward_imports(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for src, targets in edges.items():
        package = src.split(".")[0]
        for dst in targets:
            if dst.split(".")[0] == package:
                continue
            if not any(dst == allowed or dst.startswith(allowed + ".") for allowed in MAY_IMPORT[package]):
                bad.append(f"{src} imports {dst}")
    return sorted(bad)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in edges:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_imports_only_go_up_the_table():
    assert upward_imports(graph(REPO)) == []


def test_installed_packages_import_nothing_from_tools():
    """tools/ holds developer tools of a source checkout and is not installed: nothing installed may need it
    (the calibration command is `python -m tools.calibrate`, not a `swarmrl` subcommand)."""
    installed = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    assert sorted(installed) == sorted(PACKAGES)
    assert [f"{src} imports {dst}" for src, targets in sorted(graph(REPO).items()) for dst in sorted(targets)
        if dst.split(".")[0] == "tools"] == []


def test_no_import_cycles():
    assert cycles(graph(REPO)) == []


def test_the_checks_catch_what_they_are_for(tmp_path):
    """On a made-up tree: a library that imports the application, the application importing a developer
    tool, and two modules that import each other inside functions, are all found."""
    (tmp_path / "shardcast").mkdir()
    (tmp_path / "shardcast" / "relay.py").write_text("def f():\n    from swarmrl.logs import configure_logging\n")
    (tmp_path / "orchestrator").mkdir()
    (tmp_path / "orchestrator" / "a.py").write_text("def f():\n    from orchestrator.b import g\n")
    (tmp_path / "orchestrator" / "b.py").write_text("from orchestrator import a\n")
    for pkg in ("protocol", "verifier", "inference_worker", "trainer", "swarmrl"):
        (tmp_path / pkg).mkdir()
    (tmp_path / "swarmrl" / "logs.py").write_text("")
    (tmp_path / "swarmrl" / "calib.py").write_text("def f():\n    from tools import draw_calibration\n")
    edges = graph(tmp_path)
    assert upward_imports(edges) == ["shardcast.relay imports swarmrl.logs", "swarmrl.calib imports tools"]
    assert cycles(edges) == [["orchestrator.a", "orchestrator.b"]]
