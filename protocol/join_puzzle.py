"""The open-join puzzle, checked by the orchestrator and solved by a worker that has no join token.

Hashcash (A. Back, "Hashcash - a denial of service counter-measure", 2002) with SHA-256: a solution to a
challenge is a string such that sha256(challenge || solution) starts with `bits` zero bits. Finding one takes
2**bits hashes on average; checking it takes one.
"""

from __future__ import annotations

import hashlib
import itertools
import time

# How many hashes `solve` tries between two looks at the clock.
CLOCK_EVERY = 1 << 16


def _prefix(bits: int) -> tuple[bytes, int, int]:
    """(the whole zero bytes, the index of the next byte, the bound that byte must stay under)."""
    whole, rest = divmod(bits, 8)
    return bytes(whole), whole, 256 >> rest


def meets_difficulty(challenge: str, solution: str, bits: int) -> bool:
    zeros, at, bound = _prefix(bits)
    digest = hashlib.sha256((challenge + solution).encode()).digest()
    return digest.startswith(zeros) and digest[at] < bound


def solve(challenge: str, bits: int, deadline: float | None = None) -> tuple[str, int] | None:
    """The first decimal counter that solves the challenge, and how many hashes it took; None once
    `deadline` (time.monotonic) has passed. The challenge's hash state is computed once and copied."""
    zeros, at, bound = _prefix(bits)
    base = hashlib.sha256(challenge.encode())
    for i in itertools.count():
        h = base.copy()
        h.update(b"%d" % i)
        digest = h.digest()
        if digest.startswith(zeros) and digest[at] < bound:
            return str(i), i + 1
        if deadline is not None and i % CLOCK_EVERY == 0 and time.monotonic() > deadline:
            return None
    raise AssertionError("unreachable")
