"""Multi-turn episodes through the verifier: honest episodes from the worker's real vLLM turn loop are
accepted with the environment's trusted reward; each episode attack (tools/episode_attacks.py) is rejected
by the episode checks, with proofs rebuilt so that they alone would pass."""

from __future__ import annotations

import time

import numpy as np
import pytest

from environments.registry import item_to_wire
from environments.tasks import get_task
from protocol.models import RolloutSubmission, SamplingParams, TaskLease, TaskPrompt
from protocol.verdicts import RejectionCode, VerdictStatus
from tools import episode_attacks
from verifier.config import VerifierConfig
from verifier.service import Verifier, VerifyJob

HASH0 = "a" * 64
SAMPLING = SamplingParams(temperature=1.0, max_tokens=24)


def make_lease(model_dir, n_prompts=6, samples=4, environment="lookup", task="lookup"):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    items = get_task(task).make_prompts(n_prompts, seed=3)
    prompts = [TaskPrompt(prompt_id=f"p{i}", token_ids=np.array([tok.bos_token_id] + tok.encode(it.prompt,
        add_special_tokens=False), dtype=np.int32),
                          seeds=[1000 * i + s for s in range(samples)], env_item=item_to_wire(it)) for i,
                          it in enumerate(items)]
    lease = TaskLease(lease_id="E1", prompts=prompts, samples_per_prompt=samples, sampling=SAMPLING, policy_version=0,
                      min_policy_version=0, deadline=time.time() + 600, generation_version=0, environment=environment)
    return lease, items


@pytest.fixture(scope="module")
def episodes(tool_model_dir):
    """24 episodes of the lookup environment from the worker's own engine (proofs built as a worker does)."""
    from inference_worker.config import EngineConfig
    from inference_worker.engine import RolloutEngine

    lease, items = make_lease(tool_model_dir)
    engine = RolloutEngine(tool_model_dir, EngineConfig(max_model_len=128, kv_cache_bytes=64 << 20))
    try:
        completions, hidden = engine.generate_with_hidden(lease)
    finally:
        engine.close()
    return lease, items, completions, hidden


@pytest.fixture(scope="module")
def verifier(tool_model_dir):
    v = Verifier(VerifierConfig(keep_versions=1), lambda version: tool_model_dir, tool_model_dir)
    yield v
    v.close()


def job(lease, items, completions, sid="s1"):
    sub = RolloutSubmission(lease_id=lease.lease_id, policy_version=0, model_hash=HASH0, completions=completions)
    return VerifyJob(submission_id=sid, submission=sub, lease=lease, items=items, task_name="lookup",
        expected_model_hash=HASH0)


def test_honest_episodes_are_accepted_with_the_environments_reward(episodes, verifier):
    lease, items, comps, _ = episodes
    multi = [c for c in comps if episode_attacks.multi_turn(c)]
    assert len(multi) >= 3, "the tool model should call the tool in some episodes"
    for c in multi:  # the observation is the hidden digits, written by the environment
        mask = np.asarray(c.env_mask)
        assert mask.sum() == len(items[c.prompt_index].answer) + 1
        assert c.logprobs.size == int((mask == 0).sum())
    verdict = verifier.verify(job(lease, items, comps))
    assert verdict.status == VerdictStatus.accepted, verdict.rejections[:3]
    assert verdict.rewards is not None and len(verdict.rewards) == len(comps)
    assert all(0.0 <= r <= 1.0 for r in verdict.rewards)
    # The worker's ledger counts the tokens its model sampled, not the environment's.
    assert verdict.verified_tokens == sum(c.logprobs.size for c in comps) < sum(c.token_ids.size for c in comps)
    # Behaviour logprobs cover the whole episode (the trainer masks the environment's positions).
    assert [lp.size for lp in verdict.behaviour_logprobs] == [c.token_ids.size for c in comps]


def test_the_reward_is_the_environments_on_the_last_turn(episodes, verifier):
    from environments.lookup import LookupEnv

    lease, items, comps, _ = episodes
    c = next(c for c in comps if episode_attacks.multi_turn(c))
    verdict = verifier.verify(job(lease, items, [c], sid="s-reward"))
    answer_start = np.flatnonzero(np.asarray(c.env_mask) == 1)[-1] + 1  # the last model turn
    text = verifier.decode(np.asarray(c.token_ids)[answer_start:])
    assert verdict.rewards == [pytest.approx(LookupEnv.reward(items[c.prompt_index], text, {}))]


@pytest.mark.parametrize("attack", sorted(episode_attacks.ATTACKS))
def test_episode_attacks_are_rejected(episodes, verifier, attack):
    lease, items, comps, hidden = episodes
    rng = np.random.default_rng(0)
    forged, tried = [], 0
    for c, h in zip(comps, hidden):
        if not episode_attacks.multi_turn(c):
            continue
        tried += 1
        try:
            forged.append(episode_attacks.ATTACKS[attack](c, h, rng))
        except ValueError:
            continue
    assert forged, f"no episode to attack with {attack}"
    expected = {"forged_observation": {RejectionCode.env_mismatch},
                "truncated_claimed_complete": {RejectionCode.episode_incomplete},
                "extra_turn": {RejectionCode.env_mismatch, RejectionCode.bad_termination},
                "env_tokens_as_model": {RejectionCode.bad_termination},
                "model_tokens_as_env": {RejectionCode.env_mismatch}}[attack]
    for i, f in enumerate(forged):
        # One forged episode per submission, the rest honest: the episode alone must sink it.
        verdict = verifier.verify(job(lease, items, [f], sid=f"{attack}-{i}"))
        assert verdict.status == VerdictStatus.rejected, attack
        codes = {r.code for r in verdict.rejections}
        assert codes & expected, (attack, verdict.rejections)


def test_a_single_turn_completion_for_an_environment_lease_is_refused(episodes, verifier):
    lease, items, comps, _ = episodes
    c = comps[0]
    single = c.model_copy(update=dict(env_mask=None, turn_finish_reasons=None))
    # As a single-turn completion its logprobs no longer cover every token: protocol refuses it, or the
    # verifier does as a lease mismatch when they happen to line up (a one-turn episode).
    n_model = int((np.asarray(c.env_mask) == 0).sum())
    if n_model == c.token_ids.size:
        verdict = verifier.verify(job(lease, items, [single], sid="single"))
        assert verdict.status == VerdictStatus.rejected
        assert {r.code for r in verdict.rejections} == {RejectionCode.lease_mismatch}
    episode_lease_as_single = lease.model_copy(update=dict(environment=None))
    verdict = verifier.verify(job(episode_lease_as_single, items, [c], sid="episode-for-single"))
    assert verdict.status == VerdictStatus.rejected and verdict.rejections[0].code == RejectionCode.lease_mismatch


def test_calculator_episodes_from_the_engine_are_accepted(tool_model_dir, verifier):
    """The calculator environment through the same path: countdown prompts, the real turn loop, the verifier."""
    from inference_worker.config import EngineConfig
    from inference_worker.engine import RolloutEngine

    lease, items = make_lease(tool_model_dir, n_prompts=4, samples=8, environment="calculator", task="countdown")
    lease = lease.model_copy(update={"sampling": SamplingParams(temperature=1.0, max_tokens=96)})
    engine = RolloutEngine(tool_model_dir, EngineConfig(max_model_len=160, kv_cache_bytes=64 << 20))
    try:
        comps = engine.generate(lease)
    finally:
        engine.close()
    assert all(c.env_mask is not None and c.token_ids.size <= 96 for c in comps)
    verdict = verifier.verify(job(lease, items, comps, sid="calc"))
    assert verdict.status == VerdictStatus.accepted, verdict.rejections[:3]
    assert all(0.0 <= r <= 1.0 for r in verdict.rewards)


SPINNING_ENV = '''
from environments.lookup import LookupEnv

class SpinningLookupEnv(LookupEnv):
    """The lookup environment with a tool that never returns."""

    @classmethod
    def run_tool(cls, item, call, seed):
        while True:
            pass
'''


def test_a_tool_that_hangs_on_the_trusted_side_is_cut_off_by_the_pool(episodes, tool_model_dir, tmp_path, monkeypatch):
    """The environment's tool runs in the sandboxed pool, not in the verifier: a tool that never returns
    costs one time limit per call up to the submission's failure budget, the verdict says tool_failed (no
    strike: not the worker's doing), and the same verifier goes on to accept honest episodes."""
    from protocol.verdicts import NO_STRIKE
    from verifier.reward_config import RewardPoolConfig

    (tmp_path / "swarmrl_test_envs.py").write_text(SPINNING_ENV)
    monkeypatch.syspath_prepend(str(tmp_path))
    lease, items, comps, _ = episodes
    multi = [c for c in comps if episode_attacks.multi_turn(c)]
    spinning = lease.model_copy(update=dict(environment="swarmrl_test_envs:SpinningLookupEnv"))
    cfg = VerifierConfig(keep_versions=1, rewards=RewardPoolConfig(processes=1, time_limit_s=0.5,
        import_paths=[str(tmp_path)]))
    v = Verifier(cfg, lambda version: tool_model_dir, tool_model_dir)
    try:
        verdict = v.verify(job(spinning, items, multi, sid="spin"))
        assert verdict.status == VerdictStatus.rejected
        assert {r.code
            for r in verdict.rejections} == {RejectionCode.tool_failed} and RejectionCode.tool_failed in NO_STRIKE
        assert v.rewards.counts["timed_out"] == cfg.rewards.group_failure_budget  # then the rest were skipped
        assert v.rewards.counts["skipped"] == len(multi) - cfg.rewards.group_failure_budget
        verdict = v.verify(job(lease, items, comps, sid="honest-after"))
        assert verdict.status == VerdictStatus.accepted, verdict.rejections[:3]
    finally:
        v.close()
