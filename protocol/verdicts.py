"""The verdict on a submission: accepted with its trusted rewards, or rejected with the reasons.

The orchestrator answers a worker's `GET /v1/rollouts/{submission_id}` with a `Verdict`; the verifier
makes it. Wire rules as in `protocol.models`.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import numpy as np
from pydantic import Field

from protocol.models import Id, Message, WireModel


class RejectionCode(str, Enum):
    proof_mismatch = "proof_mismatch"  # hidden states do not match the claimed model / version / prompt
    proof_malformed = "proof_malformed"
    logprob_mismatch = "logprob_mismatch"
    token_outside_support = "token_outside_support"  # not allowed by temperature / top-p / top-k
    not_seeded_draw = "not_seeded_draw"  # a token that the leased seed does not draw (beyond a near tie)
    token_implausible = "token_implausible"  # no longer given (the draw replay covers it); old verdicts keep it
    bad_termination = "bad_termination"  # finish_reason does not match the tokens
    wrong_model_hash = "wrong_model_hash"
    lease_mismatch = "lease_mismatch"
    reward_error = "reward_error"  # the trusted side could not score it (e.g. a NaN reward): not the worker's fault
    verification_failed = "verification_failed"  # the verifier failed on it again and again (crash, timeout)
    env_mismatch = "env_mismatch"  # multi-turn: environment positions that the trusted replay does not write
    episode_incomplete = "episode_incomplete"  # multi-turn: the episode stops where the environment goes on
    tool_failed = "tool_failed"  # multi-turn: the trusted replay of a tool call timed out, crashed or raised


# Rejections that are the trusted side's own failure: the worker gets no strike for them. A tool call is the
# policy's own draws on a deep check (those are checked too, and strike on their own), and the trusted tool's
# failure on them is not the worker's doing; what it costs the pool is bounded per submission
# (RewardPoolConfig.group_failure_budget).
NO_STRIKE = frozenset({RejectionCode.reward_error, RejectionCode.verification_failed, RejectionCode.tool_failed})


class Rejection(WireModel):
    code: RejectionCode
    message: Message
    completion_index: int | None = None
    chunk_index: int | None = None
    # Per-chunk statistics behind the decision (e.g. exponent mismatches, mantissa mean / median error).
    stats: Annotated[dict[str, float], Field(max_length=32)] = {}


class VerdictStatus(str, Enum):
    pending = "pending"
    accepted = "accepted"
    rejected = "rejected"


class RewardStatus(str, Enum):
    """How a completion's trusted reward came out (verifier.reward_pool); all but ok give reward 0."""

    ok = "ok"
    error = "error"  # the reward code raised or gave no number in [0, 1]: the run's reward is at fault
    timed_out = "timed_out"  # past the per-completion time limit
    crashed = "crashed"  # the reward process died on it
    skipped = "skipped"  # its submission already spent its budget of timeouts and crashes


# Rewards the trusted side could not compute. A verified completion's text is the policy's draw, not the
# worker's choice, so (like RejectionCode.tool_failed) this never charges the worker: the completion's
# GRPO group is dropped instead of trained with a made-up 0 (orchestrator.buffer.build_groups).
# A reward that raised or gave no usable number (error) is the same: the scorer failed on the policy's text.
UNSCORED_REWARD_STATUS = frozenset({RewardStatus.error, RewardStatus.timed_out, RewardStatus.crashed,
    RewardStatus.skipped})


class Verdict(WireModel):
    submission_id: Id
    status: VerdictStatus
    rejections: Annotated[list[Rejection], Field(max_length=1024)] = []
    # Trusted rewards, one per completion, in submission order. Only set when accepted.
    rewards: list[float] | None = None
    # How each reward came out, in the same order; None: all ok (or a verdict from before reward statuses).
    reward_status: list[RewardStatus] | None = None
    verified_tokens: int = 0
    # Tokens accepted that are not the seed's exact winner on the verifier's logits (near ties within the
    # margin, picks at the support's boundary within the slacks), and the largest near tie's margin in
    # logits: numerical noise, held per worker to the rate noise explains.
    near_ties: int = 0
    max_draw_margin: float = 0.0
    # the near ties noise explains here: the dtype's rate x the positions that offered a choice
    near_tie_allowance: float = 0.0
    # Trusted side only (never serialized, so never sent or stored as JSON): per completion, the
    # verifier's tempered logprobs of its tokens, the behaviour logprobs the trainer uses. None when the
    # submission was not spot-checked.
    behaviour_logprobs: list[np.ndarray] | None = Field(None, exclude=True)
