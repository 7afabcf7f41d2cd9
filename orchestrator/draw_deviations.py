"""Draw deviations per worker: accepted tokens that are not the seed's exact draw on the verifier's
logits (near ties and picks at the support's boundary, verifier/checks.check_draws).

The verifier must accept them, since an honest worker's numerical noise moves a near tie or the edge of
top-k / top-p now and then; but at each such position a dishonest worker could have picked either token.
So none is free: every deviation is counted, and a worker is held to the rate that noise explains
(`Verdict.near_tie_allowance`, the verifier's calibrated rate per token times the tokens it checked).

A leaky bucket per worker: it fills with the worker's deviations and drains by its allowance, never
below empty. Each time it rises past another `burst` the worker takes a strike, and past `ban_at` it is
banned: strikes decay with accepted work, the bucket only with the allowance, so a worker that keeps
steering is banned however rarely each submission deviates. One that stays under the allowance can steer
no more often than honest noise deviates (what bench/results/verifier_steering_attacks.md measures).
"""

from __future__ import annotations

import sqlite3

from orchestrator.db import Database

SCHEMA = """
CREATE TABLE IF NOT EXISTS draw_deviations (
    worker_id TEXT PRIMARY KEY,
    excess REAL NOT NULL DEFAULT 0,     -- the bucket: deviations above the allowance, not yet forgiven
    deviations INTEGER NOT NULL DEFAULT 0,
    allowance REAL NOT NULL DEFAULT 0   -- what noise explains over the same submissions
);
"""


class DeviationLedger:
    def __init__(self, db: Database, burst: float, ban_at: float):
        db.create(SCHEMA)
        self.db = db
        self.burst, self.ban_at = burst, ban_at

    def record(self, db: sqlite3.Connection, worker_id: str, deviations: int, allowance: float) -> tuple[int, bool]:
        """In the verdict's transaction: add an accepted submission's deviations. Returns (strikes due: the
        multiples of `burst` the bucket rose past, whether it passed `ban_at`)."""
        row = db.execute("SELECT excess FROM draw_deviations WHERE worker_id=?", (worker_id,)).fetchone()
        before = row[0] if row else 0.0
        excess = max(0.0, before + deviations - allowance)
        db.execute(
            "INSERT INTO draw_deviations (worker_id, excess, deviations, allowance) VALUES (?, ?, ?, ?) "
            "ON CONFLICT(worker_id) DO UPDATE SET excess=excluded.excess, deviations=deviations+excluded.deviations, "
            "allowance=allowance+excluded.allowance",
            (worker_id, excess, deviations, allowance),
        )
        strikes = max(0, int(excess // self.burst) - int(before // self.burst)) if self.burst > 0 else 0
        return strikes, excess > self.ban_at

    def of(self, worker_ids: list[str] | None = None) -> dict[str, tuple[int, float]]:
        """worker id -> (deviations, allowance) over the run."""
        rows = self.db.all("SELECT worker_id, deviations, allowance FROM draw_deviations")
        wanted = None if worker_ids is None else set(worker_ids)
        return {r[0]: (int(r[1]), float(r[2])) for r in rows if wanted is None or r[0] in wanted}
