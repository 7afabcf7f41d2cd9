"""Verification bookkeeping: the submissions waiting for a verdict, the thread that sends them to the
verifier pool in batches, and what a verdict changes (the submission, its lease, the worker's ledger and
strikes, the buffer), all in one transaction (orchestrator/verdict_effects.py works it out before). Owns
the `submissions` and `fingerprints` tables (a submission claims a published version; the verifier checks
its model hash against orchestrator/versions.py).

Verification goes through anything with `verify_many(jobs) -> list[Verdict]`: Ray actors wrapping
`verifier.service.Verifier` in production, a fake in logic unit tests.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from orchestrator import admission, reward_failures
from orchestrator.admission import Pending, SubmissionRow
from orchestrator.buffer import RolloutBuffer
from orchestrator.data import PromptSet
from orchestrator.db import Database
from orchestrator.draw_deviations import DeviationLedger
from orchestrator.errors import ApiError
from orchestrator.leases import LeaseBook
from orchestrator.status import Metrics, RunWindows
from orchestrator.verdict_effects import Applied, prepare
from orchestrator.versions import PolicyVersions
from orchestrator.workers import WorkerRow, Workers
from protocol.models import ErrorCode, RolloutSubmission, TaskLease
from protocol.verdicts import NO_STRIKE, Rejection, RejectionCode, Verdict, VerdictStatus

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS submissions (
    submission_id TEXT PRIMARY KEY,
    worker_id TEXT NOT NULL,
    lease_id TEXT NOT NULL UNIQUE,
    policy_version INTEGER NOT NULL,
    num_tokens INTEGER NOT NULL,
    received_at REAL NOT NULL,
    status TEXT NOT NULL,           -- pending | accepted | rejected
    body BLOB,                      -- zstd JSON of the RolloutSubmission; dropped once verified
    verdict TEXT                    -- Verdict JSON once verified
);
CREATE INDEX IF NOT EXISTS submissions_pending ON submissions (status);
-- a hash of each submission's generated content, so replays are refused
CREATE TABLE IF NOT EXISTS fingerprints (fingerprint TEXT PRIMARY KEY, submission_id TEXT NOT NULL);
"""
COUNTERS = ("submissions_accepted", "submissions_rejected", "reward_count")

# Submissions waiting for verification: above this, leases are refused (retry later); parsed ones above
# MAX_PARSED_PENDING are not kept in memory but re-read from SQLite when their turn comes.
MAX_VERIFY_BACKLOG = 4096
MAX_PARSED_PENDING = 1024
# A submission the verifier fails on alone this many times is rejected (without a strike) instead of retried.
MAX_VERIFY_ATTEMPTS = 3
# The verification thread, woken by a submission, waits this long for more before it verifies and records
# them together: one transaction and one verifier call per batch instead of per submission (at 500
# submissions/s, ~10 per batch instead of ~2). The submit response does not wait for verdicts.
VERIFY_GATHER_S = 0.02


class Verifier(Protocol):
    def verify_many(self, jobs: list[Any]) -> list[Verdict]: ...


def parallelism(verifier: Any) -> int:
    """How many actors one verify_many call is spread over (a pool's `parallelism`; 1 otherwise)."""
    return max(1, int(getattr(verifier, "parallelism", 1)))


def default_make_job(**fields: Any) -> Any:
    from verifier.service import VerifyJob

    return VerifyJob(**fields)


class Verification:
    def __init__(
        self,
        db: Database,
        *,
        verifier: Verifier,
        versions: PolicyVersions,
        workers: Workers,
        leases: LeaseBook,
        buffer: RolloutBuffer,
        prompts: PromptSet,
        metrics: Metrics,
        windows: RunWindows,
        task_name: str,
        task_params: dict[str, Any],
        advantage_std: bool,
        strikes_to_ban: int,
        make_job: Callable[..., Any] = default_make_job,
        batch_size: int = 16,
        near_tie_burst: float = 8.0,
        near_tie_ban: float = 24.0,
    ):
        self.db = db
        self.deviations = DeviationLedger(db, near_tie_burst, near_tie_ban)
        db.create(SCHEMA, counters=COUNTERS, float_counters=("reward_sum",))
        reward_failures.seed_metrics(metrics, db.counters())
        self.versions = versions
        self.verifier, self.workers, self.leases, self.buffer, self.prompts = verifier, workers, leases, buffer, prompts
        self.metrics, self.windows = metrics, windows
        self.task_name, self.task_params, self.advantage_std = task_name, dict(task_params), advantage_std
        self.strikes_to_ban, self.make_job, self.batch_size = strikes_to_ban, make_job, batch_size
        self._pending: dict[str, Pending] = {}
        self._failures: dict[str, int] = {}  # submission -> failed verification attempts on its own
        self._queue: queue.Queue[str] = queue.Queue()
        self.stopping = threading.Event()
        self.evals_finished: list[int] = []  # versions whose evaluation a verdict finished (the orchestrator logs them)

    # ---------------------------------------------------------------------------------------------
    # submissions in

    def requeue_pending(self) -> None:
        """After a restart: submissions stored but not verified go back in the queue."""
        for r in self.db.all("SELECT submission_id FROM submissions WHERE status='pending' ORDER BY received_at"):
            self._queue.put(r[0])

    def backlog(self) -> int:
        return self._queue.qsize()

    def enqueue(self, row: SubmissionRow, fingerprint: str, pending: Pending) -> str | None:
        """Store a submission, mark its lease submitted and queue it, atomically. Returns None, or why it
        is a duplicate: "lease" (the lease already has a submission) or "replay" (the same content was
        submitted before, to this lease or another)."""
        with self.db.tx() as db:
            if db.execute("SELECT 1 FROM submissions WHERE lease_id=?", (row.lease_id,)).fetchone():
                return "lease"
            if db.execute("SELECT 1 FROM fingerprints WHERE fingerprint=?", (fingerprint,)).fetchone():
                return "replay"
            if not self.leases.mark_submitted(db, row.lease_id):
                return "lease"
            db.execute(
                "INSERT INTO submissions (submission_id, worker_id, lease_id, policy_version, num_tokens, "
                "received_at, status, body) "
                "VALUES (?, ?, ?, ?, ?, ?, 'pending', ?)",
                (row.submission_id, row.worker_id, row.lease_id, row.policy_version, row.num_tokens, row.received_at,
                row.body),
            )
            db.execute("INSERT INTO fingerprints (fingerprint, submission_id) VALUES (?, ?)", (fingerprint,
                row.submission_id))
        if len(self._pending) < MAX_PARSED_PENDING:  # beyond that, re-read from SQLite when verified
            self._pending[row.submission_id] = pending
        self._queue.put(row.submission_id)
        self.metrics.submissions.inc()
        self.windows.arrived()
        return None

    def submission(self, submission_id: str) -> SubmissionRow | None:
        row = self.db.one("SELECT * FROM submissions WHERE submission_id=?", (submission_id,))
        return SubmissionRow(**{k: row[k] for k in row.keys()}) if row else None

    def verdict(self, worker_id: str, submission_id: str) -> Verdict:
        """A worker's submission's verdict (pending until verified); another worker's is not found."""
        row = self.submission(submission_id)
        if row is None or row.worker_id != worker_id:
            raise ApiError(ErrorCode.not_found, f"no submission {submission_id}")
        if row.verdict is None:
            return Verdict(submission_id=submission_id, status=VerdictStatus.pending)
        return Verdict.model_validate_json(row.verdict)

    def _load(self, submission_id: str) -> Pending | None:
        p = self._pending.get(submission_id)
        if p is not None:
            return p
        row = self.submission(submission_id)  # after a restart: from the stored body
        if row is None or row.status != "pending" or row.body is None:
            return None
        raw = admission.decompress_zstd(row.body)
        sub = RolloutSubmission.model_validate_json(raw, context={"vocab_size": self.prompts.vocab_size})
        lease_row = self.leases.get(row.lease_id)
        assert lease_row is not None
        p = self._pending[submission_id] = Pending(
            row.worker_id, sub, TaskLease.model_validate_json(lease_row.body), list(lease_row.prompt_indices),
            lease_row.eval_version
        )
        return p

    # ---------------------------------------------------------------------------------------------
    # verdicts

    def _job(self, submission_id: str, p: Pending, workers: dict[str, WorkerRow | None]) -> Any:
        if p.worker_id not in workers:  # once per worker per batch
            workers[p.worker_id] = self.workers.get(p.worker_id)
        w = workers[p.worker_id]
        return self.make_job(
            submission_id=submission_id,
            submission=p.submission,
            lease=p.lease,
            items=[self.prompts.prompts[i].item for i in p.prompt_indices],
            task_name=self.task_name,
            task_params=dict(self.task_params),
            expected_model_hash=self.versions.model_hash(p.submission.policy_version),
            trust_level=w.trust_level if w is not None else "new",
        )

    def verify_pending(self, max_jobs: int | None = None, block: float = 0.0, gather_s: float = 0.0) -> int:
        """Verify queued submissions (up to max_jobs) and apply their verdicts. Returns how many verdicts.
        `block`: wait that long for a first one; `gather_s`: then wait that long for more to batch with it."""
        ids: list[str] = []
        # batch_size per actor: a pool that grew splits a bigger batch, rather than the same batch into
        # smaller calls (a call's cost per token rises as its batch shrinks: bench/results/verifier_pool.md).
        limit = max_jobs or self.batch_size * parallelism(self.verifier)
        try:
            ids.append(self._queue.get(timeout=block) if block else self._queue.get_nowait())
            if gather_s and self._queue.qsize() < limit - 1:
                self.stopping.wait(gather_s)
            while len(ids) < limit:
                ids.append(self._queue.get_nowait())
        except queue.Empty:
            pass
        self.metrics.verify_queue.set(self._queue.qsize())
        batch = [(sid, p) for sid in ids if (p := self._load(sid)) is not None]
        if not batch:
            return 0
        workers: dict[str, WorkerRow | None] = {}
        jobs = [self._job(sid, p, workers) for sid, p in batch]
        verdicts = self._verify(batch, jobs)
        # CPU work first (advantages, samples), then one transaction for the whole batch (one commit),
        # so the request path waits for the lock as briefly as possible.
        prepared = []
        for (sid, p), v in zip(batch, verdicts):
            if v is None:  # failed this time: queued again (or given up on, in _verify)
                continue
            try:
                prepared.append(prepare(sid, p, v, task_name=self.task_name, advantage_std=self.advantage_std))
            except Exception:  # one bad verdict must not lose the others; this one stays pending in SQLite
                log.exception("could not apply a verdict; the submission stays pending until a restart",
                    extra={"submission_id": sid})
        results = []
        with self.db.tx():
            for item in prepared:
                try:
                    results.append((item, self._record(item)))
                except Exception:
                    log.exception("could not record a verdict; it stays pending until a restart",
                        extra={"submission_id": item.submission_id})
        for item, (applied, banned_now) in results:
            self._after(item, applied, banned_now)
        self.buffer.added(sum(item.groups.num_samples for item, (applied, _) in results if applied
            and item.groups is not None))
        return sum(v is not None for v in verdicts)

    def _verify(self, batch: list[tuple[str, Pending]], jobs: list[Any]) -> list[Verdict | None]:
        """Verdicts of a batch. When the pool fails (an actor died, a call ran past its timeout), the batch
        is split in halves and each tried alone, so one bad submission never holds back the others; one
        that fails alone goes back in the queue, and after MAX_VERIFY_ATTEMPTS is rejected (no strike)."""
        t0 = time.perf_counter()
        try:
            verdicts = self.verifier.verify_many(jobs)
            if len(verdicts) != len(jobs):
                raise RuntimeError(f"verifier returned {len(verdicts)} verdicts for {len(jobs)} jobs")
            self.metrics.verify_seconds.observe(time.perf_counter() - t0)
            return list(verdicts)
        except Exception:
            log.exception("verification failed", extra={"submissions": len(jobs)})
        if len(jobs) > 1:
            half = len(jobs) // 2
            return self._verify(batch[:half], jobs[:half]) + self._verify(batch[half:], jobs[half:])
        sid = batch[0][0]
        self._failures[sid] = self._failures.get(sid, 0) + 1
        if self._failures[sid] < MAX_VERIFY_ATTEMPTS:
            self._queue.put(sid)
            self.stopping.wait(1.0)
            return [None]
        del self._failures[sid]
        message = f"the verifier failed on this submission {MAX_VERIFY_ATTEMPTS} times"
        log.error(message, extra={"submission_id": sid})
        return [Verdict(submission_id=sid, status=VerdictStatus.rejected,
            rejections=[Rejection(code=RejectionCode.verification_failed, message=message)])]

    def _record(self, a: Applied) -> tuple[bool, bool]:
        """Apply a verdict atomically: submission, lease, worker ledger and strikes, buffer. Returns
        (applied, banned_now). A verdict for a submission that is no longer pending is ignored, so a
        verdict applied twice (e.g. re-verified after a restart) cannot add samples twice."""
        with self.db.tx() as db:
            row = db.execute("SELECT worker_id, lease_id, status FROM submissions WHERE submission_id=?",
                (a.submission_id,)).fetchone()
            if row is None or row["status"] != "pending":
                return False, False
            status = "accepted" if a.accepted else "rejected"
            db.execute("UPDATE submissions SET status=?, verdict=?, body=NULL WHERE submission_id=?", (status,
                a.verdict.model_dump_json(), a.submission_id))
            if not a.accepted:  # its prompts come back with the same seeds: the same honest rollouts may follow
                db.execute("DELETE FROM fingerprints WHERE submission_id=?", (a.submission_id,))
            # A reward that could not be computed is never the worker's doing: full credit, no strike.
            self.leases.finish(db, row["lease_id"], a.accepted, generated=a.verdict.verified_tokens)
            tokens = a.verdict.verified_tokens if a.accepted else 0
            strike = not a.accepted and any(r.code not in NO_STRIKE for r in a.verdict.rejections)
            banned_now = self.workers.record_verdict(db, row["worker_id"], a.accepted, tokens, self.strikes_to_ban,
                strike=strike)
            if a.accepted and a.failures[1] and a.verdict.behaviour_logprobs is None:
                # Not spot-checked: the text was never shown to be the policy's draw, so it is the worker's choice.
                banned_now = self.workers.strike(db, row["worker_id"], "unchecked completions whose rewards failed",
                    self.strikes_to_ban) or banned_now
            if a.accepted:
                strikes, ban = self.deviations.record(db, row["worker_id"], a.verdict.near_ties,
                    a.verdict.near_tie_allowance)
                why = "more accepted tokens off the seed's exact draw than numerical noise explains"
                for _ in range(strikes):
                    banned_now = self.workers.strike(db, row["worker_id"], why, self.strikes_to_ban) or banned_now
                if ban:
                    banned_now = self.workers.ban_now(db, row["worker_id"], why) or banned_now
            if a.accepted and a.evaluation is not None:
                if self.leases.evals is not None and self.leases.evals.record(db, *a.evaluation):
                    self.evals_finished.append(a.evaluation[0])
            elif a.accepted:  # the run's reward totals are of training rollouts only
                Database.add(db, "reward_sum", float(sum(a.rewards)))
                Database.add(db, "reward_count", len(a.rewards))
            if a.accepted:
                Database.add(db, "submissions_accepted", 1)
                Database.add(db, "verified_tokens", a.verdict.verified_tokens)
                Database.add(db, "near_tie_tokens", a.verdict.near_ties)
                reward_failures.record(db, *a.failures)
                if a.groups is not None:
                    self.buffer.add(db, a.groups)
            else:
                Database.add(db, "submissions_rejected", 1)
        return True, banned_now

    def _after(self, a: Applied, applied: bool, banned_now: bool) -> None:
        self._pending.pop(a.submission_id, None)
        if not applied:
            return
        self.metrics.verdicts.labels("accepted" if a.accepted else "rejected").inc()
        self.windows.verified(a.num_tokens)
        if a.accepted:
            training = a.evaluation is None
            self.prompts.observe(a.scored_prompts, a.rewards)  # a curriculum's online pass rate
            self.windows.accepted(a.verdict.verified_tokens, float(sum(a.rewards)) if training else 0.0, len(a.rewards)
                if training else 0)
            self.metrics.verified_tokens.inc(a.verdict.verified_tokens)
            self.metrics.near_tie_tokens.inc(a.verdict.near_ties)
            if a.verdict.near_ties:
                self.metrics.draw_margin.observe(a.verdict.max_draw_margin)
            self.metrics.groups_dropped.inc(a.groups.dropped_zero_signal if a.groups else 0)
            reward_failures.observe(self.metrics, *a.failures, a.groups.dropped_unscored if a.groups else 0)
        else:
            self.windows.rejected()
            for r in a.verdict.rejections:
                self.metrics.rejections.labels(r.code.value).inc()
        if banned_now:
            with self.db.tx() as db:
                self.leases.release_banned(db)
            self.metrics.bans.inc()
            log.warning("worker banned after strikes", extra={"worker_id": a.worker_id})

    def run(self) -> None:
        """The verification thread: verify in batches until stopped."""
        while not self.stopping.is_set():
            try:
                self.verify_pending(block=0.2, gather_s=VERIFY_GATHER_S)
            except Exception:  # never let the thread die: log and keep serving
                log.exception("verification loop error")
                self.stopping.wait(1.0)
