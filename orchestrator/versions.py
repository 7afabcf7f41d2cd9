"""Policy versions: which versions are published (with their model hashes), the current one, and the one
way a version reaches the workers, `announce`: the trainer's commit and its reconciliation (version 0
included, at the trainer's first reconciliation) publish versions in the same transaction as the batches
they settle. Owns the `versions` and `superseded_versions` tables; the current version only moves forward.
"""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from typing import Any, TypeVar

from orchestrator.db import Database

SCHEMA = """
CREATE TABLE IF NOT EXISTS versions (version INTEGER PRIMARY KEY, model_hash TEXT NOT NULL, created_at REAL NOT NULL);
-- hashes a version had before a trainer restart re-published it with other weights
CREATE TABLE IF NOT EXISTS superseded_versions (version INTEGER NOT NULL, model_hash TEXT NOT NULL, \
PRIMARY KEY (version, model_hash)) WITHOUT ROWID;
"""

T = TypeVar("T")


class PolicyVersions:
    """Published policy versions and their model hashes; the current version only moves forward."""

    def __init__(self, db: Database, gauge: Any = None):
        self.db = db
        db.create(SCHEMA, counters=("policy_version",))
        self.current = db.get_int("policy_version")
        self.gauge = gauge  # the policy_version metric
        # (old, new) current version: evaluation opens rounds
        self.on_advance: Callable[[int, int], None] = lambda old, new: None
        self._hashes: dict[int, str] = {}  # immutable once published: cached, but dropped on (re)publish
        self._superseded = {(r[0], r[1]) for r in db.all("SELECT version, model_hash FROM superseded_versions")}

    def announce(self, published: dict[int, str], settle: Callable[[sqlite3.Connection], T] | None = None) -> T | None:
        """Announce `published` (version -> model hash) to the workers, in one transaction after `settle`
        (what the trainer's call changes with it: commits, a reconciliation), whose result it returns;
        then the current version moves forward. The only way a version is announced."""
        with self.db.tx() as db:
            out = settle(db) if settle is not None else None
            for version, model_hash in sorted(published.items()):
                self.publish(db, int(version), model_hash)
        if published:
            self._advance(max(int(v) for v in published))
        return out

    def _advance(self, version: int) -> None:
        old, self.current = self.current, max(self.current, version)
        if self.gauge is not None:
            self.gauge.set(self.current)
        self.on_advance(old, self.current)

    def publish(self, db: sqlite3.Connection, version: int, model_hash: str) -> None:
        """In `announce`'s transaction: the version's row (a new hash supersedes the old one)."""
        old = db.execute("SELECT model_hash FROM versions WHERE version=?", (version,)).fetchone()
        if old is not None and old[0] != model_hash:
            self.supersede(db, version, old[0])
        db.execute(
            "INSERT INTO versions (version, model_hash, created_at) VALUES (?, ?, ?) ON CONFLICT(version) DO UPDATE "
            "SET model_hash=excluded.model_hash",
            (version, model_hash, time.time()),
        )
        if version > Database.read_int(db, "policy_version"):
            Database.set(db, "policy_version", version)
        self._hashes.pop(version, None)

    def supersede(self, db: sqlite3.Connection, version: int, model_hash: str) -> None:
        """Weights that a version had on a trainer that crashed before they were durable (a relay may still
        serve them): a submission made with them is refused without a strike (`is_superseded`)."""
        db.execute("INSERT OR IGNORE INTO superseded_versions (version, model_hash) VALUES (?, ?)", (version,
            model_hash))
        self._superseded.add((version, model_hash))

    def is_superseded(self, version: int, model_hash: str) -> bool:
        return (version, model_hash) in self._superseded and self.model_hash(version) != model_hash

    def model_hash(self, version: int) -> str:
        """A published version's hash, or "" if it was never published."""
        h = self._hashes.get(version)
        if h is None:
            row = self.db.one("SELECT model_hash FROM versions WHERE version=?", (version,))
            if row is None:
                return ""
            h = self._hashes[version] = row["model_hash"]
        return h
