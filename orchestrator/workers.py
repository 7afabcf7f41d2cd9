"""Workers and identities: registration under a join token, bearer secrets, heartbeats, strikes and
bans, the contribution ledger, and the `workers` table that holds them.

A worker's secret is `<worker id>.<random>`; only its sha256 is stored. Authentication is a dictionary
lookup and one constant-time compare per request (the cache is filled from SQLite on a miss and dropped
on a ban), and last-seen times are kept in memory and flushed to SQLite by housekeeping. A ban of scope
"token" bans every identity of the worker's join token, and the token itself (orchestrator/tokens.py). A
token claimed by open join holds one identity and is banned with it whatever the scope: a ban takes exactly
that claimant, never another's workers.

Strikes decay with accepted work: every `strike_decay_accepted` accepted submissions in a row (no strike
between them) remove one strike, never below 0 and never from a banned worker. So a worker whose striking
rejections come more often than once per that many accepted submissions gathers strikes until banned, and
one that slipped a few times long ago is not banned by the next slip.
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
from orchestrator.tokens import JoinTokens, is_open_join
from protocol.models import Credit, ErrorCode, WorkerState
from protocol.operator_models import BanScope, WorkerRecord

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
    verified_tokens INTEGER NOT NULL DEFAULT 0,
    token_id TEXT,                  -- the join token it registered with
    decay_progress INTEGER NOT NULL DEFAULT 0  -- accepted since its last strike or decay, while it has strikes
);
CREATE INDEX IF NOT EXISTS workers_by_token ON workers (token_id);
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
    token_id: str | None = None
    decay_progress: int = 0

    @property
    def trust_level(self) -> str:
        return "trusted" if self.strikes == 0 and self.accepted >= TRUSTED_AFTER_ACCEPTED else "new"


def _row(r: sqlite3.Row) -> WorkerRow:
    return WorkerRow(**{k: r[k] for k in r.keys()} | {"banned": bool(r["banned"])})


class Workers:
    def __init__(self, db: Database, tokens: JoinTokens, dead_after_s: float, ban_scope: BanScope = BanScope.token,
        strike_decay_accepted: int = 0):
        self.db = db
        self.tokens = tokens
        self.dead_after_s = dead_after_s
        self.ban_scope = ban_scope
        self.strike_decay_accepted = strike_decay_accepted  # 0: strikes never decay
        db.create(SCHEMA)
        self._auth: dict[str, tuple[str, bool]] = {}  # worker id -> (secret hash, banned)
        self._dirty: dict[str, float] = {}  # last-seen times not yet flushed to SQLite
        # Every identity's join token and last request, in memory (fair shares and live counts read them per lease).
        rows = db.all("SELECT worker_id, token_id, last_seen, banned, state FROM workers")
        self._token_of: dict[str, str | None] = {r[0]: r[1] for r in rows}
        self._last_seen: dict[str, float] = {r[0]: float(r[2] or 0.0) for r in rows
                                             if not r[3] and r[4] != WorkerState.stopped.value}

    # ---------------------------------------------------------------------------------------------
    # identity

    def register(self, name: str, device: str, client_version: str, token_id: str) -> tuple[str, str]:
        """A new identity under a join token: (worker id, bearer secret). The caller checked the token."""
        worker_id = f"w-{secrets.token_hex(8)}"
        secret = f"{worker_id}.{secrets.token_urlsafe(32)}"
        digest = hash_secret(secret)
        now = time.time()
        with self.db.tx() as db:
            db.execute(
                "INSERT INTO workers (worker_id, name, device, client_version, secret_hash, created_at, last_seen, "
                "state, token_id) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, 'starting', ?)",
                (worker_id, name, device, client_version, digest, now, now, token_id),
            )
            self.tokens.count_registration(db, token_id)
        self._auth[worker_id] = (digest, False)
        self._token_of[worker_id] = token_id
        self._last_seen[worker_id] = self._dirty[worker_id] = now
        log.info("worker registered", extra={"worker_id": worker_id, "worker_name": name, "token_id": token_id})
        return worker_id, secret

    def credit(self, token_id: str) -> Credit:
        """A join token's record over the run: every worker that registered with it (workers_by_token)."""
        row = self.db.one("SELECT COALESCE(SUM(accepted), 0), COALESCE(SUM(rejected), 0), "
                          "COALESCE(SUM(verified_tokens), 0) FROM workers WHERE token_id=?", (token_id,))
        return Credit(accepted=row[0], rejected=row[1], verified_tokens=row[2])

    def live_identities(self, token_id: str, now: float) -> int:
        """Identities of a token that are not banned and were seen within dead_after_s."""
        return sum(1 for w, t in self._last_seen.items() if self._token_of.get(w) == token_id
            and now - t <= self.dead_after_s)

    def token_of(self, worker_id: str) -> str | None:
        return self._token_of.get(worker_id)

    def authenticate(self, secret: str) -> str:
        """The worker a bearer secret belongs to; raises unauthorized, or banned: a banned secret can do
        nothing (the worker learns why from this refusal's detail)."""
        worker_id, _, _ = secret.partition(".")
        entry = self._auth.get(worker_id)
        if entry is None:
            row = self.get(worker_id) if worker_id else None
            if row is None:
                raise ApiError(ErrorCode.unauthorized, "unknown worker secret")
            entry = self._auth[worker_id] = (row.secret_hash, row.banned)
        if not secret_matches(secret, entry[0]):
            raise ApiError(ErrorCode.unauthorized, "unknown worker secret")
        if entry[1]:
            raise ApiError(ErrorCode.banned, f"worker {worker_id} is banned")
        self._last_seen[worker_id] = self._dirty[worker_id] = time.time()
        return worker_id

    def is_banned(self, worker_id: str) -> bool:
        """Whether the worker is banned now (the auth cache, else the row): a request authenticated from its
        headers is checked again before it changes anything, since a ban can land while its body arrives."""
        entry = self._auth.get(worker_id)
        if entry is not None:
            return entry[1]
        row = self.get(worker_id)
        return row is None or row.banned

    def refuse_if_banned(self, worker_id: str) -> None:
        """Before a worker's request changes state: the gate authenticated it from the headers, and a ban
        may have landed since (while its body arrived, while its lease request was held)."""
        if self.is_banned(worker_id):
            raise ApiError(ErrorCode.banned, f"worker {worker_id} is banned")

    def is_cached(self, secret: str) -> bool:
        """Whether the secret names an identity already in the auth cache (a worker that authenticated
        before): such requests skip the per-address limit on refused credentials."""
        return secret.partition(".")[0] in self._auth

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
        """A worker's report. `stopped` is a clean leave: its secret stops working and it stops counting as a live
        identity of its token, so its restart registers at once (not after dead_after_s)."""
        stopped = state is WorkerState.stopped
        revoke = ", secret_hash=''" if stopped else ""  # no hash matches ''
        with self.db.tx() as db:
            db.execute(f"UPDATE workers SET last_seen=?, state=?, loaded_version=?, tokens_per_s=?{revoke} "
                       "WHERE worker_id=?", (time.time(), state.value, loaded_version, tokens_per_s, worker_id))
        if stopped:
            self._auth.pop(worker_id, None)
            self._last_seen.pop(worker_id, None)
            self._dirty.pop(worker_id, None)

    def flush_seen(self) -> None:
        """Persist the last-seen times kept in memory (batched, not one write per request)."""
        seen, self._dirty = self._dirty, {}
        if seen:
            with self.db.tx() as db:
                db.executemany("UPDATE workers SET last_seen=? WHERE worker_id=?", [(t, w) for w, t in seen.items()])

    def set_ban(self, worker_id: str, banned: bool, reason: str, scope: BanScope | None = None) -> WorkerRow:
        """An operator's ban (or unban). Scope "token" bans every identity of the worker's join token and
        the token itself, so the ban sticks across re-registration; unbanning a worker lifts its token's ban."""
        row = self.get(worker_id)
        if row is None:
            raise ApiError(ErrorCode.not_found, f"no worker {worker_id}")
        reason = reason or ("banned by an operator" if banned else "")
        with self.db.tx() as db:
            if banned:
                self._ban(db, worker_id, reason, scope or self.ban_scope)
            else:
                db.execute("UPDATE workers SET banned=0, ban_reason='', strikes=0 WHERE worker_id=?", (worker_id,))
                if row.token_id:
                    self.tokens.set_ban(db, row.token_id, False, "")
                self._last_seen[worker_id] = time.time()
        self._auth.pop(worker_id, None)
        log.warning("worker %s", "banned" if banned else "unbanned", extra={"worker_id": worker_id, "reason": reason})
        out = self.get(worker_id)
        assert out is not None
        return out

    def ban_token_identities(self, db: sqlite3.Connection, token_id: str, reason: str) -> list[str]:
        """Inside a transaction: ban every identity of a join token (a revoked or banned token)."""
        ids = [r[0] for r in db.execute("SELECT worker_id FROM workers WHERE token_id=? AND banned=0", (token_id,
            )).fetchall()]
        db.executemany("UPDATE workers SET banned=1, ban_reason=? WHERE worker_id=?", [(reason, w) for w in ids])
        for w in ids:
            self._forget(w)
        return ids

    def ban_now(self, db: sqlite3.Connection, worker_id: str, reason: str) -> bool:
        """A ban with the run's scope, inside the caller's transaction. Returns whether it banned now."""
        row = db.execute("SELECT banned FROM workers WHERE worker_id=?", (worker_id,)).fetchone()
        if row is None or row[0]:
            return False
        self._ban(db, worker_id, reason, self.ban_scope)
        return True

    def _ban(self, db: sqlite3.Connection, worker_id: str, reason: str, scope: BanScope) -> None:
        db.execute("UPDATE workers SET banned=1, ban_reason=? WHERE worker_id=?", (reason, worker_id))
        self._forget(worker_id)
        token_id = self._token_of.get(worker_id)
        # An open-join token is its one identity's: banned with it, so that coming back costs a new puzzle.
        if token_id and (scope is BanScope.token or is_open_join(token_id)):
            self.tokens.set_ban(db, token_id, True, f"worker {worker_id}: {reason}")
            self.ban_token_identities(db, token_id, f"join token banned (worker {worker_id}: {reason})")

    def _forget(self, worker_id: str) -> None:
        self._auth.pop(worker_id, None)
        self._last_seen.pop(worker_id, None)

    def record_verdict(self, db: sqlite3.Connection, worker_id: str, accepted: bool, verified_tokens: int,
        strikes_to_ban: int, strike: bool = True) -> bool:
        """The worker's ledger after a verdict, inside the verdict's transaction: an acceptance adds its
        verified tokens (and pays down its token's lease debt), and every `strike_decay_accepted` of them
        in a row remove a strike; a rejection is a strike (unless it was the trusted side's failure).
        Returns whether it banned now."""
        if accepted:
            # Progress towards a decay counts only while the worker has strikes: clean work banks nothing.
            db.execute(
                "UPDATE workers SET accepted=accepted+1, verified_tokens=verified_tokens+?, "
                "decay_progress=CASE WHEN strikes>0 AND banned=0 THEN decay_progress+1 ELSE 0 END WHERE worker_id=?",
                (verified_tokens, worker_id),
            )
            if self.strike_decay_accepted:
                db.execute(
                    "UPDATE workers SET strikes=strikes-1, decay_progress=0 WHERE worker_id=? AND strikes>0 AND "
                    "banned=0 AND decay_progress>=?",
                    (worker_id, self.strike_decay_accepted),
                )
            token_id = self._token_of.get(worker_id)
            if token_id:
                self.tokens.pay_debt(db, token_id)
            return False
        db.execute("UPDATE workers SET rejected=rejected+1 WHERE worker_id=?", (worker_id,))
        return self.strike(db, worker_id, "rejected submissions", strikes_to_ban) if strike else False

    def strike(self, db: sqlite3.Connection, worker_id: str, why: str, strikes_to_ban: int) -> bool:
        """One strike, inside the caller's transaction; enough strikes ban (with the run's ban scope).
        Returns whether it banned now."""
        db.execute("UPDATE workers SET strikes=strikes+1, decay_progress=0 WHERE worker_id=?", (worker_id,))
        strikes, banned = db.execute("SELECT strikes, banned FROM workers WHERE worker_id=?", (worker_id,)).fetchone()
        if banned or strikes < strikes_to_ban:
            return False
        self._ban(db, worker_id, f"{strikes} strikes (threshold {strikes_to_ban}), the last for {why}", self.ban_scope)
        return True

    # ---------------------------------------------------------------------------------------------
    # operator views

    def last_seen(self, w: WorkerRow) -> float | None:
        return max(w.last_seen or 0.0, self._last_seen.get(w.worker_id, 0.0)) or None

    def online(self, w: WorkerRow, now: float) -> bool:
        return not w.banned and w.state != WorkerState.stopped.value and now - (self.last_seen(w) or 0.0) <= \
            self.dead_after_s

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
            token_id=w.token_id,
        )
