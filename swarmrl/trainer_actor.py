"""The trainer actor: the trainer and the shardcast origin in one process (the origin lives on trainer
rank 0), taking its own batches from the orchestrator actor. No sample passes through the driver: the
driver calls `train_step()` and gets back the metrics of the steps that became durable. With
`trainer.world_size` = N > 1 there are N of these actors (swarmrl/trainer_group.py places them); ranks
1..N-1 train their share of each batch that rank 0 takes and broadcasts (trainer/ranks.py).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from swarmrl.actors import component_logging, orchestrator_actor_name, pin_to_cpus
from swarmrl.config import RunConfig
from swarmrl.run_dir import RunDir

log = logging.getLogger(__name__)


class RayBatchSource:
    """`trainer.batch_loop.BatchSource` over the orchestrator actor: the transport, and nothing else. A
    dead or restarting orchestrator (or one that does not answer in time) is `SourceUnavailable`."""

    def __init__(self, orchestrator: Any, timeout_s: float = 120.0):
        self.orchestrator = orchestrator
        self.timeout_s = timeout_s

    def _call(self, method: str, *args: Any, timeout_s: float | None = None, **kwargs: Any) -> Any:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        from trainer.batch_loop import SourceUnavailable

        try:
            return ray.get(getattr(self.orchestrator, method).remote(*args, **kwargs), timeout=timeout_s
                or self.timeout_s)
        except (RayActorError, GetTimeoutError) as exc:
            raise SourceUnavailable(f"orchestrator.{method}: {type(exc).__name__}") from exc

    def take_batch(self, n: int, trainer_version: int | None = None, wait_s: float = 0.0) -> Any:
        return self._call("take_batch", n, trainer_version, wait_s=wait_s, timeout_s=wait_s + self.timeout_s)

    def give_back_batch(self, batch_id: str) -> int:
        return self._call("give_back_batch", batch_id)

    def mark_trained(self, batch_id: str, trained_from_version: int) -> bool:
        return self._call("mark_trained", batch_id, trained_from_version)

    def commit_batches(self, batches: dict[str, int], published: dict[int, str]) -> dict[int, int]:
        return self._call("commit_batches", batches, published)

    def reconcile_trainer(self, lineage: list[list[int]], from_versions: dict[str, int], published: dict[int, str],
        superseded: dict[int, str] | None = None) -> dict[str, int]:
        return self._call("reconcile_trainer", lineage, from_versions, published, superseded)


class TrainerActor:
    """One trainer rank. Rank 0 holds the origin and the batch loop; with `trainer.world_size` > 1 the
    other ranks follow it (trainer/ranks.py). One rank (world_size 1) starts in its constructor, so Ray
    restarts it with the same arguments; a group starts in two calls that swarmrl/trainer_group.py makes:
    `rendezvous()` on rank 0 (its address and a free port), then `start(address, port)` on every rank."""

    def __init__(self, config: RunConfig, model_dir: str, run_dir: str, key_path: str, rank: int = 0):
        import torch

        self.config, self.model_dir, self.run_dir, self.key_path, self.rank = config, model_dir, run_dir, key_path, rank
        component_logging(RunDir(run_dir), "trainer" if rank == 0 else f"trainer-{rank}", config.log_level)
        pin_to_cpus(config.resources.cpu_affinity.get("trainer"))
        if config.trainer.num_threads:
            torch.set_num_threads(config.trainer.num_threads)
        self.trainer: Any = None
        self.loop: Any = None  # the BatchLoop, made (and reconciled) on the first train_step
        self.started_at = time.time()
        if config.trainer.world_size == 1:
            self.start()

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0: the address and a free port of its node, where the group's process group meets (on a
        local Ray, the loopback: every rank runs on this machine)."""
        import ray

        from swarmrl.processes import free_port

        host = ray.util.get_node_ip_address() if self.config.ray_address else "127.0.0.1"
        return host, free_port(host)

    def start(self, master_addr: str = "", master_port: int = 0) -> int:
        """Join the group (all ranks at once: the Trainer's constructor runs collectives), load the model
        or the last checkpoint; rank 0 then serves the origin and leads. Returns this process's pid."""
        world = self.config.trainer.world_size
        if world > 1:  # torchrun's variables: trainer.distributed.init_from_env forms the group from them
            # Ray gives each rank's actor only its own GPUs, so its device is cuda:0 (LOCAL_RANK 0).
            os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port), RANK=str(self.rank),
                WORLD_SIZE=str(world), LOCAL_RANK="0")
        if self.rank == 0:
            self._start_leader()
        else:
            from trainer.train import Trainer

            self.trainer = Trainer(self.config.trainer, Path(self.model_dir), RunDir(self.run_dir).root,
                                   publish=_published_by_rank_0, defer_io=True,
                                   sampling_temperature=self.config.orchestrator.sampling.temperature)
        self.started_at = time.time()
        log.info("trainer rank started", extra={"rank": self.rank, "world_size": world,
            "version": self.trainer.version})
        return os.getpid()

    def follow(self) -> int:
        """Ranks > 0: make the calls rank 0 announces until it releases the group (trainer/ranks.py)."""
        from trainer import ranks

        return ranks.follow(self.trainer)

    def _start_leader(self) -> None:
        from shardcast.keys import load_or_generate_signing_key
        from shardcast.origin import Origin
        from shardcast.server import serve_origin
        from trainer import ranks
        from trainer.train import Trainer

        config, rd = self.config, RunDir(self.run_dir)
        # LoRA versions are whole adapters (megabytes): no delta chains between them.
        shardcast_config = config.shardcast.model_copy(update={
            "deltas": False}) if config.trainer.lora.enabled else config.shardcast
        self.origin = Origin.from_config(rd.origin_dir, load_or_generate_signing_key(Path(self.key_path)),
            shardcast_config)
        self.server = serve_origin(self.origin, config.shardcast.host, config.shardcast.origin_port,
            trusted_proxies=config.shardcast.trusted_proxies)
        self.trainer = Trainer(config.trainer, Path(self.model_dir), rd.root, publish=self._publish, defer_io=True,
                               sampling_temperature=config.orchestrator.sampling.temperature)
        ranks.lead(self.trainer)
        # After a crash the trainer resumes from its last durable checkpoint. A version is published after
        # its checkpoint, so the origin can only hold later versions if it published versions between two
        # checkpoints (checkpoint_every > 1 or mini_batches > 1): they are withdrawn and will be trained
        # again under the same numbers, so versions never skip; the orchestrator learns their old hashes.
        self.superseded: dict[int, str] = {}
        for v in self.origin.versions():
            if v > self.trainer.version:
                manifest = self.origin.manifest(v)
                if manifest is not None:
                    self.superseded[v] = manifest.model_hash
                self.origin.drop(v)
        if self.trainer.version not in self.origin.versions():  # its checkpoint was durable, its publishing not
            self._publish(self.trainer.version, self.trainer.state_dict_for_publish())

    def _publish(self, version: int, state_dict: Any) -> str:
        if self.origin.manifest(version) is not None:
            self.origin.drop(version)  # a restarted trainer re-publishes a version it lost
        return self.origin.publish(version, state_dict).model_hash

    def _versions(self) -> dict[int, str]:
        out = {}
        for v in self.origin.versions():
            manifest = self.origin.manifest(v)
            if manifest is not None:
                out[v] = manifest.model_hash
        return out

    def info(self) -> dict[str, Any]:
        versions = self._versions()
        return {
            "origin_url": self.server.url,
            "public_key": self.origin.public_key_b64,
            "version": self.trainer.version,
            "model_hash": versions.get(self.trainer.version, ""),
            "pid": os.getpid(),
            "started_at": self.started_at,
            "world_size": self.trainer.env.world_size,
        }

    def train_step(self) -> dict[str, Any]:
        """One step from the orchestrator's batches (none once max_steps is reached or no whole batch is
        ready). Returns the steps that became durable and committed since the last call, oldest first."""
        from trainer import ranks

        loop = self._batch_loop()
        trained = None
        if self.trainer.version < self.config.trainer.max_steps:
            trained = loop.step()
        else:
            loop.finish()
        if trained is None:
            ranks.heartbeat(self.trainer)  # the other ranks, waiting for the next call, hear from rank 0
        return {"trained": trained is not None, "committed": [self._result(r) for r in loop.committed()],
            "version": self.trainer.version, "pid": os.getpid()}

    def finish(self) -> list[dict[str, Any]]:
        """Make every trained step durable and committed (the end of the run); returns those steps."""
        if self.loop is None:
            return []
        self.loop.finish()
        return [self._result(r) for r in self.loop.committed()]

    @staticmethod
    def _result(r: Any) -> dict[str, Any]:
        return {"batch_id": r.batch_id, "metrics": r.metrics, "staleness": r.staleness}

    def _batch_loop(self) -> Any:
        """The first call of each incarnation of this actor (a Ray restart makes a new one) finds the
        orchestrator by name; the loop's first step reconciles with it."""
        if self.loop is None:
            import ray

            from trainer.batch_loop import BatchLoop

            orchestrator = ray.get_actor(orchestrator_actor_name(self.config))
            self.loop = BatchLoop(
                self.trainer, RayBatchSource(orchestrator), self.config.trainer.samples_per_step,
                versions=self._versions, superseded=self.superseded,
                background=self.config.trainer.background_checkpoints,
            )
        return self.loop

    def release(self) -> None:
        """Rank 0: let the other ranks' `follow` return (the end of a group's run)."""
        from trainer import ranks

        ranks.release(self.trainer)

    def ping(self) -> int:
        return os.getpid()


def _published_by_rank_0(version: int, state_dict: Any) -> str:
    """The publish function of ranks > 0: they take part in gathering the weights, but rank 0 alone
    publishes them (Trainer only calls it on rank 0)."""
    raise AssertionError("only trainer rank 0 publishes")
