"""The orchestrator: the composer. It constructs the run's concepts and exposes the few methods the HTTP app
(api.py, which calls them with parsed models and the worker it authenticated) and the trainer (through
the Ray actor, or directly in tests: exactly `trainer.batch_loop.BatchSource`) call. Each concept keeps
its own state and SQL:

    db.py            the SQLite file, transactions, counters
    tokens.py        join tokens: identity caps, registration rate, token bans, lease debt
    open_join.py     join tokens claimed for a proof of work, where the run allows it
    model_files.py   the base model's config and tokenizer, for workers with no model of their own
    workers.py       identities, secrets, heartbeats, strikes and bans
    registration.py  a new identity under a join token, and what the worker is told to start with
    leases.py        which prompts and seeds a worker gets, the async bound, expiry (room.py: its long poll)
    lease_requests.py  a worker's lease request: a lease, or when to ask again
    admission.py     every check a submission must pass before it is queued
    verification.py  the verification queue and what a verdict changes
    versions.py      published policy versions, and announcing them (the only way)
    buffer.py        verified groups, batches for the trainer
    batches.py       the trainer's batches: taken -> trained -> committed, and reconciliation
    operators.py     the operator's endpoints: workers, bans, join tokens
    status.py        /v1/status, metrics, rates, history
    evaluation.py    held-out prompts, eval rounds pinned to a version, avg@k / pass@k
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orchestrator import admission, status
from orchestrator.batches import BatchBook
from orchestrator.buffer import RolloutBuffer
from orchestrator.config import EvalConfig, OrchestratorConfig, StepShape
from orchestrator.data import Prompt, PromptSet
from orchestrator.db import Database
from orchestrator.errors import ApiError
from orchestrator.evaluation import RunEvaluation, evaluated_prompts
from orchestrator.lease_requests import LeaseRequests
from orchestrator.leases import LeaseBook
from orchestrator.model_files import BaseModelFiles
from orchestrator.open_join import OpenJoin
from orchestrator.operators import Operators
from orchestrator.registration import Registration
from orchestrator.tokens import JoinTokens, TokenRow
from orchestrator.verification import Verification, Verifier, default_make_job
from orchestrator.versions import PolicyVersions
from orchestrator.workers import Workers
from protocol import limits, staleness
from protocol.batches import Batch, Lineage, ReconcileFirst
from protocol.models import (
    ErrorCode,
    Heartbeat,
    HeartbeatAck,
    LeaseRequest,
    LeaseResponse,
    ReleaseAck,
    WorkerRegistered,
    WorkerRegistration,
)
from protocol.operator_models import EvalResult, RunStatus

log = logging.getLogger(__name__)


class Orchestrator:
    def __init__(
        self, config: OrchestratorConfig, db: Database, prompts: PromptSet, verifier: Verifier, *, shape: StepShape,
        task_name: str = "toy", task_params: dict[str, Any] | None = None, run_name: str = "run",
        relay_urls: list[str] | None = None, manifest_public_key: str = "", run_id: str = "", origin_url: str = "",
        make_job: Callable[..., Any] = default_make_job, verify_batch: int = 16, evaluation: EvalConfig | None = None,
        eval_prompts: list[Prompt] | None = None, base_model_dir: Path | None = None,
    ):
        self.cfg, self.db, self.run_name = config, db, run_name
        self.prompts = prompts = evaluated_prompts(prompts, evaluation, eval_prompts)
        prompts.attach(db)  # a curriculum resumes its level
        self.metrics, self.windows = status.Metrics(), status.RunWindows()
        self.tokens = JoinTokens(db, [t.get_secret_value() for t in config.join_tokens],
                                 config.max_identities_per_token, config.lease_cooldown_s)
        self.workers = Workers(db, self.tokens, config.worker_dead_after_s, config.ban_scope,
                               config.strike_decay_accepted)
        self.open_join = OpenJoin(config.open_join, self.tokens)
        self.model_files = BaseModelFiles(base_model_dir)
        self.buffer = RolloutBuffer(db, shape.max_staleness)
        self.batches = BatchBook(db, self.buffer)
        # Batches left taken or trained by a crash are settled by the trainer's checkpoint, not by us:
        # no batch goes out until the trainer has reconciled (see reconcile_trainer).
        self.reconciled = not self.batches.unsettled()
        self.leases = LeaseBook(db, prompts, config, shape, self.workers, self.tokens)
        self.leases.costs.metric = self.metrics.leases_released
        self.buffer.room_freed = self.leases.room.notify
        self.versions = PolicyVersions(db, self.metrics.policy_version)
        self.registration = Registration(
            config, tokens=self.tokens, workers=self.workers, shares=self.leases.shares, versions=self.versions,
            relay_urls=relay_urls or [], manifest_public_key=manifest_public_key, run_id=run_id or run_name,
            origin_url=origin_url,
        )
        self.verification = Verification(
            db, verifier=verifier, versions=self.versions, workers=self.workers, leases=self.leases, buffer=self.buffer,
            prompts=prompts, metrics=self.metrics, windows=self.windows, task_name=task_name,
            task_params=task_params or {}, advantage_std=shape.advantage_std, strikes_to_ban=config.strikes_to_ban,
            make_job=make_job, batch_size=verify_batch, near_tie_burst=config.near_tie_burst,
            near_tie_ban=config.near_tie_ban,
        )
        self.evals = RunEvaluation(db, prompts, evaluation, config, leases=self.leases, versions=self.versions,
                                   metrics=self.metrics, finished=self.verification.evals_finished)
        self.versions.on_advance = self.evals.announced
        cap = limits.submission_bytes_cap(config.prompts_per_lease * config.samples_per_prompt,
                                          config.sampling.max_tokens, episodes=config.environment is not None)
        self.admission = admission.Admission(async_level=config.async_level, vocab_size=prompts.vocab_size, cap=cap,
                                             workers=self.workers, leases=self.leases, versions=self.versions,
                                             verification=self.verification)
        self.lease_requests = LeaseRequests(
            config, workers=self.workers, leases=self.leases, versions=self.versions, verification=self.verification,
            metrics=self.metrics, windows=self.windows, finished=lambda: self.finished,
        )
        self.operators = Operators(db, self.workers, self.tokens, self.leases, self.verification.deviations)
        self.limiter = admission.RateLimiter(config.rate_limit_per_s)
        self._stop = self.verification.stopping
        self._threads: list[threading.Thread] = []
        self.ready = self.finished = False
        self.error: str | None = None
        self.verifier_actors = (0, 0)  # (live, pending): told by whoever owns the pool (set_verifier_actors)

    # ---------------------------------------------------------------------------------------------
    # lifecycle

    def start(self) -> None:
        """Re-queue submissions that were stored but not verified before a restart, and start the
        verification and housekeeping threads."""
        self.verification.requeue_pending()
        self._stop.clear()
        for target, name in ((self.verification.run, "verify"), (self._housekeeping_loop, "housekeeping")):
            t = threading.Thread(target=target, name=f"orchestrator-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        self.ready = True

    def stop(self) -> None:
        self.ready = False
        self._stop.set()
        for t in self._threads:
            t.join(timeout=10)
        self._threads.clear()
        self.workers.flush_seen()

    # ---------------------------------------------------------------------------------------------
    # the workers' side

    def authenticate(self, secret: str) -> str:
        worker_id = self.workers.authenticate(secret)
        self.limiter.check(worker_id)
        return worker_id

    def register(self, reg: WorkerRegistration, join_token: str | TokenRow) -> WorkerRegistered:
        return self.registration.register(reg, join_token)

    def heartbeat(self, worker_id: str, path_worker_id: str, hb: Heartbeat) -> HeartbeatAck:
        if path_worker_id != worker_id:
            raise ApiError(ErrorCode.forbidden, "a worker can only heartbeat as itself")
        self.workers.refuse_if_banned(worker_id)
        self.workers.heartbeat(worker_id, hb.state, hb.loaded_policy_version, hb.tokens_per_s)
        current = self.versions.current
        return HeartbeatAck(
            policy_version=current, min_policy_version=staleness.min_policy_version(current, self.cfg.async_level),
            heartbeat_interval_s=self.cfg.heartbeat_interval_s,
            policy_model_hash=self.versions.model_hash(current) or None,
        )

    def lease(self, worker_id: str, req: LeaseRequest) -> LeaseResponse:
        """A lease, or a reason to come back later (api.py holds the request instead while the bound is full)."""
        return self.lease_requests.lease(worker_id, req)

    def release(self, worker_id: str, lease_id: str) -> ReleaseAck:
        return ReleaseAck(lease_id=lease_id, released=self.leases.release(lease_id, worker_id))

    # ---------------------------------------------------------------------------------------------
    # the driver's side

    def status(self) -> RunStatus:
        return status.run_status(self)

    def eval_results(self, after_version: int = -1) -> list[EvalResult]:
        """Finished evaluations (held-out prompts, per policy version) of versions above `after_version`."""
        return self.evals.finished(after_version)

    def set_verifier_actors(self, live: int, pending: int) -> None:
        """The verifier pool's size, for /v1/status and /metrics (the driver resizes the pool)."""
        self.verifier_actors = (live, pending)
        self.metrics.verifier_actors.labels("live").set(live)
        self.metrics.verifier_actors.labels("pending").set(pending)

    def reward_totals(self) -> tuple[float, int]:
        """(reward sum, completions) of all accepted rollouts of the run, zero-signal groups included:
        the driver's per-step mean reward, which the trained samples alone overstate early (dropped
        groups are often all-zero) and understate late (all-one). Persisted with each verdict."""
        c = self.db.counters()
        return c.get("reward_sum", 0.0), int(c.get("reward_count", 0))

    def record_restart(self, component: str, seconds_lost: float) -> None:
        """A component of the run was restarted (the driver tells us): counted in /v1/status, durably."""
        with self.db.tx() as db:
            Database.add(db, f"restarts:{component}", 1)
            Database.add(db, f"restart_s:{component}", float(seconds_lost))

    def set_finished(self, error: str | None = None) -> None:
        """The run is over (or failed): /v1/status says so, and workers get no new leases."""
        self.finished = True
        self.error = error
        self.leases.room.notify(everyone=True)  # held lease requests answer now: no more leases

    def stop_holding(self) -> None:
        """The server is shutting down: held lease requests answer now instead of holding it up."""
        self.ready = False
        self.leases.room.notify(everyone=True)

    # ---------------------------------------------------------------------------------------------
    # the trainer's side: trainer.batch_loop.BatchSource

    def take_batch(self, n: int, trainer_version: int | None = None, wait_s: float = 0.0) -> Batch:
        """n verified samples in whole groups (or what is ready after waiting up to wait_s), numbered as
        the next batch. Raises ReconcileFirst after a restart, until the trainer has reconciled."""
        if not self.reconciled:
            raise ReconcileFirst("the orchestrator restarted: reconcile with the trainer's checkpoint first")
        self.buffer.wait_for(n, wait_s, self._stop)
        return self.buffer.take(n, trainer_version, new_batch=self.batches.new)

    def give_back_batch(self, batch_id: str) -> int:
        with self.db.tx() as db:
            return self.batches.give_back(db, batch_id)

    def mark_trained(self, batch_id: str, trained_from_version: int) -> bool:
        """The step that started at `trained_from_version` trained the batch; its checkpoint is on the way."""
        return self.batches.mark_trained(batch_id, trained_from_version)

    def commit_batches(self, batches: dict[str, int], published: dict[int, str]) -> dict[int, int]:
        """The trainer's checkpoint that includes these batches (batch id -> the version its step started
        from) is durable: one transaction commits them (their groups trained, the steps and staleness
        counted) and announces the versions `published` (version -> model hash) to the workers. Returns
        the staleness of what it committed (version gap -> samples); committing again changes nothing."""
        gaps = self.versions.announce(published, lambda db: self.batches.commit_all(db, batches))
        self.windows.trained(sum(gaps.values()))
        return gaps

    def reconcile_trainer(
        self, lineage: list[list[int]], from_versions: dict[str, int], published: dict[int, str],
        superseded: dict[int, str] | None = None,
    ) -> dict[str, int]:
        """A (re)started trainer, or a trainer meeting a restarted orchestrator, settles every batch in
        flight by its durable checkpoint: the batches its lineage holds are committed, the others go back.
        `published`: the durable versions it serves (version -> model hash), announced here (version 0 at a
        run's first reconciliation); `superseded`: versions it withdrew, trained after its checkpoint and
        lost with it (their hashes are refused without a strike). Idempotent; opens take_batch again."""

        def settle(db: Any) -> dict[str, int]:
            for version, model_hash in (superseded or {}).items():
                self.versions.supersede(db, int(version), model_hash)
            return self.batches.reconcile(db, Lineage(lineage), dict(from_versions))

        out = self.versions.announce(published, settle)
        self.reconciled = True
        log.info("reconciled with the trainer's checkpoint", extra=out)
        return out

    # ---------------------------------------------------------------------------------------------
    # housekeeping: lease expiry, last-seen flush, evaluation rounds, dashboard history

    def housekeeping(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        expired = self.leases.expire(now)
        if expired:
            self.metrics.leases_expired.inc(len(expired))
            log.info("leases expired; prompts queued for re-issue", extra={"leases": len(expired)})
        self.workers.flush_seen()
        self.evals.housekeeping()
        status.record_history(self.metrics, self.windows, self.status(), now)

    def _housekeeping_loop(self) -> None:
        while not self._stop.wait(min(status.HISTORY_EVERY_S, self.cfg.lease_timeout_s / 4)):
            try:
                self.housekeeping()
            except Exception:
                log.exception("housekeeping error")
