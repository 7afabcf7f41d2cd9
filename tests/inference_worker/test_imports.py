"""A volunteer's install has no Ray and no fastapi: our modules must not import them.

vLLM itself imports fastapi and ray when `vllm` is imported; that is vLLM's business, so the engine
imports vLLM lazily and these checks cover our code: an import of every module with ray / fastapi /
uvicorn blocked, and a scan of the source for direct imports.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[2] / "inference_worker"
FORBIDDEN = {"ray", "fastapi", "uvicorn", "starlette"}

BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in %r:
            raise ImportError('blocked: ' + name)
        return None
sys.meta_path.insert(0, Block())
import swarmrl.cli, inference_worker.client, inference_worker.loop, inference_worker.engine
import inference_worker.capture, inference_worker.weights, inference_worker.display, inference_worker.config
import shardcast.client, verifier.proofs
print('ok')
""" % (FORBIDDEN,)


def test_modules_import_without_ray_or_fastapi():
    out = subprocess.run([sys.executable, "-c", BLOCKER], cwd=PKG.parent, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"


def test_no_direct_imports_of_cluster_packages():
    for path in PKG.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for name in names:
                assert name.split(".")[0] not in FORBIDDEN, f"{path.name} imports {name}"
