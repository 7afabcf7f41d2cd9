"""The multi-turn wire format: env masks and turn finish reasons, validated with the other completion rules."""

from __future__ import annotations

import time

import numpy as np
import pytest
from pydantic import ValidationError

from protocol import limits
from protocol.models import Completion, RolloutSubmission, SamplingParams, TaskLease, TaskPrompt


def episode(mask, finishes=None, n_logprobs=None, **kw) -> dict:
    mask = np.array(mask, dtype=np.uint8)
    n_model = int((mask == 0).sum()) if n_logprobs is None else n_logprobs
    turns = int(mask[0] == 0) + int(((mask[1:] == 0) & (mask[:-1] == 1)).sum())
    return dict(prompt_index=0, sample_index=0, token_ids=np.arange(3, 3 + mask.size, dtype=np.int32),
                logprobs=np.full(n_model, -1.0, np.float32), finish_reason="stop", proofs=[b"p"] * max(1,
                -(-n_model // 32)), env_mask=mask,
                turn_finish_reasons=finishes if finishes is not None else ["stop"] * turns, **kw)


def test_a_valid_episode_round_trips_through_json():
    c = Completion(**episode([0, 1, 1, 0, 0]))
    back = Completion.model_validate_json(c.model_dump_json())
    assert back.env_mask.tolist() == [0, 1, 1, 0, 0] and back.turn_finish_reasons == c.turn_finish_reasons
    assert back.model_positions.tolist() == [0, 3, 4]
    sub = RolloutSubmission(lease_id="L", policy_version=0, model_hash="a" * 64, completions=[c])
    assert RolloutSubmission.model_validate_json(sub.model_dump_json()).completions[0].env_mask.tolist() == [0, 1, 1,
        0, 0]


def test_single_turn_json_is_unchanged():
    c = Completion(prompt_index=0, sample_index=0, token_ids=np.array([5], np.int32), logprobs=np.array([-1.0],
        np.float32), finish_reason="stop", proofs=[b"p"])
    assert "env_mask" not in c.model_dump_json() and "turn_finish_reasons" not in c.model_dump_json()
    lease = TaskLease(lease_id="L", prompts=[TaskPrompt(prompt_id="p", token_ids=np.array([1], np.int32), seeds=[1])],
                      samples_per_prompt=1, sampling=SamplingParams(), policy_version=0, min_policy_version=0,
                      deadline=time.time() + 1)
    text = lease.model_dump_json()
    assert "environment" not in text and "env_item" not in text
    assert TaskLease.model_validate_json(text).environment is None


@pytest.mark.parametrize("fields,reason", [
    (episode([0, 1, 0], n_logprobs=3), "2 model tokens but 3 logprobs"),
    (episode([0, 1, 0], finishes=["stop"]), "2 model turns but 1 turn finish reasons"),
    (episode([1, 0, 0]), "starts and ends with a model turn"),
    (episode([0, 0, 1]), "starts and ends with a model turn"),
    (episode([0, 2, 0]), r"must be 0 \(model\) or 1"),
    ({**episode([0, 1, 0]), "env_mask": np.array([0, 1], np.uint8)}, "env_mask has 2 values for 3 tokens"),
    ({**episode([0, 1, 0]), "turn_finish_reasons": None}, "come together"),
    ({**episode([0, 1, 0]), "env_mask": None}, "come together"),
    ({**episode([0, 1, 0]), "turn_finish_reasons": ["stop", "length"]}, "is not the last turn's"),
    (episode([0, 1] * limits.MAX_EPISODE_TURNS + [0]), "at most 64 items"),
    (episode([0, 1] * limits.MAX_EPISODE_TURNS + [0], finishes=["stop"] * 3), "65 model turns exceed 64"),
])
def test_malformed_episodes_are_refused(fields, reason):
    with pytest.raises(ValidationError, match=reason):
        Completion(**fields)
    # The same inside a submission (the batched checks), from JSON too.
    good = Completion(**episode([0, 1, 0]))
    body = RolloutSubmission(lease_id="L", policy_version=0, model_hash="a" * 64,
        completions=[good]).model_dump(mode="json")
    bad = Completion.model_construct(**fields).model_dump(mode="json") if fields.get(
        "env_mask") is not None and fields.get("turn_finish_reasons") is not None else None
    if bad is not None:
        body["completions"] = [bad]
        with pytest.raises(ValidationError):
            RolloutSubmission.model_validate(body)


def test_episode_submissions_fit_the_body_cap():
    assert limits.submission_bytes_cap(4, 24, episodes=True) > limits.submission_bytes_cap(4, 24)
    n = 24
    c = Completion(**episode([0, 1] * (n // 2 - 1) + [0, 0], finishes=["length"] * (n // 2 - 1) + ["stop"]))
    sub = RolloutSubmission(lease_id="L" * 64, policy_version=0, model_hash="a" * 64,
        completions=[c.model_copy(update={"sample_index": i}) for i in range(4)])
    assert len(sub.model_dump_json()) <= limits.submission_bytes_cap(4, n, episodes=True)


def test_a_submission_of_several_episodes_keeps_each_ones_logprobs_from_json():
    """From JSON the arrays of all completions are decoded at once and split: by token counts for the ids,
    by logprob counts (model tokens) for the logprobs."""
    comps = []
    for i, mask in enumerate([[0, 1, 1, 0], [0, 0, 1, 1, 1, 0, 0], [0]]):
        fields = episode(mask)
        fields["sample_index"] = i
        fields["logprobs"] = -np.arange(1, mask.count(0) + 1, dtype=np.float32) - 10 * i
        comps.append(Completion(**fields))
    sub = RolloutSubmission(lease_id="L", policy_version=0, model_hash="a" * 64, completions=comps)
    back = RolloutSubmission.model_validate_json(sub.model_dump_json())
    for c, b in zip(comps, back.completions):
        assert b.token_ids.tolist() == c.token_ids.tolist()
        assert b.logprobs.tolist() == c.logprobs.tolist()
        assert b.env_mask.tolist() == c.env_mask.tolist()
