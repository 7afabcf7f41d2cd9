"""From an accepted submission to trainer samples, and from the persisted buffer to trainer batches.

A lease holds whole groups (every sample of each of its prompts), so a group is complete when its
submission is accepted. Advantages come from `trainer.advantages.group_advantages` (its one owner).
Groups whose rewards are all equal carry no signal and are dropped here: online difficulty filtering.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from orchestrator.state import GroupRow, State
from protocol.models import RolloutSubmission, TaskLease
from trainer.advantages import group_advantages, has_signal
from trainer.samples import TrainSample


@dataclass
class Groups:
    rows: list[GroupRow]  # the groups with a learning signal, for the buffer
    dropped_zero_signal: int

    @property
    def num_samples(self) -> int:
        return sum(g.num_samples for g in self.rows)


def build_groups(submission_id: str, sub: RolloutSubmission, lease: TaskLease, rewards: list[float], use_std: bool = True) -> Groups:
    """Every group with a learning signal, with its advantages, behaviour version and logprobs.

    Each array kind is made for all groups at once (one numpy call for the submission, then byte
    slices per group): a submission has many small groups, so per-group numpy calls would dominate."""
    comps = sub.completions
    if len(rewards) != len(comps):
        raise ValueError(f"{len(rewards)} rewards for {len(comps)} completions")
    by_prompt: dict[int, list[int]] = {}
    for i, c in enumerate(comps):
        by_prompt.setdefault(c.prompt_index, []).append(i)
    prompts = sorted(by_prompt)
    k = len(by_prompt[prompts[0]])
    if any(len(m) != k for m in by_prompt.values()):  # admission.check_shape guarantees it for real submissions
        raise ValueError("every group of a submission must have the same number of samples")
    order = [i for p in prompts for i in by_prompt[p]]  # group by group, in submission order within one
    ordered = [comps[i] for i in order]
    group_rewards = np.asarray(rewards, dtype="<f8")[order].reshape(len(prompts), k)
    advantages = group_advantages(group_rewards, use_std=use_std).astype("<f8")  # all groups in one pass
    signal = has_signal(advantages).tolist()
    lengths = np.array([c.token_ids.size for c in ordered], dtype="<i4")
    ends = (4 * np.cumsum(lengths.reshape(len(prompts), k).sum(axis=1))).tolist()  # byte offsets (4-byte values)
    completion_ids = np.concatenate([c.token_ids for c in ordered]).astype("<i4", copy=False).tobytes()
    logprobs = np.concatenate([c.logprobs for c in ordered]).astype("<f4", copy=False).tobytes()
    rows: list[GroupRow] = []
    for g, (p, start, end) in enumerate(zip(prompts, [0, *ends], ends)):
        if not signal[g]:
            continue
        rows.append(
            GroupRow(
                submission_id,
                p,
                [c.sample_index for c in ordered[g * k : (g + 1) * k]],
                sub.policy_version,
                advantages[g].tobytes(),
                group_rewards[g].tobytes(),
                lengths[g * k : (g + 1) * k].tobytes(),
                lease.prompts[p].token_ids.astype("<i4", copy=False).tobytes(),
                completion_ids[start:end],
                logprobs[start:end],
            )
        )
    return Groups(rows, len(prompts) - len(rows))


def to_train_samples(groups: list[GroupRow]) -> list[TrainSample]:
    """Decode a batch of buffer groups into samples: each array kind in one numpy call for the whole
    batch (samples get slices of it); a group's samples share its prompt array.

    Trusted (no TrainSample checks): the buffer holds only what build_groups wrote from a submission
    that protocol validated (token ids >= 0, logprobs finite and <= 0, one logprob per token), with
    finite advantages from group_advantages."""
    def concat(field: str, dtype: str, out: type) -> np.ndarray:
        return np.frombuffer(b"".join(getattr(g, field) for g in groups), dtype=dtype).astype(out)

    completions, logprobs = concat("completion_ids", "<i4", np.int64), concat("logprobs", "<f4", np.float32)
    lengths = concat("completion_lengths", "<i4", np.int64)
    ends = np.cumsum(lengths).tolist()
    advantages, rewards = concat("advantages", "<f8", np.float64).tolist(), concat("rewards", "<f8", np.float64).tolist()
    out = []
    k = start = 0
    for g in groups:
        prompt = np.frombuffer(g.prompt_ids, dtype="<i4").astype(np.int64)
        for sample_index in g.sample_indices:
            end = ends[k]
            out.append(
                TrainSample.trusted(
                    prompt, completions[start:end], logprobs[start:end], advantages[k], rewards[k], g.behaviour_version,
                    f"{g.submission_id}:{g.prompt_index}:{sample_index}",
                )
            )
            k, start = k + 1, end
    return out


@dataclass
class Batch:
    """What the trainer pulls: whole groups as the buffer stores them. They cross process boundaries
    (Ray) as a few byte strings per group; the samples are decoded where they are used (the trainer's
    side), not by the orchestrator, which serves the workers' requests."""

    batch_id: str
    groups: list[GroupRow]
    dropped_stale: int

    @property
    def num_samples(self) -> int:
        return sum(g.num_samples for g in self.groups)

    @cached_property
    def samples(self) -> list[TrainSample]:
        return to_train_samples(self.groups) if self.groups else []


class RolloutBuffer:
    """The trainer's side of the persisted buffer: take a batch, then commit it once trained.

    A batch that is taken but never committed (the trainer or the orchestrator crashed) comes back
    after a restart, so every accepted sample is trained exactly once.
    """

    def __init__(self, state: State, max_staleness: int | None = None):
        self.state = state
        self.max_staleness = max_staleness

    def depth(self) -> int:
        return self.state.buffer_depth()

    def take(self, n: int, trainer_version: int | None = None) -> Batch:
        """n samples in whole groups, oldest first (see State.take_batch), or what is ready. Samples older than
        `trainer_version - max_staleness` are dropped (counted as stale) rather than handed out."""
        lowest = None
        if self.max_staleness is not None and trainer_version is not None:
            lowest = trainer_version - self.max_staleness
        batch_id = f"B{secrets.token_hex(6)}"
        rows, dropped = self.state.take_batch(batch_id, n, lowest)
        return Batch(batch_id, rows, dropped)

    def commit(self, batch_id: str, new_version: int, model_hash: str | None = None, dropped_stale: int = 0) -> dict[int, int]:
        return self.state.commit_batch(batch_id, new_version, model_hash, dropped_stale)

    def give_back(self, batch_id: str) -> int:
        return self.state.return_batch(batch_id)
