"""TrainSample: one verified completion, as the trainer consumes it, and the decoding of the
orchestrator's batches (`protocol.batches`) into samples."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from protocol.arrays import from_le_bytes
from protocol.batches import GROUP_ARRAYS, SampleGroup


@dataclass
class TrainSample:
    """A verified completion with its group advantage.

    behaviour_logprobs are the worker's per-token logprobs of completion_ids under the policy version
    that generated them (behaviour_version); the trainer uses them for the truncated importance weight.

    loss_mask (multi-turn episodes): True where the model sampled the token, False where the environment
    wrote it; only the model's tokens enter the loss, the entropy and every normalizer. None: all of them.
    behaviour_logprobs still have one value per completion token (those at environment positions unused).
    """

    prompt_ids: list[int] | np.ndarray
    completion_ids: list[int] | np.ndarray
    behaviour_logprobs: list[float] | np.ndarray
    advantage: float
    reward: float
    behaviour_version: int
    sample_id: str = ""
    loss_mask: np.ndarray | None = None

    def __post_init__(self) -> None:
        self.prompt_ids = np.asarray(self.prompt_ids, dtype=np.int64).reshape(-1)
        self.completion_ids = np.asarray(self.completion_ids, dtype=np.int64).reshape(-1)
        self.behaviour_logprobs = np.asarray(self.behaviour_logprobs, dtype=np.float32).reshape(-1)
        where = f"sample {self.sample_id!r}"
        if self.prompt_ids.size == 0:
            raise ValueError(f"{where}: empty prompt (the first completion token needs a context)")
        if self.completion_ids.size == 0:
            raise ValueError(f"{where}: empty completion")
        if self.behaviour_logprobs.size != self.completion_ids.size:
            raise ValueError(
                f"{where}: {self.behaviour_logprobs.size} behaviour logprobs for {self.completion_ids.size} "
                f"completion tokens"
            )
        if not np.all(np.isfinite(self.behaviour_logprobs)) or np.any(self.behaviour_logprobs > 1e-4):
            raise ValueError(f"{where}: behaviour logprobs must be finite and <= 0")
        if not np.isfinite(self.advantage):
            raise ValueError(f"{where}: advantage must be finite")
        if self.behaviour_version < 0:
            raise ValueError(f"{where}: behaviour_version must be >= 0")
        if self.prompt_ids.min() < 0 or self.completion_ids.min() < 0:
            raise ValueError(f"{where}: token ids must be >= 0")
        if self.loss_mask is not None:
            self.loss_mask = np.asarray(self.loss_mask, dtype=bool).reshape(-1)
            if self.loss_mask.size != self.completion_ids.size or not self.loss_mask.any():
                raise ValueError(f"{where}: the loss mask needs one value per completion token and at least one model "
                    f"token")

    @classmethod
    def trusted(
        cls,
        prompt_ids: np.ndarray,
        completion_ids: np.ndarray,
        behaviour_logprobs: np.ndarray,
        advantage: float,
        reward: float,
        behaviour_version: int,
        sample_id: str = "",
        loss_mask: np.ndarray | None = None,
    ) -> "TrainSample":
        """A sample without the checks of `__post_init__`, for data that already passed equivalent or
        stricter ones (the orchestrator's buffer: arrays of a submission that `protocol` validated on
        admission, advantages from `group_advantages`). The caller passes 1-D arrays of the final dtypes
        (int64, int64, float32)."""
        s = cls.__new__(cls)
        s.__dict__.update(
            prompt_ids=prompt_ids,
            completion_ids=completion_ids,
            behaviour_logprobs=behaviour_logprobs,
            advantage=advantage,
            reward=reward,
            behaviour_version=behaviour_version,
            sample_id=sample_id,
            loss_mask=loss_mask,
        )
        return s

    @property
    def num_tokens(self) -> int:
        return int(self.prompt_ids.size + self.completion_ids.size)

    @property
    def num_completion_tokens(self) -> int:
        """Tokens the loss learns from: the model's (an episode's environment tokens are not counted)."""
        return int(self.completion_ids.size if self.loss_mask is None else np.count_nonzero(self.loss_mask))

    @property
    def loss_indices(self) -> np.ndarray:
        """Indices into completion_ids of the tokens the loss learns from."""
        return np.arange(self.completion_ids.size) if self.loss_mask is None else np.flatnonzero(self.loss_mask)


def samples_from_groups(groups: list[SampleGroup]) -> list[TrainSample]:
    """Decode a batch of buffer groups into samples, where they are used: each array kind in one numpy
    call for the whole batch (samples get slices of it); a group's samples share its prompt array.

    Trusted (no TrainSample checks): the buffer holds only what the orchestrator wrote from a submission
    that protocol validated (token ids >= 0, logprobs finite and <= 0, one logprob per token), with
    finite advantages from group_advantages."""
    if not groups:
        return []

    def concat(field: str, out: type) -> np.ndarray:
        return from_le_bytes(b"".join(getattr(g, field) for g in groups), GROUP_ARRAYS[field]).astype(out)

    completions, logprobs = concat("completion_ids", np.int64), concat("logprobs", np.float32)
    ends = np.cumsum(concat("completion_lengths", np.int64)).tolist()
    advantages, rewards = concat("advantages", np.float64).tolist(), concat("rewards", np.float64).tolist()
    out = []
    k = start = 0
    for g in groups:
        prompt = from_le_bytes(g.prompt_ids, GROUP_ARRAYS["prompt_ids"]).astype(np.int64)
        # Multi-turn: the group's env masks, its members' tokens in order (the model's are where it is 0).
        model_tokens = from_le_bytes(g.env_masks, GROUP_ARRAYS["env_masks"]) == 0 if g.env_masks else None
        group_start = start
        for sample_index in g.sample_indices:
            end = ends[k]
            out.append(
                TrainSample.trusted(
                    prompt, completions[start:end], logprobs[start:end], advantages[k], rewards[k], g.behaviour_version,
                    f"{g.submission_id}:{g.prompt_index}:{sample_index}",
                    None if model_tokens is None else model_tokens[start - group_start : end - group_start],
                )
            )
            k, start = k + 1, end
    return out
