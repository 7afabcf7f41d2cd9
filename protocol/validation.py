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


def check_completions(comps: list[Any], info: ValidationInfo, numbered: bool = True) -> None:
    """Every rule of Completion (`comps` are protocol.models.Completion), over many completions at once: one numpy pass per value rule; the
    error names the first completion that breaks one (`completion {i}: ` when `numbered`).

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
        if n_lp != n:
            raise ValueError(f"{where(i)}{n} tokens but {n_lp} logprobs")
        if len(c.proofs) != -(-n // chunk):
            raise ValueError(f"{where(i)}{n} tokens need {-(-n // chunk)} proofs, got {len(c.proofs)}")
    if from_json:
        ends = list(itertools.accumulate(counts))
        for c, a, b in zip(comps, [0, *ends], ends):  # all checked above: set without re-validation
            c.__dict__["token_ids"], c.__dict__["logprobs"] = ids[a:b], lps[a:b]
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
