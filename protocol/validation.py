"""Batched validation of a submission's completions: every rule of `Completion`, checked once over all
the completions of a `RolloutSubmission` (one numpy pass per rule) instead of ~6 small numpy calls per
completion. `protocol.models` calls these from its validators; the rules themselves are listed in
`check_completions`.
"""

from __future__ import annotations

import itertools
from contextvars import ContextVar
from typing import Any

import numpy as np
from pydantic import ValidationInfo

from protocol import limits
from protocol.arrays import PackedArray

# Deferred: `check_completions` turns them into arrays, for a whole submission in one numpy call each.
COMPLETION_TOKENS = PackedArray("int32", limits.MAX_COMPLETION_TOKENS, deferred=True)
LOGPROBS = PackedArray("float32", limits.MAX_COMPLETION_TOKENS, deferred=True)
# Multi-turn episodes: 1 where the environment wrote the token, 0 where the model sampled it.
ENV_MASK = PackedArray("uint8", limits.MAX_COMPLETION_TOKENS)

# Set while a RolloutSubmission validates its completions: their checks (and, from JSON, the making of
# their arrays) are then done once for all of them, in one numpy pass per rule, instead of ~6 small
# numpy calls per completion. A ContextVar, so it is per thread / task.
IN_SUBMISSION: ContextVar[bool] = ContextVar("protocol_in_submission", default=False)


def check_token_ids(ids: np.ndarray, info: ValidationInfo, what: str) -> np.ndarray:
    if ids.size and int(ids.min()) < 0:
        raise ValueError(f"{what}: negative token id {int(ids.min())}")
    vocab = (info.context or {}).get("vocab_size")
    if vocab is not None and ids.size and int(ids.max()) >= vocab:
        raise ValueError(f"{what}: token id {int(ids.max())} is outside the vocabulary of {vocab}")
    return ids


def check_logprobs(v: np.ndarray, where: str) -> np.ndarray:
    if v.size and not np.isfinite(v).all():
        raise ValueError(f"{where}logprobs contain NaN or infinity at index {int(np.argmin(np.isfinite(v)))}")
    if v.size and float(v.max()) > 0.0:
        raise ValueError(f"{where}logprobs must be <= 0, got {float(v.max())} at index {int(np.argmax(v))}")
    return v


def model_turn_count(env_mask: np.ndarray) -> int:
    """Runs of model positions (0s) in an env mask."""
    m = np.asarray(env_mask, dtype=np.int8)
    return int(m.size and (m[0] == 0)) + int(np.count_nonzero((m[1:] == 0) & (m[:-1] == 1)))


def check_episode(env_mask: np.ndarray | None, turn_finish_reasons: list | None, n: int, where: str,
    finish_reason: Any = None) -> int:
    """A multi-turn completion's shape: one mask value (0 or 1) per token, model tokens first and last
    (an episode starts with a model turn and ends after one), one finish reason per model turn. Returns the
    number of model tokens, which the logprobs and proofs cover."""
    if env_mask is None or turn_finish_reasons is None:
        raise ValueError(f"{where}env_mask and turn_finish_reasons come together (a multi-turn episode) or not at all")
    if env_mask.size != n:
        raise ValueError(f"{where}env_mask has {env_mask.size} values for {n} tokens")
    if env_mask.size and int(env_mask.max()) > 1:
        raise ValueError(f"{where}env_mask values must be 0 (model) or 1 (environment), got {int(env_mask.max())} at "
            f"index {int(np.argmax(env_mask > 1))}")
    if env_mask[0] != 0 or env_mask[-1] != 0:
        raise ValueError(
            f"{where}an episode starts and ends with a model turn (env_mask[0] and env_mask[-1] must be 0)")
    turns = model_turn_count(env_mask)
    if turns > limits.MAX_EPISODE_TURNS:
        raise ValueError(f"{where}{turns} model turns exceed {limits.MAX_EPISODE_TURNS}")
    if len(turn_finish_reasons) != turns:
        raise ValueError(f"{where}{turns} model turns but {len(turn_finish_reasons)} turn finish reasons")
    if finish_reason is not None and turn_finish_reasons[-1] != finish_reason:
        raise ValueError(f"{where}finish_reason {finish_reason} is not the last turn's ({turn_finish_reasons[-1]})")
    return int(n - np.count_nonzero(env_mask))


def check_completions(comps: list[Any], info: ValidationInfo, numbered: bool = True) -> None:
    """Every rule of Completion (`comps` are protocol.models.Completion), over many completions at once: one numpy pass
    per value rule; the error names the first completion that breaks one (`completion {i}: ` when `numbered`).

    From JSON, token ids and logprobs arrive as their decoded bytes (deferred PackedArrays) and leave as
    read-only views of one array per kind, made here in one numpy call each."""
    where = (lambda i: f"completion {i}: ") if numbered else (lambda i: "")
    from_json = type(comps[0].token_ids) is bytes
    if from_json:
        field = "token_ids"
        try:
            counts = COMPLETION_TOKENS.counts([c.token_ids for c in comps])
            field = "logprobs"
            lp_counts = LOGPROBS.counts([c.logprobs for c in comps])
        except ValueError as exc:
            i, reason = exc.args
            raise ValueError(f"{where(i)}{field}: {reason}") from None
        ids = COMPLETION_TOKENS.from_wire(b"".join([c.token_ids for c in comps]))
        lps = LOGPROBS.from_wire(b"".join([c.logprobs for c in comps]))
    else:
        counts = [c.token_ids.size for c in comps]
        lp_counts = [c.logprobs.size for c in comps]
    chunk = limits.PROOF_CHUNK_TOKENS
    for i, (c, n, n_lp) in enumerate(zip(comps, counts, lp_counts)):
        if n == 0:
            raise ValueError(f"{where(i)}completion has no tokens")
        what = "tokens"
        if c.env_mask is not None or c.turn_finish_reasons is not None:
            # logprobs and proofs cover model tokens only
            n = check_episode(c.env_mask, c.turn_finish_reasons, n, where(i), c.finish_reason)
            what = "model tokens"
        if n_lp != n:
            raise ValueError(f"{where(i)}{n} {what} but {n_lp} logprobs")
        if len(c.proofs) != -(-n // chunk):
            raise ValueError(f"{where(i)}{n} tokens need {-(-n // chunk)} proofs, got {len(c.proofs)}")
    if from_json:
        ends = list(itertools.accumulate(counts))
        lp_ends = list(itertools.accumulate(lp_counts))  # an episode's logprobs cover its model tokens only
        # all checked above: set without re-validation
        for c, a, b, la, lb in zip(comps, [0, *ends], ends, [0, *lp_ends], lp_ends):
            c.__dict__["token_ids"], c.__dict__["logprobs"] = ids[a:b], lps[la:lb]
    else:
        ids = np.concatenate([c.token_ids for c in comps])
        lps = np.concatenate([c.logprobs for c in comps])
    vocab = (info.context or {}).get("vocab_size")
    if int(ids.min()) < 0 or (vocab is not None and int(ids.max()) >= vocab):
        for i, c in enumerate(comps):
            check_token_ids(c.token_ids, info, f"completion {i}" if numbered else "completion")
    if not np.isfinite(lps).all() or float(lps.max()) > 0.0:
        for i, c in enumerate(comps):
            check_logprobs(c.logprobs, where(i))
