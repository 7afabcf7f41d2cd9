"""The trainer takes its own batches: from a `BatchSource` (the orchestrator, through whatever transport
carries it: a Ray actor in `swarmrl run`, the object itself in tests), trains one step, and commits the
batch with the versions that step published, in one call.

    loop = BatchLoop(trainer, source, samples_per_step)
    result = loop.step()   # None until a whole batch is ready

Before training, the batch id and the version the step starts from go into the trainer's data cursor, so
that the checkpoint that includes the step also records which batch it trained (restart reconciliation:
swarmrl.trainer_actor.TrainerActor).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

from protocol.batches import Batch
from trainer.samples import samples_from_groups
from trainer.train import Trainer


class BatchSource(Protocol):
    """What the orchestrator offers the trainer (orchestrator.service.Orchestrator has these methods)."""

    def take_batch(self, n: int, trainer_version: int | None = None, wait_s: float = 0.0) -> Batch: ...

    def commit_batch(self, batch_id: str, trained_from_version: int, published: dict[int, str], dropped_stale: int = 0) -> dict[int, int]: ...

    def give_back_batch(self, batch_id: str) -> int: ...


@dataclass
class StepResult:
    batch_id: str
    metrics: dict[str, float]  # Trainer.step's, plus time/wait_for_rollouts
    staleness: dict[int, int]  # version gap -> samples, as the orchestrator recorded it


class BatchLoop:
    def __init__(self, trainer: Trainer, source: BatchSource, samples_per_step: int, wait_s: float = 2.0):
        self.trainer = trainer
        self.source = source
        self.samples_per_step = samples_per_step
        self.wait_s = wait_s
        self._waited = 0.0  # time spent waiting for a whole batch since the last step

    def step(self) -> StepResult | None:
        """Take a whole batch (waiting up to wait_s), train on it and commit it; None if none was ready
        (a partial batch goes back)."""
        t0 = time.perf_counter()
        batch = self.source.take_batch(self.samples_per_step, self.trainer.version, self.wait_s)
        if batch.num_samples < self.samples_per_step:
            if batch.num_samples:
                self.source.give_back_batch(batch.batch_id)
            self._waited += time.perf_counter() - t0
            return None
        waited, self._waited = self._waited + time.perf_counter() - t0, 0.0
        start = self.trainer.version
        self.trainer.data_cursor.update(last_batch_id=batch.batch_id, last_batch_from_version=start)
        metrics = self.trainer.step(samples_from_groups(batch.groups))
        # take() already counted the samples it dropped as stale; pass only the trainer's own.
        gaps = self.source.commit_batch(batch.batch_id, start, dict(self.trainer.last_published), int(metrics.get("samples/dropped_stale", 0)))
        metrics["time/wait_for_rollouts"] = waited
        return StepResult(batch.batch_id, metrics, gaps)
