"""Sampling, logprob and termination checks of one completion against the trusted recomputation.

Definitions (what the worker must send, see inference_worker/engine.py):
- `Completion.logprobs[t]` is the *raw* log-probability of the sampled token t under the policy:
  log_softmax(logits) at temperature 1, before temperature, top-k and top-p are applied. That is what
  vLLM reports by default (`logprobs_mode="raw_logprobs"`) and what the trainer's importance weights
  compare against (the trainer scores tokens at temperature 1 too).
- The *sampling support* at step t is vLLM's: logits / temperature, then keep the top-k logits (ties
  kept), then keep the smallest set of most probable tokens whose probability reaches top-p. A token
  is inside iff fewer than k tokens have a larger logit and the (top-k renormalized, tempered)
  probability mass of strictly more probable tokens is below top-p. Temperature 0 means greedy.
  Because the verifier's logits differ slightly from the worker's, a token counts as "inside" if it
  would be inside after raising its logit by `logit_slack` (accept when in doubt: the slack is
  calibrated on honest runs).
- A token is *implausible* when its tempered log-probability is below `min_token_logprob`.
- Termination: `stop` needs the last token to be EOS or a stop token and none of them earlier;
  `length` needs exactly `max_tokens` tokens and no EOS / stop token at all. (When the token at
  `max_tokens` is EOS, vLLM reports `stop`: it checks EOS and stop tokens before the length cap.)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from protocol.models import FinishReason, SamplingParams


@dataclass
class TokenStats:
    """Per completion token statistics of the trusted recomputation (all float64 / int64 numpy, [T])."""

    logprob: np.ndarray  # raw log-softmax of the sampled token
    tempered_logprob: np.ndarray  # log-probability under logits / temperature (no truncation)
    rank_above: np.ndarray  # tokens whose logit exceeds the sampled one's by more than the slack
    mass_above: np.ndarray  # top-k-renormalized tempered mass of tokens more probable (beyond slack)

    def __len__(self) -> int:
        return int(self.logprob.shape[0])

    def slice(self, start: int, stop: int) -> "TokenStats":
        return TokenStats(self.logprob[start:stop], self.tempered_logprob[start:stop], self.rank_above[start:stop], self.mass_above[start:stop])

    @staticmethod
    def concat(parts: list["TokenStats"]) -> "TokenStats":
        if len(parts) == 1:
            return parts[0]
        return TokenStats(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("logprob", "tempered_logprob", "rank_above", "mass_above")))


def token_stats(logits: torch.Tensor, tokens: torch.Tensor, sampling: SamplingParams, logit_slack: float) -> TokenStats:
    """Statistics of `tokens` [T] under `logits` [T, V] (any float dtype; computed in float32)."""
    logits = logits.float()
    tokens = tokens.long().view(-1, 1)
    logprobs = torch.log_softmax(logits, dim=-1)
    logprob = logprobs.gather(1, tokens).squeeze(1)
    tok_logit = logits.gather(1, tokens)  # [T, 1]
    above = logits > tok_logit + logit_slack
    rank_above = above.sum(1)
    temp = sampling.temperature if sampling.temperature > 0 else 1.0
    top_k = sampling.top_k > 0 and sampling.top_k < logits.shape[1]
    if temp == 1.0:  # the common case: one softmax serves every statistic
        tempered, z_logprobs = logprob, logprobs
    else:
        z_logprobs = torch.log_softmax(logits / temp, dim=-1)
        tempered = z_logprobs.gather(1, tokens).squeeze(1)
    if top_k:  # top-k restriction (ties at the k-th value kept, like vLLM), renormalized for top-p
        kth = torch.topk(z_logprobs, sampling.top_k, dim=1).values[:, -1:]
        z_logprobs = torch.log_softmax(z_logprobs.masked_fill(z_logprobs < kth, float("-inf")), dim=-1)
    mass_above = (z_logprobs.exp() * above).sum(1)
    return TokenStats(
        logprob=logprob.double().numpy(),
        tempered_logprob=tempered.double().numpy(),
        rank_above=rank_above.numpy().astype(np.int64),
        mass_above=mass_above.double().numpy(),
    )


@dataclass
class Finding:
    """One failed check (the service turns it into a protocol Rejection)."""

    code: str  # a protocol.RejectionCode value
    message: str
    stats: dict[str, float]


def logprob_diffs(reported: np.ndarray, stats: TokenStats) -> np.ndarray | Finding:
    """|reported - recomputed| per token, or a Finding if the shapes differ."""
    reported = np.asarray(reported, dtype=np.float64)
    if reported.shape != stats.logprob.shape:
        return Finding("logprob_mismatch", f"{reported.size} logprobs for {len(stats)} tokens", {})
    return np.abs(reported - stats.logprob)


def check_logprob_max(diff: np.ndarray, max_abs_diff: float) -> Finding | None:
    """Per token: a tampered logprob shows here."""
    worst = int(diff.argmax())
    if diff[worst] > max_abs_diff:
        return Finding(
            "logprob_mismatch",
            f"reported logprobs disagree with the recomputation: |diff| {diff[worst]:.3g} at token {worst} (limit {max_abs_diff})",
            {"max_abs_diff": float(diff[worst]), "token_index": float(worst)},
        )
    return None


def check_logprob_mean(diff_sum: float, tokens: int, max_mean_diff: float) -> Finding | None:
    """Over a whole submission: systematic drift (another dtype, other weights) shows in the mean.

    Over a submission, not per completion: a short completion's mean is one token's noise divided by
    a handful, and an honest worker's rare outlier token (seen at 1e-4 on a trained model, CPU) then
    failed a 4-token completion's mean while honest submissions' means stay ~1e-7."""
    mean = diff_sum / max(tokens, 1)
    if mean > max_mean_diff:
        return Finding(
            "logprob_mismatch",
            f"reported logprobs drift from the recomputation: mean |diff| {mean:.3g} over {tokens} tokens (limit {max_mean_diff})",
            {"mean_abs_diff": mean, "tokens": float(tokens)},
        )
    return None


def check_support(stats: TokenStats, sampling: SamplingParams, min_token_logprob: float) -> list[Finding]:
    findings = []
    if sampling.temperature == 0:
        outside = stats.rank_above > 0
        rule = "greedy decoding (temperature 0) but a more likely token exists"
    else:
        outside = np.zeros(len(stats), dtype=bool)
        rules = []
        if sampling.top_k > 0:
            outside |= stats.rank_above >= sampling.top_k
            rules.append(f"top_k={sampling.top_k}")
        if sampling.top_p < 1.0:
            outside |= stats.mass_above >= sampling.top_p
            rules.append(f"top_p={sampling.top_p}")
        rule = "outside the sampling support (" + ", ".join(rules) + ")"
    if outside.any():
        t = int(np.argmax(outside))
        findings.append(Finding(
            "token_outside_support",
            f"{int(outside.sum())} token(s) {rule}; first at token {t}",
            {"token_index": float(t), "rank_above": float(stats.rank_above[t]), "mass_above": float(stats.mass_above[t])},
        ))
    if sampling.temperature > 0:
        low = stats.tempered_logprob < min_token_logprob
        if low.any():
            t = int(np.argmax(low))
            findings.append(Finding(
                "token_implausible",
                f"{int(low.sum())} token(s) with tempered logprob below {min_token_logprob}; "
                f"first at token {t}: {stats.tempered_logprob[t]:.3g}",
                {"token_index": float(t), "tempered_logprob": float(stats.tempered_logprob[t])},
            ))
    return findings


def check_termination(token_ids: np.ndarray, finish_reason: FinishReason, sampling: SamplingParams, eos_ids: set[int]) -> Finding | None:
    ids = np.asarray(token_ids)
    n = int(ids.size)
    enders = np.array(sorted(set(eos_ids) | set(sampling.stop_token_ids)), dtype=np.int64)
    is_end = np.isin(ids, enders)
    early = np.flatnonzero(is_end[:-1])
    stats = {"num_tokens": float(n), "max_tokens": float(sampling.max_tokens)}
    if n > sampling.max_tokens:
        return Finding("bad_termination", f"{n} tokens exceed max_tokens={sampling.max_tokens}", stats)
    if early.size:
        return Finding("bad_termination", f"EOS / stop token at position {int(early[0])} is followed by more tokens", stats)
    if FinishReason(finish_reason) == FinishReason.stop:
        if not is_end[-1]:
            return Finding("bad_termination", f"finish_reason=stop but the last token {int(ids[-1])} is not EOS or a stop token", stats)
    elif n != sampling.max_tokens:
        return Finding("bad_termination", f"finish_reason=length with {n} tokens, max_tokens is {sampling.max_tokens}", stats)
    elif is_end[-1]:  # vLLM checks EOS / stop tokens before the length cap: this ends as "stop"
        return Finding("bad_termination", f"finish_reason=length but the last token {int(ids[-1])} is EOS or a stop token", stats)
    return None
