"""The trainer's ranks as Ray actors, and what the driver does when one dies.

- `trainer.world_size = 1`: one TrainerActor, as it always was. Ray restarts it when it dies
  (max_restarts=-1); it resumes from its last durable checkpoint by itself.
- `trainer.world_size = N > 1`: N TrainerActors in one placement group (one bundle per rank:
  `resources.trainer_gpus` GPUs, `resources.trainer_resources`; strategy `resources.trainer_placement`).
  Rank 0 picks the rendezvous address and port (`rendezvous()`, returned through Ray), every rank joins
  the torch.distributed group (NCCL on GPUs, gloo on CPUs) and loads the model or the last checkpoint,
  and ranks 1..N-1 then `follow` rank 0 (trainer/ranks.py). A process group does not survive one of its
  processes, so Ray restarts none of them: when any rank dies, `restart()` kills the others and starts
  all N again in the same placement group, from the last durable checkpoint. The driver counts that as
  one restart of "trainer" under the supervisor's restart policy.

    group = TrainerGroup(cfg, model_dir, run_dir, key_path).start()
    out = group.call("train_step")   # on rank 0; raises TrainerDied if any rank died
    group.restart()                  # N > 1: the whole group again, from the last checkpoint
"""

from __future__ import annotations

import logging
import time
from typing import Any

from swarmrl.config import RunConfig
from swarmrl.processes import RunFailed

log = logging.getLogger(__name__)


class TrainerDied(RuntimeError):
    """A rank of a trainer group died (or failed in a collective): the group must start again."""


class TrainerGroup:
    def __init__(self, cfg: RunConfig, model_dir: str, run_dir: str, key_path: str):
        self.cfg = cfg
        self.args = (cfg, str(model_dir), str(run_dir), str(key_path))
        self.world_size = cfg.trainer.world_size
        self.actors: list[Any] = []
        self.follows: list[Any] = []  # ranks 1..N-1's `follow` calls: one finishing means the group broke
        self.pids: list[int] = []  # each rank's process (N > 1; the followers are busy following, no ping)
        self.placement_group: Any = None

    @property
    def leader(self) -> Any:
        return self.actors[0]

    def start(self, timeout_s: float = 600.0) -> "TrainerGroup":
        import ray

        from swarmrl.trainer_actor import TrainerActor

        res = self.cfg.resources
        if self.world_size == 1:
            # max_restarts=-1: Ray always restarts a dead actor; the supervisor decides when it died too often.
            actor = ray.remote(num_cpus=0, num_gpus=res.trainer_gpus, resources=res.trainer_resources or None,
                max_restarts=-1, max_task_retries=0)
            self.actors = [actor(TrainerActor).remote(*self.args)]
            return self
        if self.placement_group is None:
            self.placement_group = self._placement_group(timeout_s)
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        self.actors = [
            ray.remote(num_cpus=0, num_gpus=res.trainer_gpus, resources=res.trainer_resources or None, max_restarts=0,
            max_task_retries=0)(TrainerActor)
            .options(scheduling_strategy=PlacementGroupSchedulingStrategy(self.placement_group,
            placement_group_bundle_index=rank))
            .remote(*self.args, rank=rank)
            for rank in range(self.world_size)
        ]
        address, port = ray.get(self.leader.rendezvous.remote(), timeout=timeout_s)
        log.info("forming the trainer group", extra={"world_size": self.world_size, "master": f"{address}:{port}"})
        starts = [a.start.remote(address, port) for a in self.actors]
        # Queued behind each follower's start: rank 0's start may already announce a collective call.
        self.follows = [a.follow.remote() for a in self.actors[1:]]
        self.pids = self._wait_all(starts, timeout_s)
        return self

    def _placement_group(self, timeout_s: float) -> Any:
        """One bundle per rank. A bundle needs some resource, so a CPU rank reserves one CPU."""
        import ray
        from ray.util.placement_group import placement_group

        res = self.cfg.resources
        bundle = {"CPU": 1.0, **({"GPU": res.trainer_gpus} if res.trainer_gpus else {}), **res.trainer_resources}
        pg = placement_group([dict(bundle) for _ in range(self.world_size)], strategy=res.trainer_placement,
            name=f"swarmrl-trainer:{self.cfg.name}")
        ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
        if not ready:
            ray.util.remove_placement_group(pg)
            raise RunFailed(f"the cluster could not place {self.world_size} trainer ranks of {bundle} "
                f"({res.trainer_placement}) within {timeout_s:.0f} s")
        return pg

    def _wait_all(self, refs: list[Any], timeout_s: float) -> list[Any]:
        """Every result, or TrainerDied at the first failure (the other ranks would wait for it forever)."""
        import ray

        pending, deadline = list(refs), time.monotonic() + timeout_s
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            if not done:
                raise TrainerDied(f"{len(pending)} trainer rank(s) did not start within {timeout_s:.0f} s")
            self._get(done[0])
        return ray.get(refs)

    def _get(self, ref: Any, timeout_s: float | None = None) -> Any:
        import ray
        from ray.exceptions import RayActorError, RayTaskError

        try:
            return ray.get(ref, timeout=timeout_s)
        except RayActorError as exc:
            raise TrainerDied(f"a trainer rank died: {str(exc).splitlines()[0][:300]}") from exc
        except RayTaskError as exc:  # a collective failed because another rank went away, or a real error
            raise TrainerDied(f"a trainer rank failed: {str(exc).splitlines()[0][:300]}") from exc

    def call(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        """`method` on rank 0. With N > 1, a follower that stops (it died, or its collective failed) ends
        the wait too, since rank 0 may then wait on a collective that never completes (NCCL)."""
        import ray

        ref = getattr(self.leader, method).remote(*args)
        if self.world_size == 1:
            return ray.get(ref, timeout=timeout_s)
        done, _ = ray.wait([ref, *self.follows], num_returns=1, timeout=timeout_s)
        if not done:
            raise TimeoutError(f"trainer.{method} did not answer within {timeout_s} s")
        if ref not in done:
            self._get(done[0])  # raises TrainerDied with the follower's error
            raise TrainerDied("a trainer rank stopped following rank 0")
        return self._get(ref)

    def restart(self, timeout_s: float = 600.0) -> None:
        """N > 1: kill every rank and start the group again (from the last durable checkpoint)."""
        self._kill()
        # the old rank 0's origin must let go of its port first
        if not self.cfg.ray_address and self.cfg.shardcast.origin_port:
            from swarmrl.processes import wait_until_free

            wait_until_free(self.cfg.shardcast.host, self.cfg.shardcast.origin_port)
        self.start(timeout_s)

    def _kill(self) -> None:
        import ray

        for a in self.actors:
            ray.kill(a, no_restart=True)
        # A killed actor's calls fail once its process is gone (a follower's `follow` ends then).
        for ref in [a.ping.remote() for a in self.actors[:1]] + self.follows:
            try:
                ray.get(ref, timeout=30)
            except Exception:
                pass
        self.actors, self.follows, self.pids = [], [], []

    def shutdown(self) -> None:
        """Kill the ranks and free the placement group (a local Ray does this when it shuts down)."""
        import ray

        self._kill()
        if self.placement_group is not None:
            ray.util.remove_placement_group(self.placement_group)
            self.placement_group = None
