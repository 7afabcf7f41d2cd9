"""How long one call of the Ray verifier pool may take before its actor counts as stuck (and is restarted).

A constant tuned on the toy is wrong at real sizes: the verifier checks ~77 tokens/s at Qwen3-0.6B's shape on
2 CPU cores (bench/results/scaling.md), so 16 submissions of 2 x 4 x 512 tokens take ~14 minutes, and a fixed
120 s would kill a healthy actor and split the batch again and again. The timeout follows the call's tokens and
the pool's measured rate: max(floor, slack x tokens / rate). The rate is a running estimate over the calls that
finished, leaning slow (a slower call moves it more than a faster one); before the first call, a default rate.
"""

from __future__ import annotations

import threading


class VerifyTimeout:
    def __init__(self, floor_s: float, slack: float = 3.0, initial_tokens_per_s: float = 20.0):
        self.floor_s, self.slack = floor_s, slack
        self.seconds_per_token = 1.0 / initial_tokens_per_s
        self._lock = threading.Lock()  # the orchestrator's verification threads share the pool

    def for_call(self, tokens: int) -> float:
        """Seconds a call verifying `tokens` tokens (its largest part, as parts run in parallel) may take."""
        with self._lock:
            return max(self.floor_s, self.slack * tokens * self.seconds_per_token)

    def observe(self, tokens: int, seconds: float) -> None:
        """A call whose largest part had `tokens` tokens finished in `seconds`."""
        if tokens <= 0 or seconds <= 0:
            return
        measured = seconds / tokens
        with self._lock:
            weight = 0.5 if measured > self.seconds_per_token else 0.2
            self.seconds_per_token += weight * (measured - self.seconds_per_token)
