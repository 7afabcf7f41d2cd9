"""The staleness-aware decoupled PPO objective (docs/architecture.md, "The objective").

Per completion token t of a sample with advantage A, behaviour logprob log mu (the policy version v_b
that generated it, recomputed by the verifier: the worker's own numbers are checked, never used),
proximal logprob log pi_prox (trainer weights at the start of the step, no grad) and current logprob
log pi_theta:

    u_t   = pi_theta / pi_prox                                  (the PPO ratio, AReaL's decoupled form)
    w_t   = min(pi_prox / mu, c)                                (truncated importance weight, no grad)
    s_t   = min(u_t A, clip(u_t, 1 - eps_low, 1 + eps_high) A)  (two-sided clip, DAPO's eps_high)
    s_t   = max(s_t, delta A)        if A < 0                   (ratio cap delta for negative A, INTELLECT-2;
                                                                 the "dual clip" of Ye et al. 2020)
    l_t   = -w_t s_t  +  beta * k3_t  -  alpha * H_t
    loss  = sum_t weight_t * l_t

k3_t = exp(r) - r - 1 with r = log pi_ref - log pi_theta (Schulman's k3 estimator of KL(pi_theta||pi_ref)),
H_t is the entropy of pi_theta's next-token distribution. weight_t carries the normalizer (see
`sequence_weights`), so that a micro-batch's loss is its exact share of the step's loss and packing,
padding and gradient accumulation leave the total unchanged.

All of pi_theta, pi_prox, pi_ref and mu are the *tempered* distribution the workers sampled from,
softmax(logits / T) with the lease's temperature T (T = 0, greedy, counts as 1), untruncated. Top-k and
top-p only restrict which tokens can be drawn: a drawn token is always inside the support, where the
sampling probability is mu / Z with Z the support's tempered mass (Z >= top_p). Comparing untruncated
with untruncated keeps w_t exactly 1 on fresh samples (v_b = prox), as on-policy data should have;
against the truncated mu / Z it would be Z < 1 on every token even then.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch

from trainer.config import LossConfig

# exp() of a log ratio above this is clipped anyway (u > delta or u > 1 + eps_high): cap it to avoid inf.
_MAX_LOG_RATIO = 20.0
# The token-level sums `ppo_loss` returns in its stats (besides "importance_weight_max", a maximum, and
# "kl" when kl_coef > 0): callers sum them over micro-batches and ranks and divide by "tokens".
STAT_KEYS = ("tokens", "policy_loss", "clipped", "importance_weight", "importance_truncated", "mismatch_kl", "ratio",
    "entropy")


def sequence_weights(completion_lengths: Sequence[int], config: LossConfig) -> np.ndarray:
    """The normalizer as one weight per sequence, applied to each of its completion tokens.

    tokens:   1 / (completion tokens in the whole step)          (DAPO token-level)
    sequence: 1 / (len_i * number of sequences in the step)       (GRPO per-sequence mean)
    constant: 1 / constant_normalizer                             (Dr. GRPO / INTELLECT-2 token sum / C)
    """
    lengths = np.asarray(completion_lengths, dtype=np.float64)
    if lengths.size == 0 or np.any(lengths <= 0):
        raise ValueError("every sequence needs at least one completion token")
    if config.normalizer == "tokens":
        return np.full(lengths.size, 1.0 / lengths.sum())
    if config.normalizer == "sequence":
        return 1.0 / (lengths * lengths.size)
    return np.full(lengths.size, 1.0 / config.constant_normalizer)


def k3(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimate of KL(p || q) from samples of p: exp(r) - r - 1 with r = log q - log p (>= 0)."""
    r = (log_q - log_p).clamp(max=_MAX_LOG_RATIO)
    return torch.expm1(r) - r


def ppo_loss(
    logprobs: torch.Tensor,
    proximal_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    config: LossConfig,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Loss over the completion tokens of one micro-batch (all arguments 1-D, one entry per token).

    Returns the weighted loss and token-level *sums* for metrics (the caller divides by `tokens`).
    Only `logprobs` and `entropy` carry gradients.
    """
    proximal_logprobs = proximal_logprobs.detach().float()
    behaviour_logprobs = behaviour_logprobs.detach().float()
    logprobs = logprobs.float()
    a = advantages.float()

    u = torch.exp((logprobs - proximal_logprobs).clamp(max=_MAX_LOG_RATIO))
    log_w = proximal_logprobs - behaviour_logprobs
    w = torch.exp(log_w.clamp(max=math.log(config.importance_cap)))

    lo, hi = 1.0 - config.epsilon_low, 1.0 + config.epsilon_high
    surrogate = torch.minimum(u * a, u.clamp(lo, hi) * a)
    surrogate = torch.where(a < 0, torch.maximum(surrogate, config.ratio_cap * a), surrogate)
    per_token = -w * surrogate

    kl = None
    if config.kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs reference logprobs")
        kl = k3(logprobs, ref_logprobs.detach().float())
        per_token = per_token + config.kl_coef * kl
    if config.entropy_coef > 0:
        if entropy is None:
            raise ValueError("entropy_coef > 0 needs the entropy")
        per_token = per_token - config.entropy_coef * entropy.float()

    loss = (weights.float() * per_token).sum()

    with torch.no_grad():
        # Tokens whose surrogate is flat in u, so they carry no policy gradient.
        clipped = ((a > 0) & (u > hi)) | ((a < 0) & ((u < lo) | (u > config.ratio_cap)))
        stats = {
            "tokens": torch.tensor(float(logprobs.numel())),
            "policy_loss": (weights * -w * surrogate).sum(),
            "clipped": clipped.float().sum(),
            "importance_weight": w.sum(),
            "importance_weight_max": w.max() if w.numel() else torch.tensor(0.0),
            "importance_truncated": (log_w > math.log(config.importance_cap)).float().sum(),
            # KL(mu || pi_prox), estimated from mu's own samples: the train/inference mismatch.
            "mismatch_kl": k3(behaviour_logprobs, proximal_logprobs).sum(),
            "ratio": u.sum(),
        }
        if kl is not None:
            stats["kl"] = kl.sum()
        if entropy is not None:
            stats["entropy"] = entropy.float().sum()
    return loss, stats


def entropy_from_logprobs(logp: torch.Tensor) -> torch.Tensor:
    """Entropy of each next-token distribution, given its full log-probabilities (last dimension)."""
    return -(logp.exp() * logp).sum(-1)


def step_metrics(sums: Counter, n_steps: int, iw_max: float, tokens: int) -> dict[str, float]:
    """The metrics of one trainer step from its sums over micro-batches, ranks and optimizer steps: the
    token-level statistics (STAT_KEYS) per token, the loss, gradient norm and learning rate per optimizer step."""
    n_tok = max(sums["tokens"], 1.0)
    out = {
        "loss": sums["loss"] / n_steps,
        "policy_loss": sums["policy_loss"] / n_steps,
        "clip_frac": sums["clipped"] / n_tok,
        "importance_weight/mean": sums["importance_weight"] / n_tok,
        "importance_weight/max": iw_max,
        "importance_weight/truncated_frac": sums["importance_truncated"] / n_tok,
        "ratio/mean": sums["ratio"] / n_tok,
        "entropy": sums["entropy"] / n_tok,
        "mismatch_kl": sums["mismatch_kl"] / n_tok,
        "grad_norm": sums["grad_norm"] / n_steps,
        "lr": sums["lr"] / n_steps,
        "tokens": float(tokens),
        "completion_tokens": sums["tokens"],
    }
    if "kl" in sums:
        out["kl"] = sums["kl"] / n_tok
    return out
