"""Task leases: which prompts a worker gets (seeded, never chosen by the worker), with which sampling
seeds, until when (lease_deadlines.py), which policy version they must be generated with, and what happens
when the deadline passes (the prompts are handed out again and a late submission is refused). Owns the
`leases` and `reissue` tables, and the count of leased prompts behind the async bound.

A lease is a budget. The async bound (generation at most async_level steps ahead of the trainer) is
shared between join tokens with demand, weighted by the work each delivered (orchestrator/lease_shares.py),
however many leases they ask for: a token that only hoards, floods or keeps registering holds about one
prompt of it. A lease that expires or is released after it could have been generated costs its token
debt (orchestrator/release_costs.py, tokens.py: a cooldown that doubles, then strikes), so hoarding loses
its slot; a worker that crashes loses only the lease. A training prompt instance keeps its seeds whoever
leases it, so giving a lease back delays its group but cannot reroll it.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import sqlite3
import time
from dataclasses import dataclass

import numpy as np

from orchestrator import eval_leases
from orchestrator.buffer import BUFFERED_SAMPLES
from orchestrator.config import OrchestratorConfig, StepShape
from orchestrator.data import PromptSet
from orchestrator.db import Database
from orchestrator.errors import ApiError
from orchestrator.evaluation import EvalBook
from orchestrator.lease_deadlines import LeaseDeadlines
from orchestrator.lease_shares import LeaseShares, NoLeaseNow
from orchestrator.release_costs import ReleaseCosts
from orchestrator.room import RoomSignal
from orchestrator.tokens import JoinTokens
from orchestrator.workers import Workers
from protocol import staleness
from protocol.models import ErrorCode, TaskLease, TaskPrompt

SCHEMA = """
CREATE TABLE IF NOT EXISTS leases (
    lease_id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    worker_id TEXT NOT NULL,
    prompt_indices TEXT NOT NULL,   -- JSON list of indices into the prompt set
    instances TEXT,                 -- training: JSON list, per prompt, of its instance (the seeds' key)
    body TEXT NOT NULL,             -- the TaskLease as sent (JSON)
    issued_at REAL NOT NULL,
    deadline REAL NOT NULL,
    status TEXT NOT NULL,           -- open | submitted | done | expired | released | rejected
    request_id TEXT,                -- the worker's idempotency key, if it sent one
    token_id TEXT,                  -- the worker's join token: shares and debts are per token
    eval_version INTEGER,           -- an eval lease: the version it evaluates (NULL: a training lease)
    submitted_at REAL,              -- when its submission arrived
    charged INTEGER                 -- 1: given back unsubmitted and charged to its token
);
CREATE INDEX IF NOT EXISTS leases_by_worker ON leases (worker_id, status);
CREATE INDEX IF NOT EXISTS leases_by_deadline ON leases (status, deadline);
CREATE INDEX IF NOT EXISTS leases_by_request ON leases (worker_id, request_id);
CREATE INDEX IF NOT EXISTS leases_by_token ON leases (token_id, status);
-- prompts of expired, released or rejected leases, handed out again before new ones
CREATE TABLE IF NOT EXISTS reissue (seq INTEGER PRIMARY KEY AUTOINCREMENT, prompt_index INTEGER NOT NULL, instance INTEGER);
-- the run's secret behind every sampling seed (one row, made with the database)
CREATE TABLE IF NOT EXISTS seed_key (id INTEGER PRIMARY KEY CHECK (id = 0), key BLOB NOT NULL);
"""  # noqa: E501 - sqlite keeps this text as the tables' schema: left as written
# Prompts of open or submitted leases (kept in the same transactions as those rows; recounted at start).
LEASED_PROMPTS = "untrained:leased_prompts"
# A reissue row from before prompt instances (queued by an older version) gets instance LEGACY_INSTANCE
# + its row number: fresh seeds once more, and never an instance the prompt cursor will reach.
LEGACY_INSTANCE = 1 << 62


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
    token_id: str | None = None
    eval_version: int | None = None
    instances: list[int] | None = None
    submitted_at: float | None = None
    charged: int | None = None


def _row(r: sqlite3.Row) -> LeaseRow:
    d = {k: r[k] for k in r.keys()}
    d["prompt_indices"] = json.loads(d["prompt_indices"])
    d["instances"] = json.loads(d["instances"]) if d.get("instances") else None
    return LeaseRow(**d)


class LeaseBook:
    def __init__(
        self, db: Database, prompts: PromptSet, config: OrchestratorConfig, shape: StepShape | None = None,
        workers: Workers | None = None, tokens: JoinTokens | None = None,
    ):
        self.evals: EvalBook | None = None  # set by evaluation.RunEvaluation when the run evaluates
        self.room = RoomSignal()  # notified whenever leased prompts go down (the buffer notifies it too)
        self.db = db
        self.prompts = prompts
        self.config = config
        self.shape = shape
        self.workers = workers
        self.tokens = tokens
        db.create(SCHEMA, counters=("lease_seq", "prompt_cursor"))
        with db.tx() as conn:
            conn.execute("INSERT OR IGNORE INTO seed_key (id, key) VALUES (0, ?)", (secrets.token_bytes(32),))
            self.seed_key = bytes(conn.execute("SELECT key FROM seed_key").fetchone()[0])
            leased = conn.execute(
                "SELECT COALESCE(SUM(json_array_length(prompt_indices)), 0) FROM leases WHERE status IN ('open', "
                "'submitted') AND eval_version IS NULL"
            ).fetchone()[0]
            db.set(conn, LEASED_PROMPTS, int(leased))
            self.costs = ReleaseCosts(conn)
        # Leases whose deadline passed before this process served are not their workers' fault: no debt.
        self.serving_since = time.time()
        self.shares = LeaseShares(config.probation_share)
        self.deadlines = LeaseDeadlines(db, config)
        # Open leases, parsed, so a submission does not re-parse its lease (a cache: SQLite is the truth).
        self._open: dict[str, TaskLease] = {}
        # Prompt index -> (prompt_id, token ids) as validated by the first lease that carried the prompt.
        # The token array is shared, read-only, by every later lease of that prompt.
        self._checked_prompts: dict[int, tuple[str, np.ndarray, str | None]] = {}

    def task_prompt(self, index: int, seeds: list[int]) -> TaskPrompt:
        checked = self._checked_prompts.get(index)
        if checked is None:
            p = self.prompts.prompts[index]
            env_item = None
            if self.config.environment is not None:  # the worker's environment answers from the item
                from environments.registry import item_to_wire

                env_item = item_to_wire(p.item)
            prompt = TaskPrompt(prompt_id=p.prompt_id, token_ids=p.token_ids, seeds=seeds, env_item=env_item)
            prompt.token_ids.flags.writeable = False
            if not self.prompts.streamed:  # a stream's index is leased once (or reissued): nothing to keep
                self._checked_prompts[index] = (prompt.prompt_id, prompt.token_ids, prompt.env_item)
            return prompt
        return TaskPrompt.model_construct(prompt_id=checked[0], token_ids=checked[1], seeds=seeds, env_item=checked[2])

    def sample_seeds(self, instance: int, n: int) -> list[int]:
        """Per-sample seeds of a training prompt instance, a keyed hash under the run's secret: unknown before the
        instance is first leased, the same in every later lease of it (given back, it cannot be rerolled). SHAKE-128
        with the key first is a PRF (no length extension); "train-instance" keeps it apart from the eval seeds
        (evaluation.EvalBook.seeds)."""
        words = hashlib.shake_128(self.seed_key + b"train-instance" + instance.to_bytes(8, "little")).digest(8 * n)
        return (np.frombuffer(words, dtype="<u8") >> np.uint64(1)).tolist()  # < 2**63, as the protocol wants

    def untrained_samples(self, db: sqlite3.Connection) -> int:
        """Samples generated or being generated that the trainer has not consumed: those of open and
        submitted leases, plus the buffer (ready or taken). Two counters, not a count of rows (that was
        ~0.06 ms per lease)."""
        return Database.read_int(db, LEASED_PROMPTS) * self.config.samples_per_prompt + Database.read_int(db,
            BUFFERED_SAMPLES)

    def issue(
        self, worker_id: str, max_prompts: int, current_version: int, now: float, *, loaded_version: int | None = None,
        request_id: str | None = None
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
        token_id = self.workers.token_of(worker_id) if self.workers is not None else None
        with self.db.tx() as db:
            if request_id is not None:
                earlier = db.execute(
                    "SELECT body FROM leases WHERE worker_id=? AND request_id=? AND status='open' AND deadline>=?",
                    (worker_id, request_id, now)
                ).fetchone()
                if earlier is not None:  # a retry of a request whose answer was lost: the same lease again
                    return TaskLease.model_validate_json(earlier[0])
            if token_id is not None and self.tokens is not None:
                wait = self.tokens.cooldown_left(token_id, now)
                if wait > 0:
                    raise NoLeaseNow(f"join token {token_id} let leases go unsubmitted: cooling down", wait)
                self.shares.note_demand(token_id, now)
            if self.evals is not None and loaded_version is not None and self.evals.waiting(db, loaded_version):
                # Eval prompts of the version this worker holds go first, outside the async bound (eval_leases).
                self._check_open_cap(worker_id, now)
                lease = eval_leases.issue(self, db, worker_id, max_prompts, current_version, loaded_version, now,
                    request_id, token_id)
                self._open[lease.lease_id] = lease
                return lease
            if shape is not None:
                untrained = self.untrained_samples(db)
                bound = staleness.max_untrained_samples(cfg.async_level, shape.samples_per_step) // k
                room = bound - untrained // k
                if room <= 0:
                    raise GenerationBoundReached()
                n = min(n, room)
                if token_id is not None:  # a token that gives back too many scored leases: one prompt at a time
                    n = min(n, self.shares.room(db, token_id, bound, now, cap=1 if self.costs.over_bound(token_id,
                        cfg.max_release_ratio) else None))
                min_version = staleness.lease_min_version(
                    current_version, cfg.async_level, untrained_samples=untrained, new_samples=n * k,
                    samples_per_step=shape.samples_per_step, mini_batches=shape.mini_batches,
                    max_staleness=shape.max_staleness,
                )
            if loaded_version is not None and loaded_version < min_version:
                raise ApiError(
                    ErrorCode.version_too_old,
                    f"loaded policy version {loaded_version} would be stale by the time these samples are trained; "
                    f"pull version {min_version}",
                    min_policy_version=min_version,
                )
            self._check_open_cap(worker_id, now)
            Database.add(db, "lease_seq", 1)
            seq = Database.read_int(db, "lease_seq")
            taken = self._take_reissue(db, n)
            if len(taken) < n:  # new instances: their cursor positions
                start = Database.read_int(db, "prompt_cursor")
                Database.set(db, "prompt_cursor", start + n - len(taken))
                taken += [(self.prompts.order(start + i), start + i) for i in range(n - len(taken))]
            # Built without re-validation: every field is ours (each prompt was validated by the first
            # lease that carried it; ids, seeds, versions and deadline are made right here).
            lease = TaskLease.model_construct(
                lease_id=f"L{seq:08d}-{secrets.token_hex(4)}",
                prompts=[self.task_prompt(i, self.sample_seeds(s, k)) for i, s in taken],
                samples_per_prompt=k,
                sampling=cfg.sampling,
                policy_version=current_version,
                min_policy_version=min_version,
                deadline=self.deadlines.deadline(db, worker_id, len(taken), k, now),
                generation_version=loaded_version,
                environment=cfg.environment,
            )
            db.execute(
                "INSERT INTO leases (lease_id, seq, worker_id, prompt_indices, instances, body, issued_at, deadline, "
                "status, request_id, token_id) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, 'open', ?, ?)",
                (lease.lease_id, seq, worker_id, json.dumps([i for i, _ in taken]), json.dumps([s for _, s in taken]),
                 lease.model_dump_json(), now, lease.deadline, request_id, token_id),
            )
            Database.add(db, LEASED_PROMPTS, len(taken))
        self._open[lease.lease_id] = lease
        return lease

    def _check_open_cap(self, worker_id: str, now: float) -> None:
        # Counted inside the transaction: two concurrent requests cannot both pass the cap.
        if self.open_leases(worker_id, now) >= self.config.max_open_leases_per_worker:
            raise ApiError(
                ErrorCode.too_many_leases,
                f"worker already holds {self.config.max_open_leases_per_worker} open leases; submit or release one "
                f"first",
                retry_after_s=1.0,
            )

    @staticmethod
    def _take_reissue(db: sqlite3.Connection, n: int) -> list[tuple[int, int]]:
        """Up to n (prompt index, instance) waiting to be handed out again (oldest first)."""
        rows = db.execute("SELECT seq, prompt_index, instance FROM reissue ORDER BY seq LIMIT ?", (n,)).fetchall()
        db.executemany("DELETE FROM reissue WHERE seq=?", [(r[0],) for r in rows])
        return [(int(r[1]), int(r[2]) if r[2] is not None else LEGACY_INSTANCE + int(r[0])) for r in rows]

    # ---------------------------------------------------------------------------------------------
    # a lease's life after it was issued

    def get(self, lease_id: str) -> LeaseRow | None:
        row = self.db.one("SELECT * FROM leases WHERE lease_id=?", (lease_id,))
        return _row(row) if row else None

    def open_leases(self, worker_id: str, now: float) -> int:
        row = self.db.one("SELECT COUNT(*) FROM leases WHERE worker_id=? AND status='open' AND deadline>=?",
            (worker_id, now))
        return int(row[0])

    def parsed(self, row: LeaseRow) -> TaskLease:
        """The lease a submission was admitted for, parsed (from the cache of open leases if there)."""
        return self._open.pop(row.lease_id, None) or TaskLease.model_validate_json(row.body)

    @staticmethod
    def mark_submitted(db: sqlite3.Connection, lease_id: str, now: float | None = None) -> bool:
        """In the submission's transaction: the lease now has its submission (False if it was not open)."""
        return db.execute("UPDATE leases SET status='submitted', submitted_at=? WHERE lease_id=? AND status='open'",
            (time.time() if now is None else now, lease_id)).rowcount == 1

    def finish(self, db: sqlite3.Connection, lease_id: str, accepted: bool, credit: bool = True,
        generated: int = 0) -> None:
        """In the verdict's transaction: an accepted lease is done (its samples move to the buffer's
        count), times its worker's rate by its `generated` (verified) tokens (lease_deadlines) and, unless
        `credit` is False (accepted with a strike), adds to its token's record; a rejected one gives its
        prompts back for re-issue, and times nothing."""
        if not accepted:
            self._end(db, lease_id, "rejected", "submitted")
            return
        row = db.execute("SELECT status, json_array_length(prompt_indices), eval_version, token_id, issued_at, "
            "submitted_at, worker_id FROM leases WHERE lease_id=?", (lease_id,)).fetchone()
        db.execute("UPDATE leases SET status='done' WHERE lease_id=?", (lease_id,))
        if row is not None and row[0] in ("open", "submitted"):
            self.deadlines.note_accepted(db, row[6], generated, row[4], row[5])
        if row is not None and row[0] in ("open", "submitted") and row[2] is None:
            Database.add(db, LEASED_PROMPTS, -int(row[1]))
            self.room.notify()
            self.costs.note_accepted(row[3], int(row[1]), row[4], row[5])
            if row[3] is not None and credit:
                self.shares.note_accepted(row[3], int(row[1]), time.time())

    def release(self, lease_id: str, worker_id: str) -> bool:
        row = self.get(lease_id)
        if row is None or row.worker_id != worker_id:
            raise ApiError(ErrorCode.not_found, f"no lease {lease_id}")
        self._open.pop(lease_id, None)
        with self.db.tx() as db:
            return self._end(db, lease_id, "released", "open", charge=True)

    def release_banned(self, db: sqlite3.Connection) -> int:
        """Open leases of banned workers go back at once (their prompts re-issued), not at their deadline."""
        ids = [r[0] for r in db.execute(
            "SELECT l.lease_id FROM leases l JOIN workers w ON w.worker_id=l.worker_id WHERE l.status='open' AND "
            "w.banned=1"
        ).fetchall()]
        for lease_id in ids:
            self._open.pop(lease_id, None)
            self._end(db, lease_id, "released", "open", charge=False)
        return len(ids)

    def expire(self, now: float) -> list[str]:
        """Open leases past their deadline become expired; their prompts are queued for re-issue."""
        with self.db.tx() as db:
            ids = [r[0] for r in db.execute("SELECT lease_id FROM leases WHERE status='open' AND deadline<?", (now,
                )).fetchall()]
            for lease_id in ids:
                self._end(db, lease_id, "expired", "open", charge=True, now=now)
        for lease_id in ids:
            self._open.pop(lease_id, None)
        return ids

    def _end(self, db: sqlite3.Connection, lease_id: str, status: str, from_status: str, charge: bool = False,
        now: float | None = None) -> bool:
        """Close a lease and queue its prompts for re-issue; a lease given back unsubmitted (`charge`)
        costs its worker's token."""
        row = db.execute(
            "SELECT prompt_indices, worker_id, token_id, issued_at, deadline, eval_version, instances FROM leases "
            "WHERE lease_id=? AND status=?",
            (lease_id, from_status),
        ).fetchone()
        if row is None:
            return False
        db.execute("UPDATE leases SET status=? WHERE lease_id=?", (status, lease_id))
        indices = json.loads(row[0])
        if row[5] is not None:  # an eval lease: its held-out prompts wait for the same version again
            if self.evals is not None:
                self.evals.give_back(db, int(row[5]), indices)
        else:  # the same instances, so the same seeds, whoever leases them next
            db.executemany("INSERT INTO reissue (prompt_index, instance) VALUES (?, ?)", zip(indices,
                json.loads(row[6]) if row[6] else [None] * len(indices)))
            Database.add(db, LEASED_PROMPTS, -len(indices))  # from_status is open or submitted
            self.room.notify()
        charged = charge and row[2] is not None and self._charge(db, row[1], row[2], len(indices), row[3], row[4],
            time.time() if now is None else now)
        self.costs.closed(db, lease_id, row[2], status, bool(charged), training=row[5] is None)
        return True

    def _charge(self, db: sqlite3.Connection, worker_id: str, token_id: str, prompts: int, issued: float,
        deadline: float, now: float) -> bool:
        """Debt for a lease given back after its free window (release_costs); whether it cost anything."""
        if self.tokens is None or self.workers is None or deadline < self.serving_since:
            return False
        units = self.costs.units(token_id, prompts, issued, deadline, now, self.config.prompts_per_lease,
            self.config.release_floor)
        if units <= 0:  # given back before it could have been generated (shutting down, version too old)
            return False
        self.shares.note_forfeit(token_id, now)
        per_strike = self.config.lease_debt_per_strike
        before = (db.execute("SELECT lease_debt FROM join_tokens WHERE token_id=?", (token_id,)).fetchone() or (0.0,
            ))[0]
        after = self.tokens.add_debt(db, token_id, units, now)
        for _ in range(int(after // per_strike) - int(before // per_strike)):
            self.workers.strike(db, worker_id, "leases held and given back unsubmitted", self.config.strikes_to_ban)
        return True

    def counts(self) -> dict[str, int]:
        return {r["status"]: int(r["n"])
            for r in self.db.all("SELECT status, COUNT(*) AS n FROM leases GROUP BY status")}

    def reissue_depth(self) -> int:
        return int(self.db.one("SELECT COUNT(*) FROM reissue")[0])
