"""The Trainer on the tiny model: GRPO equivalence, staleness, publishing, metrics, schedule, bf16."""

import math

import numpy as np
import pytest
import torch
from trainer_helpers import SafetensorsPublisher, plain_logprobs, random_samples, with_behaviour

from trainer.config import LossConfig, TrainerConfig
from trainer.optimizer import lr_lambda
from trainer.packing import plan_micro_batches
from trainer.policy_model import load_model
from trainer.samples import TrainSample
from trainer.train import Trainer

torch.set_num_threads(1)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def accumulate_gradients(trainer: Trainer, samples) -> None:
    """Forward/backward over `samples` as one optimizer step, leaving the gradients in `.grad` (proximal
    policy = the current weights): the first half of `Trainer.step`, without the optimizer."""
    plan = plan_micro_batches(list(samples), trainer.config, trainer.env, trainer.device)
    reference = [trainer._logprobs_no_grad(trainer.reference, mb)
        for mb in plan] if trainer.reference is not None else None
    trainer._backward(plan, None, reference)


def on_policy(trainer: Trainer, samples, shift: float = 0.0):
    """Samples whose behaviour logprobs are the trainer's current logprobs (minus `shift`)."""
    with torch.no_grad():
        return with_behaviour(samples, [plain_logprobs(trainer.model, s) - shift for s in samples])


def test_behaviour_equal_to_proximal_gives_plain_grpo_gradient(tiny_model_dir, tmp_path):
    trainer = Trainer(TrainerConfig(micro_batch_tokens=64), tiny_model_dir, tmp_path)
    samples = on_policy(trainer, random_samples(8, seed=5))
    accumulate_gradients(trainer, samples)
    got = grads(trainer.model)

    # Plain GRPO (PPO-clip with pi_old = the sampling policy, token-level mean), sample by sample, unpacked.
    ref = load_model(tiny_model_dir, torch.device("cpu"))
    n_tokens = sum(s.num_completion_tokens for s in samples)
    for s in samples:
        logp = plain_logprobs(ref, s)
        ratio = torch.exp(logp - torch.from_numpy(s.behaviour_logprobs))
        a = s.advantage
        (-torch.minimum(ratio * a, ratio.clamp(0.8, 1.2) * a).sum() / n_tokens).backward()
    want = grads(ref)
    assert max(g.abs().max() for g in want.values()) > 1e-4
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=1e-6, rtol=1e-4, msg=name)


def test_stale_behaviour_is_reweighted_by_the_truncated_importance_weight(tiny_model_dir, tmp_path):
    trainer = Trainer(TrainerConfig(micro_batch_tokens=256), tiny_model_dir, tmp_path)
    base = random_samples(6, seed=6)

    def flat_grad(shift):
        trainer.model.zero_grad()
        accumulate_gradients(trainer, on_policy(trainer, base, shift))
        return torch.cat([p.grad.flatten() for p in trainer.model.parameters()])

    g0 = flat_grad(0.0)
    # behaviour = prox - 0.3 -> w = exp(0.3) on every token; behaviour = prox - 1 -> w = min(e, c=2) = 2
    torch.testing.assert_close(flat_grad(0.3), math.exp(0.3) * g0, atol=1e-6, rtol=1e-4)
    torch.testing.assert_close(flat_grad(1.0), 2.0 * g0, atol=1e-6, rtol=1e-4)


def test_zero_advantage_gives_zero_gradient(tiny_model_dir, tmp_path):
    trainer = Trainer(TrainerConfig(), tiny_model_dir, tmp_path)
    samples = [
        TrainSample(s.prompt_ids, s.completion_ids, s.behaviour_logprobs, 0.0, s.reward, 0, s.sample_id)
        for s in random_samples(6, seed=7)
    ]
    accumulate_gradients(trainer, samples)
    assert all(torch.all(p.grad == 0) for p in trainer.model.parameters())


def test_stale_samples_are_dropped_and_counted(tiny_model_dir, tmp_path):
    trainer = Trainer(TrainerConfig(max_staleness=1, lr=1e-3), tiny_model_dir, tmp_path)
    for _ in range(3):
        trainer.step(random_samples(4, seed=8, version=trainer.version))
    assert trainer.version == 3
    batch = random_samples(6, seed=9)
    for s, v in zip(batch, [3, 2, 1, 0, 3, 2]):
        s.behaviour_version = v
    m = trainer.step(batch)
    kept = [s for s in batch if s.behaviour_version >= 2]
    assert m["samples/dropped_stale"] == 2 and m["samples/trained"] == 4
    assert (m["staleness/0"], m["staleness/1"], m["staleness/2"], m["staleness/3"]) == (2, 2, 1, 1)
    assert m["completion_tokens"] == sum(s.num_completion_tokens for s in kept)
    assert trainer.totals["samples_dropped_stale"] == 2

    # Only stale samples: nothing is trained, no version is made, the weights do not move.
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    m = trainer.step(random_samples(3, seed=10, version=1))
    assert m["samples/dropped_stale"] == 3 and trainer.version == 4
    assert all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())
    assert trainer.totals["samples_dropped_stale"] == 5


def test_bad_batches_are_errors_that_change_nothing(tiny_model_dir, tmp_path):
    trainer = Trainer(TrainerConfig(), tiny_model_dir, tmp_path)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    with pytest.raises(ValueError, match="behaviour version 1 > trainer version 0"):
        trainer.step(random_samples(2, seed=11, version=1))
    too_big = random_samples(2, seed=11)
    too_big[1].completion_ids[0] = trainer.model_config.vocab_size
    with pytest.raises(ValueError, match="vocab size"):
        trainer.step(too_big)
    assert trainer.version == 0
    assert all(torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_publishes_version_zero_then_one_per_optimizer_step(tiny_model_dir, tmp_path):
    from safetensors.torch import load_file

    pub = SafetensorsPublisher(tmp_path / "published")
    trainer = Trainer(TrainerConfig(lr=1e-2), tiny_model_dir, tmp_path / "run", publish=pub)
    assert pub.versions == [0]
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    v0 = pub.load(0)
    assert set(v0) == set(base) and all(torch.equal(v0[k], base[k]) for k in base)

    trainer.step(random_samples(4, seed=12))
    trainer.step(random_samples(4, seed=13, version=1))
    assert pub.versions == [0, 1, 2] and trainer.version == 2
    v1, v2 = pub.load(1), pub.load(2)
    assert any(not torch.equal(v1[k], v2[k]) for k in v1)  # snapshots, not live views

    # The published version loads into a transformers model and reproduces the trainer's logits.
    model = load_model(tiny_model_dir, torch.device("cpu"))
    model.load_state_dict(v2, strict=False)
    x = torch.tensor([[1, 5, 9, 13, 17]])
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, trainer.model(x).logits)

    # Every fresh run folder starts by publishing its base model as version 0.
    pub2 = SafetensorsPublisher(tmp_path / "published2")
    Trainer(TrainerConfig(), tiny_model_dir, tmp_path / "run2", publish=pub2)
    assert pub2.versions == [0]


def test_mini_batches_make_one_version_each_and_use_the_proximal_policy(tiny_model_dir, tmp_path):
    pub = SafetensorsPublisher(tmp_path / "published")
    cfg = TrainerConfig(lr=5e-2, mini_batches=2, loss=LossConfig(epsilon_low=0.01, epsilon_high=0.01))
    trainer = Trainer(cfg, tiny_model_dir, tmp_path / "run", publish=pub)
    m = trainer.step(on_policy(trainer, random_samples(8, seed=14)))
    assert pub.versions == [0, 1, 2] and m["optimizer_steps"] == 2
    # The second mini-batch runs after one update: its ratio to the proximal policy moved off 1 and tight
    # clipping catches some tokens. (The first mini-batch is exactly on-policy: u = 1.)
    assert m["ratio/mean"] != pytest.approx(1.0, abs=1e-6)
    assert m["clip_frac"] > 0


def test_metrics_and_mismatch_kl_by_hand(tiny_model_dir, tmp_path):
    trainer = Trainer(TrainerConfig(), tiny_model_dir, tmp_path)
    m = trainer.step(on_policy(trainer, random_samples(6, seed=15), shift=0.1))
    # behaviour = proximal - 0.1 on every token: w = e^0.1, KL(mu||prox) by k3 = e^0.1 - 0.1 - 1
    assert m["importance_weight/mean"] == pytest.approx(math.exp(0.1), rel=1e-4)
    assert m["mismatch_kl"] == pytest.approx(math.exp(0.1) - 1.1, rel=1e-3)
    assert m["importance_weight/truncated_frac"] == 0 and m["clip_frac"] == 0
    for key in ["loss", "policy_loss", "entropy", "grad_norm", "lr", "tokens", "tokens_per_s", "time/compute",
                "time/publish", "samples/dropped_stale", "staleness/0", "version", "reward/mean"]:
        assert key in m and np.isfinite(m[key]), key
    assert 0 < m["entropy"] <= math.log(trainer.model_config.vocab_size) + 1e-4
    assert m["grad_norm"] > 0 and m["tokens"] == sum(s.num_tokens - 1 for s in random_samples(6, seed=15))


def test_bf16_autocast_trains_close_to_fp32(tiny_model_dir, tmp_path):
    samples = random_samples(6, seed=16)
    m32 = Trainer(TrainerConfig(), tiny_model_dir, tmp_path / "a").step(samples)
    t16 = Trainer(TrainerConfig(bf16=True), tiny_model_dir, tmp_path / "b")
    m16 = t16.step(samples)
    assert m16["loss"] == pytest.approx(m32["loss"], rel=0.05, abs=1e-3)
    assert m16["entropy"] == pytest.approx(m32["entropy"], rel=0.01)
    assert all(p.dtype == torch.float32 for p in t16.model.parameters())  # master weights stay fp32


def test_kl_to_frozen_reference(tiny_model_dir, tmp_path):
    trainer = Trainer(TrainerConfig(lr=2e-2, loss=LossConfig(kl_coef=0.1, entropy_coef=0.01)), tiny_model_dir, tmp_path)
    first = trainer.step(random_samples(6, seed=17))
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)  # the reference is the starting model
    second = trainer.step(random_samples(6, seed=18, version=1))
    assert second["kl"] > 1e-6


def test_schedule_by_hand():
    warm = lr_lambda(TrainerConfig(warmup_steps=3, schedule="constant"))
    assert [warm(s) for s in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    cos = lr_lambda(TrainerConfig(warmup_steps=2, schedule="cosine", max_steps=12, min_lr_ratio=0.1))
    assert cos(2) == pytest.approx(1.0)
    assert cos(7) == pytest.approx(0.1 + 0.9 * 0.5)  # halfway through the 10 decay steps
    assert cos(12) == pytest.approx(0.1) and cos(50) == pytest.approx(0.1)


def test_lr_follows_the_schedule_in_training(tiny_model_dir, tmp_path):
    trainer = Trainer(TrainerConfig(lr=1e-3, warmup_steps=2), tiny_model_dir, tmp_path)
    lrs = [trainer.step(random_samples(2, seed=19 + i, version=trainer.version))["lr"] for i in range(3)]
    assert lrs == pytest.approx([1e-3 / 3, 1e-3 * 2 / 3, 1e-3])


def test_bad_samples_are_rejected():
    with pytest.raises(ValueError, match="2 behaviour logprobs for 3 completion tokens"):
        TrainSample([1], [4, 5, 6], [-1.0, -1.0], 0.0, 0.0, 0)
    with pytest.raises(ValueError, match="empty completion"):
        TrainSample([1], [], [], 0.0, 0.0, 0)
    with pytest.raises(ValueError, match="<= 0"):
        TrainSample([1], [4], [0.5], 0.0, 0.0, 0)


def test_single_step_proximal_shortcut_equals_a_no_grad_pass(tiny_model_dir, tmp_path):
    """With one optimizer step per batch the trainer reuses the training forward's detached logprobs as the
    proximal logprobs; they are bit-identical to a separate no-grad pass with the same weights."""
    from trainer.policy_model import forward_logprobs

    trainer = Trainer(TrainerConfig(micro_batch_tokens=64), tiny_model_dir, tmp_path)
    for mb in plan_micro_batches(random_samples(6, seed=70), trainer.config, trainer.env, trainer.device):
        with torch.no_grad():
            separate = forward_logprobs(trainer.model, mb, bf16=False)[0]
        assert torch.equal(forward_logprobs(trainer.model, mb, bf16=False)[0].detach(), separate)


def test_every_logprob_is_of_the_sampling_temperature(tiny_model_dir, tmp_path):
    """Workers sample from logits / T and the verifier reports mu at T: the trainer's pi_theta (and so
    pi_prox and the reference) must be of the same distribution, or the importance weights are wrong."""
    from trainer.policy_model import forward_logprobs

    samples = random_samples(4, seed=90)
    trainer = Trainer(TrainerConfig(micro_batch_tokens=4096), tiny_model_dir, tmp_path, sampling_temperature=0.7)
    with torch.no_grad():
        got = torch.cat([forward_logprobs(trainer.model, mb, bf16=False, temperature=trainer.temperature)[0]
            for s in samples for mb in plan_micro_batches([s], trainer.config, trainer.env, trainer.device)])
        want = torch.cat([plain_logprobs(trainer.model, s, temperature=0.7) for s in samples])
        at_one = torch.cat([plain_logprobs(trainer.model, s) for s in samples])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, at_one, atol=1e-3)
    # On-policy samples at T = 0.7 (mu = pi at 0.7): every importance weight is exactly where it should be.
    on = with_behaviour(samples, list(want.split([s.num_completion_tokens for s in samples])))
    stats = trainer.step(on)
    assert stats["importance_weight/mean"] == pytest.approx(1.0,
        abs=1e-4) and stats["importance_weight/max"] == pytest.approx(1.0, abs=1e-3)
    assert Trainer(TrainerConfig(), tiny_model_dir, tmp_path / "greedy", sampling_temperature=0.0).temperature == 1.0


def test_a_non_finite_gradient_skips_the_step_and_keeps_the_weights(tiny_model_dir, tmp_path):
    """Dr. GRPO (no std) with a huge reward gives a huge advantage: the gradient overflows. The step is
    skipped and counted; no NaN ever reaches the weights, no version is published for it, and the next
    sane batch trains as usual."""
    pub = SafetensorsPublisher(tmp_path / "published")
    cfg = TrainerConfig(lr=1e-2, loss=LossConfig(advantage_std=False))
    trainer = Trainer(cfg, tiny_model_dir, tmp_path / "run", publish=pub)
    before = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    huge = [TrainSample(s.prompt_ids, s.completion_ids, s.behaviour_logprobs, 3e38, s.reward, 0, s.sample_id)
        for s in random_samples(4, seed=9)]
    m = trainer.step(huge)
    assert m["optimizer_steps_skipped"] == 1 and m["optimizer_steps"] == 0
    assert trainer.totals["optimizer_steps_skipped"] == 1
    assert trainer.version == 0 and trainer.last_published == {} and pub.versions == [0]
    for k, v in trainer.model.state_dict().items():
        assert torch.equal(v, before[k]), k
    m = trainer.step(random_samples(4, seed=10))
    assert m["optimizer_steps"] == 1 and trainer.version == 1 and np.isfinite(m["grad_norm"])
    assert all(torch.isfinite(v).all() for v in trainer.model.state_dict().values())
