"""The trainer's batches: numbered in the order they are taken, each moving through states that survive
any crash, and reconciled with the trainer's durable checkpoint after every restart. Owns the `batches`
table and `batch_groups` (which groups each batch held: the audit trail, kept after a batch went back).

    taken ──► trained ──► committed        (the trainer's checkpoint that includes it is durable)
      │          │
      └──────────┴──► returned             (given back: its groups are ready again)

- taken: handed to the trainer (`take`).
- trained: the trainer trained it (`mark_trained`, with the version its step started from); the weights
  that include it are not durable yet, so a trainer crash can still undo it.
- committed: the checkpoint that includes it is durable (`commit`): its groups are trained (or stale,
  for samples the step dropped), the step and staleness are counted. Never handed out again.
- returned: given back untrained (a partial batch, or a reconciliation found the trainer never durably
  trained it). Its groups are ready again; they will be part of a later batch.

`reconcile` is the one rule for every restart (orchestrator, trainer, driver): the trainer's durable
checkpoint lists the take sequences its weights include (`protocol.batches.Lineage`); every batch that is
taken or trained is committed if the lineage holds it and given back if not.
"""

from __future__ import annotations

import logging
import secrets
import sqlite3
import time

from orchestrator.buffer import RolloutBuffer
from orchestrator.db import Database
from protocol.batches import Lineage

log = logging.getLogger(__name__)

SCHEMA = """
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY,            -- take order: 1, 2, 3, ... (never reused)
    batch_id TEXT NOT NULL UNIQUE,
    status TEXT NOT NULL,               -- taken | trained | committed | returned
    num_samples INTEGER NOT NULL,
    trained_from_version INTEGER,       -- the version the step that trained it started from
    taken_at REAL NOT NULL,
    trained_at REAL,
    settled_at REAL                     -- committed or returned
);
CREATE INDEX IF NOT EXISTS batches_unsettled ON batches (status) WHERE status IN ('taken', 'trained');
CREATE TABLE IF NOT EXISTS batch_groups (batch_seq INTEGER NOT NULL, group_seq INTEGER NOT NULL, \
PRIMARY KEY (batch_seq, group_seq)) WITHOUT ROWID;
"""
UNSETTLED = ("taken", "trained")
COUNTERS = ("batches_returned", "samples_returned", "reconcile_conflicts")


class BatchBook:
    def __init__(self, db: Database, buffer: RolloutBuffer):
        self.db = db
        self.buffer = buffer
        db.create(SCHEMA, counters=COUNTERS)
        with db.tx() as conn:
            # Groups taken by a batch that has no row (a run of an older swarmrl): number those batches now,
            # so that reconciliation settles them like any other.
            for (batch_id,
                ) in conn.execute("SELECT DISTINCT batch_id FROM sample_groups WHERE status='taken' AND batch_id NOT "
                "IN (SELECT batch_id FROM batches)").fetchall():
                groups = conn.execute("SELECT seq, num_samples FROM sample_groups WHERE batch_id=? AND status='taken'",
                    (batch_id,)).fetchall()
                seq = int(conn.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM batches").fetchone()[0])
                conn.execute("INSERT INTO batches (seq, batch_id, status, num_samples, taken_at) VALUES (?, ?, "
                    "'taken', ?, ?)", (seq, batch_id, sum(g[1] for g in groups), time.time()))
                conn.executemany("INSERT INTO batch_groups (batch_seq, group_seq) VALUES (?, ?)", [(seq, g[0])
                    for g in groups])

    def new(self, db: sqlite3.Connection, group_seqs: list[int], samples: int) -> tuple[str, int]:
        """In the take's transaction: number a new batch of these groups. Returns (batch id, sequence)."""
        seq = int(db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM batches").fetchone()[0])
        batch_id = f"B{seq}-{secrets.token_hex(3)}"
        db.execute("INSERT INTO batches (seq, batch_id, status, num_samples, taken_at) VALUES (?, ?, 'taken', ?, ?)",
            (seq, batch_id, samples, time.time()))
        db.executemany("INSERT INTO batch_groups (batch_seq, group_seq) VALUES (?, ?)", [(seq, g) for g in group_seqs])
        return batch_id, seq

    def mark_trained(self, batch_id: str, trained_from_version: int) -> bool:
        """The trainer trained the batch (its checkpoint is on the way). False if it was not taken.

        Its samples still count as untrained for the async bound until the commit: the version they
        trained is not announced before then either, and leases' version arithmetic
        (`protocol.staleness.lease_min_version`) counts the steps ahead of the announced version by the
        untrained samples. Not counting them made it plan one version short: in the async benchmark, 12%
        of the samples then arrived one version too stale and were dropped."""
        with self.db.tx() as db:
            cur = db.execute(
                "UPDATE batches SET status='trained', trained_from_version=?, trained_at=? WHERE batch_id=? AND "
                "status='taken'",
                (trained_from_version, time.time(), batch_id),
            )
        return cur.rowcount > 0

    def commit(self, db: sqlite3.Connection, batch_id: str, trained_from_version: int | None = None) -> dict[int, int]:
        """In the caller's transaction: the batch is in the trainer's durable checkpoint. Returns its
        staleness (version gap -> samples); {} if it was not taken or trained (committed before, returned,
        unknown), which changes nothing."""
        row = db.execute("SELECT seq, status, trained_from_version FROM batches WHERE batch_id=?", (batch_id,
            )).fetchone()
        if row is None:
            # A batch of the buffer alone (no sequence): commit its groups as they are.
            return self.buffer.commit(db, batch_id, trained_from_version or 0)
        if row["status"] not in UNSETTLED:
            if row["status"] == "returned":
                self._conflict(db, batch_id, "a durable checkpoint includes a batch that was given back")
            return {}
        version = trained_from_version if trained_from_version is not None else row["trained_from_version"]
        if version is None:
            raise ValueError(f"batch {batch_id} was never marked trained: the version its step started from is needed "
                f"to commit it")
        db.execute("UPDATE batches SET status='committed', trained_from_version=?, settled_at=? WHERE seq=?", (version,
            time.time(), row["seq"]))
        return self.buffer.commit(db, batch_id, int(version))

    def commit_all(self, db: sqlite3.Connection, batches: dict[str, int]) -> dict[int, int]:
        """`commit` of each batch (batch id -> the version its step started from); their staleness summed."""
        gaps: dict[int, int] = {}
        for batch_id, version in batches.items():
            for gap, k in self.commit(db, batch_id, version).items():
                gaps[gap] = gaps.get(gap, 0) + k
        return gaps

    def give_back(self, db: sqlite3.Connection, batch_id: str) -> int:
        """In the caller's transaction: the batch goes back untrained; returns how many samples."""
        row = db.execute("SELECT status FROM batches WHERE batch_id=?", (batch_id,)).fetchone()
        if row is not None and row["status"] not in UNSETTLED:
            return 0
        n = self.buffer.give_back(db, batch_id)
        if row is not None:
            db.execute("UPDATE batches SET status='returned', settled_at=? WHERE batch_id=?", (time.time(), batch_id))
            Database.add(db, "batches_returned", 1)
            Database.add(db, "samples_returned", n)
        return n

    def unsettled(self) -> list[tuple[int, str, str]]:
        """(sequence, batch id, status) of every batch taken or trained, oldest first."""
        return [(r["seq"], r["batch_id"], r["status"])
            for r in self.db.all("SELECT seq, batch_id, status FROM batches WHERE status IN ('taken', 'trained') "
            "ORDER BY seq")]

    def reconcile(self, db: sqlite3.Connection, lineage: Lineage, from_versions: dict[str, int]) -> dict[str, int]:
        """In the caller's transaction: settle every unsettled batch by the trainer's durable lineage:
        in it (or named in `from_versions`, the trainer's batches not yet known to be committed, all in
        its lineage), committed with its step's start version; not in it, given back. Also counts returned batches that
        the lineage holds (conflicts: they would be trained twice; never expected)."""
        committed = returned = 0
        for r in db.execute(
            "SELECT seq, batch_id FROM batches WHERE status IN ('taken', 'trained') ORDER BY seq").fetchall():
            if r["seq"] in lineage or r["batch_id"] in from_versions:
                committed += sum(self.commit(db, r["batch_id"], from_versions.get(r["batch_id"])).values())
            else:
                returned += self.give_back(db, r["batch_id"])
        last = lineage.last()
        if last is not None:
            for seq, batch_id in db.execute("SELECT seq, batch_id FROM batches WHERE status='returned' AND seq<=?",
                (last,)).fetchall():
                if seq in lineage:
                    self._conflict(db, batch_id, "the trainer's checkpoint includes a batch that was given back")
        return {"committed": committed, "returned": returned}

    @staticmethod
    def _conflict(db: sqlite3.Connection, batch_id: str, why: str) -> None:
        log.error("exactly-once conflict: %s", why, extra={"batch_id": batch_id})
        Database.add(db, "reconcile_conflicts", 1)
