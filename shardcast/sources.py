"""Which server a transfer goes to: measured throughput, cool-downs, bans, and the origin as the fallback.

Every server is untrusted except the signing key. Servers are picked with probability proportional to
their measured throughput (an EMA per transfer; unmeasured servers count as the best seen, so they get
tried), with some exploration. A server that fails is cooled down for a while; one that was too slow or
stalled is cooled down for longer (`slow_cooldown_s`); one that served bytes the signed manifest proves
wrong is banned for good. Fallback servers (the origin, for a worker) are picked only when no primary
server is usable, so relays carry the load and the origin is always there when they fail.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass

from prometheus_client import Counter

from shardcast.config import DEFAULTS, ShardcastConfig

log = logging.getLogger(__name__)

CLIENT_FAILURES = Counter("shardcast_client_shard_failures", "failed shard transfers", ["reason"])


@dataclass(frozen=True)
class TransferPolicy:
    """How long a client waits for what (see the client_* fields of ShardcastConfig)."""

    stall_timeout_s: float = DEFAULTS.client_stall_timeout_s
    min_rate_bytes_per_s: float = DEFAULTS.client_min_rate_bytes_per_s
    rate_window_s: float = DEFAULTS.client_rate_window_s
    slow_factor: float = DEFAULTS.client_slow_factor
    slow_cooldown_s: float = DEFAULTS.client_slow_cooldown_s
    shard_deadline_s: float = DEFAULTS.client_shard_deadline_s
    pull_deadline_s: float = DEFAULTS.client_pull_deadline_s
    request_timeout_s: float = DEFAULTS.request_timeout_s

    @classmethod
    def from_config(cls, c: ShardcastConfig) -> "TransferPolicy":
        return cls(
            c.client_stall_timeout_s, c.client_min_rate_bytes_per_s, c.client_rate_window_s, c.client_slow_factor,
            c.client_slow_cooldown_s, c.client_shard_deadline_s, c.client_pull_deadline_s, c.request_timeout_s,
        )


@dataclass
class ServerStats:
    url: str
    fallback: bool = False
    throughput: float | None = None  # EMA of bytes/s per transfer
    bytes: int = 0
    failures: int = 0
    slow: int = 0  # transfers left for being too slow or stalling
    cooldown_until: float = 0.0
    banned: str | None = None  # reason


class Sources:
    def __init__(self, urls: Iterable[str], fallback_urls: Iterable[str] = (), policy: TransferPolicy | None = None,
        explore: float = 0.1, seed: int | None = None):
        primary = [u.rstrip("/") for u in urls]
        fallback = [u.rstrip("/") for u in fallback_urls if u.rstrip("/") not in primary]
        if not primary and not fallback:
            raise ValueError("need at least one server URL")
        self.stats = {u: ServerStats(u) for u in primary} | {u: ServerStats(u, fallback=True) for u in fallback}
        self.urls = list(self.stats)
        self.policy = policy or TransferPolicy()
        self.explore = explore
        self._lock = threading.Lock()
        self._rng = random.Random(seed)

    def usable(self, exclude: Iterable[str] = ()) -> list[ServerStats]:
        exclude = set(exclude)
        return [s for s in self.stats.values() if s.banned is None and s.url not in exclude]

    def choose(self, exclude: set[str], allow_fallback: bool = True) -> ServerStats | None:
        """A usable server not in `exclude`: a warm primary, else a warm fallback, else the one cooling down least."""
        with self._lock:
            candidates = [s for s in self.usable(exclude) if allow_fallback or not s.fallback]
            if not candidates:
                return None
            now = time.monotonic()
            warm = [s for s in candidates if s.cooldown_until <= now and not s.fallback]
            warm = warm or [s for s in candidates if s.cooldown_until <= now]
            warm = warm or sorted(candidates, key=lambda s: (s.cooldown_until, s.fallback))[:1]
            if self._rng.random() < self.explore:
                return self._rng.choice(warm)
            known = [s.throughput for s in warm if s.throughput]
            default = max(known) if known else 1.0
            return self._rng.choices(warm, weights=[s.throughput or default for s in warm])[0]

    def ordered(self, prefer: Iterable[str] = ()) -> list[str]:
        """Usable servers for a small request: preferred ones, then warm primaries by speed, then the rest."""
        prefer = set(prefer)
        now = time.monotonic()

        def key(s: ServerStats):
            return (s.url not in prefer, s.cooldown_until > now, s.fallback, -(s.throughput or 0.0))

        with self._lock:
            return [s.url for s in sorted(self.usable(), key=key)]

    def floor_rate(self, url: str) -> float:
        """The rate below which a transfer from `url` is moved: the absolute floor, or a fraction of the
        fastest other usable server's measured rate (a server that drips just above the floor loses to it)."""
        with self._lock:
            others = [s.throughput for s in self.usable({url}) if s.throughput and s.cooldown_until <= time.monotonic()]
        best = max(others, default=0.0)
        return max(self.policy.min_rate_bytes_per_s, self.policy.slow_factor * best)

    def record_success(self, url: str, nbytes: int, seconds: float) -> None:
        with self._lock:
            s = self.stats[url]
            s.bytes += nbytes
            if nbytes >= 64 << 10 and seconds > 0:
                self._ema(s, nbytes / seconds)

    def record_failure(self, url: str, reason: str, rate: float | None = None) -> None:
        """A failed transfer; `slow` ones (stalled, dripped, past a deadline) cool the server down longer."""
        with self._lock:
            s = self.stats[url]
            s.failures += 1
            now = time.monotonic()
            if reason == "slow":
                s.slow += 1
                s.cooldown_until = now + self.policy.slow_cooldown_s
                if rate is not None:
                    self._ema(s, rate, weight=1.0)
                elif s.throughput is not None:
                    s.throughput *= 0.1
            else:
                s.cooldown_until = now + min(10.0, 0.5 * 2 ** min(s.failures, 5))
                s.throughput = None if s.throughput is None else s.throughput * 0.5
        CLIENT_FAILURES.labels(reason).inc()

    def add_bytes(self, url: str, nbytes: int) -> None:
        with self._lock:
            self.stats[url].bytes += nbytes

    def ban(self, url: str, reason: str) -> None:
        with self._lock:
            if self.stats[url].banned is None:
                log.warning("banning shard server %s: %s", url, reason, extra={"server": url})
                self.stats[url].banned = reason
        CLIENT_FAILURES.labels("banned").inc()

    @staticmethod
    def _ema(s: ServerStats, rate: float, weight: float = 0.3) -> None:
        s.throughput = rate if s.throughput is None else (1 - weight) * s.throughput + weight * rate


def describe_stats(stats: dict[str, ServerStats]) -> str:
    """Per server: megabytes, throughput, failures and verdicts, as one JSON line."""
    return json.dumps(
        {u: {"MB": round(s.bytes / 1e6, 1), "MB/s": round((s.throughput or 0) / 1e6, 1), "failures": s.failures,
        "slow": s.slow, "banned": s.banned} for u, s in stats.items()}
    )
