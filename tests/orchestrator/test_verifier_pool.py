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

    pool = VerifierPool(VerifierConfig(), lambda v: tiny_model_dir, str(tiny_model_dir), resources={"verifier": 1},
        run_dir=str(tmp_path), retire_after_s=0.0)
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
        assert dispatch.parallelism == 1  # the orchestrator takes batch_size jobs per live actor
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
        pool.refresh()  # retire_after_s=0: killed now (ray.kill is asynchronous: a ping may still get through)
        deadline = time.time() + 60
        with pytest.raises(ray.exceptions.RayActorError):
            while time.time() < deadline:
                ray.get(live.ping.remote(), timeout=60)
                time.sleep(0.2)

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


class ScriptedScaler:
    """The sizing decision is tested on its own (tests/foundation/test_verifier_scaling.py); here it is
    scripted, to test what the driver does with it for real: the orchestrator actor's status, the pool
    and the supervisor."""

    def __init__(self) -> None:
        self.target = 1
        self.loads: list = []

    def desired(self, load, now):
        self.loads.append(load)
        return self.target


def test_the_driver_tick_resizes_the_pool_and_tells_the_orchestrator(ray_cluster, tiny_model_dir, tmp_path):
    ray = ray_cluster
    from orch_fakes import run_config

    from swarmrl.actors import start_orchestrator_actor
    from swarmrl.driver import Run
    from swarmrl.verifier_pool import VerifierPool
    from verifier.config import VerifierConfig

    cfg = run_config(tmp_path, admin_token="adm", join_tokens=["join"])
    cfg.model.path = str(tiny_model_dir)
    run = Run(cfg)
    run.pool = VerifierPool(VerifierConfig(), lambda v: tiny_model_dir, str(tiny_model_dir), resources={"verifier": 1},
        run_dir=str(run.rd.root), retire_after_s=0.0)
    run.scaler = scripted = ScriptedScaler()
    orch = None
    try:
        run.pool.grow(1)
        run.pool.wait_live(1, timeout_s=120)
        orch = run.orch = start_orchestrator_actor(cfg, run.pool.handles(), max_restarts=0)
        ray.get(orch.ping.remote(), timeout=120)

        def tick(until, timeout_s: float = 120.0):
            deadline = time.time() + timeout_s
            while True:
                run._next_scale = 0.0
                run._scale_verifiers()
                st = ray.get(orch.status.remote())
                if until(st) or time.time() > deadline:
                    return st
                time.sleep(0.5)

        # The tick read the orchestrator's queue and rates, and told it the pool (1 live).
        st = tick(lambda st: st.verifier_actors == 1)
        assert (st.verifier_actors, st.verifier_actors_pending) == (1, 0)
        assert scripted.loads and scripted.loads[-1].live == 1 and scripted.loads[-1].queue == st.verify_queue == 0

        # Grow to 2: the second actor cannot be placed (one "verifier" unit): pending, in the status too.
        scripted.target = 2
        st = tick(lambda st: st.verifier_actors_pending == 1)
        assert (st.verifier_actors, st.verifier_actors_pending) == (1, 1) and run.supervisor.failure is None

        # Shrink to 0 (below any min: scripted): the pending actor goes first, then verifier-0 leaves the
        # orchestrator's list and the supervisor's watch.
        scripted.target = 0
        st = tick(lambda st: st.verifier_actors == 0)
        assert (st.verifier_actors, st.verifier_actors_pending) == (0, 0)
        assert not any(n.startswith("verifier-") for n in run.supervisor.components)

        # Grow again: the freed unit takes the new actor, which turns live and is watched.
        scripted.target = 1
        st = tick(lambda st: st.verifier_actors == 1)
        assert (st.verifier_actors, st.verifier_actors_pending) == (1, 0)
        assert [n for n in run.supervisor.components if n.startswith("verifier-")] == ["verifier-2"]
    finally:
        if orch is not None:
            ray.get(orch.shutdown.remote(), timeout=60)
            ray.kill(orch)
        run.pool.shutdown()
