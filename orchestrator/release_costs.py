"""What a lease given back unsubmitted costs, and how often a join token gives leases back after it could
have scored them.

A training prompt instance draws the same tokens whoever leases it (orchestrator/leases.py), so giving a
lease back cannot reroll it; but a worker that generated and scored a group (the reward is public) could
still give back the groups it dislikes and so choose which ones get trained first. So:
- A release (or an expiry) is free only before the lease could have been generated: within the FREE
  WINDOW, half the fastest measured generation time of that many prompts (the token's own fastest, or
  the swarm's p10 if that is faster), never more than FREE_HOLD of the lease time; with no measurement
  yet, FREE_HOLD. A worker shutting down, or told its version is too old, gives back at once: free.
- After it, the release costs its token debt in proportion to the time held, and at least
  `release_floor` of a full lease (orchestrator/tokens.py), and halves the token's record (lease_shares).
- A token whose charged releases are above `max_release_ratio` of its last RATIO_WINDOW ended leases may
  hold one prompt at a time until the ratio falls.

Everything here is rebuilt from the leases table at start (issued_at, submitted_at, status, charged).
"""

from __future__ import annotations

import sqlite3
import threading
from collections import deque
from typing import Any

from orchestrator.db import Database

# A lease given back within this fraction of its time costs its token nothing (at most: see free_window).
FREE_HOLD = 0.1
# The swarm's generation speed: a low quantile of seconds per prompt over its last accepted leases.
SWARM_LEASES = 200
SWARM_QUANTILE = 0.1
# A token's release ratio is over its last this many ended leases (accepted, rejected, released, expired),
RATIO_WINDOW = 40
# and counts at least this many, so that one early release of a new token is not a ratio of 1.
RATIO_MIN_LEASES = 8
# Run counters (the meta table): releases that cost nothing, and those charged.
RELEASED_FREE, RELEASED_CHARGED = "leases_released_free", "leases_released_charged"


class ReleaseCosts:
    def __init__(self, db: sqlite3.Connection, free_hold: float = FREE_HOLD) -> None:
        self.free_hold = free_hold
        self.metric: Any = None  # the orchestrator's swarmrl_leases_released counter (label charged), if any
        self._lock = threading.Lock()  # verdicts, releases and housekeeping come from different threads
        self._swarm: deque[float] = deque(maxlen=SWARM_LEASES)  # seconds per prompt of accepted leases
        self._fastest: dict[str, float] = {}  # join token -> its fastest seconds per prompt
        self._ended: dict[str, deque[bool]] = {}  # join token -> its last ended leases: a charged release?
        timed = "status='done' AND eval_version IS NULL AND submitted_at IS NOT NULL"
        per_prompt = "(submitted_at - issued_at) / json_array_length(prompt_indices)"
        for (s,) in db.execute(f"SELECT {per_prompt} FROM leases WHERE {timed} ORDER BY seq DESC LIMIT ?",
            (SWARM_LEASES,)).fetchall()[::-1]:
            self._swarm.append(max(0.0, float(s)))
        for token_id, s in db.execute(f"SELECT token_id, MIN({per_prompt}) FROM leases WHERE {timed} AND token_id IS "
            f"NOT NULL GROUP BY token_id"):
            self._fastest[token_id] = max(0.0, float(s))
        for token_id, charged in db.execute(
            "SELECT token_id, charged FROM (SELECT token_id, seq, status='released' AND COALESCE(charged, 0)=1 AS "
            "charged, "
            "ROW_NUMBER() OVER (PARTITION BY token_id ORDER BY seq DESC) AS n FROM leases "
            "WHERE token_id IS NOT NULL AND eval_version IS NULL AND status IN ('done', 'rejected', 'released', "
            "'expired')) "
            "WHERE n <= ? ORDER BY seq", (RATIO_WINDOW,),
        ):
            self._ended.setdefault(token_id, deque(maxlen=RATIO_WINDOW)).append(bool(charged))

    def note_accepted(self, token_id: str | None, prompts: int, issued_at: float, submitted_at: float | None) -> None:
        """An accepted training lease: how fast it was generated (issue to submission, per prompt)."""
        if submitted_at is not None and prompts > 0:
            s = max(0.0, submitted_at - issued_at) / prompts
            with self._lock:
                self._swarm.append(s)
                if token_id is not None:
                    self._fastest[token_id] = min(s, self._fastest.get(token_id, s))
        self.note_end(token_id, False)

    def note_end(self, token_id: str | None, charged_release: bool) -> None:
        if token_id is not None:
            with self._lock:
                self._ended.setdefault(token_id, deque(maxlen=RATIO_WINDOW)).append(charged_release)

    def closed(self, db: sqlite3.Connection, lease_id: str, token_id: str | None, status: str, charged: bool,
        training: bool) -> None:
        """A lease ended unsubmitted (expired, released, rejected), in its transaction: what it cost, and
        the run's count of releases (a release of a banned worker's lease included, as free)."""
        if charged:
            db.execute("UPDATE leases SET charged=1 WHERE lease_id=?", (lease_id,))
        if training:
            self.note_end(token_id, charged and status == "released")
        if status == "released":
            Database.add(db, RELEASED_CHARGED if charged else RELEASED_FREE, 1)
            if self.metric is not None:
                self.metric.labels("true" if charged else "false").inc()

    def free_window(self, token_id: str | None, lease_s: float, prompts: int) -> float:
        """Seconds after issue within which giving the lease back is free."""
        full = self.free_hold * lease_s
        with self._lock:
            ordered = sorted(self._swarm)
            fastest = self._fastest.get(token_id) if token_id else None
        swarm = ordered[int(SWARM_QUANTILE * (len(ordered) - 1))] if ordered else None
        seen = [v for v in (fastest, swarm) if v is not None]
        return min(full, 0.5 * min(seen) * prompts) if seen else full

    def units(self, token_id: str | None, prompts: int, issued: float, deadline: float, now: float,
        prompts_per_lease: int, floor: float) -> float:
        """The debt (in full leases' worth) of a lease given back unsubmitted at `now`; 0: free."""
        if now - issued < self.free_window(token_id, deadline - issued, prompts):
            return 0.0
        held = min(1.0, max(0.0, (now - issued) / max(deadline - issued, 1e-6)))
        return max(held * prompts / prompts_per_lease, floor)  # a full lease held to its deadline costs 1

    def ratio(self, token_id: str | None) -> float:
        """The share of the token's last ended leases that it gave back after their free window."""
        with self._lock:
            ended = list(self._ended.get(token_id, ())) if token_id else []
        return sum(ended) / len(ended) if ended else 0.0

    def over_bound(self, token_id: str, max_ratio: float) -> bool:
        with self._lock:
            ended = list(self._ended.get(token_id, ()))
        return sum(ended) > max_ratio * max(len(ended), RATIO_MIN_LEASES)

    def highest_ratio(self) -> float:
        with self._lock:
            tokens = list(self._ended)
        return max((self.ratio(t) for t in tokens), default=0.0)

    @staticmethod
    def by_worker(db: Database) -> dict[str, tuple[int, int]]:
        """Worker id -> (leases it gave back unsubmitted, of those charged), over the run."""
        rows = db.all("SELECT worker_id, COUNT(*), SUM(COALESCE(charged, 0)) FROM leases WHERE status='released' "
            "GROUP BY worker_id")
        return {r[0]: (int(r[1]), int(r[2])) for r in rows}
