"""How many verifier actors the load needs: a pure decision (no Ray, no clock of its own), so that it is
tested on its own (tests/foundation/test_verifier_scaling.py) and the driver only applies it.

Inputs, over the orchestrator's last-minute window (orchestrator/status.py): the queue of unverified
submissions, how many arrive and how many get a verdict per second, and the actors live and pending
(requested but not placed yet: on KubeRay the autoscaler is adding a node for them).

- Grow while the queue (at least `min_queue_to_grow` long) grows faster than it drains, or holds more than
`target_drain_s` of work: to as
  many actors as arrivals plus draining the queue within `target_drain_s` need, at the per-actor rate
  measured now (the actors are saturated while a queue stands), at most doubling per decision. Never
  while actors are still pending (they are capacity already asked for) or within `up_cooldown_s` of
  the last change.
- Shrink by one actor after the queue has stayed empty and the arrivals fit in one actor fewer for
  `down_idle_s`, and again only after another `down_idle_s`: a burst right after a shrink finds the
  pool still there, so the pool does not flap. Pending actors go first (they serve nothing yet).
- Always within [min_actors, max_actors]; min == max is the fixed pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class PoolLoad:
    queue: int  # submissions waiting for a verdict
    arrivals_per_s: float  # submissions queued per second
    drained_per_s: float  # verdicts per second
    live: int  # actors that answer
    pending: int = 0  # actors requested, not placed or not ready yet


@dataclass
class VerifierAutoscaler:
    min_actors: int
    max_actors: int
    up_cooldown_s: float = 30.0
    down_idle_s: float = 120.0
    target_drain_s: float = 30.0
    # Hysteresis: shrinking needs the arrivals to fit in (n - 1) actors at this fraction of their rate.
    shrink_utilisation: float = 0.5
    # A queue this short is the verification thread's batch being gathered, not a backlog.
    min_queue_to_grow: int = 8
    _last_change: float = -math.inf
    _idle_since: float | None = None
    _per_actor_per_s: float = 0.0  # verdicts per second of one busy actor, last measured under a queue

    def __post_init__(self) -> None:
        if not 1 <= self.min_actors <= self.max_actors:
            raise ValueError(f"need 1 <= min_actors ({self.min_actors}) <= max_actors ({self.max_actors})")

    def desired(self, load: PoolLoad, now: float) -> int:
        """The number of actors (live + pending) the pool should have now."""
        current = load.live + load.pending
        target = self._decide(load, now, current)
        target = max(self.min_actors, min(self.max_actors, target))
        if target != current:
            self._last_change = now
            self._idle_since = None
        return target

    def _decide(self, load: PoolLoad, now: float, current: int) -> int:
        if current < self.min_actors:  # an actor was lost for good, or the pool is starting
            return self.min_actors
        if load.queue >= self.min_queue_to_grow and load.live > 0 and load.drained_per_s > 0:
            self._per_actor_per_s = load.drained_per_s / load.live  # saturated under a backlog: their capacity
        if load.queue > 0:
            self._idle_since = None
            if load.queue < self.min_queue_to_grow:
                return current
            growing = load.arrivals_per_s > load.drained_per_s
            behind = load.drained_per_s <= 0 or load.queue / load.drained_per_s > self.target_drain_s
            if not (growing or behind) or load.pending or now - self._last_change < self.up_cooldown_s:
                return current
            if self._per_actor_per_s <= 0:  # no verdict yet to size by: one more at a time
                return current + 1
            need = (load.arrivals_per_s + load.queue / self.target_drain_s) / self._per_actor_per_s
            return min(2 * max(load.live, 1), max(current + 1, math.ceil(need)))
        # An empty queue: shrink only after it stays empty, with the arrivals well within one actor fewer.
        fits = self._per_actor_per_s <= 0 or load.arrivals_per_s <= (
            current - 1) * self._per_actor_per_s * self.shrink_utilisation
        if current <= self.min_actors or not fits:
            self._idle_since = None
            return current
        if self._idle_since is None:
            self._idle_since = now
            return current
        if now - self._idle_since >= self.down_idle_s and now - self._last_change >= self.down_idle_s:
            return current - 1
        return current
