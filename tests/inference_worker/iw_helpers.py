"""Small builders shared by the inference worker tests."""

from __future__ import annotations

import time

import numpy as np

from protocol.models import SamplingParams, TaskLease, TaskPrompt


def make_lease(prompts: list[list[int]], seeds: list[list[int]], *, lease_id: str = "lease-1", version: int = 0,
    **sampling) -> TaskLease:
    return TaskLease(
        lease_id=lease_id,
        prompts=[TaskPrompt(prompt_id=f"p{i}", token_ids=np.asarray(p, dtype=np.int32), seeds=s) for i, (p,
        s) in enumerate(zip(prompts, seeds))],
        samples_per_prompt=len(seeds[0]),
        sampling=SamplingParams(**sampling),
        policy_version=version,
        min_policy_version=version,
        deadline=time.time() + 600,
    )
