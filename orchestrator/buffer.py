"""From an accepted submission to trainer samples, and from the persisted buffer to trainer batches.

A lease holds whole groups (every sample of each of its prompts), so a group is complete when its
submission is accepted. Advantages come from `trainer.advantages.group_advantages` (its one owner).
Groups whose rewards are all equal carry no signal and are dropped here: online difficulty filtering.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

import numpy as np

from orchestrator.state import SampleRow, State
from protocol.models import RolloutSubmission, TaskLease
from trainer.advantages import group_advantages, has_signal
from trainer.samples import TrainSample


@dataclass
class Groups:
    samples: list[SampleRow]
    kept: int
    dropped_zero_signal: int


def build_samples(submission_id: str, sub: RolloutSubmission, lease: TaskLease, rewards: list[float], use_std: bool = True) -> Groups:
    """Samples of every group with a learning signal, with their behaviour version and logprobs."""
    if len(rewards) != len(sub.completions):
        raise ValueError(f"{len(rewards)} rewards for {len(sub.completions)} completions")
    by_prompt: dict[int, list[tuple[int, float]]] = {}
    for i, (c, r) in enumerate(zip(sub.completions, rewards)):
        by_prompt.setdefault(c.prompt_index, []).append((i, float(r)))
    samples: list[SampleRow] = []
    kept = dropped = 0
    version = sub.policy_version
    for p, members in sorted(by_prompt.items()):
        adv = group_advantages([r for _, r in members], use_std=use_std)
        if not has_signal(adv):
            dropped += 1
            continue
        kept += 1
        prompt_ids = lease.prompts[p].token_ids.astype("<i4").tobytes()
        # tolist(): plain floats, without a numpy scalar conversion per sample.
        for (i, r), a in zip(members, adv.tolist()):
            c = sub.completions[i]
            samples.append(
                SampleRow(
                    f"{submission_id}:{c.prompt_index}:{c.sample_index}",
                    submission_id,
                    prompt_ids,
                    c.token_ids.astype("<i4", copy=False).tobytes(),
                    c.logprobs.astype("<f4", copy=False).tobytes(),
                    a,
                    r,
                    version,
                )
            )
    return Groups(samples, kept, dropped)


def to_train_samples(rows: list[SampleRow]) -> list[TrainSample]:
    """Decode a batch of buffer rows: each array kind in one numpy call for the whole batch (samples get
    slices of it), and one prompt array per group (its samples share it).

    Trusted (no TrainSample checks): the buffer holds only what build_samples wrote from a submission
    that protocol validated (token ids >= 0, logprobs finite and <= 0, one logprob per token), with
    finite advantages from group_advantages."""
    completions = np.frombuffer(b"".join(r.completion_ids for r in rows), dtype="<i4").astype(np.int64)
    logprobs = np.frombuffer(b"".join(r.logprobs for r in rows), dtype="<f4").astype(np.float32)
    prompts: dict[bytes, np.ndarray] = {}
    out = []
    start = 0
    for r in rows:
        end = start + len(r.completion_ids) // 4
        prompt = prompts.get(r.prompt_ids)
        if prompt is None:
            prompt = prompts[r.prompt_ids] = np.frombuffer(r.prompt_ids, dtype="<i4").astype(np.int64)
        out.append(
            TrainSample.trusted(prompt, completions[start:end], logprobs[start:end], r.advantage, r.reward, r.behaviour_version, r.sample_id)
        )
        start = end
    return out


@dataclass
class Batch:
    batch_id: str
    samples: list[TrainSample]
    dropped_stale: int


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
        """Up to n samples, oldest first. Samples older than `trainer_version - max_staleness` are
        dropped (counted as stale) rather than handed out."""
        lowest = None
        if self.max_staleness is not None and trainer_version is not None:
            lowest = trainer_version - self.max_staleness
        batch_id = f"B{secrets.token_hex(6)}"
        rows, dropped = self.state.take_batch(batch_id, n, lowest)
        return Batch(batch_id, to_train_samples(rows) if rows else [], dropped)

    def commit(self, batch_id: str, new_version: int, model_hash: str | None = None, dropped_stale: int = 0) -> dict[int, int]:
        return self.state.commit_batch(batch_id, new_version, model_hash, dropped_stale)

    def give_back(self, batch_id: str) -> int:
        return self.state.return_batch(batch_id)
