"""The attack of the finding, replayed on the real orchestrator: a worker scores its own seeded draws (the
reward is public) and gives back the groups it dislikes. With seeds fixed per prompt instance, whoever leases
a given-back instance again draws the same tokens, so what gets trained is exactly what an honest swarm
trains; and the releases cost the selector's token (debt, a visible ratio, one prompt at a time)."""

from __future__ import annotations

import math
import time

import numpy as np
from orch_fakes import HASH0, FakeVerifier, encode, make_orchestrator, run_config

from protocol import limits
from protocol.models import Completion, FinishReason, LeaseRequest, RolloutSubmission, WorkerRegistration
from protocol.operator_models import JoinTokenRequest


def draws(lease, k: int):
    """What a worker's seeded sampler sends: tokens that are a function of the sample's seed only."""
    comps = []
    for p, prompt in enumerate(lease.prompts):
        for s in range(k):
            rng = np.random.default_rng(prompt.seeds[s])
            n = int(rng.integers(1, lease.sampling.max_tokens + 1))
            ids = rng.integers(3, 40, size=n)
            comps.append(Completion(prompt_index=p, sample_index=s, token_ids=ids,
                                    logprobs=-rng.random(n).astype(np.float32), finish_reason=FinishReason.length,
                                    proofs=[rng.bytes(limits.MAX_PROOF_BYTES)
                                    for _ in range(math.ceil(n / limits.PROOF_CHUNK_TOKENS))]))
    return RolloutSubmission(lease_id=lease.lease_id, policy_version=0, model_hash=HASH0, completions=comps)


def test_selective_release_changes_nothing_trained_and_costs_the_selector(tmp_path, instances: int = 24):
    # The draws follow the run's secret seed key, new per database, so how many of its ~24 leases the selector
    # releases varies from run to run (3 or more); at most 24 leases, 3 releases are above a bound of 0.1.
    cfg = run_config(tmp_path, async_level=3, prompts_per_lease=1, max_open_leases_per_worker=4, lease_timeout_s=10.0,
                     max_release_ratio=0.1)
    cfg = cfg.model_copy(update={"trainer": cfg.trainer.model_copy(update={"samples_per_step": 64})})
    verifier = FakeVerifier()
    orch = make_orchestrator(cfg, verifier)
    k = cfg.orchestrator.samples_per_prompt
    workers = {}
    for name in ("picky", "honest"):
        token = orch.operators.mint_token(JoinTokenRequest(label=name)).token
        workers[name] = orch.authenticate(orch.register(WorkerRegistration(name=name), token).secret)

    def group_reward(lease, sub) -> float:  # the worker scores its own draws with the public reward
        item = orch.prompts.prompts[orch.leases.get(lease.lease_id).prompt_indices[0]].item
        return float(np.mean([verifier.task.reward(item, verifier.tok.decode(c.token_ids.tolist(),
            skip_special_tokens=True))
                              for c in sub.completions]))

    drawn: dict[int, float] = {}  # instance -> its group's reward, each time it was leased
    trained: dict[int, list[float]] = {}  # instance -> rewards of the groups accepted for it
    picky_seen, picky_kept, released = [], [], 0
    while orch.db.get_int("prompt_cursor") < instances or orch.leases.reissue_depth():
        for name, wid in workers.items():
            got = orch.lease(wid, LeaseRequest(loaded_policy_version=0, max_prompts=1)).lease
            if got is None:
                continue
            (instance,) = orch.leases.get(got.lease_id).instances
            sub = draws(got, k)
            r = group_reward(got, sub)
            assert drawn.setdefault(instance, r) == r  # leased again, by anyone: the same draws
            if name == "picky" and len(picky_seen) >= 3 and r < float(np.median(picky_seen)):
                picky_seen.append(r)
                time.sleep(0.02)  # generated and scored: past the free window its fast submissions measured
                orch.release(wid, got.lease_id)
                released += 1
                continue
            if name == "picky":
                picky_seen.append(r)
                picky_kept.append(r)
            orch.admission.submit(wid, encode(sub), None)
            while orch.verification.verify_pending():
                pass
            trained.setdefault(instance, []).append(r)
    honest_mean = float(np.mean(list(drawn.values())))  # every instance's draws, as an honest swarm trains them
    trained_mean = float(np.mean([r for rs in trained.values() for r in rs]))
    print(f"selector released {released} of {len(picky_seen)} leases; its submitted groups' mean reward "
        f"{np.mean(picky_kept):.4f}, "
          f"all its draws {np.mean(picky_seen):.4f}; trained mean {trained_mean:.4f}, honest draws of the same "
          f"instances {honest_mean:.4f}")
    assert released >= 3 and np.mean(picky_kept) > np.mean(picky_seen)  # it did select among its own groups
    # Every instance was trained exactly once, with its own draws: the trainer's data is an honest swarm's.
    assert sorted(trained) == sorted(drawn) and all(len(rs) == 1 for rs in trained.values())
    assert trained_mean == honest_mean
    picky = {r.worker_id: r for r in orch.operators.worker_list().workers}[workers["picky"]]
    assert picky.releases_charged == released and picky.token_release_ratio > orch.cfg.max_release_ratio
    assert orch.status().releases_charged == released
    assert orch.status().max_token_release_ratio == picky.token_release_ratio
    orch.db.close()
