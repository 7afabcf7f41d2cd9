"""The one check the Docker tests share: a client, a daemon that answers, and the image they run, else a skip that
says which is missing."""

from __future__ import annotations

import shutil
import subprocess

import pytest


def docker_with_image(image: str) -> str:
    """The docker client's path when a daemon answers and `image` is built here; else skip with the reason."""
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("no docker client installed")
    try:
        res = subprocess.run([docker, "version", "--format", "{{.Server.Version}}"], capture_output=True, text=True,
            timeout=15)
    except subprocess.TimeoutExpired:
        pytest.skip("the Docker daemon did not answer within 15 s")
    if res.returncode != 0:
        pytest.skip(f"no Docker daemon answers: {(res.stderr or res.stdout).strip()[:200]}")
    if subprocess.run([docker, "image", "inspect", image], capture_output=True).returncode != 0:
        pytest.skip(f"image {image} is not built here (`make images` builds it; bench/results/images.md)")
    return docker
