"""Task leases: which prompts a worker gets (seeded, never chosen by the worker), with which sampling
seeds, until when, which policy version they must be generated with, and what happens when the deadline
passes (the prompts are handed out again and a late submission is refused). Owns the `leases` and
`reissue` tables, and the count of leased prompts behind the async bound.
"""

from __future__ import annotations

import json
import secrets
import sqlite3
from dataclasses import dataclass

import numpy as np

from orchestrator.buffer import BUFFERED_SAMPLES
from orchestrator.config import OrchestratorConfig, StepShape
from orchestrator.data import PromptSet
from orchestrator.db import Database
from orchestrator.errors import ApiError
from protocol import staleness
from protocol.models import ErrorCode, TaskLease, TaskPrompt

SCHEMA = """
CREATE TABLE IF NOT EXISTS leases (
    lease_id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    worker_id TEXT NOT NULL,
    prompt_indices TEXT NOT NULL,   -- JSON list of indices into the prompt set
    body TEXT NOT NULL,             -- the TaskLease as sent (JSON)
    issued_at REAL NOT NULL,
    deadline REAL NOT NULL,
    status TEXT NOT NULL,           -- open | submitted | done | expired | released | rejected
    request_id TEXT                 -- the worker's idempotency key, if it sent one
);
CREATE INDEX IF NOT EXISTS leases_by_worker ON leases (worker_id, status);
CREATE INDEX IF NOT EXISTS leases_by_deadline ON leases (status, deadline);
-- prompts of expired, released or rejected leases, handed out again before new ones
CREATE TABLE IF NOT EXISTS reissue (seq INTEGER PRIMARY KEY AUTOINCREMENT, prompt_index INTEGER NOT NULL);
"""
# Prompts of open or submitted leases (kept in the same transactions as those rows; recounted at start).
LEASED_PROMPTS = "untrained:leased_prompts"


class GenerationBoundReached(Exception):
    """Generation is async_level steps ahead of the trainer; wait for it to consume a batch."""


@dataclass
class LeaseRow:
    lease_id: str
    seq: int
    worker_id: str
    prompt_indices: list[int]
    body: str
    issued_at: float
    deadline: float
    status: str
    request_id: str | None = None


def _row(r: sqlite3.Row) -> LeaseRow:
    d = {k: r[k] for k in r.keys()}
    d["prompt_indices"] = json.loads(d["prompt_indices"])
    return LeaseRow(**d)


class LeaseBook:
    def __init__(self, db: Database, prompts: PromptSet, config: OrchestratorConfig, shape: StepShape | None = None):
        self.db = db
        self.prompts = prompts
        self.config = config
        self.shape = shape
        db.create(SCHEMA, counters=("lease_seq", "prompt_cursor"))
        if "request_id" not in {r[1] for r in db.all("PRAGMA table_info(leases)")}:  # from before idempotent leases
            with db.tx() as conn:
                conn.execute("ALTER TABLE leases ADD COLUMN request_id TEXT")
        db.create("CREATE INDEX IF NOT EXISTS leases_by_request ON leases (worker_id, request_id);")
        with db.tx() as conn:
            leased = conn.execute(
                "SELECT COALESCE(SUM(json_array_length(prompt_indices)), 0) FROM leases WHERE status IN ('open', 'submitted')"
            ).fetchone()[0]
            db.set(conn, LEASED_PROMPTS, int(leased))
        # Open leases, parsed, so a submission does not re-parse its lease (a cache: SQLite is the truth).
        self._open: dict[str, TaskLease] = {}
        # Prompt index -> (prompt_id, token ids) as validated by the first lease that carried the prompt.
        # The token array is shared, read-only, by every later lease of that prompt.
        self._checked_prompts: dict[int, tuple[str, np.ndarray]] = {}

    def _task_prompt(self, index: int, seeds: list[int]) -> TaskPrompt:
        checked = self._checked_prompts.get(index)
        if checked is None:
            p = self.prompts.prompts[index]
            prompt = TaskPrompt(prompt_id=p.prompt_id, token_ids=p.token_ids, seeds=seeds)
            prompt.token_ids.flags.writeable = False
            self._checked_prompts[index] = (prompt.prompt_id, prompt.token_ids)
            return prompt
        return TaskPrompt.model_construct(prompt_id=checked[0], token_ids=checked[1], seeds=seeds)

    def untrained_samples(self, db: sqlite3.Connection) -> int:
        """Samples generated or being generated that the trainer has not consumed: those of open and
        submitted leases, plus the buffer (ready or taken). Two counters, not a count of rows (that was
        ~0.06 ms per lease)."""
        return Database.read_int(db, LEASED_PROMPTS) * self.config.samples_per_prompt + Database.read_int(db, BUFFERED_SAMPLES)

    def issue(
        self, worker_id: str, max_prompts: int, current_version: int, now: float, *, loaded_version: int | None = None, request_id: str | None = None
    ) -> TaskLease:
        """A new lease. With a StepShape, generation may not run more than async_level steps ahead of
        the trainer (AReaL's bound: GenerationBoundReached), and the lease says which version it must be
        generated with so that its samples are not stale by the time they are trained
        (`protocol.staleness.lease_min_version`); a worker holding an older version is told to pull first.
        """
        cfg, shape = self.config, self.shape
        k = cfg.samples_per_prompt
        n = min(max_prompts, cfg.prompts_per_lease)
        min_version = staleness.min_policy_version(current_version, cfg.async_level)
        with self.db.tx() as db:
            if request_id is not None:
                earlier = db.execute(
                    "SELECT body FROM leases WHERE worker_id=? AND request_id=? AND status='open' AND deadline>=?", (worker_id, request_id, now)
                ).fetchone()
                if earlier is not None:  # a retry of a request whose answer was lost: the same lease again
                    return TaskLease.model_validate_json(earlier[0])
            if shape is not None:
                untrained = self.untrained_samples(db)
                room = (staleness.max_untrained_samples(cfg.async_level, shape.samples_per_step) - untrained) // k
                if room <= 0:
                    raise GenerationBoundReached()
                n = min(n, room)
                min_version = staleness.lease_min_version(
                    current_version, cfg.async_level, untrained_samples=untrained, new_samples=n * k,
                    samples_per_step=shape.samples_per_step, mini_batches=shape.mini_batches, max_staleness=shape.max_staleness,
                )
                if loaded_version is not None and loaded_version < min_version:
                    raise ApiError(
                        ErrorCode.version_too_old,
                        f"loaded policy version {loaded_version} would be stale by the time these samples are trained; pull version {min_version}",
                        min_policy_version=min_version,
                    )
            # Counted inside the transaction: two concurrent requests cannot both pass the cap.
            if self.open_leases(worker_id, now) >= cfg.max_open_leases_per_worker:
                raise ApiError(
                    ErrorCode.too_many_leases,
                    f"worker already holds {cfg.max_open_leases_per_worker} open leases; submit or release one first",
                    retry_after_s=1.0,
                )
            Database.add(db, "lease_seq", 1)
            seq = Database.read_int(db, "lease_seq")
            indices = self._take_reissue(db, n)
            if len(indices) < n:
                start = Database.read_int(db, "prompt_cursor")
                Database.set(db, "prompt_cursor", start + n - len(indices))
                indices += [self.prompts.order(start + i) for i in range(n - len(indices))]
            seeds = self.prompts.sample_seeds(seq, n * k)
            # Built without re-validation: every field is ours (each prompt was validated by the first
            # lease that carried it; ids, seeds, versions and deadline are made right here).
            lease = TaskLease.model_construct(
                lease_id=f"L{seq:08d}-{secrets.token_hex(4)}",
                prompts=[self._task_prompt(i, seeds[j * k : (j + 1) * k]) for j, i in enumerate(indices)],
                samples_per_prompt=k,
                sampling=cfg.sampling,
                policy_version=current_version,
                min_policy_version=min_version,
                deadline=now + cfg.lease_timeout_s,
            )
            db.execute(
                "INSERT INTO leases (lease_id, seq, worker_id, prompt_indices, body, issued_at, deadline, status, request_id) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, 'open', ?)",
                (lease.lease_id, seq, worker_id, json.dumps(indices), lease.model_dump_json(), now, lease.deadline, request_id),
            )
            Database.add(db, LEASED_PROMPTS, len(indices))
        self._open[lease.lease_id] = lease
        return lease

    @staticmethod
    def _take_reissue(db: sqlite3.Connection, n: int) -> list[int]:
        """Up to n prompt indices waiting to be handed out again (oldest first)."""
        rows = db.execute("SELECT seq, prompt_index FROM reissue ORDER BY seq LIMIT ?", (n,)).fetchall()
        db.executemany("DELETE FROM reissue WHERE seq=?", [(r[0],) for r in rows])
        return [int(r[1]) for r in rows]

    # ---------------------------------------------------------------------------------------------
    # a lease's life after it was issued

    def get(self, lease_id: str) -> LeaseRow | None:
        row = self.db.one("SELECT * FROM leases WHERE lease_id=?", (lease_id,))
        return _row(row) if row else None

    def open_leases(self, worker_id: str, now: float) -> int:
        row = self.db.one("SELECT COUNT(*) FROM leases WHERE worker_id=? AND status='open' AND deadline>=?", (worker_id, now))
        return int(row[0])

    def for_submission(self, lease_id: str, worker_id: str, now: float) -> tuple[LeaseRow, TaskLease]:
        """The open lease a submission is for, or the reason it cannot be submitted."""
        row = self.get(lease_id)
        if row is None or row.worker_id != worker_id:
            # Not yours: indistinguishable from a lease that does not exist, so ids cannot be probed.
            raise ApiError(ErrorCode.not_found, f"no lease {lease_id}")
        if row.status in ("submitted", "done", "rejected"):
            raise ApiError(ErrorCode.duplicate, f"lease {lease_id} already has a submission")
        if row.status in ("expired", "released") or row.deadline < now:
            raise ApiError(ErrorCode.lease_expired, f"lease {lease_id} is {row.status if row.status != 'open' else 'past its deadline'}")
        lease = self._open.pop(lease_id, None) or TaskLease.model_validate_json(row.body)
        return row, lease

    @staticmethod
    def mark_submitted(db: sqlite3.Connection, lease_id: str) -> bool:
        """In the submission's transaction: the lease now has its submission (False if it was not open)."""
        return db.execute("UPDATE leases SET status='submitted' WHERE lease_id=? AND status='open'", (lease_id,)).rowcount == 1

    def finish(self, db: sqlite3.Connection, lease_id: str, accepted: bool) -> None:
        """In the verdict's transaction: an accepted lease is done (its samples move to the buffer's
        count); a rejected one gives its prompts back for re-issue."""
        if not accepted:
            self._end(db, lease_id, "rejected", "submitted")
            return
        row = db.execute("SELECT status, json_array_length(prompt_indices) FROM leases WHERE lease_id=?", (lease_id,)).fetchone()
        db.execute("UPDATE leases SET status='done' WHERE lease_id=?", (lease_id,))
        if row is not None and row[0] in ("open", "submitted"):
            Database.add(db, LEASED_PROMPTS, -int(row[1]))

    def release(self, lease_id: str, worker_id: str) -> bool:
        row = self.get(lease_id)
        if row is None or row.worker_id != worker_id:
            raise ApiError(ErrorCode.not_found, f"no lease {lease_id}")
        self._open.pop(lease_id, None)
        with self.db.tx() as db:
            return self._end(db, lease_id, "released", "open")

    def expire(self, now: float) -> list[str]:
        """Open leases past their deadline become expired; their prompts are queued for re-issue."""
        with self.db.tx() as db:
            ids = [r[0] for r in db.execute("SELECT lease_id FROM leases WHERE status='open' AND deadline<?", (now,)).fetchall()]
            for lease_id in ids:
                self._end(db, lease_id, "expired", "open")
        for lease_id in ids:
            self._open.pop(lease_id, None)
        return ids

    @staticmethod
    def _end(db: sqlite3.Connection, lease_id: str, status: str, from_status: str) -> bool:
        """Close a lease and queue its prompts for re-issue."""
        row = db.execute("SELECT prompt_indices FROM leases WHERE lease_id=? AND status=?", (lease_id, from_status)).fetchone()
        if row is None:
            return False
        db.execute("UPDATE leases SET status=? WHERE lease_id=?", (status, lease_id))
        indices = json.loads(row[0])
        db.executemany("INSERT INTO reissue (prompt_index) VALUES (?)", [(i,) for i in indices])
        Database.add(db, LEASED_PROMPTS, -len(indices))  # from_status is open or submitted
        return True

    def counts(self) -> dict[str, int]:
        return {r["status"]: int(r["n"]) for r in self.db.all("SELECT status, COUNT(*) AS n FROM leases GROUP BY status")}

    def reissue_depth(self) -> int:
        return int(self.db.one("SELECT COUNT(*) FROM reissue")[0])
