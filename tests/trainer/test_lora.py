"""LoRA (trainer.lora): the trainer trains adapters on a frozen base and publishes adapter versions through
a real shardcast origin; the worker's real vLLM engine serves them with vLLM's LoRA support (the base is
never reloaded), and the verifier applies them (peft) for its prefill: the seeded draws replay and the
proofs check. An adapter's model hash binds its base.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from trainer_helpers import random_samples

from protocol.models import SamplingParams, TaskLease, TaskPrompt
from protocol.verdicts import VerdictStatus
from shardcast.adapter import BASE_HASH_KEY, base_model_hash, is_adapter, pack_adapter, unpack_adapter
from shardcast.keys import generate_signing_key
from shardcast.origin import Origin
from shardcast.weights import model_hash
from trainer.config import LoraConfig, TrainerConfig
from trainer.train import Trainer

torch.set_num_threads(1)
LORA = LoraConfig(enabled=True, rank=8, alpha=16.0)


def lora_trainer(model_dir, run_dir, publish=None, **kw) -> Trainer:
    return Trainer(TrainerConfig(**{"lr": 1e-2, "lora": LORA, **kw}), model_dir, run_dir, publish=publish)


def test_lora_is_off_by_default():
    assert TrainerConfig().lora.enabled is False


def test_lora_trains_only_the_adapter_and_publishes_it(tiny_model_dir, tmp_path):
    published: dict[int, dict] = {}

    def publish(version, state):
        published[version] = state
        return model_hash(state)

    trainer = lora_trainer(tiny_model_dir, tmp_path / "run", publish=publish)
    base = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if not p.requires_grad}
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)

    trainer.step(random_samples(6, seed=1))
    assert sorted(published) == [0, 1]
    for n, p in trainer.model.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), f"base weight {n} moved"
    v0, v1 = published[0], published[1]
    assert is_adapter(v1)
    tensors, config, base_hash = unpack_adapter(v1)
    assert base_hash == base_model_hash(tiny_model_dir)
    assert config["r"] == 8 and config["lora_alpha"] == 16.0 and config["base_model_name_or_path"] is None
    assert all(k.startswith("base_model.model.") and (".lora_A." in k or ".lora_B." in k) for k in tensors)
    # Version 0 is the untrained adapter (B = 0: the base itself); the step moved B.
    b_keys = [k for k in tensors if ".lora_B." in k]
    assert all(not v0[k].any() for k in b_keys) and any(tensors[k].any() for k in b_keys)
    full_bytes = sum(p.numel() * 4 for p in base.values())
    assert sum(t.numel() * t.element_size() for t in tensors.values()) < full_bytes / 4


def test_the_model_hash_binds_the_base(tiny_model_dir):
    tensors = {"base_model.model.x.lora_A.weight": torch.ones(2, 3)}
    config = {"r": 2, "lora_alpha": 4}
    base = base_model_hash(tiny_model_dir)
    one = model_hash(pack_adapter(tensors, config, base))
    assert one == model_hash(pack_adapter(tensors, config, base))
    assert one != model_hash(pack_adapter(tensors, config, "0" * 64))  # same adapter, another base
    assert one != model_hash(pack_adapter(tensors, {"r": 2, "lora_alpha": 8}, base))  # another scaling
    with pytest.raises(ValueError):
        pack_adapter(tensors, config, "not-a-hash")


def test_lora_checkpoint_resumes_the_adapter(tiny_model_dir, tmp_path):
    a = lora_trainer(tiny_model_dir, tmp_path / "run", checkpoint_every=1)
    a.step(random_samples(4, seed=2))
    want = a.state_dict_for_publish()
    b = lora_trainer(tiny_model_dir, tmp_path / "run", checkpoint_every=1)
    assert b.version == 1
    got = b.state_dict_for_publish()
    assert model_hash(got) == model_hash(want)


def test_lora_export_is_a_plain_model_with_the_adapter_merged(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    trainer = lora_trainer(tiny_model_dir, tmp_path / "run", lr=5e-2)
    trainer.step(random_samples(6, seed=3))
    ids = torch.tensor([[1, 10, 11, 12, 13, 14]])
    trainer.model.eval()
    with torch.no_grad():
        want = trainer.model(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)(input_ids=ids).logits
        got = AutoModelForCausalLM.from_pretrained(trainer.export(tmp_path / "export"))(input_ids=ids).logits
    assert not torch.allclose(want, base, atol=1e-4)  # the adapter matters ...
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)  # ... and the export carries it


# ------------------------------------------------------------------------------------------------
# Worker (real vLLM, LoRA on) and verifier (peft) on published adapter versions


@pytest.fixture(scope="module")
def origin_versions(tiny_model_dir, tmp_path_factory):
    """Versions 0 and 1 of a LoRA run on a real origin; version 1's adapter is made large enough that it
    visibly changes the model (a real step at lr 1e-2 moves B only a little)."""
    root = tmp_path_factory.mktemp("lora-origin")
    origin = Origin(root / "origin", generate_signing_key(root / "key.pem"), run_id="lora-test", keep_versions=4,
        grace_s=0,
                    deltas=False)  # as the trainer actor's origin in a LoRA run
    trainer = lora_trainer(tiny_model_dir, root / "run", publish=lambda v, s: origin.publish(v, s).model_hash)
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for n, p in trainer.model.named_parameters():
            if ".lora_B." in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    trainer.version = 1
    trainer._publish(now=True)
    return origin


@pytest.fixture(scope="module")
def lora_engine(tiny_model_dir):
    from inference_worker.config import EngineConfig
    from inference_worker.engine import RolloutEngine

    engine = RolloutEngine(tiny_model_dir, EngineConfig(max_model_len=256, kv_cache_bytes=32 << 20, max_lora_rank=8))
    yield engine
    engine.close()


def lease(model_dir, version: int, sampling=SamplingParams(temperature=1.0, max_tokens=24)) -> tuple[TaskLease, list]:
    from transformers import AutoTokenizer

    from environments.tasks import get_task

    tok = AutoTokenizer.from_pretrained(model_dir)
    items = get_task("toy").make_prompts(3, seed=5)
    prompts = [np.array([tok.bos_token_id] + tok.encode(i.prompt, add_special_tokens=False), dtype=np.int32)
        for i in items]
    tl = TaskLease(lease_id=f"L{version}", prompts=[TaskPrompt(prompt_id=f"p{i}", token_ids=p, seeds=[100 + 2 * i,
        101 + 2 * i]) for i, p in enumerate(prompts)],
                   samples_per_prompt=2, sampling=sampling, policy_version=version, min_policy_version=version,
                   deadline=time.time() + 60, generation_version=version)
    return tl, items


def verify(tiny_model_dir, origin, tl, items, completions, version: int, weights_for_version=None):
    from protocol.models import RolloutSubmission
    from verifier.config import VerifierConfig
    from verifier.service import Verifier, VerifyJob

    manifest = origin.manifest(version)
    verifier = Verifier(VerifierConfig(keep_versions=2), weights_for_version or origin.version_dir, tiny_model_dir)
    sub = RolloutSubmission(lease_id=tl.lease_id, policy_version=version, model_hash=manifest.model_hash,
        completions=completions)
    return verifier.verify(VerifyJob(submission_id=f"s{version}", submission=sub, lease=tl, items=items,
                                     task_name="toy", expected_model_hash=manifest.model_hash))


def test_worker_serves_adapter_versions_and_the_verifier_accepts_them(tiny_model_dir, origin_versions, lora_engine):
    origin = origin_versions
    outs = {}
    for v in (0, 1):
        manifest = origin.manifest(v)
        assert is_adapter(origin.version_dir(v)) and manifest.deltas == [] and manifest.anchor_version == v
        lora_engine.reload(origin.version_dir(v), v, manifest.model_hash)
        assert lora_engine.lora_request is not None and lora_engine.lora_request.lora_int_id == v + 1
        tl, items = lease(tiny_model_dir, v)
        completions = lora_engine.generate(tl)
        outs[v] = completions
        verdict = verify(tiny_model_dir, origin, tl, items, completions, v)
        assert verdict.status == VerdictStatus.accepted, verdict.rejections
    # The adapter changed what was sampled from the same seeds ...
    assert any(not np.array_equal(a.token_ids, b.token_ids) for a, b in zip(outs[0], outs[1]))
    # ... and the verifier's replay of the seeded draws on base + adapter picks exactly the worker's tokens.
    from verifier.reference import load_reference_model, prefill

    tl, _ = lease(tiny_model_dir, 1)
    seqs = [(tl.prompts[c.prompt_index].token_ids, c.token_ids) for c in outs[1]]
    seeds = [tl.prompts[c.prompt_index].seeds[c.sample_index] for c in outs[1]]
    for version, replays in ((1, True), (0, False)):
        model = load_reference_model(tiny_model_dir, origin.version_dir(version), "float32")
        draws = [p.draw for p in prefill(model, seqs, [tl.sampling] * len(seqs), seeds=seeds)]
        same = all(np.array_equal(d.winner, c.token_ids) for d, c in zip(draws, outs[1]))
        assert same == replays, version
    # ... and the verifier's draw replay and proofs use it: version 1's completions checked against the
    # base alone (version 0's folder under version 1's hash) are rejected.
    tl, items = lease(tiny_model_dir, 1)
    verdict = verify(tiny_model_dir, origin, tl, items, outs[1], 1, weights_for_version=lambda v: origin.version_dir(0))
    assert verdict.status == VerdictStatus.rejected


def test_an_adapter_for_another_base_is_refused(tiny_model_dir, tiny_untied_model_dir, origin_versions, lora_engine,
    tmp_path):
    from shardcast.adapter import load_version
    from shardcast.weights import serialize_shard, split_aliases
    from verifier.reference import load_reference_model

    state = load_version(origin_versions.version_dir(1))
    tensors, config, _ = unpack_adapter(state)
    other = pack_adapter(tensors, config, base_model_hash(tiny_untied_model_dir))
    assert model_hash(other) != origin_versions.manifest(1).model_hash
    folder = tmp_path / "v9"
    folder.mkdir()
    (folder / "model-00001-of-00001.safetensors").write_bytes(serialize_shard(*split_aliases(other)))
    with pytest.raises(ValueError, match="base model"):
        load_reference_model(tiny_model_dir, folder, "float32")
    with pytest.raises(RuntimeError, match="base"):
        lora_engine.reload(folder, 9, model_hash(other))
    assert BASE_HASH_KEY in other
