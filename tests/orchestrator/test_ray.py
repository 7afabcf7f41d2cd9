"""The real path: the orchestrator in a Ray actor, verification by a Ray actor wrapping the real
`verifier.service.Verifier`, an honest worker's submissions (the product's vLLM engine: seeded draws,
proofs built while generating) sent over HTTP, and the trainer pulling and committing batches through
the actor."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
import zstandard
from orch_fakes import run_config

from protocol import api
from protocol.models import (
    LeaseResponse,
    RolloutSubmission,
    SubmissionReceipt,
    WorkerRegistered,
)
from protocol.verdicts import Verdict
from tools.vllm_rollouts import honest_completions
from trainer.samples import samples_from_groups

HASH0, HASH1 = "a" * 64, "b" * 64


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    from swarmrl.actors import init_ray

    init_ray("", num_cpus=2)
    yield ray
    ray.shutdown()


def test_orchestrator_and_verifier_actors(ray_cluster, tiny_model_dir, tmp_path):
    ray = ray_cluster
    from swarmrl.actors import RayVerifierPool, start_orchestrator_actor
    from verifier.config import VerifierConfig

    cfg = run_config(tmp_path, admin_token="adm", join_tokens=["join"], strikes_to_ban=5)
    cfg.model.path = str(tiny_model_dir)
    model_dir = tiny_model_dir
    pool = RayVerifierPool.start(VerifierConfig(), lambda v: model_dir, str(tiny_model_dir), num_actors=1)
    actor = start_orchestrator_actor(cfg, pool.actors)
    try:
        # the trainer's first reconciliation announces version 0
        ray.get(actor.reconcile_trainer.remote([], {}, {0: HASH0}))
        url = ray.get(actor.url.remote())
        with httpx.Client(base_url=url, timeout=30) as c:
            w = WorkerRegistered.model_validate_json(c.post(api.REGISTER.path, json={"name": "honest"},
                headers={"Authorization": "Bearer join"}).content)
            h = {"Authorization": f"Bearer {w.secret}"}

            def lease():
                r = c.post(api.LEASE.path, json={"loaded_policy_version": 0, "max_prompts": 64}, headers=h)
                assert r.status_code == 200, r.text
                return LeaseResponse.model_validate_json(r.content).lease

            def submit(sub):
                r = c.post(api.SUBMIT.path, content=zstandard.ZstdCompressor().compress(sub.model_dump_json().encode()),
                           headers=h | {"Content-Encoding": "zstd"})
                assert r.status_code == 200, r.text
                sid = SubmissionReceipt.model_validate_json(r.content).submission_id
                deadline = time.time() + 120
                while time.time() < deadline:
                    v = Verdict.model_validate_json(c.get(api.VERDICT.url("", submission_id=sid), headers=h).content)
                    if v.status.value != "pending":
                        return v
                    time.sleep(0.1)
                raise AssertionError("no verdict")

            l1 = lease()
            # the real engine's output
            good = RolloutSubmission(lease_id=l1.lease_id, policy_version=0, model_hash=HASH0,
                completions=honest_completions(model_dir, l1))
            v = submit(good)
            assert v.status.value == "accepted", v.rejections
            assert len(v.rewards) == len(good.completions) and v.verified_tokens == good.num_tokens

            # A worker that lies about its logprobs is rejected and gets a strike.
            l2 = lease()
            comps = honest_completions(model_dir, l2)
            comps[0] = comps[0].model_copy(update={"logprobs": np.zeros_like(comps[0].logprobs)})
            bad = RolloutSubmission(lease_id=l2.lease_id, policy_version=0, model_hash=HASH0, completions=comps)
            v2 = submit(bad)
            assert v2.status.value == "rejected" and v2.rejections

        st = ray.get(actor.status.remote())
        assert st.submissions_accepted == 1 and st.submissions_rejected == 1
        kept = len(l1.prompts) - st.groups_dropped_zero_signal
        # The trainer pulls the verified samples through the actor, then commits the step.
        batch = ray.get(actor.take_batch.remote(1000, 0, 1.0))
        samples = samples_from_groups(batch.groups)
        assert len(samples) == kept * l1.samples_per_prompt
        good_tokens = {tuple(c.token_ids.tolist()) for c in good.completions}
        for s in samples:
            assert tuple(s.completion_ids.tolist()) in good_tokens  # nothing from the rejected submission
            assert s.behaviour_version == 0
        ray.get(actor.commit_batches.remote({batch.batch_id: 0}, {1: HASH1}))
        st = ray.get(actor.status.remote())
        assert st.step == 1 and st.policy_version == 1 and st.buffer_depth == 0

        # The run's start-up check of its reward (swarmrl/reward_check.py) in the real verifier actor: every
        # reward process scores the task's first item; a reward no process can import stops the run.
        from swarmrl.config import RunConfig
        from swarmrl.processes import RunFailed
        from swarmrl.reward_check import check_rewards

        checked = check_rewards(pool.actors, RunConfig.model_validate({"data": {"task": "toy"}}))
        assert [(r.error, r.processes) for r in checked] == [("", VerifierConfig().rewards.processes)]
        with pytest.raises(RunFailed) as failed:
            check_rewards(pool.actors, RunConfig.model_validate({"data": {"task": "toy",
                                                                           "reward": "not_on_any_path:score"}}))
        assert "not_on_any_path:score" in str(failed.value) and "verifier.rewards.import_paths" in str(failed.value)
    finally:
        ray.get(actor.shutdown.remote())
        ray.kill(actor)
        pool.shutdown()
