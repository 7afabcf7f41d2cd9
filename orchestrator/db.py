"""The run's durable state: one SQLite file in WAL mode, everything that must survive a crash of the
orchestrator process.

This module owns the connection, transactions, the background WAL checkpointer, the `meta` table of
counters and the schema's version (`PRAGMA user_version`, with the migrations that bring an older file to
the latest: MIGRATIONS). Every other table belongs to the module of its concept, which creates it and keeps
its own SQL: workers.py (workers), leases.py (leases, reissue), verification.py (submissions, fingerprints,
versions), buffer.py (sample_groups and the `samples` view).

All methods are thread-safe (one connection, one lock): the HTTP server, the verification thread and the
trainer's pulls (Ray actor threads) share one `Database`. A second connection, on a thread of its own,
only checkpoints the WAL (see `_checkpoint_loop`).
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

META_SCHEMA = "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);"

# SQLite checkpoints the WAL itself after the commit that takes it past this many pages (default 1000):
# less often means fewer fsyncs on the request path and each hot page copied once, not ~10x.
WAL_AUTOCHECKPOINT_PAGES = 10_000
# The background checkpointer's period (see Database._checkpoint_loop).
CHECKPOINT_EVERY_S = 0.25


# --------------------------------------------------------------------------------------------------
# The schema's version: PRAGMA user_version. MIGRATIONS[v] takes a file at version v to v + 1, in one
# transaction with the version bump; opening a file at an earlier version applies them in order, before
# the concept modules create their tables. Every concept module's CREATE TABLE has the latest columns, so a
# new file starts at SCHEMA_VERSION, and a step changes only the tables that the file already has (a table
# made later is made new). A change of a table's columns is a new step at the end, never an edit of one.


def _add_columns(conn: sqlite3.Connection, table: str, columns: list[tuple[str, str]]) -> None:
    """Add each column (name, declaration) that `table` lacks; nothing when the file has no such table."""
    have = {r[1] for r in conn.execute(f"PRAGMA table_info({table})").fetchall()}
    for name, declaration in columns:
        if have and name not in have:
            conn.execute(f"ALTER TABLE {table} ADD COLUMN {name} {declaration}")


def _columns_of_unversioned_files(conn: sqlite3.Connection) -> None:
    """0 -> 1. Every file from before the schema had a version is at 0, with whichever of the columns added
    since then the swarmrl that made it had: join tokens, idempotency keys, eval leases, prompt instances,
    release charges, strike decay and multi-turn env masks."""
    _add_columns(conn, "leases", [("request_id", "TEXT"), ("token_id", "TEXT"), ("instances", "TEXT"), ("eval_version",
        "INTEGER"),
                                  ("charged", "INTEGER"), ("submitted_at", "REAL")])
    _add_columns(conn, "reissue", [("instance", "INTEGER")])
    _add_columns(conn, "workers", [("token_id", "TEXT"), ("decay_progress", "INTEGER NOT NULL DEFAULT 0")])
    _add_columns(conn, "sample_groups", [("env_masks", "BLOB NOT NULL DEFAULT x''")])


MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (_columns_of_unversioned_files,)
SCHEMA_VERSION = len(MIGRATIONS)


class Database:
    """The run's SQLite file. `path=":memory:"` is for logic tests only (nothing survives)."""

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
        try:
            self._migrate()
        except BaseException:
            self._db.close()
            raise
        self._db.executescript(META_SCHEMA)
        self._checkpointer: threading.Thread | None = None
        self._closing = threading.Event()
        if self.path != ":memory:":
            self._checkpointer = threading.Thread(target=self._checkpoint_loop, name="orchestrator-checkpoint",
                daemon=True)
            self._checkpointer.start()

    def _migrate(self) -> None:
        """Bring the file to SCHEMA_VERSION (see MIGRATIONS); a new, empty one is at it already."""
        version = self._db.execute("PRAGMA user_version").fetchone()[0]
        if version > SCHEMA_VERSION:
            raise RuntimeError(f"{self.path} is from a newer swarmrl (schema version {version}, this one knows up to "
                f"{SCHEMA_VERSION})")
        if version == 0 and not self._db.execute("SELECT 1 FROM sqlite_master").fetchone():
            version = SCHEMA_VERSION  # a new file: every table is made at the latest schema
            with self.tx() as db:
                db.execute(f"PRAGMA user_version = {version}")
        for step in range(version, SCHEMA_VERSION):
            with self.tx() as db:
                MIGRATIONS[step](db)
                db.execute(f"PRAGMA user_version = {step + 1}")

    def create(self, schema: str, counters: tuple[str, ...] = (), float_counters: tuple[str, ...] = ()) -> None:
        """A concept module's tables (CREATE ... IF NOT EXISTS) and the counters it keeps in `meta`."""
        self._db.executescript(schema)
        with self.tx() as db:
            for key in counters:
                db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?, '0')", (key,))
            for key in float_counters:
                db.execute("INSERT OR IGNORE INTO meta (key, value) VALUES (?, '0.0')", (key,))

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

    def one(self, sql: str, args: tuple = ()) -> sqlite3.Row | None:
        with self._lock:
            return self._db.execute(sql, args).fetchone()

    def all(self, sql: str, args: tuple = ()) -> list[sqlite3.Row]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    # ---------------------------------------------------------------------------------------------
    # counters (the meta table): run progress and the numbers /v1/status shows

    def get_int(self, key: str) -> int:
        row = self.one("SELECT value FROM meta WHERE key=?", (key,))
        return int(float(row["value"])) if row else 0

    def counters(self) -> dict[str, float]:
        return {r["key"]: float(r["value"]) for r in self.all("SELECT key, value FROM meta")}

    @staticmethod
    def add(db: sqlite3.Connection, key: str, delta: float) -> None:
        """Add to a counter, inside the caller's transaction (so it moves with the rows it counts)."""
        db.execute(
            "INSERT INTO meta (key, value) VALUES (?, ?) "
            "ON CONFLICT(key) DO UPDATE SET value = CAST(value AS REAL) + ?",
            (key, str(delta), delta),
        )

    @staticmethod
    def set(db: sqlite3.Connection, key: str, value: Any) -> None:
        db.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value=excluded.value",
            (key, str(value)))

    @staticmethod
    def read_int(db: sqlite3.Connection, key: str) -> int:
        row = db.execute("SELECT value FROM meta WHERE key=?", (key,)).fetchone()
        return int(float(row[0])) if row else 0
