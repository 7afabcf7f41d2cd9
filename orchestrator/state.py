"""The run's durable state in one SQLite file (WAL mode): everything that must survive a crash of the
orchestrator process.

Tables:
- meta: run progress (policy version, step), counters shown by /v1/status, and the untrained-work
  counters behind the async bound;
- versions: the model hash of each published policy version (submissions claim one);
- workers: identity, secret hash, strikes, ban, contribution ledger (verified tokens);
- leases: every task handed out, its deadline and status, and whether its prompts were re-issued;
- submissions: every submission accepted for verification, its body (zstd) until verified, its verdict;
- fingerprints: a hash of each submission's generated content, so replays are refused;
- sample_groups: verified samples waiting for the trainer, one row per GRPO group (the unit the
  trainer learns from, and 1/group-size the rows, statements and index updates of a row per sample).
  A batch taken by the trainer is marked with a batch id; only `commit_batch` marks it trained. After
  a restart, groups of an uncommitted batch go back to the queue, so an accepted rollout is neither
  lost nor trained twice. The view `samples` lists them one row per sample (audits, operators' SQL).

All methods are thread-safe (one connection, one lock): the HTTP server, the verification thread and
the trainer's pulls (Ray actor threads) share one `State`. A second connection, on a thread of its own,
only checkpoints the WAL (see `_checkpoint_loop`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import sqlite3
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS versions (version INTEGER PRIMARY KEY, model_hash TEXT NOT NULL, created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS workers (
    worker_id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    device TEXT NOT NULL,
    client_version TEXT NOT NULL,
    secret_hash TEXT NOT NULL,
    created_at REAL NOT NULL,
    last_seen REAL,
    state TEXT,
    loaded_version INTEGER,
    tokens_per_s REAL NOT NULL DEFAULT 0,
    strikes INTEGER NOT NULL DEFAULT 0,
    banned INTEGER NOT NULL DEFAULT 0,
    ban_reason TEXT NOT NULL DEFAULT '',
    accepted INTEGER NOT NULL DEFAULT 0,
    rejected INTEGER NOT NULL DEFAULT 0,
    verified_tokens INTEGER NOT NULL DEFAULT 0
);
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
CREATE TABLE IF NOT EXISTS fingerprints (fingerprint TEXT PRIMARY KEY, submission_id TEXT NOT NULL);
-- One row per kept group: its members' arrays concatenated in member order, split by
-- completion_lengths. seq is a plain rowid (rows are never deleted, so it only grows, as AUTOINCREMENT
-- would); batch_id is indexed only once set. Trained and stale groups keep their row (the audit trail:
-- trained exactly once) without their token arrays.
CREATE TABLE IF NOT EXISTS sample_groups (
    seq INTEGER PRIMARY KEY,
    submission_id TEXT NOT NULL,
    prompt_index INTEGER NOT NULL,  -- the group's prompt within its lease
    num_samples INTEGER NOT NULL,
    sample_indices TEXT NOT NULL,   -- JSON list: each member's sample index within the group
    behaviour_version INTEGER NOT NULL,
    created_at REAL NOT NULL,
    status TEXT NOT NULL,           -- ready | taken | trained | stale
    batch_id TEXT,
    advantages BLOB NOT NULL,       -- float64 little-endian, one per member
    rewards BLOB NOT NULL,          -- float64 little-endian, one per member
    completion_lengths BLOB NOT NULL,  -- int32 little-endian, one per member
    prompt_ids BLOB NOT NULL,       -- int32 little-endian
    completion_ids BLOB NOT NULL,   -- int32 little-endian, all members
    logprobs BLOB NOT NULL          -- float32 little-endian, all members
);
CREATE INDEX IF NOT EXISTS sample_groups_by_status ON sample_groups (status, seq);
CREATE INDEX IF NOT EXISTS sample_groups_by_batch ON sample_groups (batch_id) WHERE batch_id IS NOT NULL;
CREATE VIEW IF NOT EXISTS samples AS
    SELECT g.submission_id || ':' || g.prompt_index || ':' || m.value AS sample_id, g.submission_id, g.prompt_index,
           CAST(m.value AS INTEGER) AS sample_index, g.behaviour_version, g.status, g.batch_id, g.seq AS group_seq
    FROM sample_groups g, json_each(g.sample_indices) m;
"""

# SQLite checkpoints the WAL itself after the commit that takes it past this many pages (default
# 1000): less often means fewer fsyncs on the request path and each hot page copied once, not ~10x.
WAL_AUTOCHECKPOINT_PAGES = 10_000
# The background checkpointer's period (see State._checkpoint_loop).
CHECKPOINT_EVERY_S = 0.25

# Untrained work, for the async bound: prompts of open or submitted leases, and samples ready or
# taken (see State.untrained_samples).
LEASED_PROMPTS = "untrained:leased_prompts"
BUFFERED_SAMPLES = "untrained:buffered_samples"

COUNTERS = (
    "policy_version",
    "step",
    "lease_seq",
    "prompt_cursor",
    "submissions_accepted",
    "submissions_rejected",
    "groups_kept",
    "groups_dropped_zero_signal",
    "samples_dropped_stale",
    "samples_trained",
    "reward_count",
)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def secret_matches(secret: str, stored_hash: str) -> bool:
    return hmac.compare_digest(hash_secret(secret), stored_hash)


@dataclass
class WorkerRow:
    worker_id: str
    name: str
    device: str
    client_version: str
    secret_hash: str
    created_at: float
    last_seen: float | None
    state: str | None
    loaded_version: int | None
    tokens_per_s: float
    strikes: int
    banned: bool
    ban_reason: str
    accepted: int
    rejected: int
    verified_tokens: int


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


@dataclass
class SubmissionRow:
    submission_id: str
    worker_id: str
    lease_id: str
    policy_version: int
    num_tokens: int
    received_at: float
    status: str
    body: bytes | None
    verdict: str | None


@dataclass
class GroupRow:
    """A kept group as the buffer stores it (see the sample_groups table)."""

    submission_id: str
    prompt_index: int
    sample_indices: list[int]
    behaviour_version: int
    advantages: bytes
    rewards: bytes
    completion_lengths: bytes
    prompt_ids: bytes
    completion_ids: bytes
    logprobs: bytes

    @property
    def num_samples(self) -> int:
        return len(self.sample_indices)


GROUP_COLUMNS = ", ".join(GroupRow.__dataclass_fields__)
INSERT_GROUP = (
    f"INSERT INTO sample_groups ({GROUP_COLUMNS}, num_samples, created_at, status) "
    f"VALUES ({', '.join('?' * (len(GroupRow.__dataclass_fields__) + 2))}, 'ready')"
)


class State:
    """The run's SQLite state. `path=":memory:"` is for logic tests only (nothing survives)."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        if self.path != ":memory:":
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._depth = 0  # transaction nesting of the thread holding the lock
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        # NORMAL in WAL mode: a committed transaction survives a crash of the process (not of the OS).
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.execute("PRAGMA cache_size=-65536")  # 64 MiB of page cache: the hot tables stay in memory
        self._db.execute(f"PRAGMA wal_autocheckpoint={WAL_AUTOCHECKPOINT_PAGES}")
        self._db.execute("PRAGMA temp_store=MEMORY")
        if self._db.execute("SELECT 1 FROM sqlite_master WHERE type='table' AND name='samples'").fetchone():
            self._db.close()
            raise RuntimeError(
                f"{self.path} is from an older swarmrl (one buffer row per sample); finish or restart that run with "
                "the version that created it, or start a new run (another output_dir / db_path)"
            )
        self._db.executescript(SCHEMA)
        columns = {r[1] for r in self._db.execute("PRAGMA table_info(leases)")}
        if "request_id" not in columns:  # a database from before idempotent leases
            self._db.execute("ALTER TABLE leases ADD COLUMN request_id TEXT")
        self._db.execute("CREATE INDEX IF NOT EXISTS leases_by_request ON leases (worker_id, request_id)")
        with self.tx() as db:
            for key in COUNTERS:
                db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?, '0')", (key,))
            db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES ('reward_sum', '0.0')")
        self.recover()
        with self.tx() as db:
            self._recount_untrained(db)
        self._checkpointer: threading.Thread | None = None
        self._closing = threading.Event()
        if self.path != ":memory:":
            self._checkpointer = threading.Thread(target=self._checkpoint_loop, name="orchestrator-checkpoint", daemon=True)
            self._checkpointer.start()

    def _checkpoint_loop(self) -> None:
        """Copy the WAL back into the database file (and fsync it) on a thread of its own, with a
        connection of its own: a PASSIVE checkpoint never blocks the writers. The checkpoint that SQLite
        runs itself after a commit (every WAL_AUTOCHECKPOINT_PAGES pages) then has little left to copy
        and sync, so requests rarely wait for a disk flush."""
        db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        try:
            while not self._closing.wait(CHECKPOINT_EVERY_S):
                try:
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
                except sqlite3.Error:  # busy or closing: the next round (or SQLite's own) does it
                    pass
        finally:
            db.close()

    def close(self) -> None:
        self._closing.set()
        if self._checkpointer is not None:
            self._checkpointer.join(timeout=10)
        with self._lock:
            self._db.close()

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        """One transaction under the lock: all of it commits, or none of it.

        Nested `tx()` blocks (same thread) are savepoints inside the outer transaction: a failing inner
        block is undone alone, and everything commits once, with the outer block (group commit).
        """
        with self._lock:
            depth = self._depth
            self._depth += 1
            try:
                if depth == 0:
                    self._db.execute("BEGIN IMMEDIATE")
                else:
                    self._db.execute(f"SAVEPOINT sp{depth}")
                try:
                    yield self._db
                except BaseException:
                    self._db.execute("ROLLBACK" if depth == 0 else f"ROLLBACK TO sp{depth}")
                    if depth:
                        self._db.execute(f"RELEASE sp{depth}")
                    raise
                if depth:
                    self._db.execute(f"RELEASE sp{depth}")
                else:
                    try:
                        self._db.execute("COMMIT")
                    except BaseException:  # e.g. disk full: SQLite may leave the transaction open
                        if self._db.in_transaction:
                            self._db.execute("ROLLBACK")
                        raise
            finally:
                self._depth -= 1

    def _one(self, sql: str, args: tuple = ()) -> sqlite3.Row | None:
        with self._lock:
            return self._db.execute(sql, args).fetchone()

    def _all(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    def recover(self) -> int:
        """After a restart: groups of batches that were taken but never committed become ready again."""
        with self.tx() as db:
            n = db.execute("UPDATE sample_groups SET status='ready', batch_id=NULL WHERE status='taken'").rowcount
        return n

    # ---------------------------------------------------------------------------------------------
    # meta / counters

    def get_int(self, key: str) -> int:
        row = self._one("SELECT value FROM meta WHERE key=?", (key,))
        return int(float(row["value"])) if row else 0

    def get_float(self, key: str) -> float:
        row = self._one("SELECT value FROM meta WHERE key=?", (key,))
        return float(row["value"]) if row else 0.0

    def counters(self) -> dict[str, float]:
        return {r["key"]: float(r["value"]) for r in self._all("SELECT key, value FROM meta")}

    @staticmethod
    def _add(db: sqlite3.Connection, key: str, delta: float) -> None:
        db.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = CAST(value AS REAL) + ?",
            (key, str(delta), delta),
        )

    @staticmethod
    def _set(db: sqlite3.Connection, key: str, value: Any) -> None:
        db.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value", (key, str(value)))

    def add(self, key: str, delta: float = 1) -> None:
        with self.tx() as db:
            self._add(db, key, delta)

    # ---------------------------------------------------------------------------------------------
    # policy versions

    def publish_version(self, version: int, model_hash: str) -> None:
        """Record a published policy version; the current version only moves forward."""
        with self.tx() as db:
            db.execute(
                "INSERT INTO versions (version, model_hash, created_at) VALUES (?, ?, ?) "
                "ON CONFLICT(version) DO UPDATE SET model_hash=excluded.model_hash",
                (version, model_hash, time.time()),
            )
            current = int(float(db.execute("SELECT value FROM meta WHERE key='policy_version'").fetchone()[0]))
            if version > current:
                self._set(db, "policy_version", version)

    def model_hash(self, version: int) -> str | None:
        row = self._one("SELECT model_hash FROM versions WHERE version=?", (version,))
        return row["model_hash"] if row else None

    # ---------------------------------------------------------------------------------------------
    # workers

    def add_worker(self, worker_id: str, name: str, device: str, client_version: str, secret_hash: str) -> None:
        now = time.time()
        with self.tx() as db:
            db.execute(
                "INSERT INTO workers (worker_id, name, device, client_version, secret_hash, created_at, last_seen, state) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, 'starting')",
                (worker_id, name, device, client_version, secret_hash, now, now),
            )

    def worker(self, worker_id: str) -> WorkerRow | None:
        row = self._one("SELECT * FROM workers WHERE worker_id=?", (worker_id,))
        return _worker(row) if row else None

    def workers(self) -> list[WorkerRow]:
        return [_worker(r) for r in self._all("SELECT * FROM workers ORDER BY created_at")]

    def heartbeat(self, worker_id: str, state: str, loaded_version: int | None, tokens_per_s: float, now: float) -> None:
        with self.tx() as db:
            db.execute(
                "UPDATE workers SET last_seen=?, state=?, loaded_version=?, tokens_per_s=? WHERE worker_id=?",
                (now, state, loaded_version, tokens_per_s, worker_id),
            )

    def touch(self, seen: dict[str, float]) -> None:
        """Persist last-seen times that the server tracks in memory (batched, not one write per request)."""
        if seen:
            with self.tx() as db:
                db.executemany("UPDATE workers SET last_seen=? WHERE worker_id=?", [(t, w) for w, t in seen.items()])

    def set_ban(self, worker_id: str, banned: bool, reason: str) -> None:
        with self.tx() as db:
            if banned:
                db.execute("UPDATE workers SET banned=1, ban_reason=? WHERE worker_id=?", (reason, worker_id))
            else:
                db.execute("UPDATE workers SET banned=0, ban_reason='', strikes=0 WHERE worker_id=?", (worker_id,))

    # ---------------------------------------------------------------------------------------------
    # leases

    def next_lease_seq(self, db: sqlite3.Connection) -> int:
        self._add(db, "lease_seq", 1)
        return int(float(db.execute("SELECT value FROM meta WHERE key='lease_seq'").fetchone()[0]))

    def take_prompt_cursor(self, db: sqlite3.Connection, n: int) -> int:
        """Reserve n positions of the seeded prompt order; returns the first."""
        start = int(float(db.execute("SELECT value FROM meta WHERE key='prompt_cursor'").fetchone()[0]))
        self._set(db, "prompt_cursor", start + n)
        return start

    def take_reissue(self, db: sqlite3.Connection, n: int) -> list[int]:
        """Up to n prompt indices waiting to be handed out again (oldest first)."""
        rows = db.execute("SELECT seq, prompt_index FROM reissue ORDER BY seq LIMIT ?", (n,)).fetchall()
        db.executemany("DELETE FROM reissue WHERE seq=?", [(r[0],) for r in rows])
        return [int(r[1]) for r in rows]

    @staticmethod
    def _end_lease(db: sqlite3.Connection, lease_id: str, status: str, from_status: str) -> bool:
        """Close a lease and queue its prompts for re-issue."""
        row = db.execute("SELECT prompt_indices FROM leases WHERE lease_id=? AND status=?", (lease_id, from_status)).fetchone()
        if row is None:
            return False
        db.execute("UPDATE leases SET status=? WHERE lease_id=?", (status, lease_id))
        indices = json.loads(row[0])
        db.executemany("INSERT INTO reissue (prompt_index) VALUES (?)", [(i,) for i in indices])
        State._add(db, LEASED_PROMPTS, -len(indices))  # from_status is open or submitted
        return True

    def reissue_depth(self) -> int:
        return int(self._one("SELECT COUNT(*) FROM reissue")[0])

    def insert_lease(self, db: sqlite3.Connection, lease: LeaseRow) -> None:
        db.execute(
            "INSERT INTO leases (lease_id, seq, worker_id, prompt_indices, body, issued_at, deadline, status, request_id) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, 'open', ?)",
            (lease.lease_id, lease.seq, lease.worker_id, json.dumps(lease.prompt_indices), lease.body, lease.issued_at, lease.deadline, lease.request_id),
        )
        self._add(db, LEASED_PROMPTS, len(lease.prompt_indices))

    def open_lease_for_request(self, db: sqlite3.Connection, worker_id: str, request_id: str, now: float) -> str | None:
        """The body of the open lease that this worker's request `request_id` already got, if any."""
        row = db.execute(
            "SELECT body FROM leases WHERE worker_id=? AND request_id=? AND status='open' AND deadline>=?", (worker_id, request_id, now)
        ).fetchone()
        return row[0] if row else None

    def lease(self, lease_id: str) -> LeaseRow | None:
        row = self._one("SELECT * FROM leases WHERE lease_id=?", (lease_id,))
        return _lease(row) if row else None

    def open_leases(self, worker_id: str, now: float) -> int:
        row = self._one("SELECT COUNT(*) FROM leases WHERE worker_id=? AND status='open' AND deadline>=?", (worker_id, now))
        return int(row[0])

    def expire_leases(self, now: float) -> list[str]:
        """Open leases past their deadline become expired; their prompts are queued for re-issue."""
        with self.tx() as db:
            ids = [r[0] for r in db.execute("SELECT lease_id FROM leases WHERE status='open' AND deadline<?", (now,)).fetchall()]
            for lease_id in ids:
                self._end_lease(db, lease_id, "expired", "open")
        return ids

    def release_lease(self, lease_id: str) -> bool:
        with self.tx() as db:
            return self._end_lease(db, lease_id, "released", "open")

    def lease_counts(self) -> dict[str, int]:
        return {r["status"]: int(r["n"]) for r in self._all("SELECT status, COUNT(*) AS n FROM leases GROUP BY status")}

    # ---------------------------------------------------------------------------------------------
    # submissions

    def insert_submission(self, sub: SubmissionRow, fingerprint: str) -> str | None:
        """Store a submission and mark its lease submitted, atomically.

        Returns None on success, or the reason it is a duplicate ("lease" if the lease already has a
        submission, "replay" if the same content was submitted before).
        """
        with self.tx() as db:
            if db.execute("SELECT 1 FROM submissions WHERE lease_id=?", (sub.lease_id,)).fetchone():
                return "lease"
            if db.execute("SELECT 1 FROM fingerprints WHERE fingerprint=?", (fingerprint,)).fetchone():
                return "replay"
            n = db.execute("UPDATE leases SET status='submitted' WHERE lease_id=? AND status='open'", (sub.lease_id,)).rowcount
            if n != 1:
                return "lease"
            db.execute(
                "INSERT INTO submissions (submission_id, worker_id, lease_id, policy_version, num_tokens, received_at, status, body) "
                "VALUES (?, ?, ?, ?, ?, ?, 'pending', ?)",
                (sub.submission_id, sub.worker_id, sub.lease_id, sub.policy_version, sub.num_tokens, sub.received_at, sub.body),
            )
            db.execute("INSERT INTO fingerprints (fingerprint, submission_id) VALUES (?, ?)", (fingerprint, sub.submission_id))
        return None

    def submission(self, submission_id: str) -> SubmissionRow | None:
        row = self._one("SELECT * FROM submissions WHERE submission_id=?", (submission_id,))
        return _submission(row) if row else None

    def pending_submissions(self) -> list[str]:
        return [r[0] for r in self._all("SELECT submission_id FROM submissions WHERE status='pending' ORDER BY received_at")]

    def record_verdict(
        self,
        submission_id: str,
        accepted: bool,
        verdict_json: str,
        verified_tokens: int,
        groups: list[GroupRow],
        groups_dropped: int,
        rewards: list[float],
        strikes_to_ban: int,
    ) -> tuple[bool, bool]:
        """Apply a verdict atomically: submission status, lease status, worker ledger / strikes, buffer.

        Returns (applied, banned_now). A verdict for a submission that is no longer pending is ignored,
        so a verdict applied twice (e.g. re-verified after a restart) cannot add samples twice.
        """
        now = time.time()
        with self.tx() as db:
            row = db.execute("SELECT worker_id, lease_id, status FROM submissions WHERE submission_id=?", (submission_id,)).fetchone()
            if row is None or row["status"] != "pending":
                return False, False
            worker_id, lease_id = row["worker_id"], row["lease_id"]
            status = "accepted" if accepted else "rejected"
            db.execute("UPDATE submissions SET status=?, verdict=?, body=NULL WHERE submission_id=?", (status, verdict_json, submission_id))
            if accepted:
                lease = db.execute("SELECT status, json_array_length(prompt_indices) FROM leases WHERE lease_id=?", (lease_id,)).fetchone()
                db.execute("UPDATE leases SET status='done' WHERE lease_id=?", (lease_id,))
                if lease is not None and lease[0] in ("open", "submitted"):
                    self._add(db, LEASED_PROMPTS, -int(lease[1]))
            else:
                self._end_lease(db, lease_id, "rejected", "submitted")
            banned_now = False
            if accepted:
                db.execute(
                    "UPDATE workers SET accepted=accepted+1, verified_tokens=verified_tokens+? WHERE worker_id=?",
                    (verified_tokens, worker_id),
                )
                self._add(db, "submissions_accepted", 1)
                self._add(db, "groups_kept", len(groups))
                self._add(db, "groups_dropped_zero_signal", groups_dropped)
                self._add(db, "reward_sum", float(sum(rewards)))
                self._add(db, "reward_count", len(rewards))
                db.executemany(
                    INSERT_GROUP,
                    [
                        (g.submission_id, g.prompt_index, json.dumps(g.sample_indices), g.behaviour_version, g.advantages, g.rewards,
                         g.completion_lengths, g.prompt_ids, g.completion_ids, g.logprobs, g.num_samples, now)
                        for g in groups
                    ],
                )
                self._add(db, BUFFERED_SAMPLES, sum(g.num_samples for g in groups))
            else:
                db.execute("UPDATE workers SET rejected=rejected+1, strikes=strikes+1 WHERE worker_id=?", (worker_id,))
                self._add(db, "submissions_rejected", 1)
                strikes, banned = db.execute("SELECT strikes, banned FROM workers WHERE worker_id=?", (worker_id,)).fetchone()
                if not banned and strikes >= strikes_to_ban:
                    db.execute(
                        "UPDATE workers SET banned=1, ban_reason=? WHERE worker_id=?",
                        (f"{strikes} rejected submissions (threshold {strikes_to_ban})", worker_id),
                    )
                    banned_now = True
        return True, banned_now

    # ---------------------------------------------------------------------------------------------
    # the buffer of verified samples

    def untrained_samples(self, db: sqlite3.Connection, samples_per_prompt: int) -> int:
        """Samples generated or being generated that the trainer has not consumed yet: those of open
        and submitted leases, plus the buffer (ready or taken). The async bound is checked against this."""
        # Two counters kept in the same transactions as the rows they count (checked on every lease;
        # counting the rows was ~0.06 ms per lease), recounted from the rows at every start.
        counts = dict(db.execute("SELECT key, value FROM meta WHERE key IN (?, ?)", (LEASED_PROMPTS, BUFFERED_SAMPLES)).fetchall())
        return int(float(counts.get(LEASED_PROMPTS, 0))) * samples_per_prompt + int(float(counts.get(BUFFERED_SAMPLES, 0)))

    def _recount_untrained(self, db: sqlite3.Connection) -> None:
        leased = db.execute(
            "SELECT COALESCE(SUM(json_array_length(prompt_indices)), 0) FROM leases WHERE status IN ('open', 'submitted')"
        ).fetchone()[0]
        buffered = db.execute("SELECT COALESCE(SUM(num_samples), 0) FROM sample_groups WHERE status IN ('ready', 'taken')").fetchone()[0]
        self._set(db, LEASED_PROMPTS, int(leased))
        self._set(db, BUFFERED_SAMPLES, int(buffered))

    def buffer_depth(self) -> int:
        return int(self._one("SELECT COALESCE(SUM(num_samples), 0) FROM sample_groups WHERE status='ready'")[0])

    def take_batch(self, batch_id: str, n: int, min_behaviour_version: int | None) -> tuple[list[GroupRow], int]:
        """Mark the oldest ready groups as taken by `batch_id`, whole groups until they hold n samples
        (n exactly when n is a multiple of the group size, as RunConfig requires; otherwise up to one
        group more, so groups of another size from an earlier config never leave a batch short).

        Groups below `min_behaviour_version` would be dropped by the trainer anyway: they are marked
        stale here and their samples counted, instead of travelling to the trainer. Returns (groups,
        samples dropped as stale).
        """
        with self.tx() as db:
            dropped = 0
            if min_behaviour_version is not None:
                dropped = int(db.execute(
                    "SELECT COALESCE(SUM(num_samples), 0) FROM sample_groups WHERE status='ready' AND behaviour_version<?", (min_behaviour_version,)
                ).fetchone()[0])
                if dropped:
                    db.execute(
                        "UPDATE sample_groups SET status='stale', completion_lengths=x'', prompt_ids=x'', completion_ids=x'', logprobs=x'' "
                        "WHERE status='ready' AND behaviour_version<?",
                        (min_behaviour_version,),
                    )
                    self._add(db, "samples_dropped_stale", dropped)
                    self._add(db, BUFFERED_SAMPLES, -dropped)
            # Ready groups are taken in seq order, so a batch is every ready group up to the last one it needs.
            last, total = None, 0
            for seq, size in db.execute("SELECT seq, num_samples FROM sample_groups WHERE status='ready' ORDER BY seq LIMIT ?", (max(1, n),)):
                last, total = seq, total + size
                if total >= n:
                    break
            if last is None:
                return [], dropped
            db.execute("UPDATE sample_groups SET status='taken', batch_id=? WHERE status='ready' AND seq<=?", (batch_id, last))
            rows = db.execute(f"SELECT {GROUP_COLUMNS} FROM sample_groups WHERE batch_id=? ORDER BY seq", (batch_id,)).fetchall()
        return [GroupRow(r[0], r[1], json.loads(r[2]), *r[3:]) for r in rows], dropped

    def commit_batch(self, batch_id: str, new_version: int, model_hash: str | None, dropped_stale: int = 0) -> dict[int, int]:
        """The trainer finished the step that used `batch_id` and published `new_version`: mark the batch
        trained, advance the step and the policy version, all in one transaction. Returns the staleness
        (version gap -> samples) of the batch. Committing the same batch twice changes nothing."""
        with self.tx() as db:
            rows = db.execute("SELECT behaviour_version, num_samples FROM sample_groups WHERE batch_id=? AND status='taken'", (batch_id,)).fetchall()
            if not rows:
                return {}
            db.execute(
                "UPDATE sample_groups SET status='trained', completion_lengths=x'', prompt_ids=x'', completion_ids=x'', logprobs=x'' "
                "WHERE batch_id=? AND status='taken'",
                (batch_id,),
            )
            gaps: dict[int, int] = {}
            for version, size in rows:
                gap = max(0, new_version - 1 - int(version))
                gaps[gap] = gaps.get(gap, 0) + int(size)
            for gap, n in gaps.items():
                self._add(db, f"staleness:{gap}", n)
            trained = sum(gaps.values())
            self._add(db, "samples_trained", trained)
            self._add(db, BUFFERED_SAMPLES, -trained)
            self._add(db, "samples_dropped_stale", dropped_stale)
            self._add(db, "step", 1)
            if model_hash is not None:
                db.execute(
                    "INSERT OR REPLACE INTO versions (version, model_hash, created_at) VALUES (?, ?, ?)", (new_version, model_hash, time.time())
                )
            current = int(float(db.execute("SELECT value FROM meta WHERE key='policy_version'").fetchone()[0]))
            if new_version > current:
                self._set(db, "policy_version", new_version)
        return gaps

    def return_batch(self, batch_id: str) -> int:
        """The trainer gave a batch back untrained (e.g. it failed): its groups are ready again. Returns
        how many samples."""
        with self.tx() as db:
            n = db.execute("SELECT COALESCE(SUM(num_samples), 0) FROM sample_groups WHERE batch_id=? AND status='taken'", (batch_id,)).fetchone()[0]
            db.execute("UPDATE sample_groups SET status='ready', batch_id=NULL WHERE batch_id=? AND status='taken'", (batch_id,))
            return int(n)

    def sample_status_counts(self) -> dict[str, int]:
        """Samples by buffer status (ready, taken, trained, stale)."""
        return {r["status"]: int(r["n"]) for r in self._all("SELECT status, SUM(num_samples) AS n FROM sample_groups GROUP BY status")}

    def trained_sample_ids(self) -> list[str]:
        return [r[0] for r in self._all("SELECT sample_id FROM samples WHERE status='trained' ORDER BY group_seq, sample_index")]

    def staleness_histogram(self) -> dict[str, int]:
        rows = self._all("SELECT key, value FROM meta WHERE key LIKE 'staleness:%'")
        return {r["key"].split(":", 1)[1]: int(float(r["value"])) for r in sorted(rows, key=lambda r: int(r["key"].split(":", 1)[1]))}


def _worker(r: sqlite3.Row) -> WorkerRow:
    return WorkerRow(**{k: r[k] for k in r.keys()} | {"banned": bool(r["banned"])})


def _lease(r: sqlite3.Row) -> LeaseRow:
    d = {k: r[k] for k in r.keys()}
    d["prompt_indices"] = json.loads(d["prompt_indices"])
    return LeaseRow(**d)


def _submission(r: sqlite3.Row) -> SubmissionRow:
    return SubmissionRow(**{k: r[k] for k in r.keys()})



