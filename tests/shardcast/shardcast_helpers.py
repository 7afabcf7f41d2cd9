"""Helpers for the shardcast tests: small state dicts, CLI subprocesses, a tmpfs for disk-full."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
RUN = "test-run-0123abcd"  # the run id of every test's manifests


def state_dict(seed: int = 0, layers: int = 8, mb_per_layer: float = 1.0) -> dict[str, torch.Tensor]:
    """HF-named fp32 tensors, about `layers * mb_per_layer` MB."""
    g = torch.Generator().manual_seed(seed)
    cols = int(mb_per_layer * (1 << 20) / 4 / 256)
    out = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(256, cols, generator=g) for i in range(layers)}
    out["model.norm.weight"] = torch.randn(64, generator=g)
    return out


class Trajectory:
    """A float32 master taking small Adam-like steps (each weight moves by about `lr`); every version is
    published as its bfloat16 cast, as the GPU recipe does. Snapshots allow a trainer restart."""

    def __init__(self, seed: int = 0, layers: int = 6, cols: int = 512, lr: float = 5e-6):
        self.gen = torch.Generator().manual_seed(seed)
        self.master = {f"model.layers.{i}.mlp.up_proj.weight": torch.randn(256, cols, generator=self.gen) * 0.02
            for i in range(layers)}
        self.master["model.norm.weight"] = torch.ones(256)
        self.lr = lr
        self.version = -1
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}

    def next_version(self) -> dict[str, torch.Tensor]:
        from shardcast.precision import cast_for_publishing

        if self.version >= 0:
            for t in self.master.values():
                t.add_(torch.sign(torch.randn(t.shape, generator=self.gen)) * self.lr)
        self.version += 1
        self.snapshots[self.version] = {k: v.clone() for k, v in self.master.items()}
        return cast_for_publishing(self.master)

    def restart(self, from_version: int, seed: int) -> None:
        """The trainer resumes from `from_version`'s checkpoint; its later steps differ (other data order)."""
        self.master = {k: v.clone() for k, v in self.snapshots[from_version].items()}
        self.version = from_version
        self.gen = torch.Generator().manual_seed(seed)


def start_cli(*args: str, env: dict | None = None) -> tuple[subprocess.Popen, dict]:
    """Start `shardcast <args>` in a subprocess; returns it and the JSON line it announces."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "from swarmrl.shardcast_cli import app; app()", *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **(env or {})},
    )
    line = proc.stdout.readline()
    if not line:
        proc.kill()
        raise RuntimeError(f"shardcast {args[0]} did not start (exit {proc.wait()})")
    return proc, json.loads(line)


def stop_proc(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def tmpfs(size_bytes: int):
    """A real small filesystem (root only); skips the test where mounting is not allowed."""
    path = Path(tempfile.mkdtemp(prefix="shardcast-tmpfs-"))
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", f"shardcast-{uuid.uuid4().hex[:8]}",
        str(path)], capture_output=True)
    if r.returncode != 0:
        path.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
        path.rmdir()
