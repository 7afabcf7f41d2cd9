"""Workers and identities: registration, bearer secrets, heartbeats, strikes and bans, the contribution
ledger, and the `workers` table that holds them.

A worker's secret is `<worker id>.<random>`; only its sha256 is stored. Authentication is a dictionary
lookup and one constant-time compare per request (the cache is filled from SQLite on a miss and dropped
on a ban), and last-seen times are kept in memory and flushed to SQLite by housekeeping.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import sqlite3
import time
from dataclasses import dataclass

from orchestrator.db import Database
from orchestrator.errors import ApiError
from protocol.models import ErrorCode, WorkerRecord, WorkerState

log = logging.getLogger(__name__)

SCHEMA = """
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
"""

# A worker with this many accepted submissions and no strikes is "trusted" for the verifier's
# spot-check rate (VerifierConfig.spot_check_rate; the default verifies everything anyway).
TRUSTED_AFTER_ACCEPTED = 20


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

    @property
    def trust_level(self) -> str:
        return "trusted" if self.strikes == 0 and self.accepted >= TRUSTED_AFTER_ACCEPTED else "new"


def _row(r: sqlite3.Row) -> WorkerRow:
    return WorkerRow(**{k: r[k] for k in r.keys()} | {"banned": bool(r["banned"])})


class Workers:
    def __init__(self, db: Database, dead_after_s: float):
        self.db = db
        self.dead_after_s = dead_after_s
        db.create(SCHEMA)
        self._auth: dict[str, tuple[str, bool]] = {}  # worker id -> (secret hash, banned)
        self._seen: dict[str, float] = {}  # last request per worker, flushed to SQLite periodically

    # ---------------------------------------------------------------------------------------------
    # identity

    def register(self, name: str, device: str, client_version: str) -> tuple[str, str]:
        """A new identity: (worker id, bearer secret)."""
        worker_id = f"w-{secrets.token_hex(8)}"
        secret = f"{worker_id}.{secrets.token_urlsafe(32)}"
        digest = hash_secret(secret)
        now = time.time()
        with self.db.tx() as db:
            db.execute(
                "INSERT INTO workers (worker_id, name, device, client_version, secret_hash, created_at, last_seen, state) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, 'starting')",
                (worker_id, name, device, client_version, digest, now, now),
            )
        self._auth[worker_id] = (digest, False)
        self._seen[worker_id] = now
        log.info("worker registered", extra={"worker_id": worker_id, "worker_name": name})
        return worker_id, secret

    def authenticate(self, secret: str, allow_banned: bool = False) -> str:
        """The worker a bearer secret belongs to; raises unauthorized / banned (a banned worker may
        still read its verdicts, to learn why)."""
        worker_id, _, _ = secret.partition(".")
        entry = self._auth.get(worker_id)
        if entry is None:
            row = self.get(worker_id) if worker_id else None
            if row is None:
                raise ApiError(ErrorCode.unauthorized, "unknown worker secret")
            entry = self._auth[worker_id] = (row.secret_hash, row.banned)
        if not secret_matches(secret, entry[0]):
            raise ApiError(ErrorCode.unauthorized, "unknown worker secret")
        if entry[1] and not allow_banned:
            raise ApiError(ErrorCode.banned, f"worker {worker_id} is banned")
        self._seen[worker_id] = time.time()
        return worker_id

    def is_secret(self, secret: str) -> bool:
        worker_id, _, _ = secret.partition(".")
        row = self.get(worker_id) if worker_id else None
        return row is not None and secret_matches(secret, row.secret_hash)

    # ---------------------------------------------------------------------------------------------
    # state

    def get(self, worker_id: str) -> WorkerRow | None:
        row = self.db.one("SELECT * FROM workers WHERE worker_id=?", (worker_id,))
        return _row(row) if row else None

    def all(self) -> list[WorkerRow]:
        return [_row(r) for r in self.db.all("SELECT * FROM workers ORDER BY created_at")]

    def heartbeat(self, worker_id: str, state: WorkerState, loaded_version: int | None, tokens_per_s: float) -> None:
        with self.db.tx() as db:
            db.execute(
                "UPDATE workers SET last_seen=?, state=?, loaded_version=?, tokens_per_s=? WHERE worker_id=?",
                (time.time(), state.value, loaded_version, tokens_per_s, worker_id),
            )

    def flush_seen(self) -> None:
        """Persist the last-seen times kept in memory (batched, not one write per request)."""
        seen, self._seen = self._seen, {}
        if seen:
            with self.db.tx() as db:
                db.executemany("UPDATE workers SET last_seen=? WHERE worker_id=?", [(t, w) for w, t in seen.items()])

    def set_ban(self, worker_id: str, banned: bool, reason: str) -> WorkerRow:
        if self.get(worker_id) is None:
            raise ApiError(ErrorCode.not_found, f"no worker {worker_id}")
        reason = reason or ("banned by an operator" if banned else "")
        with self.db.tx() as db:
            if banned:
                db.execute("UPDATE workers SET banned=1, ban_reason=? WHERE worker_id=?", (reason, worker_id))
            else:
                db.execute("UPDATE workers SET banned=0, ban_reason='', strikes=0 WHERE worker_id=?", (worker_id,))
        self._auth.pop(worker_id, None)
        log.warning("worker %s", "banned" if banned else "unbanned", extra={"worker_id": worker_id, "reason": reason})
        row = self.get(worker_id)
        assert row is not None
        return row

    def record_verdict(self, db: sqlite3.Connection, worker_id: str, accepted: bool, verified_tokens: int, strikes_to_ban: int, strike: bool = True) -> bool:
        """The worker's ledger after a verdict, inside the verdict's transaction: an acceptance adds its
        verified tokens; a rejection is a strike (unless it was the trusted side's failure), and enough
        strikes ban. Returns whether it banned now."""
        if accepted:
            db.execute(
                "UPDATE workers SET accepted=accepted+1, verified_tokens=verified_tokens+? WHERE worker_id=?", (verified_tokens, worker_id)
            )
            return False
        db.execute("UPDATE workers SET rejected=rejected+1, strikes=strikes+? WHERE worker_id=?", (int(strike), worker_id))
        if not strike:
            return False
        strikes, banned = db.execute("SELECT strikes, banned FROM workers WHERE worker_id=?", (worker_id,)).fetchone()
        if banned or strikes < strikes_to_ban:
            return False
        db.execute(
            "UPDATE workers SET banned=1, ban_reason=? WHERE worker_id=?", (f"{strikes} rejected submissions (threshold {strikes_to_ban})", worker_id)
        )
        return True

    def forget_auth(self, worker_id: str) -> None:
        """Drop a cached identity (after a ban applied by a verdict), so the next request reads SQLite."""
        self._auth.pop(worker_id, None)

    # ---------------------------------------------------------------------------------------------
    # operator views

    def last_seen(self, w: WorkerRow) -> float | None:
        return max(w.last_seen or 0.0, self._seen.get(w.worker_id, 0.0)) or None

    def online(self, w: WorkerRow, now: float) -> bool:
        return not w.banned and now - (self.last_seen(w) or 0.0) <= self.dead_after_s

    def count_online(self, now: float) -> int:
        return sum(self.online(w, now) for w in self.all())

    def record(self, w: WorkerRow, now: float) -> WorkerRecord:
        return WorkerRecord(
            worker_id=w.worker_id,
            name=w.name,
            device=w.device,
            online=self.online(w, now),
            banned=w.banned,
            strikes=w.strikes,
            loaded_policy_version=w.loaded_version,
            state=WorkerState(w.state) if w.state else None,
            last_seen=self.last_seen(w),
            submissions_accepted=w.accepted,
            submissions_rejected=w.rejected,
            verified_tokens=w.verified_tokens,
            tokens_per_s=w.tokens_per_s,
        )
