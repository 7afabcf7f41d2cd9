"""The one retry policy of every client we ship (the worker's orchestrator client, its weights keeper,
the shardcast client): exponential backoff with full jitter (AWS Architecture Blog, "Exponential Backoff
and Jitter", 2015): attempt i waits uniform(0, min(max_s, initial_s * 2^i)). Full jitter spreads a herd
of clients that failed together (an orchestrator restart) instead of bringing them back in lockstep.
"""

from __future__ import annotations

import random
from collections.abc import Iterator


def backoff_delays(initial_s: float, max_s: float, rng: random.Random | None = None) -> Iterator[float]:
    """The delays before retry 1, 2, ... (endless; the caller decides when to give up)."""
    rng = rng or random.Random()
    attempt = 0
    while True:
        yield rng.uniform(0, min(max_s, initial_s * (2 ** min(attempt, 62))))
        attempt += 1
