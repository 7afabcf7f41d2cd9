"""What the trainer takes from the orchestrator: whole GRPO groups of verified samples.

Inside the trusted cluster, but across a process boundary (a Ray call): a group travels as a few byte
strings in the layout the orchestrator's buffer stores (`protocol.arrays.le_bytes`), and is decoded into
training samples only where it is used, on the trainer's side (`trainer.samples.samples_from_groups`).
"""

from __future__ import annotations

from dataclasses import dataclass

# Array fields of a SampleGroup and their little-endian dtypes (one value per member, or the members'
# arrays concatenated in member order, split by completion_lengths).
GROUP_ARRAYS = {
    "advantages": "float64",  # one per member
    "rewards": "float64",  # one per member
    "completion_lengths": "int32",  # one per member
    "prompt_ids": "int32",  # the group's shared prompt
    "completion_ids": "int32",  # all members
    "logprobs": "float32",  # all members: behaviour logprobs of each completion token
}


@dataclass
class SampleGroup:
    """One kept group: every sample of one prompt of one accepted submission."""

    submission_id: str
    prompt_index: int  # the group's prompt within its lease
    sample_indices: list[int]  # each member's sample index within the group
    behaviour_version: int
    advantages: bytes
    rewards: bytes
    completion_lengths: bytes
    prompt_ids: bytes
    completion_ids: bytes
    logprobs: bytes

    @property
    def num_samples(self) -> int:
        return len(self.sample_indices)


@dataclass
class Batch:
    """Whole groups taken for one trainer step, oldest first. `dropped_stale`: samples the orchestrator
    dropped instead of handing out, because the step would not train them (see protocol.staleness)."""

    batch_id: str
    groups: list[SampleGroup]
    dropped_stale: int = 0

    @property
    def num_samples(self) -> int:
        return sum(g.num_samples for g in self.groups)
