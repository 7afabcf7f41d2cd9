"""The trainer takes its own batches from a `BatchSource` (the orchestrator, through whatever transport
carries it: a Ray actor in `swarmrl run`, the object itself in tests), trains, and makes each step
durable in the background while the next one trains:

    loop = BatchLoop(trainer, source, samples_per_step, versions=...)
    loop.step()        # take a batch, train it, hand its publish/checkpoint/commit to the writer
    loop.committed()   # the steps whose checkpoint is durable and whose batch is committed, in order

A batch is committed only once the checkpoint that includes it is durable: taken -> (trained in memory)
-> trained (told to the orchestrator) -> checkpoint written -> versions published -> committed (and the
versions announced to the workers). A version is thus never announced before it is durable, so no worker
ever generates with weights that a trainer crash can undo.

The checkpoint records the take sequences of every batch the weights include (`protocol.batches.Lineage`)
and the batches not yet known to be committed. Whenever the orchestrator or the trainer may have
restarted, `reconcile` makes the durable state equal to the weights (waiting for the writer, and
writing one more checkpoint if a step is not in one yet) and hands that lineage to the orchestrator,
which commits what it holds and takes back the rest. The orchestrator hands out no batch before that.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from protocol.batches import Batch, Lineage, ReconcileFirst
from protocol.retry import backoff_delays
from trainer import checkpoint as ckpt
from trainer.background import BackgroundWriter
from trainer.samples import samples_from_groups
from trainer.train import Trainer

log = logging.getLogger(__name__)

# Each checkpoint also carries the metrics of the last few steps, so that steps committed but not yet
# reported when a trainer died are reported by the next one (the driver skips versions it has).
RECENT_STEPS = 8


class SourceUnavailable(RuntimeError):
    """The batch source did not answer (the orchestrator died or is restarting); the transport raises it."""


class BatchSource(Protocol):
    """What the orchestrator offers the trainer (orchestrator.service.Orchestrator has these methods)."""

    def take_batch(self, n: int, trainer_version: int | None = None, wait_s: float = 0.0) -> Batch: ...

    def give_back_batch(self, batch_id: str) -> int: ...

    def mark_trained(self, batch_id: str, trained_from_version: int) -> bool: ...

    def commit_batches(self, batches: dict[str, int], published: dict[int, str]) -> dict[int, int]: ...

    def reconcile_trainer(self, lineage: list[list[int]], from_versions: dict[str, int], published: dict[int, str],
        superseded: dict[int, str] | None = None) -> dict[str, int]: ...


@dataclass
class StepResult:
    batch_id: str
    metrics: dict[str, float]  # Trainer.step's, plus time/wait_for_rollouts, time/step and the writer's times
    staleness: dict[int, int]  # version gap -> samples trained: the step's own tally (Trainer.last_staleness)


class BatchLoop:
    def __init__(
        self,
        trainer: Trainer,
        source: BatchSource,
        samples_per_step: int,
        wait_s: float = 2.0,
        *,
        versions: Callable[[], dict[int, str]] = dict,
        superseded: dict[int, str] | None = None,
        background: bool = True,
    ):
        """`versions()`: every version the trainer serves now, with its model hash (announced at each
        reconciliation, up to the durable version). `superseded`: versions withdrawn at start (trained
        after the checkpoint this trainer resumed from), reported at the first reconciliation.
        `background=False` runs each step's writing in the step itself (the old, slower way)."""
        if not trainer.defer_io:
            raise ValueError("the batch loop needs a Trainer made with defer_io=True: it publishes and checkpoints "
                "itself")
        self.trainer, self.source = trainer, source
        self.samples_per_step, self.wait_s = samples_per_step, wait_s
        self.versions = versions
        self._superseded = dict(superseded or {})
        cursor = trainer.data_cursor
        self.lineage = Lineage(cursor.get("lineage"))
        self.uncommitted: dict[str, int] = {k: int(v) for k, v in cursor.get("uncommitted", {}).items()}
        if "last_batch_id" in cursor and "lineage" not in cursor:  # a checkpoint of an older swarmrl
            self.uncommitted[cursor["last_batch_id"]] = int(cursor.get("last_batch_from_version", trainer.version))
        self._durable_last = self.lineage.last()  # the newest batch a durable checkpoint holds
        self._durable_version = trainer.version
        self._unannounced: dict[int, str] = {}  # published, not yet announced by a commit
        self._pending: dict[str, StepResult] = {}  # trained, not committed
        self._done: list[StepResult] = []  # committed, not yet handed to the caller
        self._recent: deque[StepResult] = deque(maxlen=RECENT_STEPS)  # for the checkpoints
        # The steps the checkpoint we resumed from names: reported (again) once reconciled.
        self._recovered = [StepResult(r["batch_id"], r["metrics"], {int(k): v for k, v in r["staleness"].items()})
            for r in cursor.get("recent_steps", [])]
        self._lock = threading.Lock()
        self._waited = 0.0  # time spent waiting for a whole batch since the last step
        self.needs_reconcile = True  # a new trainer (or a resumed one) always reconciles first
        if background and not ckpt.snapshot_fits(trainer.model, trainer.optimizer):
            log.warning("checkpoints are written in the step: a background copy of the weights and the optimizer "
                "state would "
                        "not fit in the memory available",
                        extra={"snapshot_gib": round(ckpt.snapshot_bytes(trainer.model, trainer.optimizer) / 2**30, 2)})
            background = False
        self.writer = BackgroundWriter() if background else None
        trainer.snapshot_copies = background  # written in the step, a checkpoint is taken from the live tensors

    # ---------------------------------------------------------------- the step

    def step(self) -> StepResult | None:
        """Take a whole batch (waiting up to wait_s), train on it and hand its writing to the writer;
        None if none was ready (a partial batch goes back) or the orchestrator must be reconciled first."""
        if self.needs_reconcile:
            self.reconcile()
        t0 = time.perf_counter()
        try:
            batch = self.source.take_batch(self.samples_per_step, self.trainer.version, self.wait_s)
            if 0 < batch.num_samples < self.samples_per_step:
                self.source.give_back_batch(batch.batch_id)
        except (ReconcileFirst, SourceUnavailable) as exc:
            log.warning("the orchestrator restarted or is unreachable; reconciling before the next batch",
                extra={"reason": str(exc)[:200]})
            self.needs_reconcile = True
            return None
        if batch.num_samples < self.samples_per_step:
            self._waited += time.perf_counter() - t0
            if self._undurable() and not (self.writer is not None and self.writer.busy):
                # Waiting for rollouts with steps that no checkpoint holds yet (checkpoint_every > 1): their
                # batches still count against the async bound and their versions are not announced, so the
                # workers may be waiting for exactly this checkpoint. Write it now.
                self._submit(self._job(None, None, force_checkpoint=True))
            return None
        waited, self._waited = self._waited + time.perf_counter() - t0, 0.0
        t1 = time.perf_counter()
        start = self.trainer.version
        with self._lock:
            self.lineage.add(batch.seq)
            self.uncommitted[batch.batch_id] = start
            self.trainer.data_cursor = self._cursor()  # so the step's checkpoint says it holds this batch
        metrics = self.trainer.step(samples_from_groups(batch.groups))
        metrics["time/wait_for_rollouts"] = waited
        result = StepResult(batch.batch_id, metrics, dict(self.trainer.last_staleness.trained))
        self._pending[batch.batch_id] = result
        self._recent.append(result)
        metrics["time/checkpoint_wait"] = self._submit(self._job(batch.batch_id, start))
        metrics["time/step"] = time.perf_counter() - t1  # the trainer's critical path for this batch
        return result

    def committed(self) -> list[StepResult]:
        """The steps committed since the last call, oldest first. After a restart, first the last steps
        of the checkpoint it resumed from (whose report may have died with the last trainer)."""
        if self.needs_reconcile:
            return []
        with self._lock:
            done, self._done, self._recovered = self._recovered + self._done, [], []
        return done

    def finish(self) -> None:
        """Make every trained step durable and committed (end of the run)."""
        self._make_durable()
        if self.needs_reconcile:
            self.reconcile()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    # ---------------------------------------------------------------- reconciliation

    def reconcile(self, timeout_s: float = 600.0) -> dict[str, int]:
        """Settle every batch in flight with the orchestrator, by what is durable, once the durable state
        holds every batch these weights trained. Waits for the orchestrator to answer (it may be
        restarting) up to timeout_s."""
        self._make_durable()
        delays, deadline = backoff_delays(0.5, 5.0), time.monotonic() + timeout_s
        published = {v: h for v, h in self.versions().items() if v <= self._durable_version}
        while True:
            try:
                out = self.source.reconcile_trainer(self.lineage.to_json(), dict(self.uncommitted), published,
                    dict(self._superseded))
                break
            except SourceUnavailable as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the orchestrator did not answer for {timeout_s:.0f} s: {exc}") from exc
                time.sleep(next(delays))
        with self._lock:
            self._done.extend(self._pending[b] for b in self.uncommitted if b in self._pending)
            for b in self.uncommitted:
                self._pending.pop(b, None)
            self.uncommitted.clear()
            self._unannounced.clear()
            self.trainer.data_cursor = self._cursor()
        self._superseded.clear()
        self.needs_reconcile = False
        log.info("reconciled with the orchestrator", extra={**out, "lineage_batches": len(self.lineage),
            "version": self.trainer.version})
        return out

    def _make_durable(self) -> None:
        """Wait for the writer; if the weights hold a batch or a version that no durable checkpoint has
        (checkpoint_every > 1, or a step without one), write one now."""
        self._flush()
        if self._undurable():
            self._submit(self._job(None, None, force_checkpoint=True))
            self._flush()

    def _undurable(self) -> bool:
        """Whether the weights hold a batch or a version that no durable checkpoint has."""
        return self.lineage.last() != self._durable_last or self.trainer.version != self._durable_version

    # ---------------------------------------------------------------- the writer's job

    def _job(self, batch_id: str | None, start: int | None, force_checkpoint: bool = False) -> Callable[[], None]:
        """What the writer does for one step, in order: tell the orchestrator the batch is trained,
        publish the versions before the checkpointed one, write the checkpoint, publish its version,
        then commit what the checkpoint holds and announce the published versions."""
        publish, self.trainer.pending_publish = self.trainer.pending_publish, []
        state, self.trainer.pending_checkpoint = self.trainer.pending_checkpoint, None
        if force_checkpoint:
            state = self.trainer.checkpoint_state()
        if state is not None:
            state["trainer_state"]["data_cursor"]["recent_steps"] = [
                {"batch_id": r.batch_id, "metrics": copy.copy(r.metrics), "staleness": r.staleness}
                for r in self._recent
            ]
        result = self._pending.get(batch_id) if batch_id else None

        def run() -> None:
            times: dict[str, float] = {}
            if batch_id is not None:
                self._quietly(self.source.mark_trained, batch_id, start)
            t = time.perf_counter()
            durable_version = state["step"] if state is not None else None
            for version, weights in publish:
                if version != durable_version:
                    self._unannounced[version] = self.trainer.publish_fn(version, weights) or ""
            times["time/publish_bg"] = time.perf_counter() - t
            if state is not None:
                t = time.perf_counter()
                ckpt.save_checkpoint(**state)
                times["time/checkpoint_bg"] = time.perf_counter() - t
                t = time.perf_counter()
                for version, weights in publish:
                    if version == durable_version:
                        self._unannounced[version] = self.trainer.publish_fn(version, weights) or ""
                times["time/publish_bg"] += time.perf_counter() - t
            if result is not None:
                result.metrics.update(times)
            if state is not None:
                self._durable(state)

        return run

    def _durable(self, state: dict[str, Any]) -> None:
        """The checkpoint `state` is on disk: commit the batches it holds and announce its versions."""
        cursor = state["trainer_state"]["data_cursor"]
        self._durable_last = Lineage(cursor.get("lineage")).last()
        self._durable_version = int(state["step"])
        batches = {b: int(v) for b, v in cursor.get("uncommitted", {}).items()}
        published = {v: h for v, h in self._unannounced.items() if v <= self._durable_version}
        if not batches and not published:
            return
        if not self._quietly(self.source.commit_batches, batches, published):
            return  # the orchestrator is down: the reconciliation it now needs will commit them
        with self._lock:
            for b in batches:
                self.uncommitted.pop(b, None)
                if b in self._pending:
                    self._done.append(self._pending.pop(b))
            for v in published:
                self._unannounced.pop(v, None)
            self.trainer.data_cursor = self._cursor()

    def _quietly(self, call: Callable[..., Any], *args: Any) -> bool:
        """A call to the orchestrator from the writer: if it is down, note that we must reconcile."""
        try:
            call(*args)
            return True
        except SourceUnavailable as exc:
            log.warning("orchestrator unreachable from the writer; will reconcile", extra={"call": call.__name__,
                "reason": str(exc)[:200]})
            self.needs_reconcile = True
            return False

    def _submit(self, job: Callable[[], None]) -> float:
        """Run the job in the writer (returns how long we waited for the previous one), or here."""
        if self.writer is None:
            job()
            return 0.0
        return self.writer.submit(job)

    def _flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    # ---------------------------------------------------------------- helpers

    def _cursor(self) -> dict[str, Any]:
        """The data cursor that goes into the next checkpoint: a new dict each time (a checkpoint being
        copied in the other thread never sees one change)."""
        return {"lineage": self.lineage.to_json(), "uncommitted": dict(self.uncommitted)}
