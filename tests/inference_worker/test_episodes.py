"""The worker's turn loop (inference_worker/episodes.py) on the real vLLM engine: what it submits is what
the environment and the seeded sampler say, turn by turn. (The verifier's acceptance of these episodes,
and its rejection of forged ones, is tests/verifier/test_verifier_episodes.py.)"""

from __future__ import annotations

import time

import numpy as np
import pytest

from environments.base import model_turns
from environments.registry import get_environment, item_to_wire
from environments.tasks import get_task
from inference_worker.generation import LeaseNotGeneratable
from protocol.models import SamplingParams, TaskLease, TaskPrompt
from trainer.tiny_model import EOS_ID, make_tokenizer

TOK = make_tokenizer()


def lookup_lease(max_tokens: int = 24, seeds=(5, 6, 7, 8)) -> tuple[TaskLease, list]:
    items = get_task("lookup").make_prompts(3, seed=11)
    prompts = [TaskPrompt(prompt_id=f"p{i}", token_ids=np.array([1] + TOK.encode(it.prompt, add_special_tokens=False),
        np.int32),
                          seeds=[100 * i + s for s in seeds], env_item=item_to_wire(it)) for i, it in enumerate(items)]
    lease = TaskLease(lease_id="E", prompts=prompts, samples_per_prompt=len(seeds),
                      sampling=SamplingParams(max_tokens=max_tokens), policy_version=0, min_policy_version=0,
                      deadline=time.time() + 600, environment="lookup")
    return lease, items


def test_episodes_follow_the_environment_and_the_limits(tool_engine):
    lease, items = lookup_lease()
    comps, hidden = tool_engine.generate_with_hidden(lease)
    env = get_environment("lookup", lambda t: TOK.encode(t, add_special_tokens=False), [EOS_ID])
    assert len(comps) == lease.num_completions
    for c, h in zip(comps, hidden):
        ids, mask = c.token_ids.tolist(), c.env_mask.tolist()
        turns = model_turns(np.array(mask))
        assert len(turns) == len(c.turn_finish_reasons) <= env.limits.max_turns
        assert h.shape[0] == c.logprobs.size == mask.count(0)  # hidden states and logprobs of the model's tokens
        seed = lease.prompts[c.prompt_index].seeds[c.sample_index]
        for k, (a, b) in enumerate(turns):  # every observation is the environment's reply, and it ends the episode
            assert b - a <= env.turn_cap(a)
            reply = env.reply(items[c.prompt_index], ids[:b], mask[:b], seed)
            if k < len(turns) - 1:
                assert ids[b : turns[k + 1][0]] == reply
            else:
                assert reply is None and b == len(ids)
    assert any(len(model_turns(c.env_mask)) == 2 for c in comps), "the tool model should call the tool sometimes"


def test_the_same_seeds_give_the_same_episodes(tool_engine):
    lease, _ = lookup_lease()
    a = tool_engine.generate(lease)
    b = tool_engine.generate(lease)
    assert [c.token_ids.tolist() for c in a] == [c.token_ids.tolist() for c in b]
    assert [c.env_mask.tolist() for c in a] == [c.env_mask.tolist() for c in b]


def test_a_lease_whose_cap_cannot_hold_an_episode_is_refused(tool_engine):
    lease, _ = lookup_lease(max_tokens=8)
    with pytest.raises(LeaseNotGeneratable, match="episode cap"):
        tool_engine.generate(lease)
    no_item = lookup_lease()[0]
    no_item = no_item.model_copy(update={"prompts": [p.model_copy(update={"env_item": None}) for p in no_item.prompts]})
    with pytest.raises(LeaseNotGeneratable, match="item"):
        tool_engine.generate(no_item)
