"""Checkpoints: exact resume, atomic writes under a real crash, export to transformers, pruning."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from trainer_helpers import SafetensorsPublisher, random_samples

from trainer import checkpoint as ckpt
from trainer.config import TrainerConfig
from trainer.train import Trainer

torch.set_num_threads(1)
HERE = Path(__file__).parent


def params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_resume_gives_the_same_next_step(tiny_model_dir, tmp_path):
    cfg = TrainerConfig(lr=1e-2, warmup_steps=3, schedule="cosine", max_steps=10, checkpoint_every=2)
    batches = [random_samples(5, seed=20 + i, version=max(0, i - 1)) for i in range(3)]
    a = Trainer(cfg, tiny_model_dir, tmp_path / "a")
    a.step(batches[0])
    a.data_cursor = {"next_prompt": 10}
    a.step(batches[1])  # version 2: checkpoint written here, with the data cursor
    assert [p.name for p in ckpt.list_checkpoints(tmp_path / "a" / "checkpoints")] == ["step_00000002"]
    rng_after_save = torch.rand(3)
    want = a.step(batches[2])
    want_params = params(a)

    shutil.copytree(tmp_path / "a" / "checkpoints", tmp_path / "b" / "checkpoints")
    pub = SafetensorsPublisher(tmp_path / "pub")
    b = Trainer.resume(cfg, tmp_path / "b", publish=pub)
    assert b.version == 2 and b.published_version == -1 and b.data_cursor == {"next_prompt": 10}
    assert pub.versions == []  # resuming does not republish version 0
    assert torch.equal(torch.rand(3), rng_after_save)
    got = b.step(batches[2])
    assert got["loss"] == want["loss"] and got["lr"] == want["lr"] and got["grad_norm"] == want["grad_norm"]
    for name, p in params(b).items():
        assert torch.equal(p, want_params[name]), name
    assert pub.versions == [3]


def test_a_crash_mid_write_leaves_the_previous_checkpoint_usable(tiny_model_dir, tmp_path):
    run = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE), str(HERE.parent.parent)]))
    proc = subprocess.run([sys.executable, str(HERE / "trainer_crash_worker.py"), str(tiny_model_dir), str(run)],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 17, proc.stderr[-2000:]
    root = run / "checkpoints"
    leftovers = [p.name for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert len(leftovers) == 1  # the half-written step 2 (model written, train state truncated)
    assert (root / leftovers[0] / "model" / "model.safetensors").is_file()
    assert ckpt.latest_checkpoint(root).name == "step_00000001"

    trainer = Trainer(TrainerConfig(lr=1e-2, checkpoint_every=1), tiny_model_dir, run)
    assert trainer.version == 1
    assert not any(p.name.startswith(".tmp-") for p in root.iterdir())  # cleaned up on start
    m = trainer.step(random_samples(4, seed=2, version=1))
    assert trainer.version == 2 and torch.isfinite(torch.tensor(m["loss"]))
    assert ckpt.latest_checkpoint(root).name == "step_00000002"


def test_export_is_a_plain_transformers_folder(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = Trainer(TrainerConfig(lr=1e-2), tiny_model_dir, tmp_path / "run")
    trainer.step(random_samples(4, seed=30))
    out = trainer.export(tmp_path / "export")
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("12+3=", return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, trainer.model(ids).logits)
    assert not torch.allclose(model(ids).logits, AutoModelForCausalLM.from_pretrained(tiny_model_dir)(ids).logits)
    with pytest.raises(FileExistsError):
        ckpt.export_checkpoint(ckpt.latest_checkpoint(trainer.ckpt_root), out)


def test_keeps_only_the_newest_checkpoints(tiny_model_dir, tmp_path):
    trainer = Trainer(TrainerConfig(checkpoint_every=1, keep_checkpoints=2), tiny_model_dir, tmp_path)
    for i in range(4):
        trainer.step(random_samples(2, seed=40 + i, version=trainer.version))
    names = [p.name for p in ckpt.list_checkpoints(tmp_path / "checkpoints")]
    assert names == ["step_00000003", "step_00000004"]
    state = json.loads((tmp_path / "checkpoints" / "step_00000004" / "trainer_state.json").read_text())
    assert state["step"] == 4 and state["published_version"] == -1


def test_not_a_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not a swarmrl checkpoint"):
        ckpt.read_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        Trainer.resume(TrainerConfig(), tmp_path)


class _Payload:
    """Unpickling this runs code: what a malicious checkpoint could carry."""

    def __reduce__(self):
        import os

        return (os.system, ("touch /tmp/swarmrl-pwned-by-checkpoint",))


def test_a_checkpoint_is_read_as_data_never_run(tiny_model_dir, tmp_path):
    """train_state.pt is loaded with weights_only: a pickled callable is refused with a clear error, and
    never runs (`swarmrl trainer inspect|export` and resume all read checkpoints this way)."""
    import os

    from trainer.checkpoint import latest_checkpoint, read_checkpoint

    cfg = TrainerConfig(checkpoint_every=1)
    t = Trainer(cfg, tiny_model_dir, tmp_path / "run")
    t.step(random_samples(4, seed=1))
    path = latest_checkpoint(tmp_path / "run" / "checkpoints")
    read_checkpoint(path)  # an honest checkpoint reads back
    marker = "/tmp/swarmrl-pwned-by-checkpoint"
    if os.path.exists(marker):
        os.remove(marker)
    torch.save({"optimizer": {}, "scheduler": {}, "rng": _Payload()}, path / "train_state.pt")
    with pytest.raises(ValueError, match="more than tensors"):
        read_checkpoint(path)
    assert not os.path.exists(marker)


def test_a_checkpoint_written_in_the_step_copies_nothing_and_a_background_one_only_when_its_copy_fits(tiny_model_dir,
    tmp_path, monkeypatch):
    """At 0.6B a checkpoint's copy is ~7 GB (fp32 weights, AdamW's two moments): the batch loop writes in
    the step, from the live tensors, when that copy would not fit in the memory available."""
    import psutil

    from trainer.batch_loop import BatchLoop

    cfg = TrainerConfig(lr=1e-2, checkpoint_every=1)
    trainer = Trainer(cfg, tiny_model_dir, tmp_path / "run", defer_io=True)
    trainer.step(random_samples(4, seed=1))
    n = sum(p.numel() for p in trainer.model.parameters())
    assert ckpt.snapshot_bytes(trainer.model, trainer.optimizer) == 3 * 4 * n

    roomy = BatchLoop(trainer, source=None, samples_per_step=4)
    assert roomy.writer is not None and trainer.snapshot_copies
    state = trainer.checkpoint_state()
    live = dict(trainer.model.named_parameters())
    assert all(state["model_state"][k].data_ptr() != live[k].data_ptr() for k in live if k in state["model_state"])
    roomy.close()

    class Tight:
        available = 2 * 4 * n  # less than twice the copy
    monkeypatch.setattr(psutil, "virtual_memory", lambda: Tight())
    tight = BatchLoop(trainer, source=None, samples_per_step=4)
    assert tight.writer is None and not trainer.snapshot_copies
    state = trainer.checkpoint_state()
    assert all(state["model_state"][k].data_ptr() == live[k].data_ptr() for k in live if k in state["model_state"])
    path = ckpt.save_checkpoint(**state)
    want = params(trainer)
    resumed = Trainer.resume(cfg, tmp_path / "run")
    assert path.name == "step_00000001" and resumed.version == 1
    for name, p in params(resumed).items():
        assert torch.equal(p, want[name]), name
