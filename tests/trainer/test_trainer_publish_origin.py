"""Publishing through the real shardcast origin: signed, hashed version folders that reload into transformers."""

import pytest
import torch
from trainer_helpers import random_samples

from trainer.config import TrainerConfig
from trainer.policy_model import load_model
from trainer.train import Trainer

RUN = "test-run"  # the run id signed into the test origin's manifests

origin_mod = pytest.importorskip("shardcast.origin")


def test_trainer_publishes_through_the_shardcast_origin(tiny_model_dir, tmp_path):
    from shardcast.keys import generate_signing_key, verify_manifest
    from shardcast.weights import load_version_dir, model_hash

    key = generate_signing_key(tmp_path / "key.pem")
    origin = origin_mod.Origin(tmp_path / "origin", key, run_id=RUN, keep_versions=5, shard_bytes=64 << 10)
    trainer = Trainer(TrainerConfig(lr=1e-2), tiny_model_dir, tmp_path / "run", publish=lambda v, sd: origin.publish(v,
        sd).model_hash)
    trainer.step(random_samples(4, seed=50))
    trainer.step(random_samples(4, seed=51, version=1))
    assert origin.versions() == [0, 1, 2] and origin.latest() == 2
    # What the step published, with the hash the origin signed: what the trainer commits with the batch.
    assert trainer.last_published == {2: origin.manifest(2).model_hash}

    manifest = origin.manifest(2)
    verify_manifest(manifest, origin.public_key_b64)
    assert len(manifest.shards) > 1  # really sharded at 64 KiB
    weights = load_version_dir(origin.version_dir(2))
    assert manifest.model_hash == model_hash(weights) == model_hash(trainer.state_dict_for_publish())
    assert origin.manifest(1).model_hash != manifest.model_hash

    model = load_model(tiny_model_dir, torch.device("cpu"))
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    x = torch.tensor([[1, 7, 8, 9]])
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, trainer.model(x).logits)
