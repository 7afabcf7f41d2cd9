"""The objective on hand-picked tokens, checked against values computed by hand."""

import math

import pytest
import torch

from trainer.config import LossConfig
from trainer.loss import entropy_from_logprobs, k3, ppo_loss, sequence_weights

CFG = LossConfig(epsilon_low=0.2, epsilon_high=0.2, ratio_cap=4.0, importance_cap=2.0)


def five_tokens():
    """(u, pi_prox/mu, A) per token; logprobs are chosen so that these ratios come out exactly."""
    u = torch.tensor([1.5, 0.5, 5.0, 1.1, 2.0], dtype=torch.float64)
    iw = torch.tensor([0.5, 3.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, -1.0, 2.0, -1.0], dtype=torch.float64)
    prox = torch.tensor([-1.0, -2.0, -3.0, -1.5, -2.5], dtype=torch.float64)
    logprobs = (prox + u.log()).clone().requires_grad_(True)
    behaviour = prox - iw.log()
    return logprobs, prox, behaviour, adv


def test_hand_computed_loss_gradient_and_stats():
    logprobs, prox, behaviour, adv = five_tokens()
    weights = torch.full((5,), 0.2, dtype=torch.float64)
    loss, stats = ppo_loss(logprobs, prox, behaviour, adv, weights, CFG)
    # token 1: A>0, u=1.5 > 1.2 -> s = 1.2 A = 1.2; w = 0.5           -> l = -0.6   (clipped)
    # token 2: A<0, u=0.5 < 0.8 -> s = max(min(-0.5,-0.8), -4) = -0.8; w = min(3, 2) = 2 -> l = 1.6 (clipped)
    # token 3: A<0, u=5 > delta -> s = max(min(-5,-1.2), -4) = -4; w = 1 -> l = 4      (clipped by delta)
    # token 4: A>0, u=1.1       -> s = 2.2; w = 1                    -> l = -2.2
    # token 5: A<0, u=2 < delta -> s = max(min(-2,-1.2), -4) = -2    -> l = 2
    assert loss.item() == pytest.approx((-0.6 + 1.6 + 4 - 2.2 + 2) / 5, abs=1e-6)
    loss.backward()
    # d l / d logprob = -w A u where the surrogate follows u, else 0; times the 0.2 weight
    expected = torch.tensor([0, 0, 0, -1 * 2 * 1.1 * 0.2, -1 * -1 * 2.0 * 0.2], dtype=torch.float64)
    torch.testing.assert_close(logprobs.grad, expected, atol=1e-6, rtol=1e-6)
    assert stats["clipped"].item() == 3
    assert stats["importance_truncated"].item() == 1
    assert stats["importance_weight"].item() == pytest.approx(0.5 + 2 + 1 + 1 + 1, abs=1e-6)
    assert stats["importance_weight_max"].item() == pytest.approx(2.0)
    # mismatch KL(mu || prox) by k3 with r = log prox - log mu = log iw: iw - log iw - 1
    expect_kl = sum(x - math.log(x) - 1 for x in [0.5, 3.0, 1.0, 1.0, 1.0])
    assert stats["mismatch_kl"].item() == pytest.approx(expect_kl, abs=1e-6)


def test_clipped_tokens_carry_no_gradient():
    torch.manual_seed(0)
    n = 400
    prox = -torch.rand(n, dtype=torch.float64) * 5
    logprobs = (prox + torch.randn(n, dtype=torch.float64)).requires_grad_(True)  # u spread over [0.05, 20]
    behaviour = prox + 0.3 * torch.randn(n, dtype=torch.float64)
    adv = torch.randn(n, dtype=torch.float64)
    loss, stats = ppo_loss(logprobs, prox, behaviour, adv, torch.ones(n, dtype=torch.float64), CFG)
    loss.backward()
    u = (logprobs - prox).exp().detach()
    clipped = ((adv > 0) & (u > 1.2)) | ((adv < 0) & ((u < 0.8) | (u > 4.0)))
    assert clipped.sum() > 50 and (~clipped).sum() > 50
    assert torch.all(logprobs.grad[clipped] == 0)
    assert torch.all(logprobs.grad[~clipped] != 0)
    assert stats["clipped"].item() == clipped.sum().item()


def test_zero_advantage_gives_zero_policy_gradient():
    prox = torch.tensor([-1.0, -2.0, -0.5])
    logprobs = (prox + torch.tensor([0.3, -0.4, 0.05])).requires_grad_(True)
    loss, _ = ppo_loss(logprobs, prox, prox - 0.2, torch.zeros(3), torch.ones(3), CFG)
    loss.backward()
    assert loss.item() == 0
    assert torch.all(logprobs.grad == 0)


def test_on_policy_gradient_is_the_policy_gradient():
    # behaviour == proximal == current: w = 1, u = 1, gradient = -A * weight for every token
    prox = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    adv = torch.tensor([0.5, -1.5, 2.0, -0.1])
    weights = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logprobs = prox.clone().requires_grad_(True)
    loss, stats = ppo_loss(logprobs, prox, prox, adv, weights, CFG)
    loss.backward()
    torch.testing.assert_close(logprobs.grad, -adv * weights)
    assert stats["clipped"].item() == 0 and stats["mismatch_kl"].item() == 0


def test_eps_high_is_asymmetric():
    cfg = LossConfig(epsilon_low=0.2, epsilon_high=0.28)
    prox = torch.zeros(2)
    logprobs = torch.log(torch.tensor([1.25, 1.3])).requires_grad_(True)  # inside / outside 1 + 0.28
    loss, stats = ppo_loss(logprobs, prox, prox, torch.ones(2), torch.ones(2), cfg)
    loss.backward()
    assert loss.item() == pytest.approx(-(1.25 + 1.28), abs=1e-6)
    assert logprobs.grad[0].item() == pytest.approx(-1.25) and logprobs.grad[1].item() == 0
    assert stats["clipped"].item() == 1


def test_three_normalizers_by_hand():
    lengths = [2, 3]
    assert sequence_weights(lengths, LossConfig(normalizer="tokens")).tolist() == pytest.approx([0.2, 0.2])
    assert sequence_weights(lengths, LossConfig(normalizer="sequence")).tolist() == pytest.approx([1 / 4, 1 / 6])
    assert sequence_weights(lengths, LossConfig(normalizer="constant", constant_normalizer=8)).tolist() == [0.125] * 2
    with pytest.raises(ValueError):
        sequence_weights([2, 0], LossConfig())


def test_k3_kl_and_entropy_terms_by_hand():
    # k3 with log pi = log 0.5, log ref = log 0.25: r = log 0.5 -> 0.5 - log 0.5 - 1 = 0.193147
    logp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    assert k3(logp, ref).item() == pytest.approx(0.5 + math.log(2) - 1, abs=1e-6)
    assert k3(logp, logp).item() == 0
    assert entropy_from_logprobs(torch.log_softmax(torch.zeros(2, 16),
        -1)).tolist() == pytest.approx([math.log(16)] * 2, abs=1e-6)

    cfg = LossConfig(kl_coef=0.1, entropy_coef=0.01)
    lp = logp.clone().requires_grad_(True)
    entropy = torch.tensor([2.0], requires_grad=True)
    loss, stats = ppo_loss(lp, logp, logp, torch.zeros(1), torch.ones(1), cfg, ref_logprobs=ref, entropy=entropy)
    assert loss.item() == pytest.approx(0.1 * (0.5 + math.log(2) - 1) - 0.01 * 2.0, abs=1e-6)
    loss.backward()
    # d k3 / d logp = 1 - exp(ref - logp) = 0.5 ; d/d entropy = -0.01
    assert lp.grad.item() == pytest.approx(0.1 * 0.5, abs=1e-6)
    assert entropy.grad.item() == pytest.approx(-0.01)
    assert stats["kl"].item() == pytest.approx(0.193147, abs=1e-5)
    with pytest.raises(ValueError, match="reference"):
        ppo_loss(lp, logp, logp, torch.zeros(1), torch.ones(1), cfg, entropy=entropy)


def test_ratio_cap_inside_the_clip_range_is_refused():
    """delta < 1 + eps_high: the negative-advantage cap would act inside the clip range, where our dual
    clip and INTELLECT-2's ratio cap disagree. A clear error, not a silent choice."""
    with pytest.raises(ValueError, match="ratio_cap .* must be >= 1 \\+ epsilon_high"):
        LossConfig(ratio_cap=1.1)
    with pytest.raises(ValueError, match="ratio_cap"):
        LossConfig(ratio_cap=1.25, epsilon_high=0.28)  # DAPO's clip-higher needs delta >= 1.28
    assert LossConfig(ratio_cap=1.28, epsilon_high=0.28).ratio_cap == 1.28
