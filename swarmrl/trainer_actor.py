"""The trainer actor: the trainer and the shardcast origin in one process (the origin lives on trainer
rank 0), taking its own batches from the orchestrator actor. No sample passes through the driver: the
driver calls `train_step()` and gets metrics back.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from swarmrl.actors import orchestrator_actor_name, pin_to_cpus
from swarmrl.config import RunConfig
from swarmrl.run_dir import RunDir


class RayBatchSource:
    """`trainer.batch_loop.BatchSource` over the orchestrator actor: the transport, and nothing else."""

    def __init__(self, orchestrator: Any):
        self.orchestrator = orchestrator

    def take_batch(self, n: int, trainer_version: int | None = None, wait_s: float = 0.0) -> Any:
        import ray

        return ray.get(self.orchestrator.take_batch.remote(n, trainer_version, wait_s=wait_s))

    def commit_batch(self, batch_id: str, trained_from_version: int, published: dict[int, str], dropped_stale: int = 0) -> dict[int, int]:
        import ray

        return ray.get(self.orchestrator.commit_batch.remote(batch_id, trained_from_version, published, dropped_stale))

    def give_back_batch(self, batch_id: str) -> int:
        import ray

        return ray.get(self.orchestrator.give_back_batch.remote(batch_id))


class TrainerActor:
    def __init__(self, config: RunConfig, model_dir: str, run_dir: str, key_path: str):
        import torch

        from shardcast.keys import load_or_generate_signing_key
        from shardcast.origin import Origin
        from shardcast.server import serve_origin
        from trainer.train import Trainer

        pin_to_cpus(config.resources.cpu_affinity.get("trainer"))
        if config.trainer.num_threads:
            torch.set_num_threads(config.trainer.num_threads)
        self.config = config
        rd = RunDir(run_dir)
        self.origin = Origin.from_config(rd.origin_dir, load_or_generate_signing_key(Path(key_path)), config.shardcast)
        self.server = serve_origin(self.origin, config.shardcast.host, config.shardcast.origin_port)
        self.trainer = Trainer(config.trainer, Path(model_dir), rd.root, publish=self._publish,
                               sampling_temperature=config.orchestrator.sampling.temperature)
        # After a crash the trainer resumes from its last checkpoint. Versions the origin published after
        # that checkpoint are withdrawn: they will be trained again and published under the same numbers,
        # so versions never skip. (With checkpoint_every = 1 there is at most one, from the step in flight.)
        for v in self.origin.versions():
            if v > self.trainer.version:
                self.origin.drop(v)
        if self.trainer.version not in self.origin.versions():
            self._publish(self.trainer.version, self.trainer.state_dict_for_publish())
        self.loop: Any = None  # the BatchLoop, made (and reconciled) on the first train_step

    def _publish(self, version: int, state_dict: Any) -> str:
        if self.origin.manifest(version) is not None:
            self.origin.drop(version)  # a restarted trainer re-publishes a version it lost
        return self.origin.publish(version, state_dict).model_hash

    def _latest_model_hash(self) -> str:
        latest = self.origin.latest()
        return self.origin.manifest(latest).model_hash if latest is not None else ""

    def info(self) -> dict[str, Any]:
        return {
            "origin_url": self.server.url,
            "public_key": self.origin.public_key_b64,
            "version": self.trainer.version,
            "model_hash": self._latest_model_hash(),
            "last_batch_id": self.trainer.data_cursor.get("last_batch_id"),
            "pid": os.getpid(),
        }

    def train_step(self) -> dict[str, Any] | None:
        """One step from the orchestrator's batches: None until a whole batch is ready."""
        result = self._batch_loop().step()
        if result is None:
            return None
        return {"batch_id": result.batch_id, "metrics": result.metrics, "staleness": result.staleness, "pid": os.getpid()}

    def _batch_loop(self) -> Any:
        """The first call of each incarnation of this actor (a Ray restart makes a new one) finds the
        orchestrator by name and reconciles: the batch the checkpoint trained is committed, any other
        batch in flight goes back, the version this trainer resumes from is published."""
        if self.loop is None:
            import ray

            from trainer.batch_loop import BatchLoop

            orchestrator = ray.get_actor(orchestrator_actor_name(self.config))
            cursor = self.trainer.data_cursor
            ray.get(orchestrator.reconcile_trainer.remote(
                cursor.get("last_batch_id"), int(cursor.get("last_batch_from_version", self.trainer.version)), self.trainer.version, self._latest_model_hash(),
            ))
            self.loop = BatchLoop(self.trainer, RayBatchSource(orchestrator), self.config.trainer.samples_per_step)
        return self.loop

    def checkpoint(self) -> None:
        self.trainer.save_checkpoint()

    def ping(self) -> int:
        return self.trainer.version
