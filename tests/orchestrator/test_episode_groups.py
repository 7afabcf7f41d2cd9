"""Multi-turn episodes in the buffer: groups carry the env masks, and the trainer's samples learn only
from the model's tokens; the orchestrator's leases of an environment run carry the environment and items."""

from __future__ import annotations

import time

import numpy as np
import pytest

from orchestrator.buffer import build_groups
from orchestrator.config import OrchestratorConfig
from protocol.models import Completion, RolloutSubmission, SamplingParams, TaskLease, TaskPrompt
from trainer.samples import samples_from_groups


def episode(sample_index: int, mask: list[int]) -> Completion:
    n_model = mask.count(0)
    return Completion(prompt_index=0, sample_index=sample_index, token_ids=np.arange(3, 3 + len(mask), dtype=np.int32),
                      logprobs=np.full(n_model, -0.5 - sample_index, dtype=np.float32), finish_reason="stop",
                      proofs=[b"p"], env_mask=np.array(mask, dtype=np.uint8), turn_finish_reasons=["stop"] * (1 + sum(1
                      for a, b in zip(mask, mask[1:]) if a == 1 and b == 0)))


def lease() -> TaskLease:
    return TaskLease(lease_id="L", prompts=[TaskPrompt(prompt_id="p", token_ids=np.array([1, 2], np.int32), seeds=[1,
        2], env_item='{"answer":"1","meta":{},"prompt":"ask:="}')],
                     samples_per_prompt=2, sampling=SamplingParams(max_tokens=24), policy_version=0,
                     min_policy_version=0, deadline=time.time() + 60, environment="lookup")


@pytest.mark.parametrize("trusted_logprobs", [True, False])
def test_episode_groups_give_masked_samples(trusted_logprobs):
    comps = [episode(0, [0, 1, 1, 0, 0]), episode(1, [0, 0, 0])]
    sub = RolloutSubmission(lease_id="L", policy_version=0, model_hash="a" * 64, completions=comps)
    mu = [np.full(c.token_ids.size, -1.0, np.float32) for c in comps] if trusted_logprobs else None
    groups = build_groups("s", sub, lease(), [1.0, 0.0], behaviour_logprobs=mu)
    a, b = samples_from_groups(groups.rows)
    assert a.loss_mask.tolist() == [True, False, False, True, True] and b.loss_mask.tolist() == [True, True, True]
    assert a.num_completion_tokens == 3 and b.num_completion_tokens == 3
    if not trusted_logprobs:  # the worker's logprobs (model positions only) are spread over the episode
        assert a.behaviour_logprobs[a.loss_mask].tolist() == [-0.5, -0.5, -0.5]
        assert b.behaviour_logprobs.tolist() == [-1.5, -1.5, -1.5]


def test_single_turn_groups_carry_no_masks():
    c = Completion(prompt_index=0, sample_index=0, token_ids=np.array([5, 6], np.int32), logprobs=np.array([-1, -1],
        np.float32), finish_reason="stop", proofs=[b"p"])
    sub = RolloutSubmission(lease_id="L", policy_version=0, model_hash="a" * 64, completions=[c,
        c.model_copy(update={"sample_index": 1})])
    groups = build_groups("s", sub, lease().model_copy(update={"environment": None}), [1.0, 0.0])
    assert groups.rows[0].env_masks == b""
    assert all(s.loss_mask is None for s in samples_from_groups(groups.rows))


def test_unknown_environment_is_refused_by_the_config():
    with pytest.raises(ValueError, match="unknown environment"):
        OrchestratorConfig(environment="nope")


def test_the_lease_cap_must_hold_a_whole_episode():
    with pytest.raises(ValueError, match="needs sampling.max_tokens >= 24"):
        OrchestratorConfig(environment="lookup", sampling=SamplingParams(max_tokens=8))
    assert OrchestratorConfig(environment="lookup", sampling=SamplingParams(max_tokens=24)).environment == "lookup"


def test_admission_refuses_a_completion_of_the_wrong_kind():
    """A 4xx with a reason, before verification: episodes for a single-turn lease, or the reverse."""
    from orchestrator.admission import check_shape
    from orchestrator.errors import ApiError

    comps = [episode(0, [0, 1, 0]), episode(1, [0])]
    sub = RolloutSubmission(lease_id="L", policy_version=0, model_hash="a" * 64, completions=comps)
    check_shape(sub, lease())  # the right kind passes
    with pytest.raises(ApiError, match="multi-turn episode .* single-turn lease"):
        check_shape(sub, lease().model_copy(update={"environment": None}))
    single = [c.model_copy(update={"env_mask": None, "turn_finish_reasons": None, "logprobs": np.full(c.token_ids.size,
        -1.0, np.float32)}) for c in comps]
    with pytest.raises(ApiError, match="env_mask and turn_finish_reasons are required"):
        check_shape(RolloutSubmission.model_construct(lease_id="L", policy_version=0, model_hash="a" * 64,
            completions=single), lease())
