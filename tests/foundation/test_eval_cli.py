"""`swarmrl eval` refuses what it cannot evaluate with a clear message and exit code 2 (no vLLM needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from swarmrl.cli import app
from swarmrl.offline_eval import resolve_model


def test_a_folder_that_is_not_a_model_is_refused(tmp_path):
    result = CliRunner().invoke(app, ["eval", "--checkpoint", str(tmp_path), "--samples", "2", "--out",
        str(tmp_path / "r.json")])
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


def test_status_and_live_view_show_the_newest_evaluation():
    import io
    from types import SimpleNamespace

    from rich.console import Console

    from protocol.operator_models import EvalResult, RunStatus
    from swarmrl.config import RunConfig
    from swarmrl.live_view import render
    from swarmrl.run_record import Progress
    from swarmrl.status_view import render_status

    ev = EvalResult(policy_version=4, prompts=3, prompts_planned=4, samples_per_prompt=8, avg_reward=0.625,
                    pass_at={"1": 0.5, "8": 0.75}, mean_completion_tokens=6.5, complete=False, finished_at=1.0)
    st = RunStatus(run_name="r", step=5, policy_version=5, async_level=1, buffer_depth=0, workers_online=1,
                   acceptance_rate=1.0, submissions_accepted=1, submissions_rejected=0, groups_dropped_zero_signal=0,
                   samples_dropped_stale=0, rollout_tokens_per_s=0.0, trained_samples_per_s=0.0, eval_latest=ev,
                   evals_open=1)
    want = "eval of version 4: avg@8 0.625, pass@1 0.500, pass@8 0.750, 6.5 tokens (partial: 3/4 prompts)"
    for draw in (lambda c: render_status(st, c), lambda c: c.print(render(SimpleNamespace(progress=Progress(status=st),
        cfg=RunConfig(), url="u")))):
        out = io.StringIO()
        draw(Console(file=out, width=300))
        assert want in out.getvalue()
