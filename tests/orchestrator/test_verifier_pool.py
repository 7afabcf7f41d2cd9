"""The driver's verifier pool on a real Ray cluster with real `VerifierActor`s: an actor that cannot be
placed yet is pending (not an error, no jobs), it goes first when the pool shrinks, a live actor that is
removed leaves the dispatch list at once and is killed later, and the verdicts of honest rollouts (the
real vLLM worker engine) come back from whichever actors are live."""

from __future__ import annotations

import time

import pytest

from protocol.models import SamplingParams


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    # One unit of the custom resource "verifier": like a KubeRay verifier group of one node, so a second
    # actor that asks for it waits (on KubeRay the autoscaler would add a node for it).
    ray.init(num_cpus=2, resources={"verifier": 1}, include_dashboard=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def jobs(tiny_model_dir):
    from tools.verifier_calibration import honest_jobs

    return honest_jobs(tiny_model_dir, 6, SamplingParams(temperature=1.0, max_tokens=24, stop_token_ids=[]))


def test_pending_live_shrink_and_dispatch(ray_cluster, tiny_model_dir, jobs, tmp_path):
    ray = ray_cluster
    from swarmrl.actors import RayVerifierPool
    from swarmrl.verifier_pool import VerifierPool
    from verifier.config import VerifierConfig

    pool = VerifierPool(VerifierConfig(), lambda v: tiny_model_dir, str(tiny_model_dir), resources={"verifier": 1}, run_dir=str(tmp_path), retire_after_s=0.0)
    try:
        pool.grow(1)
        ready = pool.wait_live(1, timeout_s=120)
        assert [m.name for m, _, _ in ready] == ["verifier-0"] and len(pool.live) == 1
        assert (tmp_path / "logs" / "verifier-0.log").exists()

        # A second actor needs the one "verifier" unit the first holds: pending, and no error.
        pool.grow(1)
        time.sleep(2.0)
        new, failed = pool.refresh()
        assert (new, failed) == ([], [])
        assert len(pool.live) == 1 and len(pool.pending) == 1 and pool.size == 2

        # The orchestrator's dispatcher verifies on the live actors only.
        dispatch = RayVerifierPool(pool.handles(), timeout_s=120)
        verdicts = dispatch.verify_many(jobs)
        assert [v.status.value for v in verdicts] == ["accepted"] * len(jobs), [v.rejections for v in verdicts]

        # Shrinking drops the pending actor first; the live one stays and keeps verifying.
        assert pool.resize(1) == []
        assert len(pool.live) == 1 and not pool.pending

        # Now the unit is free... of the pending actor: a new request is placed once the live one goes.
        pool.grow(1)
        removed = pool.shrink(1)  # the newest is the pending one again
        assert removed == [] and len(pool.live) == 1
        live = pool.live[0].handle
        removed = pool.resize(0)
        assert removed == ["verifier-0"] and pool.size == 0
        dispatch.set_actors(pool.handles())
        with pytest.raises(RuntimeError, match="no verifier actor"):
            dispatch.verify_many(jobs[:1])
        pool.refresh()  # retire_after_s=0: killed now
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(live.ping.remote(), timeout=60)

        # The freed resource lets a new actor be placed: pending -> live.
        pool.grow(1)
        pool.wait_live(1, timeout_s=120)
        assert [m.name for m in pool.live] == ["verifier-3"]
        dispatch.set_actors(pool.handles())
        assert [v.status.value for v in dispatch.verify_many(jobs[:2])] == ["accepted"] * 2
    finally:
        pool.shutdown()


def test_an_actor_that_cannot_start_is_reported_not_raised(ray_cluster, tmp_path):
    from swarmrl.verifier_pool import VerifierPool
    from verifier.config import VerifierConfig

    pool = VerifierPool(VerifierConfig(), lambda v: tmp_path, str(tmp_path / "no-tokenizer-here"), max_restarts=0)
    try:
        pool.grow(1)
        deadline = time.time() + 120
        failed: list = []
        while not failed and time.time() < deadline:
            _, failed = pool.refresh()
            time.sleep(0.2)
        assert [name for name, _ in failed] == ["verifier-0"] and pool.size == 0
        with pytest.raises(RuntimeError, match="verifier-1 could not start"):
            pool.grow(1)
            pool.wait_live(1, timeout_s=120)
    finally:
        pool.shutdown()
