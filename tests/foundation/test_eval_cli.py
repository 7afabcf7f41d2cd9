"""`swarmrl eval` refuses what it cannot evaluate with a clear message and exit code 2 (no vLLM needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from swarmrl.cli import app
from swarmrl.offline_eval import resolve_model


def test_a_folder_that_is_not_a_model_is_refused(tmp_path):
    result = CliRunner().invoke(app, ["eval", "--checkpoint", str(tmp_path), "--samples", "2", "--out", str(tmp_path / "r.json")])
    assert result.exit_code == 2
    assert "cannot evaluate" in result.output and "neither a checkpoint" in result.output
    assert not (tmp_path / "r.json").exists()


def test_weights_alone_need_a_base_model(tmp_path):
    version = tmp_path / "v0000000003"
    version.mkdir()
    (version / "model-00001-of-00001.safetensors").write_bytes(b"")
    (version / "manifest.json").write_text('{"version": 3}')
    with pytest.raises(ValueError, match="--base-model"):
        resolve_model(version)
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text("{}")
    assert resolve_model(version, base) == (base, version, 3)


def test_a_run_folder_means_its_latest_checkpoint(tmp_path):
    for step, published in ((1, 1), (2, 2)):
        ckpt = tmp_path / "checkpoints" / f"step_{step:08d}"
        (ckpt / "model").mkdir(parents=True)
        (ckpt / "trainer_state.json").write_text(f'{{"step": {step}, "published_version": {published}}}')
    model_dir, weights, version = resolve_model(tmp_path)
    assert weights is None and version == 2 and model_dir == Path(tmp_path / "checkpoints" / "step_00000002" / "model")
