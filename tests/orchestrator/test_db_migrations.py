"""The schema's version (PRAGMA user_version, orchestrator/db.py): a new file starts at the latest, an
older one is migrated step by step when it is opened, with its rows kept."""

from __future__ import annotations

import sqlite3

import pytest

from orchestrator import buffer, leases, workers
from orchestrator import db as dbmod
from orchestrator.buffer import RolloutBuffer
from orchestrator.db import SCHEMA_VERSION, Database
from orchestrator.tokens import JoinTokens
from orchestrator.workers import Workers

# The oldest tables that the migrations know: every column added since is missing.
OLDEST = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE workers (worker_id TEXT PRIMARY KEY, name TEXT NOT NULL, device TEXT NOT NULL, \
    client_version TEXT NOT NULL,
    secret_hash TEXT NOT NULL, created_at REAL NOT NULL, last_seen REAL, state TEXT, loaded_version INTEGER,
    tokens_per_s REAL NOT NULL DEFAULT 0, strikes INTEGER NOT NULL DEFAULT 0, banned INTEGER NOT NULL DEFAULT 0,
    ban_reason TEXT NOT NULL DEFAULT '', accepted INTEGER NOT NULL DEFAULT 0, rejected INTEGER NOT NULL DEFAULT 0,
    verified_tokens INTEGER NOT NULL DEFAULT 0);
CREATE TABLE leases (lease_id TEXT PRIMARY KEY, seq INTEGER NOT NULL, worker_id TEXT NOT NULL, \
    prompt_indices TEXT NOT NULL,
    body TEXT NOT NULL, issued_at REAL NOT NULL, deadline REAL NOT NULL, status TEXT NOT NULL);
CREATE TABLE reissue (seq INTEGER PRIMARY KEY AUTOINCREMENT, prompt_index INTEGER NOT NULL);
CREATE TABLE sample_groups (seq INTEGER PRIMARY KEY, submission_id TEXT NOT NULL, prompt_index INTEGER NOT NULL,
    num_samples INTEGER NOT NULL, sample_indices TEXT NOT NULL, behaviour_version INTEGER NOT NULL, \
    created_at REAL NOT NULL,
    status TEXT NOT NULL, batch_id TEXT, advantages BLOB NOT NULL, rewards BLOB NOT NULL, \
    completion_lengths BLOB NOT NULL,
    prompt_ids BLOB NOT NULL, completion_ids BLOB NOT NULL, logprobs BLOB NOT NULL);
INSERT INTO workers (worker_id, name, device, client_version, secret_hash, created_at, strikes, accepted)
    VALUES ('w1', 'old', 'cpu', '0.1', 'h', 1.0, 2, 7);
INSERT INTO leases VALUES ('L1', 1, 'w1', '[3]', '{}', 1.0, 2.0, 'open');
INSERT INTO reissue (prompt_index) VALUES (5);
INSERT INTO sample_groups VALUES (1, 's1', 3, 2, '[0, 1]', 0, 1.0, 'ready', NULL, \
    x'0000803f000080bf', x'0000803f00000000',
    x'0100000001000000', x'01000000', x'0200000003000000', x'0000000000000000');
"""
TABLES = ("workers", "leases", "reissue", "sample_groups")


def user_version(path) -> int:
    con = sqlite3.connect(path)
    try:
        return con.execute("PRAGMA user_version").fetchone()[0]
    finally:
        con.close()


def columns(db: Database, table: str) -> list[str]:
    return sorted(r[1] for r in db.all(f"PRAGMA table_info({table})"))


def make_tables(db: Database) -> None:
    for schema in (workers.SCHEMA, leases.SCHEMA, buffer.SCHEMA):
        db.create(schema)


def test_a_new_file_starts_at_the_latest_version(tmp_path):
    assert SCHEMA_VERSION == len(dbmod.MIGRATIONS) >= 1
    db = Database(tmp_path / "new.sqlite")
    make_tables(db)
    assert db.one("PRAGMA user_version")[0] == SCHEMA_VERSION
    db.close()
    db = Database(tmp_path / "new.sqlite")  # opened again: nothing to do
    assert db.one("PRAGMA user_version")[0] == SCHEMA_VERSION
    db.close()
    memory = Database(":memory:")
    assert memory.one("PRAGMA user_version")[0] == SCHEMA_VERSION
    memory.close()


def test_an_unversioned_file_with_the_oldest_columns_is_upgraded_and_keeps_its_rows(tmp_path):
    path = tmp_path / "old.sqlite"
    old = sqlite3.connect(path)
    old.executescript(OLDEST)
    old.commit()
    old.close()
    assert user_version(path) == 0

    db = Database(path)
    assert db.one("PRAGMA user_version")[0] == SCHEMA_VERSION
    make_tables(db)  # the concept modules' schemas (their indexes name the added columns) apply on top
    fresh = Database(":memory:")
    make_tables(fresh)
    for table in TABLES:
        assert columns(db, table) == columns(fresh, table), table
    fresh.close()

    w = Workers(db, JoinTokens(db, [], 1, 0.0), dead_after_s=60).get("w1")
    assert (w.name, w.strikes, w.accepted, w.token_id, w.decay_progress) == ("old", 2, 7, None, 0)
    lease = db.one("SELECT * FROM leases WHERE lease_id='L1'")
    assert (lease["prompt_indices"], lease["status"], lease["token_id"], lease["instances"],
        lease["eval_version"]) == ("[3]", "open", None, None, None)
    assert tuple(db.one("SELECT prompt_index, instance FROM reissue")) == (5, None)
    batch = RolloutBuffer(db).take(2)
    [group] = batch.groups
    assert group.submission_id == "s1" and group.num_samples == 2 and group.env_masks == b""
    assert group.advantages == bytes.fromhex("0000803f000080bf")
    db.close()
    assert user_version(path) == SCHEMA_VERSION


def test_a_file_with_some_of_the_columns_already_is_upgraded(tmp_path):
    """Files from before the version were migrated column by column: any subset may be there already."""
    path = tmp_path / "partial.sqlite"
    old = sqlite3.connect(path)
    old.executescript(OLDEST + "ALTER TABLE workers ADD COLUMN token_id TEXT; ALTER TABLE leases ADD COLUMN "
        "request_id TEXT;")
    old.commit()
    old.close()
    db = Database(path)
    make_tables(db)
    assert "decay_progress" in columns(db, "workers") and "charged" in columns(db, "leases")
    db.close()


def test_a_failing_step_leaves_the_file_at_its_version(tmp_path, monkeypatch):
    path = tmp_path / "v.sqlite"
    Database(path).close()

    def breaks(conn):
        conn.execute("ALTER TABLE meta ADD COLUMN half_done TEXT")
        raise sqlite3.OperationalError("disk on fire")

    monkeypatch.setattr(dbmod, "MIGRATIONS", (*dbmod.MIGRATIONS, breaks))
    monkeypatch.setattr(dbmod, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    with pytest.raises(sqlite3.OperationalError, match="disk on fire"):
        Database(path)
    assert user_version(path) == SCHEMA_VERSION
    con = sqlite3.connect(path)
    assert "half_done" not in {r[1] for r in con.execute("PRAGMA table_info(meta)")}
    con.close()


def test_a_file_from_a_newer_swarmrl_is_refused(tmp_path):
    path = tmp_path / "newer.sqlite"
    con = sqlite3.connect(path)
    con.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    con.close()
    with pytest.raises(RuntimeError, match="newer swarmrl"):
        Database(path)
