"""How long a lease may take: its deadline, from its size and its worker's verified generation rate.

A constant deadline fits one size of model and machine. Tuned on a 4M-parameter toy (a lease in about a
second), 60 s expires every honest lease of a 0.6B model on a 2-core CPU (4-7 tokens/s: 2 prompts x 4
samples x 512 tokens take ~10 minutes), each one charged as lease debt; on a GPU (~1000x faster) it lets a
worker that never submits hold its prompts far longer than the work takes. So a lease gets

    deadline = now + max(floor, min(cap, slack x lease_tokens / rate))

- lease_tokens: the most the lease can make, prompts x samples_per_prompt x the token cap of one sample
  (sampling.max_tokens, or an environment's episode cap when lower).
- rate: the worker's generation rate in tokens/s, measured only on its ACCEPTED submissions (verified tokens
  over the time from issue to submission), so nothing a worker claims, and nothing rejected, moves its
  deadline. It is a running ratio of decayed sums of tokens and seconds: a lease weighs by its size (a lease
  of short completions, where fixed costs dominate, tells little), and a slower lease than the estimate
  weighs more than a faster one (FALL > RISE), so the estimate leans slow. A worker with no accepted work
  gets `new_worker_tokens_per_s`. Kept in the `worker_rates` table: a restarted orchestrator keeps it.
- slack (`lease_slack`) absorbs a lease slower than measured (longer completions, a weights pull, a second
  lease at once); the floor (`lease_timeout_s`) keeps toy-sized leases at the old constant, and wins over
  the cap; the cap (`lease_timeout_max_s`) bounds how long anyone holds prompts, whatever rate it showed,
  a worker that slows itself down with verified work included.
"""

from __future__ import annotations

import sqlite3

from orchestrator.config import OrchestratorConfig
from orchestrator.db import Database

SCHEMA = """
CREATE TABLE IF NOT EXISTS worker_rates (
    worker_id TEXT PRIMARY KEY,
    tokens REAL NOT NULL,       -- decayed sum of verified tokens of its accepted leases
    seconds REAL NOT NULL,      -- decayed sum of their seconds from issue to submission
    leases INTEGER NOT NULL,    -- accepted leases measured
    updated_at REAL NOT NULL
);
"""
# Weight of the newest accepted lease in the decayed sums: more when it was slower than the estimate.
FALL, RISE = 0.5, 0.2
# A submission that arrives within this of its issue is timed as this long (clocks, a zero division).
MIN_SECONDS = 1e-3


def lease_seconds(lease_tokens: int, tokens_per_s: float, slack: float, floor_s: float, cap_s: float) -> float:
    """How long a lease of `lease_tokens` may take at `tokens_per_s`: slack x the time it needs, within
    [floor, cap]; never below the floor, even where the floor is above the cap."""
    return max(floor_s, min(cap_s, slack * lease_tokens / tokens_per_s))


def decayed(old_tokens: float, old_seconds: float, tokens: float, seconds: float) -> tuple[float, float]:
    """The running sums after one more accepted lease of `tokens` made in `seconds`."""
    slower = tokens * old_seconds < old_tokens * seconds  # tokens / seconds < old_tokens / old_seconds
    w = FALL if slower else RISE
    return (1 - w) * old_tokens + w * tokens, (1 - w) * old_seconds + w * seconds


def sample_token_cap(config: OrchestratorConfig) -> int:
    """The most tokens one sample can take: sampling.max_tokens, or an environment's episode cap."""
    cap = config.sampling.max_tokens
    if config.environment is not None:
        from environments.registry import environment_class

        cap = min(cap, environment_class(config.environment).limits.max_episode_tokens)
    return cap


class LeaseDeadlines:
    def __init__(self, db: Database, config: OrchestratorConfig) -> None:
        db.create(SCHEMA)
        self.config = config
        self.sample_tokens = sample_token_cap(config)

    def rate(self, db: sqlite3.Connection, worker_id: str) -> float | None:
        """The worker's measured tokens/s over its accepted leases; None before it has any."""
        row = db.execute("SELECT tokens, seconds FROM worker_rates WHERE worker_id=?", (worker_id,)).fetchone()
        return None if row is None else float(row[0]) / max(float(row[1]), MIN_SECONDS)

    def seconds(self, db: sqlite3.Connection, worker_id: str, prompts: int, samples_per_prompt: int) -> float:
        """How long this worker's lease of this size may take (the module's rule)."""
        cfg = self.config
        rate = self.rate(db, worker_id) or cfg.new_worker_tokens_per_s
        lease_tokens = prompts * samples_per_prompt * self.sample_tokens
        return lease_seconds(lease_tokens, rate, cfg.lease_slack, cfg.lease_timeout_s, cfg.lease_timeout_max_s)

    def deadline(self, db: sqlite3.Connection, worker_id: str, prompts: int, samples_per_prompt: int,
        now: float) -> float:
        """In the issuing transaction: the deadline of a lease of this size to this worker."""
        return now + self.seconds(db, worker_id, prompts, samples_per_prompt)

    @staticmethod
    def note_accepted(db: sqlite3.Connection, worker_id: str, tokens: int, issued_at: float,
        submitted_at: float | None) -> None:
        """In the verdict's transaction: the worker's lease was accepted with `tokens` verified tokens."""
        if tokens <= 0 or submitted_at is None:
            return
        seconds = max(submitted_at - issued_at, MIN_SECONDS)
        row = db.execute("SELECT tokens, seconds FROM worker_rates WHERE worker_id=?", (worker_id,)).fetchone()
        t, s = (float(tokens), seconds) if row is None else decayed(float(row[0]), float(row[1]), tokens, seconds)
        db.execute(
            "INSERT INTO worker_rates (worker_id, tokens, seconds, leases, updated_at) VALUES (?, ?, ?, 1, ?) "
            "ON CONFLICT(worker_id) DO UPDATE SET tokens=excluded.tokens, seconds=excluded.seconds, "
            "leases=leases+1, updated_at=excluded.updated_at",
            (worker_id, t, s, submitted_at),
        )
