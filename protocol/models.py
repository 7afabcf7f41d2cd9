"""Pydantic models of everything that crosses the trust boundary: the shared field types and `WireModel`,
errors, and what a worker and the orchestrator exchange (registration, heartbeats, leases, rollouts).
The verdict on a submission is in `protocol.verdicts`, the operator API's records in
`protocol.operator_models`; `protocol` (the package) exports all three.

Rules every model keeps:
- unknown fields are an error (`extra="forbid"`), so a typo or an injected field never passes silently;
- every size is bounded by a constant from `protocol.limits`;
- token ids are checked against the vocabulary when the caller passes `context={"vocab_size": V}`
  to `model_validate` / `model_validate_json`.
"""

from __future__ import annotations

import unicodedata
from enum import Enum
from typing import Annotated, Any

import numpy as np
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from protocol import limits
from protocol.arrays import PackedArray
from protocol.validation import COMPLETION_TOKENS, ENV_MASK, IN_SUBMISSION, LOGPROBS, check_completions, check_token_ids

Id = Annotated[str, Field(min_length=1, max_length=limits.MAX_ID_CHARS, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")]
Sha256Hex = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
Message = Annotated[str, Field(max_length=limits.MAX_MESSAGE_CHARS)]
Version = Annotated[int, Field(ge=0, le=2**31 - 1)]
# A run's identity, signed into every policy manifest: the run config's name plus a part made once per run.
RunId = Annotated[str, Field(min_length=1, max_length=limits.MAX_RUN_ID_CHARS, pattern=r"^[\w.:-]+$")]
PromptTokens = Annotated[np.ndarray, PackedArray("int32", limits.MAX_PROMPT_TOKENS)]
# Deferred: the batched checks of protocol.validation turn them into arrays.
CompletionTokens = Annotated[np.ndarray, COMPLETION_TOKENS]
Logprobs = Annotated[np.ndarray, LOGPROBS]
EnvMask = Annotated[np.ndarray, ENV_MASK]


def _absent(value: Any) -> bool:
    return value is None


# An optional field added later: left out of the JSON when unset, so older messages stay byte-identical.
Later = dict(default=None, exclude_if=_absent)


class WireModel(BaseModel):
    # Bytes travel as base64 in JSON (proofs, and PackedArray's arrays, which pydantic-core decodes).
    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, ser_json_inf_nan="constants",
        ser_json_bytes="base64", val_json_bytes="base64")

    def to_json(self) -> str:
        return self.model_dump_json()


class ErrorCode(str, Enum):
    invalid_request = "invalid_request"
    unauthorized = "unauthorized"
    forbidden = "forbidden"
    banned = "banned"
    not_found = "not_found"
    lease_expired = "lease_expired"
    lease_mismatch = "lease_mismatch"
    version_too_old = "version_too_old"
    duplicate = "duplicate"
    payload_too_large = "payload_too_large"
    rate_limited = "rate_limited"
    too_many_leases = "too_many_leases"
    unsupported_encoding = "unsupported_encoding"
    timeout = "timeout"  # the request took longer than the server allows; safe to retry
    too_many_identities = "too_many_identities"  # the join token has as many live workers as it may have


class ErrorBody(WireModel):
    error: ErrorCode
    detail: Message
    # For version_too_old: the lowest policy version the orchestrator accepts now.
    min_policy_version: Version | None = None
    retry_after_s: float | None = None


# --------------------------------------------------------------------------------------------------
# Workers: registration and heartbeat


def _nfkc(value: Any) -> Any:
    """Unicode compatibility normalization before the ASCII patterns below: a fullwidth 'ａｄｍｉｎ' is
    stored as 'admin', and anything that stays outside the safe set is refused."""
    return unicodedata.normalize("NFKC", value) if isinstance(value, str) else value


SafeName = Annotated[str, BeforeValidator(_nfkc), Field(min_length=1, max_length=limits.MAX_NAME_CHARS,
    pattern=r"^[A-Za-z0-9][A-Za-z0-9_.@-]*$")]


class WorkerRegistration(WireModel):
    name: SafeName
    client_version: Annotated[str, Field(max_length=32, pattern=r"^[A-Za-z0-9_.+-]*$")] = "0"
    device: Annotated[str, BeforeValidator(_nfkc), Field(max_length=64, pattern=r"^[ -~]*$")] = "cpu"  # printable ASCII


class Credit(WireModel):
    """A join token's record over the run, all its workers (past registrations too): a volunteer's credit."""

    accepted: Annotated[int, Field(ge=0)] = 0  # submissions
    rejected: Annotated[int, Field(ge=0)] = 0
    verified_tokens: Annotated[int, Field(ge=0)] = 0  # tokens of accepted submissions


class WorkerRegistered(WireModel):
    worker_id: Id
    # Bearer secret for every later request. The orchestrator stores only its hash.
    secret: Annotated[str, Field(min_length=16, max_length=256)]
    heartbeat_interval_s: Annotated[float, Field(gt=0)]
    async_level: Annotated[int, Field(ge=0)]
    policy_version: Version
    # Where to pull weights from, and the key that signs every manifest (base64 raw ed25519 public key).
    relay_urls: Annotated[list[Annotated[str, Field(max_length=512)]], Field(max_length=64)]
    manifest_public_key: Annotated[str, Field(max_length=128)]
    # The run every manifest must name: a manifest signed by the same key in another run is refused.
    run_id: RunId
    # The shardcast origin: the fallback when relays lie, stall or lack a version ("" if not reachable).
    origin_url: Annotated[str, Field(max_length=512)] = ""
    # The model hash of policy_version (None before the first publish): the worker takes only that version's
    # manifest with this hash, so a relay replaying a re-published version's earlier (signed) manifest is refused.
    policy_model_hash: Sha256Hex | None = None
    # The join token's credit before this registration: a restarted worker with the same token carries on from it.
    credit: Credit = Credit()


class ModelFile(WireModel):
    """One of the run's base model files that are not weights (config, tokenizer), as the run serves it."""

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]
    size: Annotated[int, Field(ge=0, le=1 << 30)]
    sha256: Sha256Hex


class ModelFiles(WireModel):
    files: Annotated[list[ModelFile], Field(max_length=32)]


class WorkerState(str, Enum):
    starting = "starting"
    downloading = "downloading"
    generating = "generating"
    idle = "idle"
    draining = "draining"
    stopped = "stopped"  # the last heartbeat of a worker that stops cleanly: its secret is revoked


class Heartbeat(WireModel):
    state: WorkerState
    loaded_policy_version: Version | None = None
    tokens_per_s: Annotated[float, Field(ge=0, le=1e9, allow_inf_nan=False)] = 0.0


class HeartbeatAck(WireModel):
    policy_version: Version
    min_policy_version: Version
    heartbeat_interval_s: Annotated[float, Field(gt=0)]
    policy_model_hash: Sha256Hex | None = None  # as in WorkerRegistered


# --------------------------------------------------------------------------------------------------
# Open join: a join token for a solved puzzle (protocol.join_puzzle), where the run allows it

JoinChallengeText = Annotated[str, Field(min_length=1, max_length=128, pattern=r"^[0-9a-f.]+$")]


class JoinChallengeRequest(WireModel):
    """Asks for a puzzle. No fields: a POST only so that no cache in between hands one puzzle to many."""


class JoinChallenge(WireModel):
    challenge: JoinChallengeText
    difficulty_bits: Annotated[int, Field(ge=0, le=64)]
    expires_in_s: Annotated[float, Field(gt=0)]  # from when it was sent: no clock is shared


class JoinClaim(WireModel):
    challenge: JoinChallengeText
    solution: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9]+$")]


class JoinTokenClaimed(WireModel):
    token: Annotated[str, Field(min_length=16, max_length=256)]  # shown once; register with it like a minted one
    token_id: Id


# --------------------------------------------------------------------------------------------------
# Tasks and leases


class SamplingParams(WireModel):
    temperature: Annotated[float, Field(ge=0.0, le=10.0, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(ge=-1, le=limits.MAX_VOCAB_SIZE)] = -1  # -1 disables top-k
    max_tokens: Annotated[int, Field(ge=1, le=limits.MAX_COMPLETION_TOKENS)] = 64
    stop_token_ids: Annotated[list[Annotated[int, Field(ge=0)]], Field(max_length=limits.MAX_STOP_TOKEN_IDS)] = []

    @field_validator("top_k")
    @classmethod
    def _top_k_not_zero(cls, v: int) -> int:
        if v == 0:
            raise ValueError("top_k must be -1 (disabled) or >= 1")
        return v


class TaskPrompt(WireModel):
    prompt_id: Id
    token_ids: PromptTokens
    # One seed per sample, chosen by the orchestrator so that sampling is reproducible.
    seeds: Annotated[list[Annotated[int, Field(ge=0, lt=2**63)]], Field(min_length=1,
        max_length=limits.MAX_SAMPLES_PER_PROMPT)]
    # Multi-turn leases: the task item the worker's copy of the environment answers from (JSON, written by
    # environments.registry.item_to_wire). The verifier replays the environment from its own trusted item.
    env_item: Annotated[str | None, Field(max_length=limits.MAX_ENV_ITEM_CHARS, **Later)]

    @field_validator("token_ids")
    @classmethod
    def _tokens(cls, v: np.ndarray, info: ValidationInfo) -> np.ndarray:
        if v.size == 0:
            raise ValueError("prompt has no tokens")
        return check_token_ids(v, info, "prompt")


class TaskLease(WireModel):
    lease_id: Id
    prompts: Annotated[list[TaskPrompt], Field(min_length=1, max_length=limits.MAX_PROMPTS_PER_TASK)]
    samples_per_prompt: Annotated[int, Field(ge=1, le=limits.MAX_SAMPLES_PER_PROMPT)]
    sampling: SamplingParams
    policy_version: Version  # the orchestrator's current version when the lease was issued
    min_policy_version: Version  # generation must use at least this version
    deadline: Annotated[float, Field(gt=0, allow_inf_nan=False)]  # unix seconds
    # The version the worker said it had loaded when it asked: generate with exactly this one. A worker
    # that could pick the version after seeing the seeds could keep the best of several draws.
    # None: a lease issued before versions were pinned (any version from min_policy_version on).
    generation_version: Version | None = None
    # A multi-turn lease: the environment (environments.registry) that answers each model turn. Then
    # `sampling.max_tokens` caps the whole episode (model and environment tokens); the environment's own
    # limits cap turns and tokens per turn. None: single-turn.
    environment: Annotated[Id | None, Field(**Later)]

    @model_validator(mode="after")
    def _consistent(self) -> "TaskLease":
        if self.min_policy_version > self.policy_version:
            raise ValueError("min_policy_version is above policy_version")
        if self.generation_version is not None and self.generation_version < self.min_policy_version:
            raise ValueError("generation_version is below min_policy_version")
        for p in self.prompts:
            if len(p.seeds) != self.samples_per_prompt:
                raise ValueError(f"prompt {p.prompt_id}: {len(p.seeds)} seeds for {self.samples_per_prompt} samples")
        return self

    @property
    def num_completions(self) -> int:
        return len(self.prompts) * self.samples_per_prompt


class LeaseRequest(WireModel):
    loaded_policy_version: Version
    max_prompts: Annotated[int, Field(ge=1, le=limits.MAX_PROMPTS_PER_TASK)] = 1
    # Idempotency key: a retried request (the answer to the first one was lost) gets the same open
    # lease back instead of a second one that the worker would never know it holds.
    request_id: Id | None = None
    # When the run's generation budget is full: how long the server may hold this request until room
    # frees up (a verdict, a trained batch, a lease given back), instead of answering "none now" at once
    # and leaving the worker to guess when to ask again. 0: answer at once.
    wait_s: Annotated[float, Field(ge=0, le=limits.MAX_LEASE_WAIT_S)] = 0.0


class LeaseResponse(WireModel):
    lease: TaskLease | None = None
    # When no task is available: how long to wait before asking again.
    retry_after_s: Annotated[float, Field(ge=0)] = 0.0


class ReleaseRequest(WireModel):
    reason: Message = ""


class ReleaseAck(WireModel):
    lease_id: Id
    released: bool


# --------------------------------------------------------------------------------------------------
# Rollouts


class FinishReason(str, Enum):
    stop = "stop"  # ended on EOS or a stop token, which is the last token
    length = "length"  # hit max_tokens exactly


ProofBlob = Annotated[bytes, Field(min_length=1, max_length=limits.MAX_PROOF_BYTES)]


class Completion(WireModel):
    """One sample of a lease. Single-turn: `token_ids` are the sampled tokens, and `logprobs` and `proofs`
    cover all of them. Multi-turn (a lease with an environment): `token_ids` are the whole episode after
    the prompt, model turns and environment observations interleaved; `env_mask` marks which positions the
    environment wrote (1) and which the model sampled (0); `logprobs` and `proofs` cover the model-sampled
    positions only, in order; `turn_finish_reasons` has one entry per model turn and `finish_reason` is the
    last turn's. The seeded-draw position of a model token is its index in the episode."""

    prompt_index: Annotated[int, Field(ge=0, lt=limits.MAX_PROMPTS_PER_TASK)]
    sample_index: Annotated[int, Field(ge=0, lt=limits.MAX_SAMPLES_PER_PROMPT)]
    token_ids: CompletionTokens
    logprobs: Logprobs  # logprob of each sampled token under the behaviour policy
    finish_reason: FinishReason
    # One TOPLOC-style proof per PROOF_CHUNK_TOKENS generated tokens (the last chunk may be partial).
    proofs: Annotated[list[ProofBlob], Field(max_length=limits.MAX_COMPLETION_TOKENS // limits.PROOF_CHUNK_TOKENS + 1)]
    env_mask: Annotated[EnvMask | None, Field(**Later)]
    turn_finish_reasons: Annotated[list[FinishReason] | None, Field(max_length=limits.MAX_EPISODE_TURNS, **Later)]

    @property
    def model_positions(self) -> np.ndarray:
        """Indices of the model-sampled tokens in `token_ids` (all of them for a single-turn completion)."""
        n = int(np.asarray(self.token_ids).size)
        return np.arange(n) if self.env_mask is None else np.flatnonzero(np.asarray(self.env_mask) == 0)

    @model_validator(mode="after")
    def _values(self, info: ValidationInfo) -> "Completion":
        if not IN_SUBMISSION.get():  # inside a RolloutSubmission: checked there, with all the others
            check_completions([self], info, numbered=False)
        return self


class RolloutSubmission(WireModel):
    lease_id: Id
    policy_version: Version  # the version the worker claims it generated with
    model_hash: Sha256Hex  # hash of the weights it generated with (PolicyManifest.model_hash)
    completions: Annotated[list[Completion], Field(min_length=1, max_length=limits.MAX_COMPLETIONS_PER_SUBMISSION)]

    @model_validator(mode="wrap")
    @classmethod
    def _batched_checks(cls, data: Any, handler: Any, info: ValidationInfo) -> "RolloutSubmission":
        token = IN_SUBMISSION.set(True)
        try:
            sub = handler(data)
        finally:
            IN_SUBMISSION.reset(token)
        check_completions(sub.completions, info)
        return sub

    @model_validator(mode="after")
    def _unique(self) -> "RolloutSubmission":
        seen: set[tuple[int, int]] = set()
        for c in self.completions:
            key = (c.prompt_index, c.sample_index)
            if key in seen:
                raise ValueError(f"completion for prompt {key[0]} sample {key[1]} appears twice")
            seen.add(key)
        return self

    @property
    def num_tokens(self) -> int:
        """Every token after the prompts, environment observations included (what a prefill costs)."""
        return sum(int(c.token_ids.size) for c in self.completions)

    @property
    def model_tokens(self) -> int:
        """The tokens the model sampled (what the worker generated, the ledger's verified tokens)."""
        return sum(int(c.token_ids.size if c.env_mask is None else (np.asarray(c.env_mask) == 0).sum())
            for c in self.completions)


class SubmissionReceipt(WireModel):
    submission_id: Id
    lease_id: Id
    num_completions: int


Json = dict[str, Any]
