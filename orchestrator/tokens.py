"""Join tokens: what a volunteer holds to register workers, and what a worker's identity is bound to.

An operator mints one token per volunteer (or per group) through the admin API; the run config's
`join_tokens` are imported at start as tokens too. A token carries:
- a cap on its live identities (registered, not banned, seen recently) and a registration rate, so one
  token cannot become a crowd (Sybil identities) or flood the workers table;
- a ban: a banned (or revoked) token registers nothing, and its workers are refused everywhere;
- a lease debt and a cooldown: leases its workers held and gave back unsubmitted (expired or released)
  after they could have been generated cost the token, in proportion to the prompts and the time held
  and at least `release_floor` of a lease (orchestrator/release_costs.py), with an exponential cooldown; every
  `debt_per_strike` leases of debt strike the worker that let the lease go (orchestrator/leases.py).
  Debt lives on the token, not the identity, so registering a fresh identity does not wipe it.

Only a token's sha256 is stored. A minted token is `jt-<token id>.<random>`; a config token is any string.
A token claimed by open join (orchestrator/open_join.py) has an id that starts with OPEN_JOIN_PREFIX.
"""

from __future__ import annotations

import hashlib
import secrets
import sqlite3
import time
from dataclasses import dataclass

from orchestrator.db import Database
from orchestrator.errors import ApiError
from protocol.models import ErrorCode
from protocol.operator_models import JoinTokenRecord

SCHEMA = """
CREATE TABLE IF NOT EXISTS join_tokens (
    token_id TEXT PRIMARY KEY,
    token_hash TEXT NOT NULL UNIQUE,
    label TEXT NOT NULL,
    created_at REAL NOT NULL,
    max_identities INTEGER NOT NULL,
    revoked INTEGER NOT NULL DEFAULT 0,
    banned INTEGER NOT NULL DEFAULT 0,
    ban_reason TEXT NOT NULL DEFAULT '',
    registrations INTEGER NOT NULL DEFAULT 0,
    lease_debt REAL NOT NULL DEFAULT 0,
    cooldown_until REAL NOT NULL DEFAULT 0
);
"""


# Ids of tokens claimed by open join: one identity each, on probation until they have a record
# (lease_shares.py), and banned with their identity (workers.py).
OPEN_JOIN_PREFIX = "oj-"


def is_open_join(token_id: str | None) -> bool:
    return token_id is not None and token_id.startswith(OPEN_JOIN_PREFIX)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


@dataclass
class TokenRow:
    token_id: str
    token_hash: str
    label: str
    created_at: float
    max_identities: int
    revoked: bool
    banned: bool
    ban_reason: str
    registrations: int
    lease_debt: float
    cooldown_until: float

    @property
    def usable(self) -> bool:
        return not (self.revoked or self.banned)


def _row(r: sqlite3.Row) -> TokenRow:
    return TokenRow(**{k: r[k] for k in r.keys()} | {"revoked": bool(r["revoked"]), "banned": bool(r["banned"])})


class JoinTokens:
    def __init__(self, db: Database, config_tokens: list[str], default_max_identities: int, lease_cooldown_s: float):
        self.db = db
        self.default_max_identities = default_max_identities
        self.lease_cooldown_s = lease_cooldown_s
        db.create(SCHEMA)
        now = time.time()
        with db.tx() as conn:
            for token in config_tokens:  # stable ids, so a restart finds the same rows
                digest = hash_token(token)
                conn.execute(
                    "INSERT OR IGNORE INTO join_tokens (token_id, token_hash, label, created_at, max_identities) "
                    "VALUES (?, ?, 'config', ?, ?)",
                    (f"cfg-{digest[:16]}", digest, now, default_max_identities),
                )
        self._by_hash: dict[str, str] = {r["token_hash"]: r["token_id"]
            for r in db.all("SELECT token_id, token_hash FROM join_tokens")}

    # ---------------------------------------------------------------------------------------------
    # operator

    def mint(self, label: str, max_identities: int | None, prefix: str = "t-") -> tuple[TokenRow, str]:
        token_id = f"{prefix}{secrets.token_hex(6)}"
        token = f"jt-{token_id}.{secrets.token_urlsafe(32)}"
        digest = hash_token(token)
        with self.db.tx() as db:
            db.execute(
                "INSERT INTO join_tokens (token_id, token_hash, label, created_at, max_identities) VALUES (?, ?, ?, "
                "?, ?)",
                (token_id, digest, label, time.time(), max_identities or self.default_max_identities),
            )
        self._by_hash[digest] = token_id
        row = self.get(token_id)
        assert row is not None
        return row, token

    def get(self, token_id: str) -> TokenRow | None:
        row = self.db.one("SELECT * FROM join_tokens WHERE token_id=?", (token_id,))
        return _row(row) if row else None

    def all(self) -> list[TokenRow]:
        return [_row(r) for r in self.db.all("SELECT * FROM join_tokens ORDER BY created_at")]

    def revoke(self, token_id: str, reason: str) -> TokenRow:
        """Revoke a token: no registration with it any more (its workers are banned by the caller)."""
        if self.get(token_id) is None:
            raise ApiError(ErrorCode.not_found, f"no join token {token_id}")
        with self.db.tx() as db:
            db.execute("UPDATE join_tokens SET revoked=1, ban_reason=? WHERE token_id=?", (reason
                or "revoked by an operator", token_id))
        row = self.get(token_id)
        assert row is not None
        return row

    def set_ban(self, db: sqlite3.Connection, token_id: str, banned: bool, reason: str) -> None:
        db.execute("UPDATE join_tokens SET banned=?, ban_reason=? WHERE token_id=?", (int(banned), reason if banned
            else "", token_id))

    def record(self, row: TokenRow, live_identities: int) -> JoinTokenRecord:
        return JoinTokenRecord(
            token_id=row.token_id, label=row.label, created_at=row.created_at, revoked=row.revoked, banned=row.banned,
            max_identities=row.max_identities, live_identities=live_identities, registrations=row.registrations,
            lease_debt=row.lease_debt, cooldown_until=row.cooldown_until,
        )

    # ---------------------------------------------------------------------------------------------
    # registration

    def authenticate(self, token: str) -> TokenRow:
        """The token a join secret belongs to, if it may still register; raises unauthorized / banned."""
        token_id = self._by_hash.get(hash_token(token))
        return self._usable(self.get(token_id) if token_id else None)

    def current(self, row: TokenRow) -> TokenRow:
        """The token as it is now, if it may still register: the HTTP gate read `row` from the request's
        headers, and a ban or a revocation may have landed while its body arrived."""
        return self._usable(self.get(row.token_id))

    @staticmethod
    def _usable(row: TokenRow | None) -> TokenRow:
        if row is None or row.revoked:
            raise ApiError(ErrorCode.unauthorized, "invalid join token")
        if row.banned:
            raise ApiError(ErrorCode.banned, f"join token {row.token_id} is banned: {row.ban_reason}")
        return row

    def count_registration(self, db: sqlite3.Connection, token_id: str) -> None:
        db.execute("UPDATE join_tokens SET registrations=registrations+1 WHERE token_id=?", (token_id,))

    # ---------------------------------------------------------------------------------------------
    # lease debt

    def cooldown_left(self, token_id: str, now: float) -> float:
        row = self.db.one("SELECT cooldown_until FROM join_tokens WHERE token_id=?", (token_id,))
        return max(0.0, float(row[0]) - now) if row else 0.0

    def add_debt(self, db: sqlite3.Connection, token_id: str, units: float, now: float) -> float:
        """Charge a lease given back unsubmitted (units: leases' worth, scaled by the time held). The first
        lease of debt is free (a crash costs only the lease); beyond it the cooldown doubles with every
        unit: backoff, before the strikes. Returns the new debt."""
        row = db.execute("SELECT lease_debt FROM join_tokens WHERE token_id=?", (token_id,)).fetchone()
        if row is None:
            return 0.0
        debt = float(row[0]) + units
        cooldown = min(self.lease_cooldown_s * (2 ** max(0.0, debt - 1.0) - 1.0), 3600.0)
        db.execute("UPDATE join_tokens SET lease_debt=? WHERE token_id=?", (debt, token_id))
        if cooldown > 0:  # from the wall clock: `now` may be when the deadline was noticed, not when it is
            db.execute("UPDATE join_tokens SET cooldown_until=MAX(cooldown_until, ?) WHERE token_id=?",
                (time.time() + cooldown, token_id))
        return debt

    def pay_debt(self, db: sqlite3.Connection, token_id: str) -> None:
        """An accepted submission: the token did real work, so its debt halves and its cooldown ends."""
        db.execute(
            "UPDATE join_tokens SET lease_debt=lease_debt/2, cooldown_until=0 WHERE token_id=? AND lease_debt>0",
            (token_id,))
