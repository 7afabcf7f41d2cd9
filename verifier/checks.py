"""Draw, logprob and termination checks of one completion against the trusted recomputation.

Definitions (what the worker must send, see inference_worker/engine.py):
- Every token is the seeded draw of `protocol.sampling`: the winner of an exponential race over the
  lease's support (logits / temperature, top-k, then top-p) with noise from the sample's leased seed.
  The verifier replays each draw on its own logits (`verifier.reference.prefill`): a token that is not
  the seed's winner passes only as a near tie, when the winner's score beats it by no more than
  `draw_margin` logits (numerical noise between the worker's logits and ours), and only if it is inside
  the support widened by the slacks. Temperature 0 means greedy: the winner is the argmax.
- `Completion.logprobs[t]` is the *raw* log-probability of token t: log_softmax(logits) at temperature
  1, before temperature, top-k and top-p. That is what vLLM reports by default
  (`logprobs_mode="raw_logprobs"`); it is checked against ours, and the trainer never uses it (the
  behaviour logprobs it learns from are the verifier's tempered ones, `TokenStats.tempered_logprob`).
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
    """Per completion token statistics of the trusted recomputation (float64 numpy, [T])."""

    logprob: np.ndarray  # raw log-softmax of the sampled token
    tempered_logprob: np.ndarray  # log-probability under logits / temperature (1 when greedy), untruncated

    def __len__(self) -> int:
        return int(self.logprob.shape[0])

    def slice(self, start: int, stop: int) -> "TokenStats":
        return TokenStats(self.logprob[start:stop], self.tempered_logprob[start:stop])

    @staticmethod
    def concat(parts: list["TokenStats"]) -> "TokenStats":
        if len(parts) == 1:
            return parts[0]
        return TokenStats(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("logprob", "tempered_logprob")))


def token_stats(logits: torch.Tensor, tokens: torch.Tensor, sampling: SamplingParams) -> TokenStats:
    """Statistics of `tokens` [T] under `logits` [T, V] (any float dtype and device; computed in float32
    where the logits are, and only the [T] results copied to the host)."""
    logits = logits.float()
    tokens = tokens.long().view(-1, 1)
    logprob = torch.log_softmax(logits, dim=-1).gather(1, tokens).squeeze(1)
    temp = sampling.temperature if sampling.temperature > 0 else 1.0
    tempered = logprob if temp == 1.0 else torch.log_softmax(logits / temp, dim=-1).gather(1, tokens).squeeze(1)
    return TokenStats(logprob=logprob.double().cpu().numpy(), tempered_logprob=tempered.double().cpu().numpy())


@dataclass
class Draw:
    """The seeded draw replayed on the trusted logits (protocol.sampling.replay), per completion token."""

    winner: np.ndarray  # int64 [T]: the token the seed draws here
    margin: np.ndarray  # float64 [T]: score(winner) - score(claimed) in logit units (0 when they agree)
    inside: np.ndarray  # bool [T]: the claimed token is in the sampling support (within the slacks)
    scale: np.ndarray  # float64 [T]: max(|logit of the winner|, |logit of the claimed token|), raw logits
    exact: np.ndarray | None = None  # int64 [T]: the winner over our own support, no slack (None: `winner`)
    choice: np.ndarray | None = None  # bool [T]: more than one token would pass here (None: not computed, none)

    def __post_init__(self) -> None:
        if self.exact is None:
            self.exact = self.winner
        if self.choice is None:
            self.choice = np.zeros(self.winner.shape, dtype=bool)

    def __len__(self) -> int:
        return int(self.winner.shape[0])

    def take(self, index) -> "Draw":
        """The positions `index` (a slice, or an index array) of every field."""
        return Draw(*(getattr(self, f)[index] for f in DRAW_FIELDS))

    def slice(self, start: int, stop: int) -> "Draw":
        return self.take(slice(start, stop))

    @staticmethod
    def concat(parts: list["Draw"]) -> "Draw":
        if len(parts) == 1:
            return parts[0]
        return Draw(*(np.concatenate([getattr(p, f) for p in parts]) for f in DRAW_FIELDS))


DRAW_FIELDS = ("winner", "margin", "inside", "scale", "exact", "choice")


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
            f"reported logprobs disagree with the recomputation: |diff| {diff[worst]:.3g} at token {worst} (limit "
            f"{max_abs_diff})",
            {"max_abs_diff": float(diff[worst]), "token_index": float(worst)},
        )
    return None


# The submission mean forgives one outlier token this many times its limit: honest outliers seen were
# ~5x (fp32: 1.08e-4 against 2e-5, a trained model) and ~2x (bf16: 0.018 against 0.01, batch 1), while
# fp16 claimed as fp32 (mean >= 5e-5 per token) still fails any submission of 7 tokens or more.
OUTLIER_ALLOWANCE = 10.0


def check_logprob_mean(diff_sum: float, tokens: int, max_mean_diff: float) -> Finding | None:
    """Over a whole submission: systematic drift (another dtype, other weights) shows in the mean.

    Over a submission, not per completion: a short completion's mean is one token's noise divided by
    a handful, and an honest worker's rare outlier token (seen at 1e-4 on a trained model, CPU) then
    failed a 4-token completion's mean while honest submissions' means stay ~1e-7. For the same reason
    a short submission's limit leaves room for one outlier: max_mean_diff * (1 + OUTLIER_ALLOWANCE / n),
    i.e. the sum of |diff| may reach n * max_mean_diff plus one outlier token. Honest bf16 submissions of
    1 to 3 tokens (batch 1, a trained model) had means of 0.011 to 0.018 against 0.01."""
    n = max(tokens, 1)
    mean = diff_sum / n
    limit = max_mean_diff * (1.0 + OUTLIER_ALLOWANCE / n)
    if mean > limit:
        return Finding(
            "logprob_mismatch",
            f"reported logprobs drift from the recomputation: mean |diff| {mean:.3g} over {tokens} tokens (limit "
            f"{limit:.3g})",
            {"mean_abs_diff": mean, "tokens": float(tokens), "limit": limit},
        )
    return None


@dataclass
class DrawReport:
    """What the replay of one completion's draws found (the service sums it over a submission)."""

    finding: "Finding | None"
    # Accepted tokens that are not the seed's exact winner on our logits: near ties and picks at the
    # support's boundary. Each is a place where an honest worker's noise and a dishonest worker's choice
    # look alike, so every one is counted (a worker's count is held to what noise explains).
    near_ties: int
    max_margin: float  # the largest margin of those that lost the draw (0 when there are none)
    choices: int = 0  # positions where more than one token would pass: honest noise deviates at few of them


def check_draws(draw: Draw, token_ids: np.ndarray, draw_margin: float, draw_margin_rel: float = 0.0) -> DrawReport:
    """Every token must be the seed's winner, or a near tie, inside the support. A near tie loses by no
    more than draw_margin + draw_margin_rel * |logit| (logits): rounding noise grows with the logits'
    size, and a model whose logits reach 20 rounds them to bf16 in steps of 0.06."""
    ids = np.asarray(token_ids, dtype=np.int64)
    tolerance = draw_margin + draw_margin_rel * draw.scale
    not_winner = draw.winner != ids
    outside = ~draw.inside
    too_far = not_winner & (draw.margin > tolerance)
    # Accepted but not our exact draw: a near tie (lost by a margin within the tolerance), a token of the
    # boundary band that beat the tightened support (margin <= 0), or the tightened winner where our
    # exact winner sits in the band. All counted: none of them is a free choice.
    deviated = (draw.exact != ids) & ~too_far & ~outside
    near = not_winner & deviated & (draw.margin > 0)
    near_ties = int(deviated.sum())
    max_margin = float(draw.margin[near].max()) if near.any() else 0.0
    finding = None
    if outside.any():
        t = int(np.argmax(outside))
        finding = Finding(
            "token_outside_support",
            f"{int(outside.sum())} token(s) outside the lease's sampling support (temperature / top-k / top-p); first "
            f"at token {t}",
            {"token_index": float(t), "token": float(ids[t])},
        )
    elif too_far.any():
        t = int(np.argmax(too_far))
        finding = Finding(
            "not_seeded_draw",
            f"{int(too_far.sum())} token(s) are not the draw of the leased seed; first at token {t}: the seed draws "
            f"{int(draw.winner[t])}, not {int(ids[t])}, by a margin of {draw.margin[t]:.3g} logits (tolerance "
            f"{tolerance[t]:.3g})",
            {"token_index": float(t), "margin": float(draw.margin[t]), "tolerance": float(tolerance[t]),
             "winner": float(draw.winner[t]), "token": float(ids[t]), "tokens_not_drawn": float(too_far.sum())},
        )
    return DrawReport(finding, near_ties, max_margin, int(draw.choice.sum()))


def check_termination(token_ids: np.ndarray, finish_reason: FinishReason, sampling: SamplingParams,
    eos_ids: set[int]) -> Finding | None:
    ids = np.asarray(token_ids)
    n = int(ids.size)
    enders = np.array(sorted(set(eos_ids) | set(sampling.stop_token_ids)), dtype=np.int64)
    is_end = np.isin(ids, enders)
    early = np.flatnonzero(is_end[:-1])
    stats = {"num_tokens": float(n), "max_tokens": float(sampling.max_tokens)}
    if n > sampling.max_tokens:
        return Finding("bad_termination", f"{n} tokens exceed max_tokens={sampling.max_tokens}", stats)
    if early.size:
        return Finding("bad_termination", f"EOS / stop token at position {int(early[0])} is followed by more tokens",
            stats)
    if FinishReason(finish_reason) == FinishReason.stop:
        if not is_end[-1]:
            return Finding("bad_termination",
                f"finish_reason=stop but the last token {int(ids[-1])} is not EOS or a stop token", stats)
    elif n != sampling.max_tokens:
        return Finding("bad_termination", f"finish_reason=length with {n} tokens, max_tokens is {sampling.max_tokens}",
            stats)
    elif is_end[-1]:  # vLLM checks EOS / stop tokens before the length cap: this ends as "stop"
        return Finding("bad_termination",
            f"finish_reason=length but the last token {int(ids[-1])} is EOS or a stop token", stats)
    return None
