"""The orchestrator core: workers, leases, admission, verification, strikes and bans, the buffer.

Transport-free: the HTTP layer (api.py) calls these methods with parsed models and the worker it
authenticated; the trainer pulls batches through `take_batch` / `commit_batch` (directly, or through a
Ray actor). Verification goes through anything with `verify_many(jobs) -> list[Verdict]`: Ray actors
wrapping `verifier.service.Verifier` in production (ray_actors.py), a fake in logic unit tests.
"""

from __future__ import annotations

import logging
import queue
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import zstandard
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from orchestrator import admission
from orchestrator.buffer import Batch, Groups, RolloutBuffer, build_groups
from orchestrator.config import RunConfig
from orchestrator.data import PromptSet
from orchestrator.errors import ApiError
from orchestrator.leases import GenerationBoundReached, LeaseBook, min_policy_version
from orchestrator.state import State, SubmissionRow, WorkerRow, hash_secret, secret_matches
from protocol.models import (
    ErrorCode,
    Heartbeat,
    HeartbeatAck,
    LeaseRequest,
    LeaseResponse,
    ReleaseAck,
    RolloutSubmission,
    RunStatus,
    SubmissionReceipt,
    TaskLease,
    Verdict,
    VerdictStatus,
    WorkerList,
    WorkerRecord,
    WorkerRegistered,
    WorkerRegistration,
    WorkerState,
)

log = logging.getLogger(__name__)

WINDOW_S = 60.0  # throughput and acceptance are reported over this window
HISTORY_EVERY_S = 2.0
HISTORY_POINTS = 1800
# A worker with this many accepted submissions and no strikes is "trusted" for the verifier's
# spot-check rate (VerifierConfig.spot_check_rate; the default verifies everything anyway).
TRUSTED_AFTER_ACCEPTED = 20
# Submissions waiting for verification: above this, leases are refused (retry later); parsed ones
# above MAX_PARSED_PENDING are not kept in memory but re-read from SQLite when their turn comes.
MAX_VERIFY_BACKLOG = 4096
MAX_PARSED_PENDING = 1024
# The verification thread, woken by a submission, waits this long for more before it verifies and
# records them together: one transaction and one verifier call per batch instead of per submission
# (at 500 submissions/s, ~10 per batch instead of ~2). Verdicts come this much later; the submit
# response does not wait for them.
VERIFY_GATHER_S = 0.02


class Verification(Protocol):
    def verify_many(self, jobs: list[Any]) -> list[Verdict]: ...


def default_make_job(**fields: Any) -> Any:
    from verifier.service import VerifyJob

    return VerifyJob(**fields)


@dataclass
class _Pending:
    worker_id: str
    submission: RolloutSubmission
    lease: TaskLease
    prompt_indices: list[int]


@dataclass
class _Applied:
    submission_id: str
    worker_id: str
    verdict: Verdict
    accepted: bool
    rewards: list[float]
    groups: Groups | None


class Metrics:
    """Prometheus metrics of one orchestrator (own registry, so several can live in one process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests_refused = Counter("swarmrl_requests_refused", "Requests refused, by error code", ["code"], registry=r)
        self.submissions = Counter("swarmrl_submissions", "Submissions queued for verification", registry=r)
        self.verdicts = Counter("swarmrl_verdicts", "Verdicts, by status", ["status"], registry=r)
        self.rejections = Counter("swarmrl_rejections", "Rejection reasons", ["code"], registry=r)
        self.leases_issued = Counter("swarmrl_leases_issued", "Leases issued", registry=r)
        self.leases_refused_async_bound = Counter(
            "swarmrl_leases_refused_async_bound",
            "Lease requests refused because generation is async_level versions ahead of the trainer (high: the trainer is the bottleneck)",
            registry=r,
        )
        self.leases_expired = Counter("swarmrl_leases_expired", "Leases expired", registry=r)
        self.groups_dropped = Counter("swarmrl_groups_dropped_zero_signal", "Groups dropped for zero signal", registry=r)
        self.verified_tokens = Counter("swarmrl_verified_tokens", "Tokens in accepted submissions", registry=r)
        self.bans = Counter("swarmrl_bans", "Workers banned for strikes", registry=r)
        self.buffer_depth = Gauge("swarmrl_buffer_depth", "Verified samples waiting for the trainer", registry=r)
        self.policy_version = Gauge("swarmrl_policy_version", "Current policy version", registry=r)
        self.workers_online = Gauge("swarmrl_workers_online", "Workers seen recently", registry=r)
        self.verify_queue = Gauge("swarmrl_verify_queue", "Submissions waiting for verification", registry=r)
        self.verify_seconds = Histogram("swarmrl_verify_seconds", "Wall time of one verify_many call", registry=r)


class Orchestrator:
    def __init__(
        self,
        config: RunConfig,
        state: State,
        prompts: PromptSet,
        verifier: Verification,
        *,
        relay_urls: list[str] | None = None,
        manifest_public_key: str = "",
        make_job: Callable[..., Any] = default_make_job,
        verify_batch: int = 16,
    ):
        self.config = config
        self.cfg = config.orchestrator
        self.state = state
        self.prompts = prompts
        self.verifier = verifier
        self.relay_urls = list(relay_urls or [])
        self.manifest_public_key = manifest_public_key
        self.make_job = make_job
        self.verify_batch = verify_batch
        self.leases = LeaseBook(state, prompts, self.cfg)
        self.buffer = RolloutBuffer(state, config.trainer.max_staleness)
        self.limiter = admission.RateLimiter(self.cfg.rate_limit_per_s)
        self.metrics = Metrics()
        self.started_at = time.time()
        self._version = state.get_int("policy_version")
        self._auth: dict[str, tuple[str, bool]] = {}  # worker id -> (secret hash, banned)
        self._seen: dict[str, float] = {}  # last request per worker, flushed to SQLite periodically
        self._pending: dict[str, _Pending] = {}
        self._model_hashes: dict[int, str] = {}
        self._queue: queue.Queue[str] = queue.Queue()
        self._events_lock = threading.Lock()
        self._bound_since: float | None = None
        self.wait_for_trainer_s = 0.0  # time workers were refused leases by the async bound
        self._buffer_changed = threading.Condition()
        self._ready = 0  # samples ready for the trainer, as counted by the waiting trainer plus those added since
        self._want: int | None = None  # how many a waiting trainer waits for (None: nobody waits)
        self._accepted: deque[tuple[float, int, float, int]] = deque()  # (t, tokens, reward sum, completions)
        self._rejected: deque[float] = deque()
        self._trained: deque[tuple[float, int]] = deque()
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY_POINTS)
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self.ready = False
        self.finished = False
        self.error: str | None = None

    # ---------------------------------------------------------------------------------------------
    # lifecycle

    def start(self) -> None:
        """Re-queue submissions that were accepted but not verified before a restart, and start the
        verification and housekeeping threads."""
        for sid in self.state.pending_submissions():
            self._queue.put(sid)
        self._stop.clear()
        for target, name in ((self._verify_loop, "verify"), (self._housekeeping_loop, "housekeeping")):
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
        self.state.touch(self._take_seen())

    # ---------------------------------------------------------------------------------------------
    # auth

    def authenticate(self, secret: str, allow_banned: bool = False) -> str:
        """The worker a bearer secret belongs to; raises unauthorized / banned (a banned worker may
        still read its verdicts, to learn why)."""
        worker_id, _, _ = secret.partition(".")
        entry = self._auth.get(worker_id)
        if entry is None:
            row = self.state.worker(worker_id) if worker_id else None
            if row is None:
                raise ApiError(ErrorCode.unauthorized, "unknown worker secret")
            entry = self._auth[worker_id] = (row.secret_hash, row.banned)
        if not secret_matches(secret, entry[0]):
            raise ApiError(ErrorCode.unauthorized, "unknown worker secret")
        if entry[1] and not allow_banned:
            raise ApiError(ErrorCode.banned, f"worker {worker_id} is banned")
        self.limiter.check(worker_id)
        self._seen[worker_id] = time.time()
        return worker_id

    def is_worker_secret(self, secret: str) -> bool:
        worker_id, _, _ = secret.partition(".")
        row = self.state.worker(worker_id) if worker_id else None
        return row is not None and secret_matches(secret, row.secret_hash)

    # ---------------------------------------------------------------------------------------------
    # worker endpoints

    def register(self, reg: WorkerRegistration) -> WorkerRegistered:
        worker_id = f"w-{secrets.token_hex(8)}"
        secret = f"{worker_id}.{secrets.token_urlsafe(32)}"
        digest = hash_secret(secret)
        self.state.add_worker(worker_id, reg.name, reg.device, reg.client_version, digest)
        self._auth[worker_id] = (digest, False)
        self._seen[worker_id] = time.time()
        log.info("worker registered", extra={"worker_id": worker_id, "worker_name": reg.name})
        return WorkerRegistered(
            worker_id=worker_id,
            secret=secret,
            heartbeat_interval_s=self.cfg.heartbeat_interval_s,
            async_level=self.cfg.async_level,
            policy_version=self._version,
            relay_urls=self.relay_urls,
            manifest_public_key=self.manifest_public_key,
        )

    def heartbeat(self, worker_id: str, path_worker_id: str, hb: Heartbeat) -> HeartbeatAck:
        if path_worker_id != worker_id:
            raise ApiError(ErrorCode.forbidden, "a worker can only heartbeat as itself")
        now = time.time()
        self.state.heartbeat(worker_id, hb.state.value, hb.loaded_policy_version, hb.tokens_per_s, now)
        return HeartbeatAck(
            policy_version=self._version,
            min_policy_version=min_policy_version(self._version, self.cfg.async_level),
            heartbeat_interval_s=self.cfg.heartbeat_interval_s,
        )

    def lease(self, worker_id: str, req: LeaseRequest) -> LeaseResponse:
        if self.finished:
            return LeaseResponse(lease=None, retry_after_s=max(self.cfg.heartbeat_interval_s, 5.0))
        if self._queue.qsize() >= MAX_VERIFY_BACKLOG:
            # Backpressure: the verifier pool is behind; more rollouts now would only wait (and go stale).
            return LeaseResponse(lease=None, retry_after_s=1.0)
        lowest = min_policy_version(self._version, self.cfg.async_level)
        if req.loaded_policy_version < lowest:
            raise ApiError(
                ErrorCode.version_too_old,
                f"loaded policy version {req.loaded_policy_version} is below {lowest}: pull a newer version first",
                min_policy_version=lowest,
            )
        if req.loaded_policy_version > self._version:
            raise ApiError(ErrorCode.invalid_request, f"policy version {req.loaded_policy_version} has not been published (current {self._version})")
        # AReaL's bound: samples not yet trained (in the buffer or being generated) may cover at most
        # async_level + 1 training steps, so generation never runs more than async_level versions ahead.
        bound = (self.cfg.async_level + 1) * self.config.trainer.samples_per_step
        now = time.time()
        try:
            lease = self.leases.issue(
                worker_id, req.max_prompts, self._version, now, max_untrained_samples=bound,
                samples_per_step=self.config.trainer.samples_per_step, max_staleness=self.config.trainer.max_staleness,
                loaded_version=req.loaded_policy_version, request_id=req.request_id,
            )
        except GenerationBoundReached:
            with self._events_lock:
                if self._bound_since is None:
                    self._bound_since = now
            self.metrics.leases_refused_async_bound.inc()
            return LeaseResponse(lease=None, retry_after_s=0.2)
        with self._events_lock:
            if self._bound_since is not None:
                self.wait_for_trainer_s += now - self._bound_since
                self._bound_since = None
        self.metrics.leases_issued.inc()
        return LeaseResponse(lease=lease)

    def release(self, worker_id: str, lease_id: str) -> ReleaseAck:
        return ReleaseAck(lease_id=lease_id, released=self.leases.release(lease_id, worker_id))

    def submit(self, worker_id: str, body: bytes, content_encoding: str | None) -> SubmissionReceipt:
        raw = admission.decode_body(body, content_encoding)
        sub = admission.parse_submission(raw, self.prompts.vocab_size)
        now = time.time()
        row, lease = self.leases.for_submission(sub.lease_id, worker_id, now)
        admission.check_version(sub.policy_version, self._version, self.cfg.async_level)
        if sub.policy_version < lease.min_policy_version:
            raise ApiError(
                ErrorCode.version_too_old,
                f"policy version {sub.policy_version} is below the lease's minimum {lease.min_policy_version}",
                min_policy_version=max(lease.min_policy_version, min_policy_version(self._version, self.cfg.async_level)),
            )
        admission.check_shape(sub, lease)
        submission_id = f"S{secrets.token_hex(8)}"
        stored = body if (content_encoding or "").strip().lower() == "zstd" else zstandard.ZstdCompressor(level=1).compress(raw)
        dup = self.state.insert_submission(
            SubmissionRow(submission_id, worker_id, sub.lease_id, sub.policy_version, sub.num_tokens, now, "pending", stored, None),
            admission.fingerprint(sub),
        )
        if dup == "lease":
            raise ApiError(ErrorCode.duplicate, f"lease {sub.lease_id} already has a submission")
        if dup == "replay":
            raise ApiError(ErrorCode.duplicate, "these rollouts were submitted before (replay)")
        if len(self._pending) < MAX_PARSED_PENDING:  # beyond that, re-read from SQLite when verified
            self._pending[submission_id] = _Pending(worker_id, sub, lease, list(row.prompt_indices))
        self._queue.put(submission_id)
        self.metrics.submissions.inc()
        return SubmissionReceipt(submission_id=submission_id, lease_id=sub.lease_id, num_completions=len(sub.completions))

    def verdict(self, worker_id: str, submission_id: str) -> Verdict:
        row = self.state.submission(submission_id)
        if row is None or row.worker_id != worker_id:
            raise ApiError(ErrorCode.not_found, f"no submission {submission_id}")
        if row.verdict is None:
            return Verdict(submission_id=submission_id, status=VerdictStatus.pending)
        return Verdict.model_validate_json(row.verdict)

    # ---------------------------------------------------------------------------------------------
    # operator endpoints

    def _online(self, w: WorkerRow, now: float) -> bool:
        last = max(w.last_seen or 0.0, self._seen.get(w.worker_id, 0.0))
        return not w.banned and now - last <= self.cfg.worker_dead_after_s

    def _record(self, w: WorkerRow, now: float) -> WorkerRecord:
        return WorkerRecord(
            worker_id=w.worker_id,
            name=w.name,
            device=w.device,
            online=self._online(w, now),
            banned=w.banned,
            strikes=w.strikes,
            loaded_policy_version=w.loaded_version,
            state=WorkerState(w.state) if w.state else None,
            last_seen=max(w.last_seen or 0.0, self._seen.get(w.worker_id, 0.0)) or None,
            submissions_accepted=w.accepted,
            submissions_rejected=w.rejected,
            verified_tokens=w.verified_tokens,
            tokens_per_s=w.tokens_per_s,
        )

    def worker_list(self) -> WorkerList:
        now = time.time()
        return WorkerList(workers=[self._record(w, now) for w in self.state.workers()])

    def set_ban(self, worker_id: str, banned: bool, reason: str) -> WorkerRecord:
        if self.state.worker(worker_id) is None:
            raise ApiError(ErrorCode.not_found, f"no worker {worker_id}")
        self.state.set_ban(worker_id, banned, reason or ("banned by an operator" if banned else ""))
        self._auth.pop(worker_id, None)
        log.warning("worker %s", "banned" if banned else "unbanned", extra={"worker_id": worker_id, "reason": reason})
        w = self.state.worker(worker_id)
        assert w is not None
        return self._record(w, time.time())

    def status(self) -> RunStatus:
        now = time.time()
        c = self.state.counters()
        accepted, rejected = int(c.get("submissions_accepted", 0)), int(c.get("submissions_rejected", 0))
        win = self._window(now)
        return RunStatus(
            run_name=self.config.name,
            step=int(c.get("step", 0)),
            policy_version=self._version,
            async_level=self.cfg.async_level,
            buffer_depth=self.state.buffer_depth(),
            workers_online=sum(self._online(w, now) for w in self.state.workers()),
            acceptance_rate=accepted / (accepted + rejected) if accepted + rejected else 0.0,
            submissions_accepted=accepted,
            submissions_rejected=rejected,
            groups_dropped_zero_signal=int(c.get("groups_dropped_zero_signal", 0)),
            samples_dropped_stale=int(c.get("samples_dropped_stale", 0)),
            rollout_tokens_per_s=win["rollout_tokens_per_s"],
            trained_samples_per_s=win["trained_samples_per_s"],
            mean_reward=win["mean_reward"],
            wait_for_trainer_s=self.wait_for_trainer_s + (now - self._bound_since if self._bound_since is not None else 0.0),
            staleness_histogram=self.state.staleness_histogram(),
            finished=self.finished,
            error=self.error,
        )

    def reward_totals(self) -> tuple[float, int]:
        """(reward sum, completions) of all accepted rollouts of the run, zero-signal groups included:
        the driver's per-step mean reward, which the trained samples alone overstate early (dropped
        groups are often all-zero) and understate late (all-one). Persisted with each verdict."""
        c = self.state.counters()
        return c.get("reward_sum", 0.0), int(c.get("reward_count", 0))

    def _window(self, now: float) -> dict[str, Any]:
        """Rates over the last WINDOW_S seconds (or since start, if shorter)."""
        span = max(1e-3, min(WINDOW_S, now - self.started_at))
        with self._events_lock:
            for dq in (self._accepted, self._rejected, self._trained):
                while dq and now - (dq[0] if isinstance(dq[0], float) else dq[0][0]) > WINDOW_S:
                    dq.popleft()
            tokens = sum(e[1] for e in self._accepted)
            reward_sum = sum(e[2] for e in self._accepted)
            completions = sum(e[3] for e in self._accepted)
            n_acc, n_rej = len(self._accepted), len(self._rejected)
            trained = sum(e[1] for e in self._trained)
        return {
            "rollout_tokens_per_s": tokens / span,
            "trained_samples_per_s": trained / span,
            "submissions_per_s": (n_acc + n_rej) / span,
            "acceptance": n_acc / (n_acc + n_rej) if n_acc + n_rej else None,
            "mean_reward": reward_sum / completions if completions else None,
        }

    # ---------------------------------------------------------------------------------------------
    # trainer and publisher side

    def set_finished(self, error: str | None = None) -> None:
        """The run is over (or failed): /v1/status says so, and workers get no new leases."""
        self.finished = True
        self.error = error

    def publish_version(self, version: int, model_hash: str) -> None:
        """A new policy version is available to workers (called by the trainer / shardcast origin)."""
        self.state.publish_version(version, model_hash)
        self._model_hashes.pop(version, None)
        self._version = max(self._version, version)
        self.metrics.policy_version.set(self._version)

    def take_batch(self, n: int, trainer_version: int | None = None, wait_s: float = 0.0) -> Batch:
        """Up to n verified samples for the trainer, waiting up to wait_s for n to be ready."""
        deadline = time.monotonic() + wait_s
        with self._buffer_changed:
            # The verification thread counts what it adds and wakes us only once n are ready (each
            # wake-up costs a thread switch); every 0.5 s we recount from SQLite, so nothing is missed.
            self._ready = self.state.buffer_depth()
            while self._ready < n and not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._want = n if self._want is None else min(self._want, n)
                if not self._buffer_changed.wait(min(left, 0.5)):
                    self._ready = self.state.buffer_depth()
            self._want = None
        return self.buffer.take(n, trainer_version)

    def commit_batch(self, batch_id: str, new_version: int, model_hash: str | None = None, dropped_stale: int = 0) -> dict[int, int]:
        gaps = self.buffer.commit(batch_id, new_version, model_hash, dropped_stale)
        with self._events_lock:
            self._trained.append((time.time(), sum(gaps.values())))
        self._version = max(self._version, new_version)
        self.metrics.policy_version.set(self._version)
        return gaps

    def give_back_batch(self, batch_id: str) -> int:
        return self.buffer.give_back(batch_id)

    # ---------------------------------------------------------------------------------------------
    # verification

    def _load_pending(self, submission_id: str) -> _Pending | None:
        p = self._pending.get(submission_id)
        if p is not None:
            return p
        row = self.state.submission(submission_id)  # after a restart: from the stored body
        if row is None or row.status != "pending" or row.body is None:
            return None
        raw = admission.decompress_zstd(row.body)
        sub = RolloutSubmission.model_validate_json(raw, context={"vocab_size": self.prompts.vocab_size})
        lease_row = self.state.lease(row.lease_id)
        assert lease_row is not None
        p = _Pending(row.worker_id, sub, TaskLease.model_validate_json(lease_row.body), list(lease_row.prompt_indices))
        self._pending[submission_id] = p
        return p

    def _model_hash(self, version: int) -> str:
        """A published version's hash (immutable once published: cached, but dropped on publish)."""
        h = self._model_hashes.get(version)
        if h is None:
            h = self.state.model_hash(version)
            if h is None:
                return ""
            self._model_hashes[version] = h
        return h

    def _job(self, submission_id: str, p: _Pending, workers: dict[str, WorkerRow | None]) -> Any:
        if p.worker_id not in workers:  # once per worker per batch
            workers[p.worker_id] = self.state.worker(p.worker_id)
        w = workers[p.worker_id]
        trusted = w is not None and w.strikes == 0 and w.accepted >= TRUSTED_AFTER_ACCEPTED
        return self.make_job(
            submission_id=submission_id,
            submission=p.submission,
            lease=p.lease,
            items=[self.prompts.prompts[i].item for i in p.prompt_indices],
            task_name=self.config.data.task,
            task_params=dict(self.config.data.task_params),
            expected_model_hash=self._model_hash(p.submission.policy_version),
            trust_level="trusted" if trusted else "new",
        )

    def verify_pending(self, max_jobs: int | None = None, block: float = 0.0, gather_s: float = 0.0) -> int:
        """Verify queued submissions (up to max_jobs) and apply their verdicts. Returns how many.
        `block`: wait that long for a first one; `gather_s`: then wait that long for more to batch with it."""
        ids: list[str] = []
        limit = max_jobs or self.verify_batch
        try:
            ids.append(self._queue.get(timeout=block) if block else self._queue.get_nowait())
            if gather_s and self._queue.qsize() < limit - 1:
                self._stop.wait(gather_s)
            while len(ids) < limit:
                ids.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        self.metrics.verify_queue.set(self._queue.qsize())
        batch = [(sid, p) for sid in ids if (p := self._load_pending(sid)) is not None]
        if not batch:
            return 0
        workers: dict[str, WorkerRow | None] = {}
        jobs = [self._job(sid, p, workers) for sid, p in batch]
        t0 = time.perf_counter()
        try:
            verdicts = self.verifier.verify_many(jobs)
            if len(verdicts) != len(jobs):
                raise RuntimeError(f"verifier returned {len(verdicts)} verdicts for {len(jobs)} jobs")
        except Exception:
            log.exception("verification failed; submissions stay queued", extra={"submissions": len(jobs)})
            for sid, _ in batch:
                self._queue.put(sid)
            self._stop.wait(1.0)
            return 0
        self.metrics.verify_seconds.observe(time.perf_counter() - t0)
        # CPU work first (advantages, samples), then one transaction for the whole batch (one commit),
        # so the request path waits for the lock as briefly as possible.
        prepared = []
        for (sid, p), v in zip(batch, verdicts):
            try:
                prepared.append(self._prepare(sid, p, v))
            except Exception:  # one bad verdict must not lose the others; this one stays pending in SQLite
                log.exception("could not apply a verdict; the submission stays pending until a restart", extra={"submission_id": sid})
        results = []
        with self.state.tx():
            for item in prepared:
                try:
                    results.append((item, self._record_verdict(item)))
                except Exception:
                    log.exception("could not record a verdict; it stays pending until a restart", extra={"submission_id": item.submission_id})
        for item, (applied, banned_now) in results:
            self._after(item, applied, banned_now)
        added = sum(item.groups.num_samples for item, (applied, _) in results if applied and item.groups is not None)
        if added:
            with self._buffer_changed:
                self._ready += added
                if self._want is not None and self._ready >= self._want:
                    self._buffer_changed.notify_all()
        return len(batch)

    def _prepare(self, submission_id: str, p: _Pending, v: Verdict) -> "_Applied":
        accepted = v.status == VerdictStatus.accepted
        rewards = list(v.rewards or [])
        v = v.model_copy(update={"submission_id": submission_id})
        if accepted and len(rewards) != len(p.submission.completions):
            log.error("accepted verdict without one reward per completion; treated as rejected", extra={"submission_id": submission_id})
            accepted = False
        groups = build_groups(submission_id, p.submission, p.lease, rewards, self.config.trainer.loss.advantage_std) if accepted else None
        return _Applied(submission_id, p.worker_id, v, accepted, rewards if accepted else [], groups)

    def _record_verdict(self, a: "_Applied") -> tuple[bool, bool]:
        return self.state.record_verdict(
            a.submission_id,
            a.accepted,
            a.verdict.model_dump_json(),
            a.verdict.verified_tokens if a.accepted else 0,
            a.groups.rows if a.groups else [],
            a.groups.dropped_zero_signal if a.groups else 0,
            a.rewards,
            self.cfg.strikes_to_ban,
        )

    def _after(self, a: "_Applied", applied: bool, banned_now: bool) -> None:
        self._pending.pop(a.submission_id, None)
        if not applied:
            return
        now = time.time()
        self.metrics.verdicts.labels("accepted" if a.accepted else "rejected").inc()
        with self._events_lock:
            if a.accepted:
                self._accepted.append((now, a.verdict.verified_tokens, float(sum(a.rewards)), len(a.rewards)))
            else:
                self._rejected.append(now)
        if a.accepted:
            self.metrics.verified_tokens.inc(a.verdict.verified_tokens)
            self.metrics.groups_dropped.inc(a.groups.dropped_zero_signal if a.groups else 0)
        else:
            for r in a.verdict.rejections:
                self.metrics.rejections.labels(r.code.value).inc()
        if banned_now:
            self._auth.pop(a.worker_id, None)
            self.metrics.bans.inc()
            log.warning("worker banned after strikes", extra={"worker_id": a.worker_id})

    def _verify_loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.verify_pending(block=0.2, gather_s=VERIFY_GATHER_S)
            except Exception:  # never let the thread die: log and keep serving
                log.exception("verification loop error")
                self._stop.wait(1.0)

    # ---------------------------------------------------------------------------------------------
    # housekeeping: lease expiry, last-seen flush, dashboard history

    def housekeeping(self, now: float | None = None) -> None:
        now = time.time() if now is None else now
        expired = self.leases.expire(now)
        if expired:
            self.metrics.leases_expired.inc(len(expired))
            log.info("leases expired; prompts queued for re-issue", extra={"leases": len(expired)})
        self.state.touch(self._take_seen())
        st = self.status()
        win = self._window(now)
        self.metrics.buffer_depth.set(st.buffer_depth)
        self.metrics.workers_online.set(st.workers_online)
        self.metrics.policy_version.set(st.policy_version)
        self.history.append(
            {
                "t": now,
                "step": st.step,
                "policy_version": st.policy_version,
                "mean_reward": win["mean_reward"],
                "rollout_tokens_per_s": win["rollout_tokens_per_s"],
                "submissions_per_s": win["submissions_per_s"],
                "acceptance": win["acceptance"],
                "workers_online": st.workers_online,
                "buffer_depth": st.buffer_depth,
            }
        )

    def _take_seen(self) -> dict[str, float]:
        seen, self._seen = self._seen, {}
        return seen

    def _housekeeping_loop(self) -> None:
        while not self._stop.wait(min(HISTORY_EVERY_S, self.cfg.lease_timeout_s / 4)):
            try:
                self.housekeeping()
            except Exception:
                log.exception("housekeeping error")
