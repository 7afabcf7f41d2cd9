import json

import torch
from trainer_helpers import random_samples
from typer.testing import CliRunner

from swarmrl.trainer_cli import app
from trainer.config import TrainerConfig
from trainer.train import Trainer

runner = CliRunner()


def test_inspect_and_export(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    trainer = Trainer(TrainerConfig(checkpoint_every=1), tiny_model_dir, tmp_path / "run")
    trainer.data_cursor = {"epoch": 0, "next": 7}
    trainer.step(random_samples(3, seed=60))

    res = runner.invoke(app, ["inspect", str(tmp_path / "run"), "--json"])
    assert res.exit_code == 0, res.output
    info = json.loads(res.output)
    assert info["step"] == 1 and info["data_cursor"] == {"epoch": 0, "next": 7}
    assert info["parameters"] == sum(p.numel() for p in trainer.model.parameters())  # tied: lm_head is the embedding

    res = runner.invoke(app, ["checkpoints", str(tmp_path / "run")])
    assert res.exit_code == 0 and "step_00000001" in res.output

    res = runner.invoke(app, ["export", str(tmp_path / "run"), str(tmp_path / "hf")])
    assert res.exit_code == 0, res.output
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    x = torch.tensor([[1, 4, 5]])
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, trainer.model(x).logits)

    again = runner.invoke(app, ["export", str(tmp_path / "run"), str(tmp_path / "hf")])
    assert again.exit_code != 0 and "not empty" in again.output
    bad = runner.invoke(app, ["inspect", str(tmp_path)])
    assert bad.exit_code != 0 and "neither a checkpoint" in bad.output
