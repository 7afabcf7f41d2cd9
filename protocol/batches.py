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
    "env_masks": "uint8",  # all members, multi-turn only (empty otherwise): 1 where the environment wrote the token
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
    env_masks: bytes = b""  # multi-turn episodes: the env mask of every member's tokens (see GROUP_ARRAYS)

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
    seq: int = 0  # the take sequence: batches are numbered in the order they are taken (see Lineage)

    @property
    def num_samples(self) -> int:
        return sum(g.num_samples for g in self.groups)


class ReconcileFirst(RuntimeError):
    """The orchestrator (re)started and has not yet compared its batches with the trainer's: it hands out
    no batch until the trainer calls `reconcile_trainer`."""


class Lineage:
    """The take sequences of every batch a trainer's weights include: what its checkpoint says it trained.

    Batches are taken in order and trained in the order taken, with gaps where a batch went back to the
    buffer; so the set is a short list of ranges, small enough to go into every checkpoint and to travel
    in a reconciliation call, however long the run.
    """

    def __init__(self, ranges: list[list[int]] | None = None):
        self.ranges: list[list[int]] = [[int(a), int(b)] for a, b in ranges or []]

    def add(self, seq: int) -> None:
        if self.ranges and seq <= self.ranges[-1][1]:
            if seq in self:
                raise ValueError(f"batch {seq} is already in the lineage: it would be trained twice")
            raise ValueError(f"batch {seq} comes after {self.ranges[-1][1]}: batches are trained in take order")
        if self.ranges and seq == self.ranges[-1][1] + 1:
            self.ranges[-1][1] = seq
        else:
            self.ranges.append([seq, seq])

    def __contains__(self, seq: int) -> bool:
        return any(a <= seq <= b for a, b in self.ranges)

    def __len__(self) -> int:
        return sum(b - a + 1 for a, b in self.ranges)

    def __iter__(self):
        for a, b in self.ranges:
            yield from range(a, b + 1)

    def last(self) -> int | None:
        return self.ranges[-1][1] if self.ranges else None

    def to_json(self) -> list[list[int]]:
        return [list(r) for r in self.ranges]
