"""The orchestrator: one object that composes the run's concepts and answers every endpoint.

Transport-free: the HTTP app (api.py) calls the endpoint methods with parsed models and the worker it
authenticated; the trainer takes and commits batches through `take_batch` / `commit_batches` (in a Ray
actor, or directly in tests). Each concept keeps its own state and SQL:

    db.py            the SQLite file, transactions, counters
    tokens.py        join tokens: identity caps, registration rate, token bans, lease debt
    workers.py       identities, secrets, heartbeats, strikes and bans
    leases.py        which prompts and seeds a worker gets, the async bound, expiry
    admission.py     what a submission must pass before it is queued
    verification.py  the verification queue and what a verdict changes
    buffer.py        verified groups, batches for the trainer
    batches.py       the trainer's batches: taken -> trained -> committed, and reconciliation
    status.py        metrics, rates, history
    evaluation.py    held-out prompts, eval rounds pinned to a version, avg@k / pass@k
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import zstandard

from orchestrator import admission, reward_failures
from orchestrator.batches import BatchBook
from orchestrator.buffer import RolloutBuffer
from orchestrator.config import EvalConfig, OrchestratorConfig, StepShape
from orchestrator.data import Prompt, PromptSet
from orchestrator.db import Database
from orchestrator.errors import ApiError
from orchestrator.evaluation import EvalBook, HeldOutPrompts, hold_out
from orchestrator.lease_shares import NoLeaseNow
from orchestrator.leases import GenerationBoundReached, LeaseBook
from orchestrator.release_costs import RELEASED_CHARGED, RELEASED_FREE
from orchestrator.status import HISTORY_EVERY_S, Metrics, RunWindows
from orchestrator.tokens import JoinTokens, TokenRow
from orchestrator.verification import (
    MAX_VERIFY_BACKLOG,
    Pending,
    SubmissionRow,
    Verification,
    Verifier,
    default_make_job,
)
from orchestrator.workers import Workers
from protocol import limits, staleness
from protocol.batches import Batch, Lineage, ReconcileFirst
from protocol.models import (
    BanScope,
    ErrorCode,
    EvalResult,
    Heartbeat,
    HeartbeatAck,
    JoinTokenList,
    JoinTokenMinted,
    JoinTokenRecord,
    JoinTokenRequest,
    LeaseRequest,
    LeaseResponse,
    ReleaseAck,
    RestartCount,
    RolloutSubmission,
    RunStatus,
    SubmissionReceipt,
    Verdict,
    VerdictStatus,
    WorkerList,
    WorkerRecord,
    WorkerRegistered,
    WorkerRegistration,
)

log = logging.getLogger(__name__)


class Orchestrator:
    def __init__(
        self,
        config: OrchestratorConfig,
        db: Database,
        prompts: PromptSet,
        verifier: Verifier,
        *,
        shape: StepShape,
        task_name: str = "toy",
        task_params: dict[str, Any] | None = None,
        run_name: str = "run",
        relay_urls: list[str] | None = None,
        manifest_public_key: str = "",
        run_id: str = "",
        origin_url: str = "",
        make_job: Callable[..., Any] = default_make_job,
        verify_batch: int = 16,
        evaluation: EvalConfig | None = None,
        eval_prompts: list[Prompt] | None = None,
    ):
        self.cfg = config
        self.db = db
        if evaluation is not None and evaluation.every_steps:
            # Held-out prompts (from eval.path, or a seeded slice of the run's) are never in the training order.
            prompts = HeldOutPrompts(prompts, eval_prompts) if eval_prompts else hold_out(prompts, evaluation.num_prompts, prompts.seed)
        self.prompts = prompts
        self.run_name = run_name
        self.relay_urls = list(relay_urls or [])
        self.manifest_public_key = manifest_public_key
        self.run_id = run_id or run_name  # workers accept only manifests signed for this run
        self.origin_url = origin_url  # the workers' fallback when relays fail
        self.metrics = Metrics()
        self.windows = RunWindows()
        self.tokens = JoinTokens(db, [t.get_secret_value() for t in config.join_tokens], config.max_identities_per_token, config.lease_cooldown_s)
        self.workers = Workers(db, self.tokens, config.worker_dead_after_s, config.ban_scope, config.strike_decay_accepted)
        self.buffer = RolloutBuffer(db, shape.max_staleness)
        self.batches = BatchBook(db, self.buffer)
        # Batches left taken or trained by a crash are settled by the trainer's checkpoint, not by us:
        # no batch goes out until the trainer has reconciled (see reconcile_trainer).
        self.reconciled = not self.batches.unsettled()
        self.leases = LeaseBook(db, prompts, config, shape, self.workers, self.tokens)
        self.leases.costs.metric = self.metrics.leases_released
        self.buffer.room_freed = self.leases.room.notify
        if isinstance(prompts, HeldOutPrompts) and evaluation is not None:
            self.leases.evals = EvalBook(
                db, prompts, evaluation, train_k=config.samples_per_prompt, prompts_per_lease=config.prompts_per_lease, seed_key=self.leases.seed_key,
            )
        self.verification = Verification(
            db, verifier=verifier, workers=self.workers, leases=self.leases, buffer=self.buffer, prompts=prompts, metrics=self.metrics,
            windows=self.windows, task_name=task_name, task_params=task_params or {}, advantage_std=shape.advantage_std,
            strikes_to_ban=config.strikes_to_ban, make_job=make_job, batch_size=verify_batch, near_tie_burst=config.near_tie_burst,
            near_tie_ban=config.near_tie_ban,
        )
        self.limiter = admission.RateLimiter(config.rate_limit_per_s)
        self.submission_cap = limits.submission_bytes_cap(config.prompts_per_lease * config.samples_per_prompt, config.sampling.max_tokens,
                                                          episodes=config.environment is not None)
        # A token may register its whole quota of identities at once, then re-register at the per-minute rate.
        self.registrations = admission.RateLimiter(config.registrations_per_min_per_token / 60.0, burst=float(config.max_identities_per_token))
        self._version = db.get_int("policy_version")
        self._stop = self.verification.stopping
        self._threads: list[threading.Thread] = []
        self.ready = False
        self.finished = False
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
    # auth

    def authenticate(self, secret: str) -> str:
        worker_id = self.workers.authenticate(secret)
        self.limiter.check(worker_id)
        return worker_id

    def is_worker_secret(self, secret: str) -> bool:
        return self.workers.is_secret(secret)

    def refuse_if_banned(self, worker_id: str) -> None:
        """Before a worker's request changes state: the gate authenticated it from the headers, and a ban
        may have landed since (while its body arrived, while its lease request was held)."""
        if self.workers.is_banned(worker_id):
            raise ApiError(ErrorCode.banned, f"worker {worker_id} is banned")

    # ---------------------------------------------------------------------------------------------
    # worker endpoints

    def register(self, reg: WorkerRegistration, join_token: "str | TokenRow") -> WorkerRegistered:
        """A new identity under a join token that may still register (the secret, or the row the HTTP gate
        already authenticated): not banned or revoked, under its registration rate and its cap on live
        identities."""
        token = self.tokens.authenticate(join_token) if isinstance(join_token, str) else self.tokens.current(join_token)
        if self.workers.live_identities(token.token_id, time.time()) >= token.max_identities:
            raise ApiError(
                ErrorCode.too_many_identities, f"join token {token.token_id} already has {token.max_identities} live workers",
                retry_after_s=self.cfg.worker_dead_after_s,
            )
        self.registrations.check(token.token_id)
        worker_id, secret = self.workers.register(reg.name, reg.device, reg.client_version, token.token_id)
        self.leases.shares.note_demand(token.token_id, time.time())  # a new worker asks for its first lease next
        return WorkerRegistered(
            worker_id=worker_id,
            secret=secret,
            heartbeat_interval_s=self.cfg.heartbeat_interval_s,
            async_level=self.cfg.async_level,
            policy_version=self._version,
            relay_urls=self.relay_urls,
            manifest_public_key=self.manifest_public_key,
            run_id=self.run_id,
            origin_url=self.origin_url,
            policy_model_hash=self.verification.versions.model_hash(self._version) or None,
        )

    def heartbeat(self, worker_id: str, path_worker_id: str, hb: Heartbeat) -> HeartbeatAck:
        if path_worker_id != worker_id:
            raise ApiError(ErrorCode.forbidden, "a worker can only heartbeat as itself")
        self.refuse_if_banned(worker_id)
        self.workers.heartbeat(worker_id, hb.state, hb.loaded_policy_version, hb.tokens_per_s)
        return HeartbeatAck(
            policy_version=self._version,
            min_policy_version=staleness.min_policy_version(self._version, self.cfg.async_level),
            heartbeat_interval_s=self.cfg.heartbeat_interval_s,
            policy_model_hash=self.verification.versions.model_hash(self._version) or None,
        )

    def lease(self, worker_id: str, req: LeaseRequest) -> LeaseResponse:
        try:
            return self._lease(worker_id, req)
        except GenerationBoundReached:
            return self._bound_reached()

    async def lease_held(self, worker_id: str, req: LeaseRequest) -> LeaseResponse:
        """`lease`, held on the event loop for up to `req.wait_s` while the async bound is full (a long
        poll): the worker gets its lease as soon as a verdict, a trained batch or a lease given back makes
        room, instead of sleeping a guessed retry-after. Each wake-up is one more try."""
        deadline = time.monotonic() + min(req.wait_s, self.cfg.request_timeout_s / 2)
        woken = False
        while True:
            try:
                answer = self._lease(worker_id, req)
            except GenerationBoundReached:
                left = deadline - time.monotonic()
                if left <= 0 or not self.ready:
                    return self._bound_reached()
            except ApiError:  # e.g. its version is too old: the room it was woken for is someone else's
                if woken:
                    self.leases.room.notify()
                raise
            else:
                if woken:  # there may be room for the next waiter too (leases.RoomSignal: one at a time)
                    self.leases.room.notify()
                return answer
            await self.leases.room.wait(left)
            woken = True

    def _bound_reached(self) -> LeaseResponse:
        self.windows.bound_reached(time.time())
        self.metrics.leases_refused_async_bound.inc()
        return LeaseResponse(lease=None, retry_after_s=0.2)

    def _lease(self, worker_id: str, req: LeaseRequest) -> LeaseResponse:
        """A lease, a reason to come back later, or GenerationBoundReached."""
        self.refuse_if_banned(worker_id)
        if self.finished:
            return LeaseResponse(lease=None, retry_after_s=max(self.cfg.heartbeat_interval_s, 5.0))
        if self.verification.backlog() >= MAX_VERIFY_BACKLOG:
            # Backpressure: the verifier pool is behind; more rollouts now would only wait (and go stale).
            return LeaseResponse(lease=None, retry_after_s=1.0)
        admission.check_version(req.loaded_policy_version, self._version, self.cfg.async_level, what="loaded policy version")
        now = time.time()
        try:
            lease = self.leases.issue(
                worker_id, req.max_prompts, self._version, now, loaded_version=req.loaded_policy_version, request_id=req.request_id
            )
        except NoLeaseNow as exc:  # this worker's token: its share is in use, or it is cooling down
            self.metrics.leases_refused_budget.inc()
            return LeaseResponse(lease=None, retry_after_s=round(exc.retry_after_s, 3))
        self.windows.bound_cleared(now)
        self.metrics.leases_issued.inc()
        return LeaseResponse(lease=lease)

    def release(self, worker_id: str, lease_id: str) -> ReleaseAck:
        return ReleaseAck(lease_id=lease_id, released=self.leases.release(lease_id, worker_id))

    def submit(self, worker_id: str, body: bytes, content_encoding: str | None) -> SubmissionReceipt:
        """Admission in the order that spends the least work on a bad submission (see admission.py),
        then into the verification queue."""
        return self.accept_submission(worker_id, self.parse_submission(body, content_encoding), body, content_encoding)

    def parse_submission(self, body: bytes, content_encoding: str | None) -> tuple[bytes, RolloutSubmission]:
        """Decompress and validate, at most the largest honest body for this run's leases. Touches no
        state, so the HTTP app may run it off the event loop."""
        raw = admission.decode_body(body, content_encoding, self.submission_cap)
        return raw, admission.parse_submission(raw, self.prompts.vocab_size)

    def accept_submission(self, worker_id: str, parsed: tuple[bytes, RolloutSubmission], body: bytes, content_encoding: str | None) -> SubmissionReceipt:
        raw, sub = parsed
        self.refuse_if_banned(worker_id)
        now = time.time()
        row, lease = self.leases.for_submission(sub.lease_id, worker_id, now)
        admission.check_version(sub.policy_version, self._version, self.cfg.async_level)
        if sub.policy_version < lease.min_policy_version:
            raise ApiError(
                ErrorCode.version_too_old,
                f"policy version {sub.policy_version} is below the lease's minimum {lease.min_policy_version}",
                min_policy_version=max(lease.min_policy_version, staleness.min_policy_version(self._version, self.cfg.async_level)),
            )
        if lease.generation_version is not None and sub.policy_version != lease.generation_version:
            raise ApiError(
                ErrorCode.lease_mismatch,
                f"generated with policy version {sub.policy_version}; this lease was issued for version {lease.generation_version}, "
                "the one the worker said it had loaded",
            )
        if self.verification.versions.is_superseded(sub.policy_version, sub.model_hash):
            # Weights of a version that a trainer crash undid (a relay served them before they were
            # replaced): the worker is honest, so no strike; it moves on to a newer version.
            raise ApiError(
                ErrorCode.version_too_old, f"version {sub.policy_version} was re-published with other weights after a trainer restart",
                min_policy_version=sub.policy_version + 1,
            )
        admission.check_shape(sub, lease)
        submission_id = f"S{secrets.token_hex(8)}"
        stored = body if (content_encoding or "").strip().lower() == "zstd" else zstandard.ZstdCompressor(level=1).compress(raw)
        dup = self.verification.enqueue(
            SubmissionRow(submission_id, worker_id, sub.lease_id, sub.policy_version, sub.num_tokens, now, "pending", stored, None),
            admission.fingerprint(sub),
            Pending(worker_id, sub, lease, list(row.prompt_indices), row.eval_version),
        )
        if dup == "lease":
            raise ApiError(ErrorCode.duplicate, f"lease {sub.lease_id} already has a submission")
        if dup == "replay":
            raise ApiError(ErrorCode.duplicate, "these rollouts were submitted before (replay)")
        return SubmissionReceipt(submission_id=submission_id, lease_id=sub.lease_id, num_completions=len(sub.completions))

    def verdict(self, worker_id: str, submission_id: str) -> Verdict:
        row = self.verification.submission(submission_id)
        if row is None or row.worker_id != worker_id:
            raise ApiError(ErrorCode.not_found, f"no submission {submission_id}")
        if row.verdict is None:
            return Verdict(submission_id=submission_id, status=VerdictStatus.pending)
        return Verdict.model_validate_json(row.verdict)

    # ---------------------------------------------------------------------------------------------
    # operator endpoints

    def worker_list(self) -> WorkerList:
        now, released, costs = time.time(), self.leases.costs.by_worker(self.db), self.leases.costs
        deviations = self.verification.deviations.of()
        return WorkerList(workers=[
            self.workers.record(w, now).model_copy(update={
                "leases_released": released.get(w.worker_id, (0, 0))[0], "releases_charged": released.get(w.worker_id, (0, 0))[1],
                "token_release_ratio": costs.ratio(w.token_id),
                "draw_deviations": deviations.get(w.worker_id, (0, 0.0))[0], "deviation_allowance": deviations.get(w.worker_id, (0, 0.0))[1],
            })
            for w in self.workers.all()
        ])

    def set_ban(self, worker_id: str, banned: bool, reason: str, scope: BanScope | None = None) -> WorkerRecord:
        row = self.workers.set_ban(worker_id, banned, reason, scope)
        if banned:
            self._release_banned()
        return self.workers.record(row, time.time())

    def mint_token(self, req: JoinTokenRequest) -> JoinTokenMinted:
        row, token = self.tokens.mint(req.label, req.max_identities)
        return JoinTokenMinted(token=token, **self.tokens.record(row, 0).model_dump())

    def token_list(self) -> JoinTokenList:
        now = time.time()
        return JoinTokenList(tokens=[self.tokens.record(t, self.workers.live_identities(t.token_id, now)) for t in self.tokens.all()])

    def revoke_token(self, token_id: str, reason: str) -> JoinTokenRecord:
        """No registration with the token any more, and every worker it registered is banned."""
        row = self.tokens.revoke(token_id, reason)
        with self.db.tx() as db:
            self.workers.ban_token_identities(db, token_id, f"join token revoked: {row.ban_reason}")
        self._release_banned()
        return self.tokens.record(row, 0)

    def _release_banned(self) -> None:
        with self.db.tx() as db:
            self.leases.release_banned(db)

    def status(self) -> RunStatus:
        now = time.time()
        c = self.db.counters()
        accepted, rejected = int(c.get("submissions_accepted", 0)), int(c.get("submissions_rejected", 0))
        rates = self.windows.rates(now)
        return RunStatus(
            run_name=self.run_name,
            step=int(c.get("step", 0)),
            policy_version=self._version,
            async_level=self.cfg.async_level,
            buffer_depth=self.buffer.depth(),
            workers_online=self.workers.count_online(now),
            acceptance_rate=accepted / (accepted + rejected) if accepted + rejected else 0.0,
            submissions_accepted=accepted,
            submissions_rejected=rejected,
            groups_dropped_zero_signal=int(c.get("groups_dropped_zero_signal", 0)),
            groups_dropped_unscored=int(c.get("groups_dropped_unscored", 0)),
            reward_failures=reward_failures.from_counters(c),
            samples_dropped_stale=int(c.get("samples_dropped_stale", 0)),
            verified_tokens=int(c.get("verified_tokens", 0)),
            near_tie_tokens=int(c.get("near_tie_tokens", 0)),
            rollout_tokens_per_s=rates["rollout_tokens_per_s"],
            trained_samples_per_s=rates["trained_samples_per_s"],
            mean_reward=rates["mean_reward"],
            wait_for_trainer_s=self.windows.wait_for_trainer_s(now),
            verify_queue=self.verification.backlog(),
            verify_in_per_s=rates["verify_in_per_s"],
            verify_out_per_s=rates["verify_out_per_s"],
            verify_tokens_per_s=rates["verify_tokens_per_s"],
            verifier_actors=self.verifier_actors[0],
            verifier_actors_pending=self.verifier_actors[1],
            staleness_histogram=self.buffer.staleness_histogram(),
            restarts=self._restarts(c),
            finished=self.finished,
            error=self.error,
            eval_latest=self.leases.evals.latest() if self.leases.evals else None,
            evals_open=self.leases.evals.open_rounds() if self.leases.evals else 0,
            releases_free=int(c.get(RELEASED_FREE, 0)),
            releases_charged=int(c.get(RELEASED_CHARGED, 0)),
            max_token_release_ratio=self.leases.costs.highest_ratio(),
        )

    def eval_results(self, after_version: int = -1) -> list[EvalResult]:
        """Finished evaluations (held-out prompts, per policy version) of versions above `after_version`."""
        return self.leases.evals.finished(after_version) if self.leases.evals else []

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

    # ---------------------------------------------------------------------------------------------
    # the trainer's side

    def set_finished(self, error: str | None = None) -> None:
        """The run is over (or failed): /v1/status says so, and workers get no new leases."""
        self.finished = True
        self.error = error
        self.leases.room.notify(everyone=True)  # held lease requests answer now: no more leases

    def stop_holding(self) -> None:
        """The server is shutting down: held lease requests answer now instead of holding it up."""
        self.ready = False
        self.leases.room.notify(everyone=True)

    def publish_version(self, version: int, model_hash: str) -> None:
        """A policy version is available to workers (version 0, or one re-published after a restart)."""
        with self.db.tx() as db:
            self.verification.versions.publish(db, version, model_hash)
        self._advance(version)

    def take_batch(self, n: int, trainer_version: int | None = None, wait_s: float = 0.0) -> Batch:
        """n verified samples in whole groups (or what is ready after waiting up to wait_s), numbered as
        the next batch. Raises ReconcileFirst after a restart, until the trainer has reconciled."""
        if not self.reconciled:
            raise ReconcileFirst("the orchestrator restarted: reconcile with the trainer's checkpoint first")
        self.buffer.wait_for(n, wait_s, self._stop)
        return self.buffer.take(n, trainer_version, new_batch=self.batches.new)

    def mark_trained(self, batch_id: str, trained_from_version: int) -> bool:
        """The step that started at `trained_from_version` trained the batch; its checkpoint is on the way."""
        return self.batches.mark_trained(batch_id, trained_from_version)

    def commit_batches(self, batches: dict[str, int], published: dict[int, str]) -> dict[int, int]:
        """The trainer's checkpoint that includes these batches (batch id -> the version its step started
        from) is durable: one transaction commits them (their groups trained, the steps and staleness
        counted) and announces the versions `published` (version -> model hash) to the workers. Returns
        the staleness of what it committed (version gap -> samples); committing again changes nothing."""
        gaps: dict[int, int] = {}
        with self.db.tx() as db:
            for batch_id, version in batches.items():
                for gap, k in self.batches.commit(db, batch_id, version).items():
                    gaps[gap] = gaps.get(gap, 0) + k
            for version, model_hash in sorted(published.items()):
                self.verification.versions.publish(db, version, model_hash)
        self.windows.trained(sum(gaps.values()))
        if published:
            self._advance(max(published))
        return gaps

    def give_back_batch(self, batch_id: str) -> int:
        with self.db.tx() as db:
            return self.batches.give_back(db, batch_id)

    def reconcile_trainer(
        self, lineage: list[list[int]], from_versions: dict[str, int], published: dict[int, str], superseded: dict[int, str] | None = None,
    ) -> dict[str, int]:
        """A (re)started trainer, or a trainer meeting a restarted orchestrator, settles every batch in
        flight by its durable checkpoint: the batches its lineage holds are committed, the others go back.
        `published`: the durable versions it serves (version -> model hash), announced here; `superseded`:
        versions it withdrew, trained after its checkpoint and lost with it (their hashes are refused
        without a strike). Idempotent; opens take_batch again."""
        with self.db.tx() as db:
            for version, model_hash in (superseded or {}).items():
                self.verification.versions.supersede(db, int(version), model_hash)
            out = self.batches.reconcile(db, Lineage(lineage), dict(from_versions))
            for version, model_hash in sorted(published.items()):
                self.verification.versions.publish(db, int(version), model_hash)
        if published:
            self._advance(max(int(v) for v in published))
        self.reconciled = True
        log.info("reconciled with the trainer's checkpoint", extra=out)
        return out

    def record_restart(self, component: str, seconds_lost: float) -> None:
        """A component of the run was restarted (the driver tells us): counted in /v1/status, durably."""
        with self.db.tx() as db:
            Database.add(db, f"restarts:{component}", 1)
            Database.add(db, f"restart_s:{component}", float(seconds_lost))

    @staticmethod
    def _restarts(counters: dict[str, float]) -> dict[str, RestartCount]:
        names = [k.split(":", 1)[1] for k in counters if k.startswith("restarts:")]
        return {n: RestartCount(count=int(counters[f"restarts:{n}"]), seconds_lost=round(counters.get(f"restart_s:{n}", 0.0), 3)) for n in sorted(names)}

    def _advance(self, version: int) -> None:
        old, self._version = self._version, max(self._version, version)
        self.metrics.policy_version.set(self._version)
        if self.leases.evals is not None:
            # Every newly announced version still generatable (several at once with mini_batches > 1; a
            # version announced before a crash of this process again, idempotently).
            lo = max(staleness.min_policy_version(self._version, self.cfg.async_level), min(old + 1, self._version))
            with self.db.tx() as db:
                for v in range(lo, self._version + 1):
                    if self.leases.evals.announce(db, v):
                        log.info("evaluation opened", extra={"policy_version": v, "prompts": len(self.prompts.held_out)})
                self._close_left_behind(db)

    def _close_left_behind(self, db) -> None:
        evals = self.leases.evals
        assert evals is not None
        min_version = staleness.min_policy_version(self._version, self.cfg.async_level)
        for v in evals.close_left_behind(db, min_version, self.leases.eval_in_flight(db)):
            self.verification.evals_finished.append(v)
            log.warning("evaluation closed partial: its version was left behind before every prompt was verified", extra={"policy_version": v})

    # ---------------------------------------------------------------------------------------------
    # housekeeping: lease expiry, last-seen flush, dashboard history

    def housekeeping(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        expired = self.leases.expire(now)
        if expired:
            self.metrics.leases_expired.inc(len(expired))
            log.info("leases expired; prompts queued for re-issue", extra={"leases": len(expired)})
        self.workers.flush_seen()
        if self.leases.evals is not None:
            with self.db.tx() as db:
                self._close_left_behind(db)
            self._log_finished_evals()
        st = self.status()
        rates = self.windows.rates(now)
        self.metrics.buffer_depth.set(st.buffer_depth)
        self.metrics.workers_online.set(st.workers_online)
        self.metrics.policy_version.set(st.policy_version)
        self.metrics.verify_queue.set(st.verify_queue)
        for what, key in (("in", "verify_in_per_s"), ("out", "verify_out_per_s"), ("tokens", "verify_tokens_per_s")):
            self.metrics.verify_rate.labels(what).set(rates[key])
        self.windows.history.append(
            {
                "t": now,
                "step": st.step,
                "policy_version": st.policy_version,
                "mean_reward": rates["mean_reward"],
                "rollout_tokens_per_s": rates["rollout_tokens_per_s"],
                "submissions_per_s": rates["submissions_per_s"],
                "acceptance": rates["acceptance"],
                "workers_online": st.workers_online,
                "buffer_depth": st.buffer_depth,
                "verify_queue": st.verify_queue,
                "verifier_actors": st.verifier_actors,
            }
        )

    def _log_finished_evals(self) -> None:
        """Evaluations finished since the last call: logged and exported to Prometheus."""
        evals, done = self.leases.evals, self.verification.evals_finished
        while evals is not None and done:
            r = evals.result(done.pop(0))
            if r is None:
                continue
            self.metrics.observe_eval(r)
            log.info("evaluation finished", extra={"policy_version": r.policy_version, "avg_reward": r.avg_reward, "pass_at": r.pass_at,
                                                    "mean_completion_tokens": r.mean_completion_tokens, "complete": r.complete})

    def _housekeeping_loop(self) -> None:
        while not self._stop.wait(min(HISTORY_EVERY_S, self.cfg.lease_timeout_s / 4)):
            try:
                self.housekeeping()
            except Exception:
                log.exception("housekeeping error")
